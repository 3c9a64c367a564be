"""Misuse of rlix_plugins/generation raises, never hangs (each test failed before its fix)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from rlix_plugins.errors import ShardStateError
from rlix_plugins.generation import (
    LocalShardState,
    RayShardState,
    ShardLifecycle,
    ShardStateStore,
    ShardStatus,
)
from rlix_plugins.generation import ray_state as ray_state_module
from rlix_plugins.generation.loop_thread import LoopThread
from tests.unit.test_generation_router import FakePicklableEngine


def test_loop_thread_run_on_its_own_thread_raises_instead_of_deadlocking() -> None:
    # A sync callback running on the loop (a shard-state listener, an on_counters callback)
    # that calls run() blocked the very loop that had to run the coroutine: with no timeout
    # it waited forever.
    lt = LoopThread()
    try:
        async def nested() -> str:
            inner = asyncio.sleep(0, result="never")
            try:
                lt.run(inner, timeout=2.0)
            except RuntimeError as exc:
                return str(exc)
            return "run() returned"

        message = lt.run(nested(), timeout=10.0)
        assert "own loop thread" in message
        assert lt.run(asyncio.sleep(0, result="ok"), timeout=5.0) == "ok"  # loop still serves
    finally:
        lt.close()


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"num_shards": 0}, "num_shards must be >= 1, got 0"),
    ({"num_shards": 2, "initial": ShardStatus.WOKEN}, "initial status 'woken' is not valid"),
])
def test_ray_state_create_rejects_bad_arguments_before_starting_an_actor(
    monkeypatch: pytest.MonkeyPatch, kwargs: dict[str, Any], message: str
) -> None:
    # Before the fix the actor was started and its __init__ raised: the caller got Ray's
    # ActorDiedError (not a ShardStateError) after a worker process was spent on it.
    def no_actor() -> Any:
        raise AssertionError("an actor was started for invalid arguments")

    monkeypatch.setattr(ray_state_module, "_actor_class", no_actor)
    with pytest.raises(ShardStateError, match=message):
        RayShardState.create(**kwargs)


@pytest.mark.parametrize("ranks", [0, [0, "1"], [0, None], None, "01"])
def test_lifecycle_rank_arguments_of_the_wrong_type_get_a_typed_error(ranks: Any) -> None:
    # preempt(0) raised TypeError("'int' object is not iterable") and [0, "1"] a sorting
    # TypeError; the contract is ShardStateError naming the bad value, nothing changed.
    store = ShardStateStore(2)
    engines = [FakePicklableEngine("e0"), FakePicklableEngine("e1")]
    life = ShardLifecycle(LocalShardState(store), engines)
    before = store.snapshot()

    async def go() -> None:
        with pytest.raises(ShardStateError, match="dp rank"):
            await life.preempt(ranks)
        with pytest.raises(ShardStateError, match="dp rank"):
            await life.wake(ranks)

    asyncio.run(go())
    assert store.snapshot() is before


def test_a_rank_without_an_engine_is_refused_before_the_lifecycle_marks_it() -> None:
    # A lifecycle given fewer engines than the state has shards marked the rank PREEMPTED,
    # then failed with PreemptionError(IndexError): the shard stayed unrouted for good.
    store = ShardStateStore(2)
    life = ShardLifecycle(LocalShardState(store), [FakePicklableEngine("e0")])
    before = store.snapshot()

    async def go() -> None:
        with pytest.raises(ShardStateError, match=r"shard\(s\) \[1\] have no engine: this "
                                                  r"lifecycle was given 1 engine\(s\) for 2"):
            await life.preempt([0, 1])
        assert store.snapshot() is before
        await life.preempt([0])  # ranks that have an engine still work
        store.apply([1], "preempt")
        store.apply([1], "asleep")
        with pytest.raises(ShardStateError, match="have no engine"):
            await life.wake([1])
        assert store.snapshot().statuses[1] is ShardStatus.SLEEPING
        store.apply([1], "wake")
        with pytest.raises(ShardStateError, match="have no engine"):
            await life.activate([1])
        assert store.snapshot().statuses[1] is ShardStatus.WOKEN

    asyncio.run(go())
