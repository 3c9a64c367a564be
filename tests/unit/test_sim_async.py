"""Simulator: our async partial-overlap pipeline model vs the ROLL-sequence model (pure)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from rlix_plugins.coordinator.core import DemandSharePlanner, Plan, SchedulerState, ShrinkReason
from rlix_plugins.sim.engine import EngineConfig, RunResult
from rlix_plugins.sim.metrics import summarize
from rlix_plugins.sim.report import compare
from rlix_plugins.sim.runner import POLICIES, run_policy
from rlix_plugins.sim.workloads import (
    JobSpec,
    LengthDistribution,
    PhaseTimes,
    Placement,
    SwitchCosts,
    Workload,
    rollmux_trace,
)

FAST = SwitchCosts(1.0, 1.0, 2.0, 1.0, 1.0, 2.0)


def _job(
    i: int, *, kind: str, steps: int = 3, prefill: float = 0.5, turn: float = math.inf
) -> JobSpec:
    return JobSpec(
        name=f"ft_{i:012x}",
        arrival_s=0.0,
        steps=steps,
        batch=24,
        train_gpus=2,
        infer_gpus=2,
        infer_tp=1,
        n_sat=4,
        max_seqs=8,
        lengths=LengthDistribution("lognormal", 10.0, 0.8, 60.0),
        turn_s=turn,
        phases=PhaseTimes(2.0, 1.0, 5.0, 1.5),
        costs=FAST,
        max_age=1,
        kind=kind,
        redispatch_prefill_s=prefill,
    )


def _overlap(kind: str, **kw: float) -> Workload:
    """Two jobs, one shared training pool (GPUs 0-1), inference on all 6 GPUs."""
    jobs = tuple(_job(i, kind=kind, **kw) for i in range(2))  # type: ignore[arg-type]
    everything = tuple(range(6))
    return Workload(
        "overlap",
        "two jobs, partial overlap",
        jobs,
        gpus_per_node=6,
        exclusive_nodes=2,
        shared_nodes=1,
        shared_placements=(Placement((0, 1), everything), Placement((0, 1), everything)),
    )


def test_async_kind_never_plans_a_release_and_keeps_partial_tokens() -> None:
    wl = _overlap("async", prefill=0.5)
    cfg = EngineConfig(record_tenures=False)
    ours = run_policy(wl, "ours", seed=2, config=cfg)
    roll = run_policy(wl, "ours_roll", seed=2, config=cfg)
    assert ours.cycles.planned_shrinks == 0  # no await_release_gpus per step
    assert roll.cycles.planned_shrinks > 0
    assert ours.trajectories == roll.trajectories == 2 * 3 * 24
    # Only training preempts shards here (no GENERATION-vs-GENERATION moves are forced), and
    # an abort costs exactly one re-prefill: lost work = prefill x aborts.
    assert ours.cycles.preempt_shrinks > 0
    assert ours.lost_work_s == pytest.approx(0.5 * ours.aborted)
    # The ROLL sequence with single-turn requests loses whole partial outputs.
    assert roll.lost_work_s > ours.lost_work_s


@pytest.mark.parametrize("seed", [1, 2, 3, 5])
def test_continued_requests_are_served_exactly_their_work_plus_prefills(seed: int) -> None:
    """Conservation: under CONTINUE a request's generated tokens all survive, so the service
    every shard gave adds up to the trajectories' own work (exclusive allocation, which never
    aborts, draws the same lengths) plus one re-prefill per abort and per migration. An abort
    of a request already re-dispatched once used to throw away the re-prefill it had been
    served (kept capped at ``work``), so it was served twice without showing in ``lost s``."""
    wl = _overlap("async", prefill=2.0)
    cfg = EngineConfig(record_tenures=False)

    def served(result: RunResult) -> float:
        # saturated-equivalent GPU-s x n_sat = solo-seconds of service (tp 1, n_sat 4)
        return sum(j.gen_useful_gpu_s for j in result.jobs) * 4

    work = served(run_policy(wl, "exclusive", seed=seed, config=cfg))
    for policy in ("ours", "rlix_async"):
        r = run_policy(wl, policy, seed=seed, config=cfg)
        assert r.aborted > 0
        assert served(r) == pytest.approx(work + 2.0 * (r.aborted + r.migrated), abs=1e-6)


def test_zero_prefill_async_abort_is_free() -> None:
    r = run_policy(_overlap("async", prefill=0.0), "ours", seed=4)
    assert r.lost_work_s == 0.0


def test_non_overlap_shards_keep_generating_through_training() -> None:
    """Training shrinks only the shards on its own GPUs; shards outside the pool keep their
    tenure across a training window (active refresh, nothing aborted there)."""
    wl = _overlap("async")
    planner = DemandSharePlanner()
    preempted: list[tuple[int, ...]] = []
    inner = planner.plan

    def plan(state: SchedulerState, now: float) -> Plan:
        out = inner(state, now)
        preempted.extend(m.gpus for m in out.shrinks if m.reason is ShrinkReason.PREEMPT)
        return out

    planner.plan = plan  # type: ignore[method-assign]
    r = run_policy(wl, "ours", seed=1, config=EngineConfig(record_tenures=True), planner=planner)
    assert preempted and all(set(g) <= {0, 1} for g in preempted)
    windows = [(t.start, t.end) for t in r.tenures if t.kind == "train"]
    spans = [(t.start, t.end) for t in r.tenures if t.kind == "gen" and t.gpu >= 2]
    assert any(a <= s and e <= b for s, e in windows for a, b in spans)


def test_default_deployments_and_ratios() -> None:
    assert POLICIES == ("exclusive", "rlix", "rlix_async", "ours")
    wl = _overlap("async", steps=2)
    comp = compare(wl, seed=3, out_dir=None, config=EngineConfig(record_tenures=False))
    assert tuple(s.policy for s in comp.summaries) == POLICIES
    r = comp.ratios()
    for key in (
        "ours_throughput_x_exclusive",
        "rlix_async_gpu_hours_saving_vs_exclusive",
        "ours_gpu_hours_saving_vs_rlix",
        "ours_gpu_hours_saving_vs_rlix_async",
    ):
        assert key in r
    # The ratios of one run agree with each other: ours vs RLix follows from both vs exclusive.
    for base in ("rlix", "rlix_async"):
        assert r[f"ours_throughput_x_{base}"] == pytest.approx(
            r["ours_throughput_x_exclusive"] / r[f"{base}_throughput_x_exclusive"]
        )
        assert 1 - r[f"ours_gpu_hours_saving_vs_{base}"] == pytest.approx(
            (1 - r["ours_gpu_hours_saving_vs_exclusive"])
            / (1 - r[f"{base}_gpu_hours_saving_vs_exclusive"])
        )
    # The summary carries the run's own abort and lost-work counts (a shared deployment on
    # this overlap workload aborts some trajectories; exclusive allocation never does).
    assert comp.get("exclusive").aborted_trajectories == 0
    assert comp.get("rlix").aborted_trajectories > 0
    run = run_policy(wl, "ours", seed=3)
    s = summarize("ours", run, {j.name: 1.0 for j in wl.jobs})
    assert run.aborted > 0, "the check below needs a run that aborted something"
    assert (s.aborted_trajectories, s.lost_work_s) == (run.aborted, run.lost_work_s)


def test_job_kind_is_validated() -> None:
    with pytest.raises(ValueError, match="kind"):
        _job(0, kind="nemo")
    with pytest.raises(ValueError, match="redispatch_prefill_s"):
        replace(_job(0, kind="async"), redispatch_prefill_s=-1.0)


def test_async_pipelines_report_outstanding_work_beyond_the_oldest_batch() -> None:
    """The async model reports ``outstanding`` (every admitted, unfinished request, any step)
    and the planner sees more than the oldest batch's remaining while the next step runs."""
    wl = _overlap("async")
    planner = DemandSharePlanner()
    seen: list[tuple[int, int]] = []  # (remaining of the oldest batch, outstanding)
    inner = planner.plan

    def plan(state: SchedulerState, now: float) -> Plan:
        for pid in state.pipelines:
            out, rem = state.outstanding(pid), state.demand(pid)
            if out is not None and rem is not None:
                seen.append((rem, out))
        return inner(state, now)

    planner.plan = plan  # type: ignore[method-assign]
    run_policy(wl, "ours", seed=1, config=EngineConfig(record_tenures=False), planner=planner)
    job = wl.jobs[0]
    assert seen and all(0 <= out <= job.batch * (job.max_age + 1) for _, out in seen)
    assert any(out > rem for rem, out in seen), "the next step's requests are outstanding too"


@pytest.mark.parametrize("profile", ["rollout_heavy", "training_heavy"])
def test_a_job_alone_is_never_slower_under_ours_than_under_rlix_policy(profile: str) -> None:
    # With nobody to share with, the policy has nothing to trade: ours must give a lone job
    # every GPU it can use, as RLix's policy does (same pipelines and router, only the policy
    # differs). This is why the two tie on a nearly idle cluster (docs/simulator.md).
    trace = rollmux_trace(profile, num_jobs=2, steps=3, seed=5)
    for job in trace.jobs:
        alone = replace(trace, jobs=(replace(job, arrival_s=0.0),), shared_nodes=4)
        ours = run_policy(alone, "ours", seed=5).makespan
        rlix = run_policy(alone, "rlix_async_migr", seed=5).makespan
        assert ours <= rlix, (job.name, ours, rlix)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [("arrival_s", math.nan, "arrival_s must be finite"), ("arrival_s", -1.0, "arrival_s"),
     ("weight", math.nan, "weight must be finite"), ("weight", 0.0, "weight"),
     ("redispatch_prefill_s", math.inf, "redispatch_prefill_s must be finite")],
)
def test_job_spec_refuses_non_finite_or_negative_times_and_weights(
    field: str, value: float, message: str
) -> None:
    from dataclasses import replace

    with pytest.raises(ValueError, match=message):
        replace(_job(0, kind="async"), **{field: value})
