"""Builders for scheduling-core tests (plain functions, shared by unit and property tests)."""

from __future__ import annotations

import copy
from collections.abc import Iterable

from rlix_plugins.coordinator.core import (
    CommitResult,
    DemandSharePlanner,
    Plan,
    Planner,
    SchedulerState,
    Topology,
    check_plan,
    check_state,
    validate_registration,
)
from rlix_plugins.protocol import ProgressReport


def register(
    state: SchedulerState,
    pipeline_id: str,
    *,
    train: list[int] | None = None,
    infer: list[int] | None = None,
    infer_tp: int = 1,
    train_tp: int = 1,
    weight: float = 1.0,
) -> None:
    tps: dict[str, int] = {}
    maps: dict[str, list[int]] = {}
    if train is not None:
        tps["actor_train"], maps["actor_train"] = train_tp, train
    if infer is not None:
        tps["actor_infer"], maps["actor_infer"] = infer_tp, infer
    state.register(
        validate_registration(
            state.topology,
            pipeline_id=pipeline_id,
            ray_namespace=f"pipeline_{pipeline_id}_NS",
            cluster_tp_configs=tps,
            cluster_device_mappings=maps,
            weight=weight,
        )
    )


def progress(state: SchedulerState, pipeline_id: str, target: int, completed: int) -> None:
    state.report_progress(
        ProgressReport(pipeline_id, target, None, {"completed": completed, "mode": "train"})
    )


def cycle(
    state: SchedulerState,
    now: float,
    planner: Planner | None = None,
    failed_shrinks: Iterable[str] = (),
    failed_expands: Iterable[str] = (),
) -> tuple[Plan, CommitResult]:
    """Plan, check, commit and check again: what the service and the simulator do."""
    plan = (planner or DemandSharePlanner()).plan(state, now)
    check_plan(state, plan)
    result = state.commit(
        plan, now=now, failed_shrinks=failed_shrinks, failed_expands=failed_expands
    )
    check_state(state)
    return plan, result


def new_state(num_nodes: int = 1, gpus_per_node: int = 8) -> SchedulerState:
    return SchedulerState(Topology(num_nodes, gpus_per_node))


def observable(state: SchedulerState) -> object:
    """A copy of everything a scheduling event can change (compare before and after)."""
    return copy.deepcopy(
        (
            state.pipelines,
            state.owner,
            state.active_ranks,
            state.holdings,
            state.pending,
            state.planned_releases,
            state.progress,
            state.estimates,
            state.warming,
            state.fenced,
            state.runs_over,
        )
    )


def active(state: SchedulerState, pid: str) -> set[int]:
    """The DP ranks of ``pid``'s generation cluster that are active."""
    return set(state.active_ranks[f"{pid}_actor_infer"])
