"""Core fix found by the simulator: a generating pipeline whose ranks were all preempted."""

from __future__ import annotations

from rlix_plugins.protocol import Priority
from tests.core_builders import cycle, new_state, progress, register


def test_pipeline_preempted_to_zero_ranks_gets_ranks_back() -> None:
    state = new_state(1, 4)
    register(state, "ft_a", train=[0], infer=[0, 1, 2, 3])
    register(state, "ft_b", train=[0, 1, 2, 3])
    state.submit_request("ft_a_actor_infer", Priority.GENERATION, now=0, step_target_estimate=100)
    cycle(state, 0)
    progress(state, "ft_a", 100, 10)
    assert len(state.active_ranks["ft_a_actor_infer"]) == 4
    # Another job's training takes every GPU: ft_a keeps generating demand but has no rank
    # and no pending request (it was granted long ago).
    state.submit_request("ft_b_actor_train", Priority.ACTOR_TRAINING, now=1)
    cycle(state, 1)
    assert not state.active_ranks["ft_a_actor_infer"]
    state.release("ft_b_actor_train")
    cycle(state, 2)
    # Before the fix ft_a was not eligible any more and waited forever on an idle cluster.
    assert len(state.active_ranks["ft_a_actor_infer"]) == 4


def test_finished_step_without_request_stays_ineligible() -> None:
    state = new_state(1, 2)
    register(state, "ft_a", infer=[0, 1])
    progress(state, "ft_a", 10, 10)  # nothing remaining, no request: no ranks
    cycle(state, 0)
    assert not state.active_ranks["ft_a_actor_infer"]
