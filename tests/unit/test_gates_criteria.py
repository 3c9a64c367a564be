"""Gate criteria and timeline pieces: each criterion passes on a good run and fails on the
specific defect it exists to catch."""

from __future__ import annotations

import pytest

from rlix_plugins.gates.criteria import (
    CriterionResult,
    GateResult,
    IdleShare,
    RequestCount,
    RunCount,
    WeightCheck,
    idle_below_exclusive,
    measure_idle,
    no_double_ownership,
    reactivations,
    requests_accounted,
    steps_completed,
    time_sharing,
    weights_current,
)
from rlix_plugins.gates.timeline import (
    Interval,
    busy_share,
    double_ownership,
    intervals_from_trace,
    pipeline_of,
    to_chrome_trace,
)


def iv(gpu: int, owner: str, start: float, end: float, stage: str = "generation") -> Interval:
    return Interval(gpu, owner, stage, start, end)


def test_double_ownership_only_between_different_owners() -> None:
    a = iv(0, "ft_a_actor_infer", 0, 2)
    a2 = iv(0, "ft_a_actor_infer", 1, 3)  # same owner overlapping itself: fine
    b = iv(0, "ft_a_actor_train", 3, 4, "train")  # touches, does not overlap
    assert double_ownership([a, a2, b]) == []
    c = iv(0, "ft_b_actor_infer", 3.5, 5)
    found = double_ownership([a, a2, b, c])
    assert len(found) == 1 and found[0].gpu == 0
    assert {found[0].first.owner, found[0].second.owner} == {"ft_a_actor_train",
                                                             "ft_b_actor_infer"}
    # a different GPU never conflicts
    assert double_ownership([a, iv(1, "ft_b_actor_infer", 0, 2)]) == []
    # tolerance absorbs a tiny overlap
    assert double_ownership([b, c], tolerance_s=0.6) == []


def test_ownership_criterion_fails_on_overlap_and_on_no_evidence() -> None:
    good = no_double_ownership("own", [iv(0, "x", 0, 1), iv(0, "y", 1, 2)], source="log")
    assert good.passed and "0 overlaps" in good.measured
    bad = no_double_ownership("own", [iv(1, "x", 0, 1), iv(1, "y", 0.5, 2)], source="log")
    assert not bad.passed and "GPU 1" in bad.measured
    # An empty log proves nothing: not a pass.
    assert not no_double_ownership("own", [], source="log").passed


def test_busy_share_merges_overlaps_per_gpu_and_clips_to_window() -> None:
    busy = [iv(0, "a", 0, 5), iv(0, "b", 4, 6), iv(1, "a", -3, 2), iv(1, "a", 9, 12)]
    # GPU 0: [0,6] = 6 s; GPU 1: [0,2] + [9,10] = 3 s; 2 GPUs x 10 s
    assert busy_share(busy, 2, 0, 10) == pytest.approx(9 / 20)
    assert busy_share(busy, 2, 5, 5) == 0.0
    idle = measure_idle(busy, 2, 0, 10)
    assert idle.idle_share == pytest.approx(11 / 20) and idle.window_s == 10


def test_idle_criterion_needs_shared_strictly_below_exclusive() -> None:
    shared = IdleShare(0.7, 10.0, 2)
    excl = IdleShare(0.5, 14.0, 2)
    assert idle_below_exclusive(shared, excl).passed
    assert not idle_below_exclusive(excl, shared).passed
    assert not idle_below_exclusive(shared, IdleShare(0.7, 10.0, 2)).passed
    # no exclusive run (window 0): cannot pass
    assert not idle_below_exclusive(shared, IdleShare(0.0, 0.0, 2)).passed


def test_steps_criterion() -> None:
    assert steps_completed([RunCount("a", 3, 3), RunCount("b", 3, 3)]).passed
    short = steps_completed([RunCount("a", 3, 3), RunCount("b", 2, 3)])
    assert not short.passed and "b 2/3" in short.measured
    failed = steps_completed([RunCount("a", 3, 3, error="TimeoutError: x")])
    assert not failed.passed and "TimeoutError" in failed.measured
    assert not steps_completed([]).passed


def _count(**kw: int) -> RequestCount:
    base = dict(submitted=10, completed=10, duplicates=0, lost=0, aborted_returned=0,
                short_samples=0, redispatched=3, router_requests=10, router_completed=10)
    base.update(kw)
    return RequestCount("p", **base)


def test_requests_criterion_catches_each_defect() -> None:
    assert requests_accounted([_count()]).passed
    for defect in ({"completed": 9, "lost": 1}, {"duplicates": 1}, {"aborted_returned": 1},
                   {"short_samples": 2}, {"submitted": 0, "completed": 0},
                   # the router's own counters disagree with the ledger's verdict
                   {"router_completed": 9}, {"router_requests": 0, "router_completed": 0}):
        assert not requests_accounted([_count(**defect)]).passed, defect


def test_overlap_reactivations_count_only_wakes_after_a_preemption() -> None:
    overlap = {0}
    # the first wake precedes any preemption: no re-activation
    assert reactivations([("expand", 0), ("preempt", 0)], overlap) == 0
    assert reactivations([("expand", 0), ("preempt", 0), ("expand", 0)], overlap) == 1
    # a wake of another rank does not answer the overlap shard's preemption
    assert reactivations([("preempt", 0), ("expand", 1), ("preempt", 0)], overlap) == 0
    events = [("expand", 0), ("preempt", 0), ("expand", 0), ("preempt", 0), ("expand", 0),
              ("preempt", 0)]
    assert reactivations(events, overlap) == 2


def test_time_sharing_needs_a_gpu_held_by_two_pipelines_in_turn() -> None:
    a, b = "ft_aaaaaaaaaaaa_actor_infer", "ft_bbbbbbbbbbbb_actor_train"
    shared = [iv(0, a, 0, 1), iv(0, b, 1, 2), iv(1, a, 0, 2)]
    assert time_sharing(shared, 2).passed
    apart = [iv(0, a, 0, 1), iv(1, b, 0, 1)]
    res = time_sharing(apart, 2)
    assert not res.passed and "shared: []" in res.measured
    assert not time_sharing([], 3).passed


def test_weights_criterion() -> None:
    ok = WeightCheck("p", 0, 1, "refresh", 2, 2, True)
    assert weights_current([ok]).passed
    stale = WeightCheck("p", 1, 0, "expand", 3, 2, True)
    res = weights_current([ok, stale])
    assert not res.passed and "engine v2 vs trainer v3" in res.measured
    assert not weights_current([WeightCheck("p", 1, 0, "expand", 3, 3, False)]).passed
    assert not weights_current([WeightCheck("p", 1, 0, "expand", 3, None, True)]).passed
    assert not weights_current([]).passed


def test_gate_result_lines_and_verdict() -> None:
    res = GateResult(1, "cpu", (CriterionResult("a", "r", "m", True),
                                CriterionResult("b", "r2", "m2", False)))
    lines = res.lines()
    assert not res.passed and lines[-1] == "gate 1: FAILED"
    assert "  [PASS] a: m (required: r)" in lines and "  [FAIL] b: m2 (required: r2)" in lines
    assert not GateResult(1, "cpu", ()).passed
    assert GateResult(2, "cpu", (CriterionResult("a", "r", "m", True),)).passed


def test_trace_round_trip_and_pipeline_of() -> None:
    t0 = 1000.0
    ivs = [iv(0, "ft_aa_actor_train", 1000.5, 1001.0, "ACTOR_TRAINING"),
           iv(1, "ft_bb_actor_infer", 1000.0, 1002.25, "GENERATION")]
    trace = to_chrome_trace({"coordinator": ivs}, t0=t0, num_gpus=2)
    # our own writer uses the coordinator's format (ts/dur in us, t0 in otherData); the
    # reader gets the same intervals back
    for ev in trace["traceEvents"]:
        if ev["ph"] == "X":
            ev["args"] = {"cluster_id": ev["args"]["owner"], "stage": ev["args"]["stage"]}
    back, t0b = intervals_from_trace(trace)
    assert t0b == t0
    assert sorted(back, key=lambda i: i.gpu) == [
        Interval(i.gpu, i.owner, i.stage, pytest.approx(i.start), pytest.approx(i.end))  # type: ignore[arg-type]
        for i in ivs
    ]
    assert pipeline_of("ft_aa_actor_train") == "ft_aa"
    assert pipeline_of("ft_bb_actor_infer") == "ft_bb"
    assert pipeline_of("plain") == "plain"


def test_coordinator_trace_format_is_read() -> None:
    """The scheduler's own OwnershipTrace output parses into the intervals it recorded."""
    from rlix_plugins.coordinator.service.trace import Holder, OwnershipTrace

    tr = OwnershipTrace(2, t0=50.0)
    tr.observe([Holder("ft_a_actor_infer", "GENERATION", 0), None], 50.0)
    tr.observe([Holder("ft_a_actor_train", "ACTOR_TRAINING"), Holder("ft_a_actor_infer",
                                                                     "GENERATION", 1)], 51.0)
    tr.instant("preempt", [0], 51.0)
    ivs, t0 = intervals_from_trace(tr.to_json(52.0))
    assert t0 == 50.0
    got = sorted((i.gpu, i.owner, i.stage, round(i.start, 3), round(i.end, 3)) for i in ivs)
    assert got == [
        (0, "ft_a_actor_infer", "GENERATION", 50.0, 51.0),
        (0, "ft_a_actor_train", "ACTOR_TRAINING", 51.0, 52.0),
        (1, "ft_a_actor_infer", "GENERATION", 51.0, 52.0),
    ]
    assert double_ownership(ivs) == []
