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
from rlix_plugins.protocol import Priority, ProgressReport


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


def chain_of_spans(planner: Planner, now: float = 0.0) -> SchedulerState:
    """A chain of spans on 12 GPUs after one cycle of ``planner``: ``ft_a`` and ``ft_b`` share
    GPUs 0-3, ``ft_c`` maps 3-11 (so the three form one group) and holds one rank without
    demand. ``ft_a`` (demand 24) holds all four of GPUs 0-3; ``ft_b`` has not reported yet.
    The idle GPUs 5-11 only ``ft_c`` reaches count in the group's budget, so ``ft_a``'s target
    is all four ranks: a donor never above its target (docs/coordinator.md)."""
    state = new_state(1, 12)
    register(state, "ft_a", infer=[0, 1, 2, 3])
    register(state, "ft_b", infer=[0, 1, 2, 3])
    register(state, "ft_c", infer=list(range(3, 12)))
    progress(state, "ft_a", 24, 0)
    state.submit_request("ft_c_actor_infer", Priority.GENERATION, now=now)  # no estimate
    cycle(state, now, planner)
    assert len(active(state, "ft_a")) == 4 and len(active(state, "ft_c")) == 1
    return state


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
