"""Calibrate a workload's trajectory lengths so its exclusive run matches a published cycle."""

from __future__ import annotations

import logging
from dataclasses import replace

from rlix_plugins.sim.engine import EngineConfig
from rlix_plugins.sim.runner import run_policy
from rlix_plugins.sim.workloads import Workload

log = logging.getLogger(__name__)


#: steps per job a calibration probe should run: two warm-up steps, then steady cycles
CALIBRATION_STEPS = 8
#: fewer step ends leave no steady cycle to measure (with 1 or 2 the "cycle" is 0 or training
#: time alone, flat in the length scale, and the secant search stops at its first guess)
_MIN_STEP_ENDS = 4


def exclusive_cycle(workload: Workload, seed: int) -> float:
    """Mean steady-state step time of the first job under exclusive allocation (after two
    warm-up steps); needs a run of at least 4 steps."""
    if workload.jobs[0].steps < _MIN_STEP_ENDS:
        raise ValueError(
            f"calibration needs a probe of >= {_MIN_STEP_ENDS} steps per job "
            f"(use {CALIBRATION_STEPS}), got {workload.jobs[0].steps}"
        )
    result = run_policy(workload, "exclusive", seed=seed, config=EngineConfig(record_tenures=False))
    ends = [s.end for s in result.steps if s.job == workload.jobs[0].name]
    warm = 2
    return (ends[-1] - ends[warm]) / (len(ends) - 1 - warm)


def calibrate_lengths(workload: Workload, target_cycle_s: float, seed: int) -> float:
    """Scale factor for every job's lengths so the exclusive cycle equals ``target_cycle_s``.

    The cycle is affine in the length scale (fixed sync/overhead plus generation), so two
    probes pin it down; a third run refines.
    """

    def scaled(f: float) -> Workload:
        jobs = tuple(replace(j, lengths=j.lengths.scaled(f)) for j in workload.jobs)
        return replace(workload, jobs=jobs)

    f0, f1 = 1.0, 2.0
    c0, c1 = exclusive_cycle(scaled(f0), seed), exclusive_cycle(scaled(f1), seed)
    for _ in range(3):
        if abs(c1 - c0) < 1e-9:
            break
        f2 = f1 + (target_cycle_s - c1) * (f1 - f0) / (c1 - c0)
        f0, c0 = f1, c1
        f1, c1 = max(0.05, f2), exclusive_cycle(scaled(max(0.05, f2)), seed)
        if abs(c1 - target_cycle_s) / target_cycle_s < 0.01:
            break
    log.info(
        "%s: length scale %.3f gives exclusive cycle %.1f s (target %.1f)",
        workload.name,
        f1,
        c1,
        target_cycle_s,
    )
    return f1
