"""Partial-sleep generation: shard state, routing over active shards, preemption.

Host-agnostic: nothing here imports a host framework, and vLLM/Ray are imported lazily, so
``import rlix_plugins.generation`` works without either. See docs/generation.md.
"""

from rlix_plugins.generation.engine import (
    ABORTED,
    EngineOutput,
    GenerationRequest,
    GenerationResult,
    ProgressReporting,
    RequestAbortable,
    ShardEngine,
)
from rlix_plugins.generation.migration import (
    MigrationCandidate,
    MigrationConfig,
    MigrationMove,
    plan_migration,
)
from rlix_plugins.generation.preemption import (
    PreemptionConfig,
    PreemptionRecord,
    ShardLifecycle,
    ShardPreemptionTiming,
)
from rlix_plugins.generation.ray_state import RayShardState
from rlix_plugins.generation.router import (
    RedispatchMode,
    RouterConfig,
    RouterCounters,
    RouterStats,
    RoutingPolicy,
    ShardRouter,
)
from rlix_plugins.generation.shard_state import (
    LastActivePolicy,
    ShardEvent,
    ShardSnapshot,
    ShardStatus,
    apply_event,
    check_event,
)
from rlix_plugins.generation.state_store import LocalShardState, ShardStateStore, ShardStateView
from rlix_plugins.generation.vllm_engine import DEFAULT_SLEEP_LEVEL, VllmAsyncShard

__all__ = [
    "ABORTED",
    "DEFAULT_SLEEP_LEVEL",
    "EngineOutput",
    "GenerationRequest",
    "GenerationResult",
    "LastActivePolicy",
    "LocalShardState",
    "MigrationCandidate",
    "MigrationConfig",
    "MigrationMove",
    "PreemptionConfig",
    "PreemptionRecord",
    "ProgressReporting",
    "RayShardState",
    "RedispatchMode",
    "RequestAbortable",
    "RouterConfig",
    "RouterCounters",
    "RouterStats",
    "RoutingPolicy",
    "ShardEngine",
    "ShardEvent",
    "ShardLifecycle",
    "ShardPreemptionTiming",
    "ShardRouter",
    "ShardSnapshot",
    "ShardStateStore",
    "ShardStateView",
    "ShardStatus",
    "VllmAsyncShard",
    "apply_event",
    "check_event",
    "plan_migration",
]
