"""Scheduling behaviour of our policy on small, hand-checked scenarios."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from rlix_plugins.coordinator.core import (
    DemandSharePlanner,
    ImmediateGrant,
    InvariantViolation,
    Plan,
    PolicyConfig,
    RankMove,
    SchedulerState,
    ShrinkReason,
    check_plan,
    check_state,
)
from rlix_plugins.errors import (
    OwnershipError,
    ProtocolError,
    RequestStateError,
    UnknownClusterError,
)
from rlix_plugins.protocol import OUTSTANDING_METRIC, Priority, ProgressReport
from tests.core_builders import active, cycle, new_state, observable, progress, register

GEN = Priority.GENERATION


def test_generation_grant_then_training_preempts_overlap_only() -> None:
    state = new_state(1, 4)
    register(state, "ft_a", train=[0], infer=[0, 1, 2, 3])
    state.submit_request("ft_a_actor_infer", GEN, now=0, step_target_estimate=64)
    _, res = cycle(state, 0)
    assert active(state, "ft_a") == {0, 1, 2, 3}
    assert "ft_a_actor_infer" in res.granted
    state.submit_request("ft_a_actor_train", Priority.ACTOR_TRAINING, now=1)
    plan, res = cycle(state, 1)
    assert [(m.dp_rank, m.reason) for m in plan.shrinks] == [(0, ShrinkReason.PREEMPT)]
    assert res.granted == {"ft_a_actor_train": (0,)}
    assert active(state, "ft_a") == {1, 2, 3}


def test_unsatisfiable_request_preempts_nothing() -> None:
    state = new_state(1, 4)
    register(state, "ft_a", train=[0, 1], infer=[0, 1, 2, 3])
    register(state, "ft_b", train=[1, 2], infer=[2, 3])
    state.submit_request("ft_a_actor_train", Priority.ACTOR_TRAINING, now=0)
    cycle(state, 0)
    state.submit_request("ft_b_actor_infer", GEN, now=0, step_target_estimate=10)
    cycle(state, 0)
    assert active(state, "ft_b") == {0, 1}
    # ft_b's training needs GPU 1, held by ft_a's training: nothing of ft_b may be preempted.
    state.submit_request("ft_b_actor_train", Priority.ACTOR_TRAINING, now=1)
    plan, res = cycle(state, 1)
    assert plan.shrinks == () and res.granted == {}
    assert active(state, "ft_b") == {0, 1}
    state.release("ft_a_actor_train")
    plan, res = cycle(state, 2)
    assert res.granted == {"ft_b_actor_train": (1, 2)}
    assert [m.gpus for m in plan.shrinks] == [(2,)]


def test_blocked_request_reserves_its_gpus_against_backfill_and_aging_wins() -> None:
    state = new_state(1, 4)
    register(state, "ft_a", train=[0, 1])
    register(state, "ft_b", train=[1, 2])
    register(state, "ft_c", train=[2])
    reserving = DemandSharePlanner(PolicyConfig(reserve_after_s=0))
    state.submit_request("ft_a_actor_train", Priority.ACTOR_TRAINING, now=0)
    cycle(state, 0, reserving)
    state.submit_request("ft_b_actor_train", Priority.ACTOR_TRAINING, now=1)
    state.submit_request("ft_c_actor_train", Priority.VALUE_COMPUTE, now=1)
    _, res = cycle(state, 1, reserving)
    assert res.granted == {}  # ft_b blocked by ft_a; ft_c may not backfill ft_b's GPU 2
    state.cancel_request("ft_b_actor_train")
    _, res = cycle(state, 2, reserving)
    assert res.granted == {"ft_c_actor_train": (2,)}
    state.release("ft_a_actor_train")
    state.release("ft_c_actor_train")
    # Aging: an old VALUE_COMPUTE request overtakes a fresh ACTOR_TRAINING one.
    config = PolicyConfig(aging_s=10)
    state.submit_request("ft_c_actor_train", Priority.VALUE_COMPUTE, now=0)
    state.submit_request("ft_b_actor_train", Priority.ACTOR_TRAINING, now=100)
    plan = DemandSharePlanner(config).plan(state, 100)
    assert [g.cluster_id for g in plan.grants] == ["ft_c_actor_train"]


def _blocked_behind_a(last_c_hold_s: float | None) -> SchedulerState:
    """ft_a trains on GPUs 0-1 (granted at t=0, its last holding lasted 100 s); ft_b's
    training (GPUs 1-2) waits behind it; ft_c (GPU 2) asks at t=50 (its last holding lasted
    ``last_c_hold_s``)."""
    state = new_state(1, 4)
    register(state, "ft_a", train=[0, 1])
    register(state, "ft_b", train=[1, 2])
    register(state, "ft_c", train=[2])
    state.submit_request("ft_a_actor_train", Priority.ACTOR_TRAINING, now=-200)
    cycle(state, -200)
    state.release("ft_a_actor_train", now=-100)
    if last_c_hold_s is not None:
        state.submit_request("ft_c_actor_train", Priority.ACTOR_TRAINING, now=-100)
        cycle(state, -100)
        state.release("ft_c_actor_train", now=-100 + last_c_hold_s)
    state.submit_request("ft_a_actor_train", Priority.ACTOR_TRAINING, now=0)
    cycle(state, 0)
    state.submit_request("ft_b_actor_train", Priority.ACTOR_TRAINING, now=0)
    state.submit_request("ft_c_actor_train", Priority.VALUE_COMPUTE, now=50)
    return state


def test_a_fresh_blocked_request_reserves_nothing() -> None:
    # ft_b has waited 50 s < reserve_after_s: ft_c takes GPU 2 whatever its duration.
    state = _blocked_behind_a(None)
    _, res = cycle(state, 50)
    assert res.granted == {"ft_c_actor_train": (2,)}


@pytest.mark.parametrize(
    ("last_c_hold_s", "granted"),
    [
        (None, False),  # duration unknown: may not backfill
        (40.0, True),  # ends at 90, before ft_a's expected end at 100 (when ft_b may start)
        (60.0, False),  # would end at 110: ft_b would wait for it
    ],
)
def test_backfill_only_ends_before_the_reserving_request_may_start(
    last_c_hold_s: float | None, granted: bool
) -> None:
    state = _blocked_behind_a(last_c_hold_s)
    planner = DemandSharePlanner(PolicyConfig(reserve_after_s=30))
    _, res = cycle(state, 50, planner)
    assert res.granted == ({"ft_c_actor_train": (2,)} if granted else {})
    # Without backfill reserved GPUs are never lent.
    if granted:
        state = _blocked_behind_a(last_c_hold_s)
        strict = DemandSharePlanner(PolicyConfig(reserve_after_s=30, backfill=False))
        _, res = cycle(state, 50, strict)
        assert res.granted == {}


def test_past_its_expected_end_a_holding_leaves_no_room_to_backfill() -> None:
    # ft_a was expected to release at 100; at 150 it still holds, so ft_b may start any
    # moment: the 40 s backfill that fitted at t=50 (test above) no longer does.
    state = _blocked_behind_a(40.0)
    planner = DemandSharePlanner(PolicyConfig(reserve_after_s=30))
    _, res = cycle(state, 150, planner)
    assert res.granted == {}


@pytest.mark.parametrize(("last_c_hold_s", "granted"), [(90.0, True), (110.0, False)])
def test_a_second_reservation_starts_after_the_first_one_ends(
    last_c_hold_s: float, granted: bool
) -> None:
    """ft_a holds GPU 0 until 100 (expected); ft_b (GPUs 0-1, 50 s) waits for it, so it holds
    GPUs 0-1 until 150; ft_d (GPUs 1-2, 80 s) cannot backfill GPU 1 (50 + 80 > 100) and
    reserves GPU 2 from 150 on; ft_c (GPU 2) may backfill only if it ends by 150."""
    state = new_state(1, 4)
    for pid, gpus in (("ft_a", [0]), ("ft_b", [0, 1]), ("ft_d", [1, 2]), ("ft_c", [2])):
        register(state, pid, train=gpus)
    for pid, last in (("ft_b", 50.0), ("ft_d", 80.0), ("ft_c", last_c_hold_s), ("ft_a", 100.0)):
        state.submit_request(f"{pid}_actor_train", Priority.ACTOR_TRAINING, now=-1000)
        cycle(state, -1000)
        state.release(f"{pid}_actor_train", now=-1000 + last)
    state.submit_request("ft_a_actor_train", Priority.ACTOR_TRAINING, now=0)
    cycle(state, 0)
    state.submit_request("ft_b_actor_train", Priority.ACTOR_TRAINING, now=0)
    state.submit_request("ft_d_actor_train", Priority.ACTOR_TRAINING, now=1)
    state.submit_request("ft_c_actor_train", Priority.VALUE_COMPUTE, now=2)
    planner = DemandSharePlanner(PolicyConfig(reserve_after_s=30))
    _, res = cycle(state, 50, planner)
    assert res.granted == ({"ft_c_actor_train": (2,)} if granted else {})


def test_release_keeps_the_holding_duration_and_unregister_forgets_it() -> None:
    state = new_state(1, 4)
    register(state, "ft_a", train=[0, 1])
    state.submit_request("ft_a_actor_train", Priority.ACTOR_TRAINING, now=5)
    cycle(state, 7)
    assert state.held_since == {"ft_a_actor_train": 7}
    state.release("ft_a_actor_train", now=19.5)
    assert state.last_hold_s == {"ft_a_actor_train": 12.5} and state.held_since == {}
    state.submit_request("ft_a_actor_train", Priority.ACTOR_TRAINING, now=20)
    cycle(state, 20)
    state.release("ft_a_actor_train")  # no clock given: the last known duration stays
    assert state.last_hold_s == {"ft_a_actor_train": 12.5}
    state.unregister("ft_a")
    assert state.last_hold_s == {} and state.held_since == {}


def test_policy_config_refuses_a_negative_reserve_after() -> None:
    with pytest.raises(ValueError, match="reserve_after_s"):
        PolicyConfig(reserve_after_s=-1)


def test_generation_share_follows_remaining_demand() -> None:
    state = new_state(1, 8)
    register(state, "ft_a", infer=list(range(8)))
    register(state, "ft_b", infer=list(range(8)))
    progress(state, "ft_a", 100, 25)  # 75 remaining
    progress(state, "ft_b", 100, 75)  # 25 remaining
    state.submit_request("ft_a_actor_infer", GEN, now=0)
    state.submit_request("ft_b_actor_infer", GEN, now=0)
    cycle(state, 0)
    assert (len(active(state, "ft_a")), len(active(state, "ft_b"))) == (6, 2)
    # Demand flips; after the hold time ranks move, and ranks of a finished pipeline all go.
    progress(state, "ft_a", 100, 100)
    plan, _ = cycle(state, 10)
    assert len(active(state, "ft_b")) == 8 and not active(state, "ft_a")
    assert {m.reason for m in plan.shrinks} == {ShrinkReason.REBALANCE}


def test_hysteresis_and_min_hold_stop_flip_flop() -> None:
    state = new_state(1, 8)
    register(state, "ft_a", infer=list(range(8)))
    register(state, "ft_b", infer=list(range(8)))
    progress(state, "ft_a", 100, 50)
    progress(state, "ft_b", 100, 50)
    state.submit_request("ft_a_actor_infer", GEN, now=0)
    state.submit_request("ft_b_actor_infer", GEN, now=0)
    cycle(state, 0)
    assert (len(active(state, "ft_a")), len(active(state, "ft_b"))) == (4, 4)
    progress(state, "ft_a", 100, 45)  # 55 vs 50: target 4.19 vs 3.8 -> no move
    plan, _ = cycle(state, 100)
    assert plan.empty
    progress(state, "ft_a", 100, 0)  # 100 vs 50: target 5 vs 3, gap 1/5 inside the band
    plan, _ = cycle(state, 100)
    assert plan.empty
    progress(state, "ft_b", 100, 75)  # 100 vs 25: target 6 vs 2, but ranks are fresh
    plan, _ = cycle(state, 1.0)
    assert plan.empty
    plan, _ = cycle(state, 100)
    assert len(plan.shrinks) == 2 and len(active(state, "ft_a")) == 6


def test_starving_pipeline_gets_a_rank_even_from_fresh_ranks() -> None:
    state = new_state(1, 4)
    register(state, "ft_a", infer=[0, 1, 2, 3])
    register(state, "ft_b", infer=[0, 1, 2, 3])
    progress(state, "ft_a", 1000, 0)
    state.submit_request("ft_a_actor_infer", GEN, now=0)
    cycle(state, 0)
    assert len(active(state, "ft_a")) == 4
    progress(state, "ft_b", 1, 0)  # tiny demand still gets one rank
    state.submit_request("ft_b_actor_infer", GEN, now=0.1)
    _, res = cycle(state, 0.1)
    assert len(active(state, "ft_b")) == 1 and "ft_b_actor_infer" in res.granted


@pytest.mark.parametrize("idle_elsewhere", [0, 4, 60])
def test_idle_gpus_no_span_reaches_do_not_starve_a_pipeline(idle_elsewhere: int) -> None:
    """Both pipelines' inference spans are GPUs 0-3; the rest of the cluster is idle. The
    targets used to split a budget counting every idle GPU, so ``ft_a`` (4 ranks) was at its
    target and ``ft_b`` (demand, no rank) was never given one while ``ft_a``'s demand lasted."""
    state = new_state(1, 4 + idle_elsewhere)
    register(state, "ft_a", infer=[0, 1, 2, 3])
    register(state, "ft_b", infer=[0, 1, 2, 3])
    progress(state, "ft_a", 24, 0)
    cycle(state, 0.0)
    assert len(active(state, "ft_a")) == 4
    progress(state, "ft_b", 8, 0)
    for t in (100.0, 200.0):
        cycle(state, t)
    assert len(active(state, "ft_b")) >= 1 and len(active(state, "ft_a")) >= 2


def test_idle_gpus_of_another_group_of_spans_do_not_starve_a_pipeline() -> None:
    """``ft_a`` and ``ft_b`` share GPUs 0-3; ``ft_c`` alone maps 4-7 and asked for generation
    GPUs without reporting demand (one rank), so three of its GPUs stay idle. They are no use
    to ``ft_a`` or ``ft_b``; counted in one budget with theirs they lifted ``ft_a``'s target to
    all four ranks and ``ft_b`` (demand, no rank) got none."""
    state = new_state(1, 8)
    register(state, "ft_a", infer=[0, 1, 2, 3])
    register(state, "ft_b", infer=[0, 1, 2, 3])
    register(state, "ft_c", infer=[4, 5, 6, 7])
    progress(state, "ft_a", 24, 0)
    state.submit_request("ft_c_actor_infer", GEN, now=0)
    cycle(state, 0.0)
    assert len(active(state, "ft_a")) == 4 and len(active(state, "ft_c")) == 1
    progress(state, "ft_b", 8, 0)
    for t in (100.0, 200.0):
        cycle(state, t)
    assert len(active(state, "ft_b")) >= 1 and len(active(state, "ft_a")) >= 2
    assert len(active(state, "ft_c")) == 1


def test_pipeline_without_progress_donates() -> None:
    state = new_state(1, 4)
    register(state, "ft_silent", infer=[0, 1, 2, 3])
    register(state, "ft_b", infer=[0, 1, 2, 3])
    state.submit_request("ft_silent_actor_infer", GEN, now=0)  # no estimate, never reports
    cycle(state, 0)
    assert len(active(state, "ft_silent")) == 1
    state.submit_request("ft_b_actor_infer", GEN, now=1, step_target_estimate=32)
    plan, _ = cycle(state, 100)
    # ft_silent has no demand and no pending request: its rank is given to ft_b (RLix would
    # not see it at all and could not move it).
    assert len(active(state, "ft_b")) == 4 and not active(state, "ft_silent")
    assert [(m.cluster_id, m.reason) for m in plan.shrinks] == [
        ("ft_silent_actor_infer", ShrinkReason.REBALANCE)
    ]


def test_planned_release_and_release_then_request_flow() -> None:
    state = new_state(1, 2)
    register(state, "ft_a", train=[0], infer=[0, 1])
    state.submit_request("ft_a_actor_infer", GEN, now=0, step_target_estimate=8)
    cycle(state, 0)
    assert not state.plan_release("ft_a_actor_infer", now=1)
    plan, res = cycle(state, 1)
    assert {m.reason for m in plan.shrinks} == {ShrinkReason.PLANNED_RELEASE}
    assert res.released == ("ft_a_actor_infer",) and not active(state, "ft_a")
    assert state.plan_release("ft_a_actor_infer", now=2)  # nothing active: done at once


def test_failed_shrink_keeps_gpu_and_blocks_dependent_grant() -> None:
    state = new_state(1, 2)
    register(state, "ft_a", train=[0], infer=[0, 1])
    state.submit_request("ft_a_actor_infer", GEN, now=0, step_target_estimate=8)
    cycle(state, 0)
    state.submit_request("ft_a_actor_train", Priority.ACTOR_TRAINING, now=1)
    _, res = cycle(state, 1, failed_shrinks=["ft_a_actor_infer"])
    assert res.granted == {} and active(state, "ft_a") == {0, 1}
    assert "ft_a_actor_train" in state.pending
    _, res = cycle(state, 2)
    assert res.granted == {"ft_a_actor_train": (0,)}


def test_immediate_grants_and_bad_calls_leave_state_unchanged() -> None:
    state = new_state(1, 2)
    register(state, "ft_a", train=[0], infer=[0, 1])
    state.submit_request("ft_a_actor_train", Priority.INITIALIZATION, now=0)
    cycle(state, 0)
    again = state.submit_request("ft_a_actor_train", Priority.OLD_LOG_PROBS, now=1)
    assert again == ImmediateGrant("ft_a_actor_train", (0,))

    def refused(error: type[Exception], match: str, call: Callable[[], object]) -> None:
        before = (observable(state), state.revision)
        with pytest.raises(error, match=match):
            call()
        assert (observable(state), state.revision) == before, f"refused {match!r} changed state"

    train, infer = "ft_a_actor_train", "ft_a_actor_infer"
    refused(
        UnknownClusterError,
        "not registered",
        lambda: state.submit_request("ft_zz_actor_train", Priority.ACTOR_TRAINING, now=1),
    )
    refused(
        ProtocolError,
        "known cluster name",
        lambda: state.submit_request("ft_a_policy", Priority.ACTOR_TRAINING, now=1),
    )
    refused(
        RequestStateError,
        "only valid for actor_infer",
        lambda: state.submit_request(train, Priority.GENERATION, now=1),
    )
    refused(OwnershipError, "may not act", lambda: state.check_owner(train, "ft_b"))
    for bad in (-1, 64.0, True, "8"):
        for cid, prio in ((infer, GEN), (train, Priority.ACTOR_TRAINING)):
            refused(
                RequestStateError,
                "step_target_estimate",
                lambda c=cid, p=prio, b=bad: state.submit_request(
                    c, p, now=1, step_target_estimate=b
                ),
            )
    state.submit_request(infer, GEN, now=1)
    refused(
        RequestStateError,
        "already has a pending",
        lambda: state.submit_request(infer, GEN, now=1),
    )


def test_unregister_frees_everything() -> None:
    state = new_state(1, 4)
    register(state, "ft_a", train=[0, 1], infer=[0, 1, 2, 3])
    state.submit_request("ft_a_actor_infer", GEN, now=0, step_target_estimate=8)
    cycle(state, 0)
    state.submit_request("ft_a_actor_train", Priority.ACTOR_TRAINING, now=1)
    freed, cancelled = state.unregister("ft_a")
    assert freed == (0, 1, 2, 3) and cancelled == ("ft_a_actor_train",)
    assert state.idle_gpus() == [0, 1, 2, 3]


def test_check_plan_rejects_double_assignment_and_unjustified_preemption() -> None:
    state = new_state(1, 2)
    register(state, "ft_a", train=[0], infer=[0, 1])
    register(state, "ft_b", infer=[0, 1])
    state.submit_request("ft_a_actor_infer", GEN, now=0, step_target_estimate=8)
    cycle(state, 0)
    with pytest.raises(InvariantViolation, match="P2"):
        check_plan(state, Plan(state.revision, expands=(RankMove("ft_b_actor_infer", 0, (0,)),)))
    shrink = RankMove("ft_a_actor_infer", 1, (1,), ShrinkReason.PREEMPT)
    with pytest.raises(InvariantViolation, match="P5"):
        check_plan(state, Plan(state.revision, shrinks=(shrink,)))
    with pytest.raises(InvariantViolation, match="P1"):
        check_plan(state, Plan(state.revision, shrinks=(shrink, shrink)))


def _load_report(
    state: SchedulerState, pid: str, target: int, completed: int, load: dict[int, int]
) -> None:
    metrics = {"completed": completed, "mode": "train", "rank_load": load}
    state.report_progress(ProgressReport(pid, target, None, metrics))


def test_rebalance_takes_the_least_loaded_donor_rank() -> None:
    """A move aborts what the donor rank runs: with ``rank_load`` hints the lightest donor
    ranks go, not the first ones found (before: rank 0, with 30 requests in flight)."""
    state = new_state(1, 4)
    register(state, "ft_a", infer=[0, 1, 2, 3])
    register(state, "ft_b", infer=[0, 1, 2, 3])
    progress(state, "ft_a", 100, 0)
    state.submit_request("ft_a_actor_infer", GEN, now=0)
    cycle(state, 0)
    assert active(state, "ft_a") == {0, 1, 2, 3}
    _load_report(state, "ft_a", 100, 90, {0: 30, 1: 25, 2: 0, 3: 12})  # 10 remaining
    progress(state, "ft_b", 100, 0)  # 100 remaining: target 3 of 4 ranks
    plan, _ = cycle(state, 100)
    # ft_a keeps its busiest rank (0, 30 requests); the three lighter ones go.
    assert sorted(m.dp_rank for m in plan.shrinks) == [1, 2, 3]
    # Without the preference (old behaviour) the lowest ranks go, busy or not.
    state2 = new_state(1, 4)
    register(state2, "ft_a", infer=[0, 1, 2, 3])
    register(state2, "ft_b", infer=[0, 1, 2, 3])
    progress(state2, "ft_a", 100, 0)
    state2.submit_request("ft_a_actor_infer", GEN, now=0)
    cycle(state2, 0)
    _load_report(state2, "ft_a", 100, 90, {0: 30, 1: 25, 2: 0, 3: 12})
    progress(state2, "ft_b", 100, 0)
    plan2, _ = cycle(state2, 100, DemandSharePlanner(PolicyConfig(prefer_idle_donors=False)))
    assert 0 in {m.dp_rank for m in plan2.shrinks}


def test_malformed_rank_load_is_ignored() -> None:
    state = new_state(1, 2)
    register(state, "ft_a", infer=[0, 1])
    register(state, "ft_b", infer=[0, 1])
    progress(state, "ft_a", 10, 0)
    state.submit_request("ft_a_actor_infer", GEN, now=0)
    cycle(state, 0)
    _load_report(state, "ft_a", 10, 9, {"x": "y", 1: None})  # type: ignore[dict-item]
    progress(state, "ft_b", 10, 0)
    plan, _ = cycle(state, 100)
    assert len(plan.shrinks) == 1


def _outstanding_report(
    state: SchedulerState, pid: str, target: int, completed: int, outstanding: object
) -> None:
    metrics = {"completed": completed, "mode": "train", OUTSTANDING_METRIC: outstanding}
    state.report_progress(ProgressReport(pid, target, None, metrics))


def _two_async_jobs(config: PolicyConfig | None = None, outstanding: object = 60) -> set[int]:
    """ft_a: 4 left of its oldest batch but ``outstanding`` requests over both open steps;
    ft_b: 60 left. Returns ft_a's ranks out of 8 after one cycle."""
    state = new_state(1, 8)
    register(state, "ft_a", infer=list(range(8)))
    register(state, "ft_b", infer=list(range(8)))
    _outstanding_report(state, "ft_a", 64, 60, outstanding)
    progress(state, "ft_b", 64, 4)
    state.submit_request("ft_a_actor_infer", GEN, now=0)
    state.submit_request("ft_b_actor_infer", GEN, now=0)
    cycle(state, 0, DemandSharePlanner(config) if config else None)
    return active(state, "ft_a")


def test_outstanding_sizes_an_async_job_by_all_its_open_work() -> None:
    """An async job generating for its next step while 4 trajectories of its oldest batch are
    left needs GPUs for all 60 requests: demand = max(remaining, outstanding)."""
    assert len(_two_async_jobs()) == 4  # 60 vs 60: an even split
    # Without the metric (or with the knob off) only the oldest batch counts: 4 vs 60.
    assert len(_two_async_jobs(PolicyConfig(count_outstanding=False))) == 1
    # Outstanding below remaining never shrinks the demand.
    assert len(_two_async_jobs(outstanding=0)) == 1


@pytest.mark.parametrize("bad", [-5, "many", True, None, [3]])
def test_malformed_outstanding_is_ignored(bad: object) -> None:
    assert len(_two_async_jobs(outstanding=bad)) == 1


def test_state_outstanding_sums_streams_and_is_none_without_reports() -> None:
    state = new_state(1, 2)
    register(state, "ft_a", infer=[0, 1])
    assert state.outstanding("ft_a") is None
    progress(state, "ft_a", 10, 0)
    assert state.outstanding("ft_a") is None  # a report without the metric
    for adapter, n in (("l1", 7), ("l2", 5)):
        state.report_progress(ProgressReport(
            "ft_a", 10, None, {"completed": 0, "adapter_id": adapter, OUTSTANDING_METRIC: n}))
    assert state.outstanding("ft_a") == 12


def test_a_warming_rank_is_no_rebalance_donor_but_yields_to_training() -> None:
    """Background expands: a rank committed before its wake finished is not taken to
    rebalance generation (the wake would be thrown away) until it serves; training still
    preempts it. ``expand_done`` starts its hold time."""
    state = new_state(1, 2)
    register(state, "ft_a", train=[0], infer=[0, 1])
    register(state, "ft_b", infer=[0, 1])
    state.submit_request("ft_a_actor_infer", GEN, now=0, step_target_estimate=64)
    plan = DemandSharePlanner().plan(state, 0)
    check_plan(state, plan)
    state.commit(plan, now=0, expands_pending=True)
    assert state.warming == {("ft_a_actor_infer", 0), ("ft_a_actor_infer", 1)}
    # ft_b now needs half the budget and has no rank (starving, which overrides min_hold_s);
    # ft_a's ranks are still waking: neither is taken.
    state.submit_request("ft_b_actor_infer", GEN, now=100, step_target_estimate=64)
    progress(state, "ft_a", 64, 0)
    progress(state, "ft_b", 64, 0)
    assert DemandSharePlanner().plan(state, 100).shrinks == ()
    # Rank 1 serves: its hold time starts now. Rank 0 still wakes, so moves between ft_a and
    # ft_b wait (pace_moves_by_wakes); unpaced, the starving ft_b takes rank 1 (not rank 0).
    assert state.expand_done("ft_a_actor_infer", 1, now=100)
    assert state.active_ranks["ft_a_actor_infer"][1] == 100
    assert DemandSharePlanner().plan(state, 100).shrinks == ()
    unpaced = DemandSharePlanner(PolicyConfig(pace_moves_by_wakes=False))
    assert [(m.cluster_id, m.dp_rank, m.reason) for m in unpaced.plan(state, 100).shrinks] == [
        ("ft_a_actor_infer", 1, ShrinkReason.REBALANCE)
    ]
    # Both serve: the paced planner moves a rank too (the most recently activated one).
    assert state.expand_done("ft_a_actor_infer", 0, now=103)
    assert [(m.cluster_id, m.reason) for m in DemandSharePlanner().plan(state, 103).shrinks] == [
        ("ft_a_actor_infer", ShrinkReason.REBALANCE)
    ]
    # Training preempts a warming rank (the service's shrink waits for the wake).
    state.submit_request("ft_a_actor_train", Priority.ACTOR_TRAINING, now=107)
    plan = DemandSharePlanner().plan(state, 107)
    assert ("ft_a_actor_infer", 0, ShrinkReason.PREEMPT) in {
        (m.cluster_id, m.dp_rank, m.reason) for m in plan.shrinks
    }


def test_moves_wait_for_wakes_only_in_their_own_group_of_spans() -> None:
    """``pace_moves_by_wakes``: while ft_a's rank wakes, ft_b (same GPUs) gets no rank moved
    to it but still gets an idle GPU of its span; ft_c / ft_d on other GPUs rebalance as
    usual; a training request is granted whatever wakes."""
    state = new_state(1, 8)
    register(state, "ft_a", train=[0, 1], infer=[0, 1])
    register(state, "ft_b", infer=[0, 1, 2])
    register(state, "ft_c", infer=[4, 5])
    register(state, "ft_d", infer=[4, 5])
    for pid in ("ft_a", "ft_c"):
        state.submit_request(f"{pid}_actor_infer", GEN, now=0, step_target_estimate=64)
    plan = DemandSharePlanner().plan(state, 0)
    check_plan(state, plan)
    state.commit(plan, now=0, expands_pending=True)
    assert active(state, "ft_a") == {0, 1} and active(state, "ft_c") == {0, 1}
    assert state.expand_done("ft_a_actor_infer", 1, now=1)
    for rank in (0, 1):
        assert state.expand_done("ft_c_actor_infer", rank, now=1)
    assert state.warming == {("ft_a_actor_infer", 0)}
    for pid in ("ft_b", "ft_d"):  # starving: a pending request and no rank
        state.submit_request(f"{pid}_actor_infer", GEN, now=100, step_target_estimate=64)
    for pid in ("ft_a", "ft_b", "ft_c", "ft_d"):
        progress(state, pid, 64, 0)
    plan = DemandSharePlanner().plan(state, 100)
    check_plan(state, plan)
    moved = {(m.cluster_id, m.reason) for m in plan.shrinks}
    assert moved == {("ft_c_actor_infer", ShrinkReason.REBALANCE)}  # ft_a's group waits
    grown = {(m.cluster_id, m.gpus) for m in plan.expands}
    assert ("ft_b_actor_infer", (2,)) in grown  # an idle GPU is still given
    assert any(cid == "ft_d_actor_infer" for cid, _ in grown)
    state.submit_request("ft_a_actor_train", Priority.ACTOR_TRAINING, now=100)
    plan = DemandSharePlanner().plan(state, 100)
    assert [g.cluster_id for g in plan.grants] == ["ft_a_actor_train"]


def test_check_state_catches_a_warming_rank_that_is_not_active() -> None:
    state = new_state(1, 2)
    register(state, "ft_a", infer=[0, 1])
    state.warming.add(("ft_a_actor_infer", 0))
    with pytest.raises(InvariantViolation, match="S6"):
        check_state(state)
