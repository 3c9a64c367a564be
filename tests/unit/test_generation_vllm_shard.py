"""VllmAsyncShard over an engine that does not expose vLLM's internal request map.

The engine is a FAKE: a unit test cannot start a vLLM engine (the real-engine tests are in
tests/integration/test_generation_vllm.py). It has ``AsyncLLM``'s generate/abort/sleep/
get_num_unfinished_requests but no ``output_processor`` (an engine that is not an
``AsyncLLM``, or a vLLM release that moved the attribute). vLLM itself is imported: the
wrapper builds real ``SamplingParams``/``TokensPrompt``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest

from rlix_plugins.errors import SettingsError, ShardPreemptedError
from rlix_plugins.generation import (
    GenerationRequest,
    LocalShardState,
    PreemptionConfig,
    ShardLifecycle,
    ShardStateStore,
    ShardStatus,
    VllmAsyncShard,
)

pytest.importorskip("vllm")


class FakeEngineWithoutRequestMap:
    """FAKE engine (see module docstring). A request registers after ``admit_s`` (vLLM's
    input processing); an abort of an id not registered yet is ignored, as vLLM does."""

    def __init__(self, admit_s: float = 0.0) -> None:
        self.admit_s = admit_s
        self.abort_calls: list[list[str]] = []
        self.unfinished: dict[str, asyncio.Event] = {}
        self.slept: list[tuple[int, str]] = []

    async def generate(self, prompt: Any, params: Any, request_id: str) -> AsyncIterator[Any]:
        await asyncio.sleep(self.admit_s)
        aborted = self.unfinished[request_id] = asyncio.Event()
        try:
            await aborted.wait()  # runs until aborted
            yield SimpleNamespace(finished=True, outputs=[SimpleNamespace(
                token_ids=[9, 9], finish_reason="abort", logprobs=None)])
        finally:
            del self.unfinished[request_id]

    async def abort(self, request_ids: list[str]) -> None:
        self.abort_calls.append(list(request_ids))
        for rid in request_ids:
            if rid in self.unfinished:
                self.unfinished[rid].set()

    def get_num_unfinished_requests(self) -> int:
        return len(self.unfinished)

    async def sleep(self, level: int, mode: str) -> None:
        self.slept.append((level, mode))


async def _until(cond: Any, timeout: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        assert loop.time() < end, "condition not reached in time"
        await asyncio.sleep(0.001)


def test_abort_all_aborts_our_requests_and_counts_each_once() -> None:
    async def go() -> None:
        engine = FakeEngineWithoutRequestMap()
        shard = VllmAsyncShard(engine, name="s0")
        task = asyncio.ensure_future(shard.generate(GenerationRequest("r1:a1", [1, 2], 8)))  # type: ignore[arg-type]
        await _until(lambda: "r1:a1" in engine.unfinished)
        # Registered in the engine AND ours: one request, not two.
        assert await shard.num_running() == 1
        assert await shard.abort_all() == 1
        assert engine.abort_calls == [["r1:a1"]]
        out = await asyncio.wait_for(task, 5)
        assert out.aborted and out.token_ids == (9, 9)
        assert await shard.num_running() == 0 and shard.aborted_total == 1
        with pytest.raises(ShardPreemptedError):
            await shard.generate(GenerationRequest("r2:a1", (1,), 8))

    asyncio.run(go())


def test_preemption_drains_without_waiting_for_the_drain_timeout() -> None:
    async def go() -> None:
        # Admission slower than the first abort: that abort misses it (ignored by the
        # engine), so abort_all must send it again on the drain loop's next call.
        engine = FakeEngineWithoutRequestMap(admit_s=0.05)
        shard = VllmAsyncShard(engine, name="s0")
        store = ShardStateStore(2)
        view = LocalShardState(store)
        life = ShardLifecycle(view, [shard, VllmAsyncShard(FakeEngineWithoutRequestMap())],
                              PreemptionConfig(drain_timeout_s=10.0))
        task = asyncio.ensure_future(shard.generate(GenerationRequest("r1:a1", (1, 2), 8)))
        await asyncio.sleep(0)  # tracked by the wrapper, still being admitted by the engine
        record = await life.preempt([0])
        assert record.forced_sleeps == 0 and record.shards[0].drain_s < 5.0
        assert record.shards[0].aborted_requests == 1  # re-sent aborts are not re-counted
        assert len(engine.abort_calls) >= 2 and all(c == ["r1:a1"] for c in engine.abort_calls)
        assert (await asyncio.wait_for(task, 5)).aborted
        assert engine.slept == [(2, "abort")]
        assert store.snapshot().statuses[0] is ShardStatus.SLEEPING

    asyncio.run(go())


@pytest.mark.parametrize("level", [3, -1, True, 2.0, "2"])
def test_a_sleep_level_outside_0_1_2_is_refused_before_the_engine_sleeps(level: Any) -> None:
    """The constructor checked ``sleep_level`` but ``sleep(level)`` passed any level straight to
    vLLM (``AsyncLLM.rlix_sleep(3)`` reached its workers)."""
    async def go() -> None:
        engine = FakeEngineWithoutRequestMap()
        shard = VllmAsyncShard(engine, name="s0")
        with pytest.raises(SettingsError, match=r"sleep level must be None, 0, 1 or 2, got"):
            await shard.sleep(level)
        assert engine.slept == []
        await shard.sleep(None)
        await shard.sleep(1)
        assert engine.slept == [(2, "abort"), (1, "abort")]

    asyncio.run(go())


class FakeEngineThatQueuesWhileAsleep(FakeEngineWithoutRequestMap):
    """FAKE engine with vLLM's sleep behaviour (shared/notes/vllm-cpu.md): ``sleep(mode=
    "abort")`` aborts what is registered; a request that registers while the engine sleeps
    waits and runs after ``wake_up``, and finishes normally with ``tokens`` (on GPU: computed
    with the weights a level-2 sleep dropped, before the weight sync)."""

    def __init__(self, admit_s: float = 0.0, tokens: tuple[int, ...] = (7, 7, 7)) -> None:
        super().__init__(admit_s)
        self.tokens = tokens
        self.awake = asyncio.Event()
        self.awake.set()

    async def generate(self, prompt: Any, params: Any, request_id: str) -> AsyncIterator[Any]:
        await asyncio.sleep(self.admit_s)
        aborted = self.unfinished[request_id] = asyncio.Event()
        try:
            await self.awake.wait()
            reason = "abort" if aborted.is_set() else "length"
            tokens = [9] if aborted.is_set() else list(self.tokens)
            yield SimpleNamespace(finished=True, outputs=[SimpleNamespace(
                token_ids=tokens, finish_reason=reason, logprobs=None)])
        finally:
            del self.unfinished[request_id]

    async def sleep(self, level: int, mode: str) -> None:
        await super().sleep(level, mode)
        self.awake.clear()
        for event in self.unfinished.values():
            event.set()

    async def wake_up(self) -> None:
        self.awake.set()


def test_an_attempt_that_registered_after_a_forced_sleep_is_never_returned_as_a_sample() -> None:
    """After a forced sleep (the drain timed out while a request was still being admitted),
    the request registered in the sleeping engine, ran after wake-up (before the weight sync:
    level 2 had dropped the weights) and came back as a normal completion: the router returned
    that sample. It must come back aborted, so the router re-dispatches it."""
    from rlix_plugins.generation import MigrationConfig, RouterConfig, ShardRouter

    async def go() -> None:
        slow = FakeEngineThatQueuesWhileAsleep(admit_s=0.3, tokens=(7, 7, 7))
        fresh = FakeEngineThatQueuesWhileAsleep(tokens=(5, 5, 5))
        shards = [VllmAsyncShard(slow, name="s0"), VllmAsyncShard(fresh, name="s1")]
        store = ShardStateStore(2)
        view = LocalShardState(store)
        router = ShardRouter(view, shards, RouterConfig(migration=MigrationConfig(enabled=False)))
        life = ShardLifecycle(view, shards, PreemptionConfig(drain_timeout_s=0.02))
        task = asyncio.ensure_future(router.generate(GenerationRequest("r1", (1, 2), 3)))
        await _until(lambda: router.inflight == (1, 0))  # dispatched to shard 0, admitting
        record = await life.preempt([0])
        assert record.forced_sleeps == 1
        await _until(lambda: "r1:a1" in slow.unfinished)  # registered while asleep
        await life.wake([0])  # runs now, with weights not synced yet
        result = await asyncio.wait_for(task, 5)
        assert (result.dp_rank, result.token_ids) == (1, (5, 5, 5))
        assert result.attempts == 2 and shards[0].completed_total == 0
        c = router.counters()
        assert (c.submitted, c.completed, c.lost, c.in_flight) == (1, 1, 0, 0)

    asyncio.run(go())
