"""Figures of merit of a run, computed the same way for every policy."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from rlix_plugins.sim.engine import RunResult


@dataclass(frozen=True, slots=True)
class Summary:
    """What ``rlix-plugins simulate`` prints and the benchmark saves, per policy."""

    policy: str
    num_gpus: int
    makespan_s: float
    trajectories: int
    #: trajectories consumed by training per hour of makespan (cluster-wide)
    rollout_throughput_per_h: float
    steps: int
    gpu_hours_per_step: float
    #: useful GPU-seconds / (GPUs x makespan); generation lost to aborts and migration
    #: re-prefills keep GPUs busy but are not useful (the same work under every deployment)
    gpu_utilisation: float
    #: 1 - training compute / (training GPUs x job lifetime), mean over jobs (PlexRL's bubble)
    train_bubble: float
    mean_jct_s: float
    p95_jct_s: float
    mean_slowdown: float
    max_slowdown: float
    jain_fairness: float
    preemptions: int
    rebalances: int
    idle_preemptions: int
    aborted_trajectories: int
    #: generation work lost to aborts (regenerated tokens + re-prefills), solo-seconds
    lost_work_s: float
    #: running requests moved to a newly active shard, and their re-prefill solo-seconds
    migrated_requests: int
    migration_prefill_s: float
    cycles: int
    plan_ms_mean: float
    plan_ms_max: float
    #: generation ranks the starvation guard moved (``PolicyConfig.starve_after_s``)
    starvation_moves: int = 0


def jain(values: list[float]) -> float:
    """Jain's fairness index: 1 = perfectly even, 1/n = one job gets everything."""
    if not values:
        return 1.0
    s = sum(values)
    sq = sum(v * v for v in values)
    return (s * s) / (len(values) * sq) if sq > 0 else 1.0


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return 0.0
    k = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[k]


def slowdowns(result: RunResult, isolated: dict[str, float]) -> dict[str, float]:
    """JCT (arrival to finish, queueing included) over the job's JCT alone on its own GPUs."""
    return {j.job: (j.finished - j.arrival) / isolated[j.job] for j in result.jobs}


def summarize(policy: str, result: RunResult, isolated: dict[str, float]) -> Summary:
    """Compute every figure of merit of one run."""
    jcts = [j.finished - j.arrival for j in result.jobs]
    slow = slowdowns(result, isolated)
    bubbles = [
        1.0 - j.train_compute_gpu_s / (j.train_gpus * max(1e-9, j.finished - j.admitted))
        for j in result.jobs
    ]
    steps = len(result.steps)
    c = result.cycles
    return Summary(
        policy=policy,
        num_gpus=result.num_gpus,
        makespan_s=result.makespan,
        trajectories=result.trajectories,
        rollout_throughput_per_h=result.trajectories / result.makespan * 3600.0,
        steps=steps,
        gpu_hours_per_step=result.num_gpus * result.makespan / 3600.0 / max(1, steps),
        gpu_utilisation=(result.useful_gpu_s - result.wasted_gpu_s)
        / (result.num_gpus * result.makespan),
        train_bubble=sum(bubbles) / len(bubbles),
        mean_jct_s=sum(jcts) / len(jcts),
        p95_jct_s=_percentile(jcts, 0.95),
        mean_slowdown=sum(slow.values()) / len(slow),
        max_slowdown=max(slow.values()),
        # Fairness over normalised progress rates (isolated JCT / JCT), as in RollMux/Themis.
        jain_fairness=jain([1.0 / s for s in slow.values()]),
        preemptions=c.preempt_shrinks,
        rebalances=c.rebalance_shrinks,
        idle_preemptions=c.idle_preemptions,
        aborted_trajectories=result.aborted,
        lost_work_s=result.lost_work_s,
        migrated_requests=result.migrated,
        migration_prefill_s=result.migration_prefill_s,
        cycles=c.cycles,
        plan_ms_mean=1000.0 * c.plan_wall_s_total / max(1, c.cycles),
        plan_ms_max=1000.0 * c.plan_wall_s_max,
        starvation_moves=c.starvation_shrinks,
    )


def implied_pool_ratio(saving: float) -> float:
    """Training:rollout ratio T/R at which sharing one of two jobs' training pools saves
    ``saving`` of the GPU-hours with no slowdown: ``saving = T / (2 (T + R))``, so
    ``T/R = 2 s / (1 - 2 s)`` (PlexRL's 2-job setup against split-async deployment)."""
    if not 0.0 <= saving < 0.5:
        raise ValueError(f"a saving from sharing one of two pools lies in [0, 0.5), got {saving}")
    return 2.0 * saving / (1.0 - 2.0 * saving)


def first_crossing(points: list[tuple[float, float]], level: float) -> float | None:
    """Smallest x at which the piecewise-linear curve through ``points`` (sorted by x)
    reaches ``level``; None when it never does."""
    for (x0, y0), (x1, y1) in itertools.pairwise(points):
        if y0 >= level:
            return x0
        if y1 >= level:
            return x0 + (level - y0) * (x1 - x0) / (y1 - y0)
    if points and points[-1][1] >= level:
        return points[-1][0]
    return None


@dataclass(frozen=True, slots=True)
class FinalDrain:
    """The end of a run where the cluster stays under-used: from the first utilisation bin after
    which every bin is below ``level`` of the cluster, to the makespan."""

    start_s: float
    length_s: float
    #: idle cluster-seconds (idle GPU-seconds / GPUs) inside the drain and before it
    idle_in_s: float
    idle_before_s: float


def final_drain(result: RunResult, level: float = 0.5) -> FinalDrain:
    """Split a run's idle time into the final drain and the rest (see :class:`FinalDrain`).
    Bins cover ``[0, makespan)``; the last one is partial and counted up to the makespan."""
    if not 0.0 < level <= 1.0:
        raise ValueError(f"level is a fraction of the cluster in (0, 1], got {level}")
    width, gpus = result.util_bin_s, result.num_gpus
    n = math.ceil(result.makespan / width)
    useful = [*result.util_bins[:n], *([0.0] * (n - len(result.util_bins)))]
    spans = [min(width, result.makespan - i * width) for i in range(n)]
    k = n
    while k > 0 and useful[k - 1] < level * gpus * spans[k - 1]:
        k -= 1
    idle = [max(0.0, gpus * s - u) / gpus for s, u in zip(spans, useful, strict=True)]
    start = min(k * width, result.makespan)
    return FinalDrain(
        start_s=start,
        length_s=result.makespan - start,
        idle_in_s=sum(idle[k:]),
        idle_before_s=sum(idle[:k]),
    )
