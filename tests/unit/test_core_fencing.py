"""A fenced (failed) pipeline's GPUs stay frozen until it is unregistered (invariant P7)."""

from __future__ import annotations

import pytest

from rlix_plugins.coordinator.core import (
    InvariantViolation,
    Plan,
    RankMove,
    SchedulerState,
    check_plan,
)
from rlix_plugins.errors import RequestStateError, UnknownPipelineError
from rlix_plugins.protocol import Priority
from tests.core_builders import cycle, new_state, progress, register

GEN = Priority.GENERATION


def _two_generating() -> SchedulerState:
    """ft_a and ft_b share GPUs 0-3 for generation, two ranks each, both with demand."""
    state = new_state(1, 4)
    register(state, "ft_a", train=[0], infer=[0, 1, 2, 3])
    register(state, "ft_b", train=[1], infer=[0, 1, 2, 3])
    state.submit_request("ft_a_actor_infer", GEN, now=0, step_target_estimate=100)
    cycle(state, 0)
    state.submit_request("ft_b_actor_infer", GEN, now=0, step_target_estimate=100)
    for t in range(1, 20):
        cycle(state, float(t * 10))
    assert len(state.active_ranks["ft_a_actor_infer"]) == 2
    assert len(state.active_ranks["ft_b_actor_infer"]) == 2
    return state


def test_fence_cancels_requests_and_forgets_demand_once() -> None:
    state = new_state(1, 4)
    register(state, "ft_a", train=[0], infer=[0, 1, 2, 3])
    state.submit_request("ft_a_actor_infer", GEN, now=0, step_target_estimate=64)
    progress(state, "ft_a", 64, 10)
    assert state.fence("ft_a") == ("ft_a_actor_infer",)
    assert "ft_a_actor_infer" not in state.pending
    assert "ft_a" not in state.progress and "ft_a" not in state.estimates
    revision = state.revision
    assert state.fence("ft_a") == ()  # idempotent: nothing changes
    assert state.revision == revision
    state.unregister("ft_a")
    assert state.fenced == set()


def test_fence_of_an_unknown_pipeline_is_refused_and_changes_nothing() -> None:
    state = new_state(1, 4)
    register(state, "ft_a", infer=[0, 1])
    revision = state.revision
    with pytest.raises(UnknownPipelineError, match="pipeline 'ft_nobody' is not registered"):
        state.fence("ft_nobody")
    assert state.revision == revision and state.fenced == set()


def test_a_fenced_pipeline_may_not_request_or_plan_a_release() -> None:
    state = _two_generating()
    state.fence("ft_a")
    revision = state.revision
    with pytest.raises(RequestStateError, match="fenced"):
        state.submit_request("ft_a_actor_train", Priority.ACTOR_TRAINING, now=300)
    with pytest.raises(RequestStateError, match="fenced"):
        state.plan_release("ft_a_actor_infer", now=300)
    assert state.revision == revision and not state.pending and not state.planned_releases


def test_a_fenced_pipelines_ranks_are_neither_taken_nor_grown() -> None:
    state = _two_generating()
    frozen = dict(state.active_ranks["ft_a_actor_infer"])
    state.fence("ft_a")
    # ft_b has all the demand now; before fencing existed ft_a (demand 0, ranks above target)
    # was a donor, and its shards cannot be told to sleep any more.
    progress(state, "ft_b", 100, 0)
    for t in range(30, 60):
        plan, _ = cycle(state, float(t * 10))
        assert all(not m.cluster_id.startswith("ft_a") for m in (*plan.shrinks, *plan.expands))
    assert state.active_ranks["ft_a_actor_infer"] == frozen
    freed, _ = state.unregister("ft_a")  # declared dead: its GPUs go to ft_b
    cycle(state, 700)
    assert len(state.active_ranks["ft_b_actor_infer"]) == 4 and len(freed) == 2


def test_training_waits_for_a_fenced_rank_instead_of_preempting_it() -> None:
    state = new_state(1, 4)
    register(state, "ft_a", infer=[0, 1])
    register(state, "ft_b", train=[0], infer=[2, 3])
    state.submit_request("ft_a_actor_infer", GEN, now=0, step_target_estimate=64)
    cycle(state, 0)
    assert set(state.active_ranks["ft_a_actor_infer"]) == {0, 1}
    state.fence("ft_a")
    state.submit_request("ft_b_actor_train", Priority.ACTOR_TRAINING, now=10)
    plan, result = cycle(state, 10)
    # Unfenced, ft_a's rank 0 would be preempted for it (test_core_planner's first test).
    assert not result.granted and not plan.shrinks
    state.unregister("ft_a")
    _, result = cycle(state, 20)
    assert result.granted == {"ft_b_actor_train": (0,)}


def test_check_plan_refuses_a_plan_that_moves_a_fenced_pipeline() -> None:
    state = _two_generating()
    state.fence("ft_a")
    # Both map GPUs 0-3 at tp 1, so ft_b's rank r is ft_a's rank r: a P5-clean move.
    rank = min(state.active_ranks["ft_a_actor_infer"])
    gpus = state.clusters["ft_a_actor_infer"].rank_gpus(rank)
    moves = {
        "shrinks": (RankMove("ft_a_actor_infer", rank, gpus),),
        "expands": (RankMove("ft_b_actor_infer", rank, gpus),),
    }
    with pytest.raises(InvariantViolation, match="P7"):
        check_plan(state, Plan(revision=state.revision, **moves))
