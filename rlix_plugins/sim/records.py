"""Records the simulator produces while it runs (frozen; aggregated by :mod:`.metrics`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TenureRecord:
    """A closed physical tenure of a GPU, for the ownership timeline plot."""

    gpu: int
    job: str
    #: "train", "gen", "init"
    kind: str
    start: float
    end: float


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One finished training step of one job."""

    job: str
    step: int
    end: float
    trajectories: int
    #: oldest weight version among the batch's trajectories (staleness = step - version)
    min_version: int


@dataclass(frozen=True, slots=True)
class JobRecord:
    """One job's life: arrival, admission (register), completion (unregister)."""

    job: str
    arrival: float
    admitted: float
    finished: float
    steps: int
    trajectories: int
    train_gpus: int
    #: GPU-seconds of training compute (old/ref log-probs + update) on its training GPUs
    train_compute_gpu_s: float
    #: GPU-seconds its generation ranks spent saturated-equivalent (useful decode)
    gen_useful_gpu_s: float
    aborted: int


@dataclass(frozen=True, slots=True)
class CycleStats:
    """Counters over every scheduling cycle of a run."""

    cycles: int
    preempt_shrinks: int
    rebalance_shrinks: int
    planned_shrinks: int
    #: RLix-style shrinks whose GPUs nobody took this cycle (churn)
    idle_preemptions: int
    expands: int
    grants: int
    plan_wall_s_total: float
    plan_wall_s_max: float
    #: shrinks by the planner's starvation guard (``PolicyConfig.starve_after_s``)
    starvation_shrinks: int = 0
