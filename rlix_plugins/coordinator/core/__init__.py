"""Pure scheduling core: no Ray, no clock, no I/O.

The service and the simulator run this same code: events mutate :class:`SchedulerState`
(validated first), a :class:`Planner` turns the state into a :class:`Plan`, the plan is checked
against the numbered invariants (:mod:`.invariants`), applied outside the lock by the caller, and
committed with :meth:`SchedulerState.commit`.
"""

from rlix_plugins.coordinator.core.invariants import InvariantViolation, check_plan, check_state
from rlix_plugins.coordinator.core.model import (
    ClusterSpec,
    GpuOwner,
    PendingRequest,
    PipelineSpec,
    PolicyConfig,
    Topology,
)
from rlix_plugins.coordinator.core.plan import Grant, Plan, RankMove, ShrinkReason
from rlix_plugins.coordinator.core.planner import DemandSharePlanner, Planner
from rlix_plugins.coordinator.core.registration import validate_cluster, validate_registration
from rlix_plugins.coordinator.core.state import CommitResult, ImmediateGrant, SchedulerState

__all__ = [
    "ClusterSpec",
    "CommitResult",
    "DemandSharePlanner",
    "GpuOwner",
    "Grant",
    "ImmediateGrant",
    "InvariantViolation",
    "PendingRequest",
    "PipelineSpec",
    "Plan",
    "Planner",
    "PolicyConfig",
    "RankMove",
    "SchedulerState",
    "ShrinkReason",
    "Topology",
    "check_plan",
    "check_state",
    "validate_cluster",
    "validate_registration",
]
