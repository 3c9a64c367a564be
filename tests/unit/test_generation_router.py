"""Router/lifecycle wiring that needs no engine: config validation and pickling."""

from __future__ import annotations

import asyncio
import pickle
from collections.abc import Coroutine, Iterable
from dataclasses import dataclass
from typing import Any

import pytest

from rlix_plugins.generation import (
    EngineOutput,
    GenerationRequest,
    PreemptionConfig,
    RayShardState,
    RouterConfig,
    ShardEvent,
    ShardLifecycle,
    ShardRouter,
    ShardSnapshot,
    ShardStatus,
    apply_event,
)
from tests.support.recording_engine import IdleLifecycleEngine


@dataclass
class FakePicklableEngine(IdleLifecycleEngine):
    """Fake: pickling needs an engine that can cross processes; the real in-process vLLM
    wrapper refuses to be pickled (checked below), a remote-engine handle would be used.
    ``running``: what it reports as still running after an abort (never drains if > 0)."""

    name: str
    running: int = 0

    async def generate(self, request: GenerationRequest) -> EngineOutput:
        raise NotImplementedError

    async def num_running(self) -> int:
        return self.running


@dataclass
class FakePicklableState:
    """FAKE ShardStateView that works in this process AND pickles: the real in-process view
    (LocalShardState) refuses pickling and the picklable one (RayShardState) needs a Ray
    actor. It applies transitions with the real state machine."""

    snap: ShardSnapshot

    def snapshot(self) -> ShardSnapshot:
        return self.snap

    async def refresh(self) -> ShardSnapshot:
        return self.snap

    async def wait_for_update(self, after_version: int, timeout_s: float) -> ShardSnapshot:
        return self.snap

    async def apply(self, dp_ranks: Iterable[int], event: ShardEvent) -> ShardSnapshot:
        self.snap = apply_event(self.snap, dp_ranks, event)
        return self.snap


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
    assert [e.name for e in copy.engines] == ["a", "b"]
    assert copy.inflight == (0, 0) and copy.stats().requests == 0
    assert copy.state.handle == "HANDLE"


def test_lifecycle_pickles_without_its_lock() -> None:
    config = PreemptionConfig(drain_timeout_s=0.01)
    life = ShardLifecycle(FakePicklableState(ShardSnapshot.initial(2)),
                          [FakePicklableEngine("a"), FakePicklableEngine("b", running=1)], config)
    # One operation first: the lock is made lazily and the counters start at 0.
    asyncio.run(life.preempt([1]))
    assert life._lock is not None and (life.preemptions, life.forced_sleeps) == (1, 1)
    copy = pickle.loads(pickle.dumps(life))
    # Only wiring travels (__getstate__): the lock and the counters belong to the original.
    assert copy._lock is None and (copy.preemptions, copy.forced_sleeps) == (0, 0)
    assert copy.config == config
    assert [e.name for e in copy._engines] == ["a", "b"]
    assert copy._state.snapshot().statuses[1] is ShardStatus.SLEEPING
    # The copy works on a loop of its own.
    snap = asyncio.run(copy.wake([1]))
    assert snap.statuses[1] is ShardStatus.WOKEN and copy._lock is not None



def test_lifecycle_serializes_operations_on_a_second_event_loop() -> None:
    """Its operation lock was made once and bound to the first loop where two operations
    overlapped: overlapping operations under a later loop (a host's next ``asyncio.run``, a
    new LoopThread) failed with asyncio's bare RuntimeError 'bound to a different event
    loop' before doing anything. The router keeps one lock per loop; so must the lifecycle."""
    life = ShardLifecycle(FakePicklableState(ShardSnapshot.initial(3)),
                          [FakePicklableEngine(n) for n in "abc"])

    async def overlap(*ops: Coroutine[Any, Any, object]) -> None:
        await asyncio.gather(*ops)

    asyncio.run(overlap(life.preempt([0]), life.preempt([1])))  # the lock meets its loop
    asyncio.run(overlap(life.wake([0]), life.wake([1])))  # another loop, overlapping again
    statuses = life._state.snapshot().statuses
    assert statuses[:2] == (ShardStatus.WOKEN, ShardStatus.WOKEN)


def test_engine_count_must_match_shards() -> None:
    with pytest.raises(ValueError, match="one per rank"):
        ShardRouter(_ray_view(), [FakePicklableEngine("a")])


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"max_attempts": 0}, "max_attempts must be >= 1, got 0"),
    ({"wait_timeout_s": 0}, "wait_timeout_s must be > 0, got 0"),
    ({"policy": "random"}, "unknown routing policy 'random'; valid values are"),
    ({"redispatch": "maybe"}, "unknown redispatch mode 'maybe'; valid values are"),
])
def test_router_config_rejects_bad_values(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RouterConfig(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"sleep_level": 3}, "sleep_level must be None, 0, 1 or 2, got 3"),
    ({"drain_timeout_s": 0}, "drain_timeout_s must be > 0, got 0"),
    ({"drain_poll_s": -1}, "drain_poll_s must be > 0, got -1"),
    # inf passed and hung every preempt whose drain had to poll twice
    ({"drain_poll_s": float("inf")},
     r"drain_poll_s must be finite \(a poll interval in seconds\), got inf"),
    # the engine-call bounds: finite seconds > 0 (inf is no bound: one hung engine held the
    # lifecycle's lock for good)
    *[({f"{call}_timeout_s": bad}, rf"{call}_timeout_s must be a finite number of seconds > 0 "
                                    rf"\(the bound on each {call} call\), got {shown}")
      for call in ("abort_all", "num_running", "sleep", "wake_up", "resume")
      for bad, shown in ((0, "0"), (-1.5, "-1.5"), (float("inf"), "inf"), (True, "True"),
                         ("60", "'60'"), (None, "None"))],
])
def test_preemption_config_rejects_bad_values(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PreemptionConfig(**kwargs)  # type: ignore[arg-type]


def test_engine_call_bounds_default_to_catching_hangs_only() -> None:
    """The defaults must let real engines finish: a veRL replica's sleep first waits up to
    ``REFRESH_WAIT_S`` for an in-place refresh, and a wake that reloads the model takes up to
    100+ s (vLLM's sleep-mode figures); the control calls take milliseconds."""
    from rlix_plugins.adapters.verl_shards import REFRESH_WAIT_S

    cfg = PreemptionConfig()
    assert cfg.sleep_timeout_s >= 2 * REFRESH_WAIT_S and cfg.sleep_timeout_s >= 200
    assert cfg.wake_up_timeout_s >= 200
    assert min(cfg.abort_all_timeout_s, cfg.num_running_timeout_s, cfg.resume_timeout_s) >= 30
    assert cfg.bound_s("wake_up") == cfg.wake_up_timeout_s


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
