"""Router migration with the real router, state owner and lifecycle over FAKE engines.

Fake because a unit test cannot start vLLM (the real-engine version is
tests/integration/test_generation_migration.py). The fake decodes one token per step; its
next token is a pure function of all tokens so far (like greedy decoding), so a request
continued from its partial tokens must end with exactly the uninterrupted tokens.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence

import pytest

from rlix_plugins.errors import ShardPreemptedError
from rlix_plugins.generation import (
    EngineOutput,
    GenerationRequest,
    GenerationResult,
    LocalShardState,
    MigrationConfig,
    ProgressReporting,
    RedispatchMode,
    RequestAbortable,
    RouterConfig,
    ShardEngine,
    ShardLifecycle,
    ShardRouter,
    ShardStateStore,
)


def next_token(seq: Sequence[int]) -> int:
    return (31 * sum(seq) + 7 * len(seq)) % 997


def reference(prompt: tuple[int, ...], n: int) -> tuple[int, ...]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(next_token(seq))
    return tuple(seq[len(prompt):])


class FakeDecodeEngine:
    """Fake ShardEngine without per-request abort: ``step_s`` per token, gate, sleep."""

    def __init__(self, step_s: float = 0.002) -> None:
        self.step_s = step_s
        self.accepting = True
        self.sleeping = False
        self.running: dict[str, list[int]] = {}  # id -> generated tokens
        self.abort_flags: set[str] = set()
        self.received: list[GenerationRequest] = []
        self.completed = 0

    async def generate(self, request: GenerationRequest) -> EngineOutput:
        if not self.accepting:
            raise ShardPreemptedError(f"fake shard gate closed ({request.request_id})")
        self.received.append(request)
        out: list[int] = []
        self.running[request.request_id] = out
        try:
            seq = list(request.prompt_token_ids)
            while len(out) < request.max_tokens:
                await asyncio.sleep(self.step_s)
                if request.request_id in self.abort_flags:
                    return EngineOutput(tuple(out), "abort")
                tok = next_token(seq)
                seq.append(tok)
                out.append(tok)
            self.completed += 1
            return EngineOutput(tuple(out), "length")
        finally:
            self.running.pop(request.request_id, None)
            self.abort_flags.discard(request.request_id)

    async def abort_all(self) -> int:
        self.accepting = False
        self.abort_flags.update(self.running)
        return len(self.running)

    async def num_running(self) -> int:
        return len(self.running)

    async def sleep(self, level: int | None = None) -> None:
        self.sleeping = True

    async def wake_up(self) -> None:
        self.sleeping = False

    async def resume(self) -> None:
        self.accepting = True


class FakeAbortableEngine(FakeDecodeEngine):
    """Fake with the optional per-request abort and progress capabilities."""

    def __init__(self, step_s: float = 0.002) -> None:
        super().__init__(step_s)
        self.request_aborts = 0

    async def abort_requests(self, request_ids: Sequence[str]) -> tuple[str, ...]:
        ids = tuple(i for i in dict.fromkeys(request_ids) if i in self.running)
        self.abort_flags.update(ids)
        self.request_aborts += len(ids)
        return ids

    async def request_progress(self, request_ids: Sequence[str]) -> Mapping[str, int]:
        return {i: len(self.running[i]) for i in request_ids if i in self.running}


class FakeAbortMissesEngine(FakeAbortableEngine):
    """Fake whose per-request abort finds nothing (every request finished or was not yet
    registered when the abort arrived)."""

    async def abort_requests(self, request_ids: Sequence[str]) -> tuple[str, ...]:
        return ()


class FakeAbortFailsEngine(FakeAbortableEngine):
    """Fake whose per-request abort raises (a remote engine that cannot be reached)."""

    async def abort_requests(self, request_ids: Sequence[str]) -> tuple[str, ...]:
        raise ConnectionError("fake: engine process unreachable")


class Setup:
    """Real owner + view + router + lifecycle over fake engines; shard 1 starts asleep."""

    def __init__(self, engines: Sequence[ShardEngine], config: RouterConfig | None = None):
        self.store = ShardStateStore(len(engines))
        self.view = LocalShardState(self.store)
        self.engines = list(engines)
        self.router = ShardRouter(self.view, engines, config)
        self.life = ShardLifecycle(self.view, engines)

    async def put_to_sleep(self, ranks: list[int]) -> None:
        await self.life.preempt(ranks)

    async def expand(self, ranks: list[int]) -> None:
        await self.life.wake(ranks)
        await self.life.activate(ranks)

    def generate_all(
        self, load: Sequence[GenerationRequest]
    ) -> asyncio.Future[list[GenerationResult]]:
        """Every request of ``load`` sent through the router at once; their results in order."""
        return asyncio.ensure_future(asyncio.gather(*(self.router.generate(q) for q in load)))


def reqs(n: int, max_tokens: int, tag: str = "q") -> list[GenerationRequest]:
    return [GenerationRequest(f"{tag}{i}", (i + 3, 2 * i + 5, 11), max_tokens) for i in range(n)]


async def wait_until(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        assert loop.time() < end, "condition not reached in time"
        await asyncio.sleep(0.001)


def check_exact(requests: Sequence[GenerationRequest], results: Sequence[GenerationResult]) -> None:
    assert Counter(r.request_id for r in results) == Counter(q.request_id for q in requests)
    for q, r in zip(requests, results, strict=True):
        assert r.finish_reason == "length"
        assert r.token_ids == reference(q.prompt_token_ids, q.max_tokens), r


def run(coro_fn: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(coro_fn(), 30))


def test_capabilities_are_optional_protocols() -> None:
    assert isinstance(FakeAbortableEngine(), RequestAbortable)
    assert isinstance(FakeAbortableEngine(), ProgressReporting)
    assert not isinstance(FakeDecodeEngine(), RequestAbortable)
    assert isinstance(FakeDecodeEngine(), ShardEngine)


@pytest.mark.parametrize("mode", [RedispatchMode.RESTART, RedispatchMode.CONTINUE])
def test_activation_mid_run_moves_half_and_continues_from_partial_tokens(
    mode: RedispatchMode,
) -> None:
    async def go() -> None:
        engines = [FakeAbortableEngine(), FakeAbortableEngine()]
        s = Setup(engines, RouterConfig(redispatch=mode,
                                        migration=MigrationConfig(watch_interval_s=0.1)))
        await s.put_to_sleep([1])
        load = reqs(12, 80)
        task = s.generate_all(load)
        await wait_until(lambda: len(engines[0].running) == 12
                         and min(map(len, engines[0].running.values())) >= 5)
        await s.expand([1])  # the router's watcher sees shard 1 become active
        results = await task
        check_exact(load, results)
        moved = [r for r in results if r.dp_rank == 1]
        assert len(moved) == 6 and all(r.attempts == 2 for r in moved)
        c = s.router.counters()
        assert (c.submitted, c.completed, c.lost, c.duplicated, c.in_flight) == (12, 12, 0, 0, 0)
        assert (c.migrated, c.redispatched) == (6, 0)
        assert s.router.stats().migrated == 6 and s.router.stats().stale_refreshes == 0
        assert engines[0].request_aborts == 6 and engines[0].completed == 6
        # The target continued each one from its partial tokens: prompt + prefix, the rest
        # of the budget; the prefix is the uninterrupted output's start.
        for sent in engines[1].received:
            orig = next(q for q in load if sent.request_id.startswith(q.request_id + ":"))
            k = len(sent.prompt_token_ids) - len(orig.prompt_token_ids)
            assert k >= 5 and sent.max_tokens == orig.max_tokens - k
            assert sent.prompt_token_ids == orig.prompt_token_ids + reference(
                orig.prompt_token_ids, orig.max_tokens)[:k]
        # the watcher ends by itself within watch_interval_s once nothing is in flight
        watcher = s.router._watcher
        assert watcher is not None
        await asyncio.wait_for(watcher, timeout=2.0)

    run(go)


def test_requests_sent_one_after_another_share_one_watcher() -> None:
    """A copy that goes idle keeps its watcher until watch_interval_s has passed: requests
    sent back to back do not each start and cancel a task of their own, and an activation
    between them is still watched."""

    async def go() -> None:
        engines = [FakeAbortableEngine(), FakeAbortableEngine()]
        s = Setup(engines, RouterConfig(migration=MigrationConfig(watch_interval_s=5.0)))
        await s.put_to_sleep([1])
        watchers = set()
        for q in reqs(5, 4):
            check_exact([q], [await s.router.generate(q)])
            watchers.add(s.router._watcher)
        assert len(watchers) == 1 and None not in watchers
        (watcher,) = watchers
        assert not watcher.done()
        # the idle watcher still sees an activation and moves a request that runs then
        load = reqs(8, 80, tag="b")
        task = s.generate_all(load)
        await wait_until(lambda: len(engines[0].running) == 8
                         and min(map(len, engines[0].running.values())) >= 5)
        await s.expand([1])
        results = await task
        check_exact(load, results)
        assert s.router._watcher is watcher
        assert [r.dp_rank for r in results].count(1) == 4

    run(go)


def test_explicit_rebalance_when_auto_is_off() -> None:
    async def go() -> None:
        engines = [FakeAbortableEngine(), FakeAbortableEngine()]
        s = Setup(engines, RouterConfig(migration=MigrationConfig(auto=False)))
        await s.put_to_sleep([1])
        load = reqs(8, 60)
        task = s.generate_all(load)
        await wait_until(lambda: len(engines[0].running) == 8)
        await s.expand([1])
        await asyncio.sleep(0.02)
        assert s.router.counters().migrated == 0, "auto=False must not migrate by itself"
        moves = await s.router.rebalance([1])
        assert len(moves) == 4 and {(m.source, m.target) for m in moves} == {(0, 1)}
        assert await s.router.rebalance([1]) == (), "a second call must not move them again"
        results = await task
        check_exact(load, results)
        assert s.router.counters().migrated == 4
        assert sorted(r.dp_rank for r in results).count(1) == 4

    run(go)


def test_disabled_or_incapable_engines_never_migrate() -> None:
    async def go(engines: list[FakeDecodeEngine], cfg: RouterConfig) -> None:
        s = Setup(engines, cfg)
        await s.put_to_sleep([1])
        load = reqs(8, 40)
        task = s.generate_all(load)
        await wait_until(lambda: len(engines[0].running) == 8)
        await s.expand([1])
        assert await s.router.rebalance([1]) == ()
        results = await task
        check_exact(load, results)
        assert s.router.counters().migrated == 0
        assert {r.dp_rank for r in results} == {0}

    run(lambda: go([FakeAbortableEngine(), FakeAbortableEngine()],
                   RouterConfig(migration=MigrationConfig(enabled=False))))
    run(lambda: go([FakeDecodeEngine(), FakeDecodeEngine()], RouterConfig()))


def test_nearly_finished_requests_stay_where_they_are() -> None:
    async def go() -> None:
        engines = [FakeAbortableEngine(), FakeAbortableEngine()]
        s = Setup(engines, RouterConfig(migration=MigrationConfig(min_remaining_tokens=16)))
        await s.put_to_sleep([1])
        load = reqs(8, 40)
        task = s.generate_all(load)
        # Budget 40 >= 16, but with >= 30 tokens done fewer than 16 remain: the engine's
        # progress report must keep them in place.
        await wait_until(lambda: len(engines[0].running) == 8
                         and min(map(len, engines[0].running.values())) >= 30)
        await s.expand([1])
        results = await task
        check_exact(load, results)
        assert s.router.counters().migrated == 0 and engines[0].request_aborts == 0

    run(go)


def test_abort_that_finds_nothing_leaves_requests_and_later_preemption_is_a_redispatch() -> None:
    async def go() -> None:
        engines = [FakeAbortMissesEngine(), FakeAbortMissesEngine()]
        s = Setup(engines, RouterConfig(migration=MigrationConfig(auto=False)))
        await s.put_to_sleep([1])
        load = reqs(6, 200)
        task = s.generate_all(load)
        await wait_until(lambda: len(engines[0].running) == 6)
        await s.expand([1])
        assert await s.router.rebalance([1]) == ()
        assert all(r.migrate_to is None for r in s.router._running.values())
        await s.life.preempt([0])  # now a real preemption: counted as re-dispatch
        results = await task
        check_exact(load, results)
        c = s.router.counters()
        assert (c.migrated, c.redispatched, c.completed) == (0, 6, 6)
        assert {r.dp_rank for r in results} == {1}

    run(go)


def test_a_migrated_request_is_not_moved_again_and_preemption_after_it_restarts() -> None:
    async def go() -> None:
        engines = [FakeAbortableEngine(), FakeAbortableEngine(), FakeAbortableEngine()]
        s = Setup(engines, RouterConfig(redispatch=RedispatchMode.RESTART))
        await s.put_to_sleep([1, 2])
        load = reqs(8, 150)
        task = s.generate_all(load)
        await wait_until(lambda: len(engines[0].running) == 8
                         and min(map(len, engines[0].running.values())) >= 3)
        await s.expand([1])
        await wait_until(lambda: len(engines[1].running) == 4)
        on_1 = {rid.split(":")[0] for rid in engines[1].running}
        # Loads 4/4/0: shard 1's requests were migrated once already, so only shard 0's may
        # move: 2 of them (then 2/4/2 and shard 0 has no gap to shard 2 any more).
        await s.expand([2])
        await wait_until(lambda: s.router.counters().migrated == 6)
        on_2 = {q.request_id.split(":")[0] for q in engines[2].received}
        assert len(on_2) == 2 and not on_2 & on_1, "a migrated request was moved again"
        await s.life.preempt([1])  # migrated requests preempted: restart from the prompt
        results = await task
        check_exact(load, results)
        c = s.router.counters()
        assert c.migrated == 6 and c.redispatched == 4 and c.completed == 8
        assert s.router.inflight == (0, 0, 0)

    run(go)


def test_failing_abort_never_fails_a_request() -> None:
    async def go() -> None:
        engines = [FakeAbortFailsEngine(), FakeAbortFailsEngine()]
        s = Setup(engines)
        await s.put_to_sleep([1])
        load = reqs(6, 60)
        task = s.generate_all(load)
        await wait_until(lambda: len(engines[0].running) == 6)
        await s.expand([1])
        assert await s.router.rebalance([1]) == ()
        results = await task
        check_exact(load, results)
        c = s.router.counters()
        assert (c.completed, c.lost, c.migrated) == (6, 0, 0)

    run(go)


@pytest.mark.parametrize("mode", [RedispatchMode.RESTART, RedispatchMode.CONTINUE])
def test_list_prompts_survive_migration_and_preemption(mode: RedispatchMode) -> None:
    """A caller's list prompt (the common host form) must continue from partial tokens like
    a tuple one: the continued attempt's prompt is prompt + partial tokens."""

    async def go() -> None:
        engines = [FakeAbortableEngine(), FakeAbortableEngine()]
        s = Setup(engines, RouterConfig(redispatch=mode))
        await s.put_to_sleep([1])
        load = [GenerationRequest(f"l{i}", [i + 3, 2 * i + 5, 11], 120)  # type: ignore[arg-type]
                for i in range(4)]
        task = asyncio.ensure_future(
            asyncio.gather(*(s.router.generate(q) for q in load), return_exceptions=True))
        await wait_until(lambda: len(engines[0].running) == 4
                         and min(map(len, engines[0].running.values())) >= 3)
        await s.expand([1])  # migration: continues the moved half from their partial tokens
        # (or the load ended early: a request failed; the results below show which)
        await wait_until(lambda: task.done() or (len(engines[1].running) == 2 and min(
            map(len, engines[1].running.values())) >= 3))
        # Preempting the moved half: CONTINUE continues them again from prompt + prefix.
        await s.life.preempt([1])
        results = await task
        assert not [r for r in results if isinstance(r, BaseException)], results
        check_exact(load, results)  # type: ignore[arg-type]
        c = s.router.counters()
        assert (c.completed, c.lost, c.migrated, c.redispatched) == (4, 0, 2, 2)

    run(go)


class FakeAbortLandsReplyLostEngine(FakeAbortableEngine):
    """Fake whose per-request abort lands but whose reply is lost (a remote engine's call
    that timed out after the engine had aborted)."""

    async def abort_requests(self, request_ids: Sequence[str]) -> tuple[str, ...]:
        await super().abort_requests(request_ids)
        raise ConnectionError("fake: the abort's reply was lost")


def test_an_abort_whose_reply_was_lost_is_a_migration_not_a_preemption() -> None:
    """One attempt only: counted as a preemption, each aborted request would be lost."""

    async def go() -> None:
        engines = [FakeAbortLandsReplyLostEngine(), FakeAbortLandsReplyLostEngine()]
        s = Setup(engines, RouterConfig(max_attempts=1, migration=MigrationConfig(auto=False)))
        await s.put_to_sleep([1])
        load = reqs(6, 200)
        task = s.generate_all(load)
        await wait_until(lambda: len(engines[0].running) == 6
                         and min(map(len, engines[0].running.values())) >= 3)
        await s.expand([1])
        assert await s.router.rebalance([1]) == ()  # nobody knows which moves started
        results = await task
        check_exact(load, results)
        c = s.router.counters()
        assert (c.completed, c.lost, c.redispatched) == (6, 0, 0)
        assert c.migrated == engines[0].request_aborts == 3
        assert sum(r.dp_rank == 1 for r in results) == 3

    run(go)
