"""Router/lifecycle wiring that needs no engine: config validation and pickling."""

from __future__ import annotations

import pickle
from dataclasses import dataclass

import pytest

from rlix_plugins.generation import (
    EngineOutput,
    GenerationRequest,
    PreemptionConfig,
    RayShardState,
    RouterConfig,
    ShardLifecycle,
    ShardRouter,
    ShardSnapshot,
)


@dataclass
class FakePicklableEngine:
    """Fake: pickling needs an engine that can cross processes; the real in-process vLLM
    wrapper refuses to be pickled (checked below), a remote-engine handle would be used."""

    name: str

    async def generate(self, request: GenerationRequest) -> EngineOutput:
        raise NotImplementedError

    async def abort_all(self) -> int:
        return 0

    async def num_running(self) -> int:
        return 0

    async def sleep(self, level: int | None = None) -> None:
        return None

    async def wake_up(self) -> None:
        return None

    async def resume(self) -> None:
        return None


def _ray_view() -> RayShardState:
    view = RayShardState(handle="HANDLE")
    view._cached = ShardSnapshot.initial(2)  # as if it had read the owner once
    return view


def test_router_pickles_wiring_not_runtime_state() -> None:
    router = ShardRouter(_ray_view(), [FakePicklableEngine("a"), FakePicklableEngine("b")],
                         RouterConfig(max_attempts=3))
    router._inflight[0] = 5
    copy = pickle.loads(pickle.dumps(router))
    assert copy.config == router.config
    assert [e.name for e in copy.engines] == ["a", "b"]  # type: ignore[attr-defined]
    assert copy.inflight == (0, 0) and copy.stats().requests == 0
    assert copy.state.handle == "HANDLE"  # type: ignore[attr-defined]


def test_lifecycle_pickles_without_its_lock() -> None:
    life = ShardLifecycle(_ray_view(), [FakePicklableEngine("a"), FakePicklableEngine("b")])
    copy = pickle.loads(pickle.dumps(life))
    assert copy.config == PreemptionConfig() and copy.forced_sleeps == 0


def test_engine_count_must_match_shards() -> None:
    with pytest.raises(ValueError, match="one per rank"):
        ShardRouter(_ray_view(), [FakePicklableEngine("a")])


@pytest.mark.parametrize("kwargs", [{"max_attempts": 0}, {"wait_timeout_s": 0},
                                    {"policy": "random"}, {"redispatch": "maybe"}])
def test_router_config_rejects_bad_values(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        RouterConfig(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("kwargs", [{"sleep_level": 3}, {"drain_timeout_s": 0},
                                    {"drain_poll_s": -1}])
def test_preemption_config_rejects_bad_values(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        PreemptionConfig(**kwargs)  # type: ignore[arg-type]


def test_vllm_shard_refuses_pickling() -> None:
    from rlix_plugins.generation import VllmAsyncShard

    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(VllmAsyncShard(object()))


def test_counters_keep_their_positional_form_and_migration_config_travels() -> None:
    from rlix_plugins.generation import MigrationConfig, RouterCounters

    # Eight positional fields as before (readers built before migration existed).
    assert RouterCounters("c", 3, 3, 0, 0, 0, 0, 1).migrated == 0
    cfg = RouterConfig(migration=MigrationConfig(min_gap=4, auto=False))
    router = ShardRouter(_ray_view(), [FakePicklableEngine("a"), FakePicklableEngine("b")], cfg)
    copy = pickle.loads(pickle.dumps(router))
    assert copy.config.migration == MigrationConfig(min_gap=4, auto=False)
    assert copy.counters().migrated == 0 and copy.stats().migrated == 0
