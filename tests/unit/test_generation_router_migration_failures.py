"""Router migration whose aborted attempt fails instead of returning its partial output.

Engines here are FAKES (a unit test cannot make a vLLM engine fail an aborted request on
purpose); the router, state owner, view and lifecycle are the real ones.
"""

from __future__ import annotations

import asyncio

from rlix_plugins.generation import (
    EngineOutput,
    GenerationRequest,
    LocalShardState,
    MigrationConfig,
    RouterConfig,
    ShardStateStore,
)
from tests.unit.test_generation_accounting_and_inputs import (
    FakeHeldEngine,
    _four_running_on_shard_0_and_shard_1_active,
)


class FakeFailingAbortEngine(FakeHeldEngine):
    """FAKE: an engine whose aborted requests fail with a plain error instead of returning
    their partial output (a remote host call whose stream ends without a result, e.g.
    NemoRlShard's "produced no output"), while the shard itself stays active."""

    async def generate(self, request: GenerationRequest) -> EngineOutput:
        out = await super().generate(request)
        if out.aborted:
            raise RuntimeError(f"FAKE: {request.request_id} aborted, stream gave no output")
        return out


def test_a_migration_whose_attempt_fails_on_its_active_shard_is_not_lost() -> None:
    # The router marked the attempts and aborted them on shard 0 to move them to shard 1;
    # the engine failed them with a plain error. Shard 0 is still active, so _dispatch took
    # that for a real engine error and raised it to the caller: the moved requests were lost
    # although _generate treats a marked attempt that raised as a migration.
    async def go() -> None:
        engines = [FakeFailingAbortEngine(), FakeFailingAbortEngine()]
        router, tasks = await _four_running_on_shard_0_and_shard_1_active(
            LocalShardState(ShardStateStore(2)), engines,
            RouterConfig(migration=MigrationConfig(auto=False)))
        engines[1].want = 2
        moves = await router.rebalance([1])
        assert len(moves) == 2
        reached = asyncio.ensure_future(engines[1].reached.wait())
        await asyncio.wait([reached, *tasks], return_when=asyncio.FIRST_COMPLETED)
        reached.cancel()
        for e in engines:
            e.release_all()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert all(not isinstance(r, BaseException) for r in results), results
        assert sorted(r.dp_rank for r in results) == [0, 0, 1, 1]  # type: ignore[union-attr]
        c = router.counters()
        assert (c.completed, c.lost, c.migrated, c.redispatched) == (4, 0, 2, 0)

    asyncio.run(asyncio.wait_for(go(), 30))
