"""What a commit does with requests that changed while its plan's resizes ran: the service
plans under its lock, sends the resizes outside it, and lets events (a caller giving up and
asking again) change the pending requests before the commit."""

from __future__ import annotations

from rlix_plugins.coordinator.core import DemandSharePlanner, check_plan, check_state
from rlix_plugins.protocol import Priority
from tests.core_builders import new_state, register

INFER = "ft_a_actor_infer"


def test_a_whole_cluster_grant_does_not_answer_a_generation_request_made_since() -> None:
    state = new_state(1, 4)
    register(state, "ft_a", infer=[0, 1])
    state.submit_request(INFER, Priority.INITIALIZATION, now=0)
    plan = DemandSharePlanner().plan(state, 0)
    check_plan(state, plan)
    assert [g.cluster_id for g in plan.grants] == [INFER]
    # While the plan's resizes run, the INITIALIZATION caller gives up and the pipeline asks
    # for generation instead.
    assert state.cancel_request(INFER)
    state.submit_request(INFER, Priority.GENERATION, now=1, step_target_estimate=8)
    result = state.commit(plan, now=1)
    check_state(state)
    # A whole-mapping holding at GENERATION would answer the request with no shard woken
    # (no resize_infer(add) is ever sent) and keep generation planning off the cluster.
    assert INFER not in state.holdings
    assert INFER not in result.granted
    assert state.pending[INFER].priority is Priority.GENERATION
