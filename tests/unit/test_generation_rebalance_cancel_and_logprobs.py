"""Cancelled rebalances and logprob alignment in generation: each test failed before its fix.

Engines here are FAKES (a unit test cannot start vLLM; the real-engine suites are under
tests/integration); the router, state owner, views, lifecycle and migration policy are the real
ones.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from rlix_plugins.errors import ProtocolError
from rlix_plugins.generation import (
    EngineOutput,
    GenerationRequest,
    LocalShardState,
    MigrationConfig,
    RouterConfig,
    RoutingPolicy,
    ShardEvent,
    ShardRouter,
    ShardStateStore,
)
from tests.unit.test_generation_accounting_and_inputs import FakeScriptedEngine, _router
from tests.unit.test_generation_router_migration import (
    FakeAbortableEngine,
    Setup,
    reference,
    reqs,
    wait_until,
)

# -- 1. a cancelled rebalance leaves no migration marks behind ------------------------------------


class FakeHeldAbortEngine(FakeAbortableEngine):
    """FAKE abortable engine whose per-request abort parks until ``hold`` is set (a slow abort
    RPC to a remote engine), then aborts the ids (``finds``) or finds none of them."""

    def __init__(self, step_s: float, finds: bool) -> None:
        super().__init__(step_s)
        self.finds = finds
        self.entered = asyncio.Event()
        self.hold = asyncio.Event()

    async def abort_requests(self, request_ids: Sequence[str]) -> tuple[str, ...]:
        self.entered.set()
        await self.hold.wait()
        return await super().abort_requests(request_ids) if self.finds else ()


@pytest.mark.parametrize("abort_lands", [True, False], ids=["abort-lands", "abort-misses"])
def test_cancelled_rebalance_leaves_no_migration_marks(abort_lands: bool) -> None:
    # rebalance() marked every chosen attempt, then awaited each source's abort in turn; a
    # cancel during the first abort left the marks of every move set. A later preemption of a
    # still-marked attempt was then counted (and continued) as a migration that never happened,
    # and did not count against max_attempts.
    async def go() -> None:
        step = 0.005
        e0 = FakeHeldAbortEngine(step, finds=abort_lands)
        setup = Setup([e0, FakeAbortableEngine(step), FakeAbortableEngine(step)],
                      RouterConfig(migration=MigrationConfig(auto=False)))
        e2 = setup.engines[2]
        assert isinstance(e2, FakeAbortableEngine)
        await setup.put_to_sleep([1])
        work = reqs(8, 300)
        tasks = [asyncio.create_task(setup.router.generate(r)) for r in work]
        await wait_until(lambda: len(e0.running) == 4 and len(e2.running) == 4)
        await setup.expand([1])
        # Loads 4/0/4 with target 1: one move from shard 0, then one from shard 2.
        rebalance = asyncio.create_task(setup.router.rebalance([1]))
        await asyncio.wait_for(e0.entered.wait(), 10)
        rebalance.cancel()
        with pytest.raises(asyncio.CancelledError):
            await rebalance
        # Shard 2's move never had its abort sent: a preemption of shard 2 is a preemption.
        await setup.life.preempt([2])
        e0.hold.set()  # the abort sent to shard 0 before the cancel ends now
        if not abort_lands:
            await asyncio.sleep(0.05)  # let the abort's outcome settle its mark
            await setup.life.preempt([0])  # the move shard 0 did not abort is no migration
        results = await asyncio.wait_for(asyncio.gather(*tasks), 60)
        assert [r.request_id for r in results] == [r.request_id for r in work]
        for req, res in zip(work, results, strict=True):
            assert res.token_ids == reference(req.prompt_token_ids, req.max_tokens)
        c = setup.router.counters()
        assert (c.submitted, c.completed, c.lost, c.in_flight) == (8, 8, 0, 0)
        if abort_lands:
            # The abort that did reach shard 0 is a real migration (continued on shard 1).
            assert (c.migrated, c.redispatched) == (1, 4)
        else:
            assert (c.migrated, c.redispatched) == (0, 8)

    asyncio.run(go())


def test_cancel_before_any_abort_leaves_no_marks_and_loses_nothing() -> None:
    # Cancelled while its first abort parks, a rebalance must also leave every move of that
    # source unmarked once the abort finds nothing, so a later migration may pick them again.
    async def go() -> None:
        step = 0.005
        e0 = FakeHeldAbortEngine(step, finds=False)
        setup = Setup([e0, FakeAbortableEngine(step)],
                      RouterConfig(migration=MigrationConfig(auto=False)))
        await setup.put_to_sleep([1])
        work = reqs(4, 300)
        tasks = [asyncio.create_task(setup.router.generate(r)) for r in work]
        await wait_until(lambda: len(e0.running) == 4)
        await setup.expand([1])
        rebalance = asyncio.create_task(setup.router.rebalance([1]))
        await asyncio.wait_for(e0.entered.wait(), 10)
        rebalance.cancel()
        with pytest.raises(asyncio.CancelledError):
            await rebalance
        e0.hold.set()
        await asyncio.sleep(0.05)
        # The same requests are candidates again: a fresh rebalance moves two of them.
        e0.finds = True
        moves = await setup.router.rebalance([1])
        assert len(moves) == 2
        results = await asyncio.wait_for(asyncio.gather(*tasks), 60)
        for req, res in zip(work, results, strict=True):
            assert res.token_ids == reference(req.prompt_token_ids, req.max_tokens)
        c = setup.router.counters()
        assert (c.completed, c.lost, c.migrated, c.redispatched) == (4, 0, 2, 0)

    asyncio.run(go())


# -- 2. logprobs must line up with the tokens -----------------------------------------------------


@pytest.mark.parametrize(("tokens", "logprobs"), [((1, 2, 3), (-0.1,)), ((), (-0.1, -0.2))])
def test_engine_output_rejects_logprobs_of_another_length(
    tokens: tuple[int, ...], logprobs: tuple[float, ...]
) -> None:
    with pytest.raises(ProtocolError, match=rf"{len(logprobs)} logprobs for {len(tokens)} token"):
        EngineOutput(tokens, "length", logprobs)


def test_engine_output_accepts_aligned_or_absent_logprobs() -> None:
    assert EngineOutput((1, 2), "stop", (-0.5, -0.25)).logprobs == (-0.5, -0.25)
    assert EngineOutput((1, 2), "abort").logprobs is None
    assert EngineOutput((), "abort", ()).logprobs == ()


def test_misaligned_engine_output_fails_the_request_loudly_not_its_logprobs() -> None:
    # A partial output with 2 tokens and 1 logprob was concatenated with the next attempt's:
    # the returned sample's logprobs were shifted against its tokens, silently. Now the
    # engine's output is rejected where it is built; the router returns the typed error to
    # the caller and counts the request lost (it does not retry a broken engine contract).
    class FakeMisalignedEngine(FakeScriptedEngine):
        """FAKE engine whose first attempt builds a misaligned output."""

        async def generate(self, request: GenerationRequest) -> EngineOutput:
            self.received.append(request)
            if len(self.received) == 1:
                return EngineOutput((7, 8), "abort", (-0.1,))
            return EngineOutput((9, 9), "length", (-0.3, -0.4))

    async def go() -> None:
        engine = FakeMisalignedEngine([])
        router = _router(engine, redispatch="continue")
        with pytest.raises(ProtocolError, match="1 logprobs for 2 token"):
            await router.generate(GenerationRequest("r", (1, 2), 4))
        assert len(engine.received) == 1
        c = router.counters()
        assert (c.submitted, c.completed, c.lost, c.redispatched) == (1, 0, 1, 0)

    asyncio.run(go())


def test_misaligned_output_on_a_preempted_shard_is_not_taken_for_the_preemption() -> None:
    # Any exception from a shard that is no longer active passes for the preemption tearing
    # it down and is retried silently; a malformed output is an engine bug wherever it comes
    # from, so it reaches the caller even then (one retry on the next shard would hide it).
    store = ShardStateStore(2)

    class FakePreemptedMidwayEngine(FakeScriptedEngine):
        """FAKE engine: its shard is preempted while it runs, then it builds a bad output."""

        async def generate(self, request: GenerationRequest) -> EngineOutput:
            self.received.append(request)
            store.apply([0], ShardEvent.PREEMPT)
            return EngineOutput((7, 8), "length", (-0.1,))

    async def go() -> None:
        bad, good = FakePreemptedMidwayEngine([]), FakeScriptedEngine(
            [EngineOutput((1, 2), "length")])
        router = ShardRouter(LocalShardState(store), [bad, good],
                             RouterConfig(policy=RoutingPolicy.ROUND_ROBIN))
        with pytest.raises(ProtocolError, match="1 logprobs for 2 token"):
            await router.generate(GenerationRequest("r", (1, 2), 2))
        assert (len(bad.received), len(good.received)) == (1, 0)
        assert router.counters().lost == 1

    asyncio.run(go())
