"""Shard state hosted in a Ray actor, read by router copies in other processes (real Ray)."""

from __future__ import annotations

import asyncio
import pickle
import time
from typing import Any

import pytest

from rlix_plugins.errors import LastActiveShardError, ShardStateError
from rlix_plugins.generation import (
    LastActivePolicy,
    RayShardState,
    ShardEvent,
    ShardLifecycle,
    ShardRouter,
    ShardSnapshot,
    ShardStatus,
    VllmAsyncShard,
)
from tests.fixtures.vllm_engines import VllmPair, make_prompts
from tests.integration.test_generation_vllm import assert_exact, requests, run_load, wait_until

pytestmark = [pytest.mark.integration]


class ObserverImpl:
    """A routing copy in another process: holds an unpickled view and reports what it sees."""

    def __init__(self, view: RayShardState) -> None:
        self.view = view

    async def watch(self, target_version: int, timeout_s: float) -> list[tuple[int, Any]]:
        snap = await self.view.refresh()
        # What the first read saw counts too: on a loaded box this call can start after the
        # owner has already reached ``target_version``.
        seen = [(snap.version, snap.active)]
        deadline = time.monotonic() + timeout_s
        while snap.version < target_version and time.monotonic() < deadline:
            snap = await self.view.wait_for_update(snap.version, deadline - time.monotonic())
            seen.append((snap.version, snap.active))
        return seen

    async def latest_cached(self) -> ShardSnapshot:
        return self.view.snapshot()


def test_every_copy_sees_the_owner_state(ray_session: Any) -> None:
    ray = ray_session
    owner = RayShardState.create(3, last_active=LastActivePolicy.REFUSE)
    observer = ray.remote(num_cpus=0)(ObserverImpl).remote(pickle.loads(pickle.dumps(owner)))
    ray.get(observer.latest_cached.remote())  # actor up, view primed (starts its long-poll)
    watch = observer.watch.remote(4, 30.0)

    driver_copy = pickle.loads(pickle.dumps(owner))

    async def drive() -> ShardSnapshot:
        await driver_copy.apply([0], ShardEvent.PREEMPT)
        await driver_copy.apply([0], ShardEvent.ASLEEP)
        await driver_copy.apply([0], ShardEvent.WAKE)
        return await driver_copy.apply([1, 2], ShardEvent.PREEMPT)

    # typed across the actor boundary, naming the refused ranks
    with pytest.raises(LastActiveShardError, match=r"preempting \[1, 2\] would leave no active"):
        asyncio.run(drive())
    final = asyncio.run(owner.apply([1], ShardEvent.PREEMPT))
    assert final.version == 4 and final.active == (2,)
    with pytest.raises(ShardStateError, match=r"cannot wake shard\(s\) \[1\]: .* sleeping"):
        asyncio.run(owner.apply([1], ShardEvent.WAKE))  # preempted, not sleeping
    assert asyncio.run(owner.refresh()) == final

    seen = ray.get(watch, timeout=60)
    versions = [v for v, _ in seen]
    assert versions == sorted(versions) and versions[-1] == 4
    assert seen[-1][1] == (2,)
    # The copy's cached snapshot is kept fresh by its long-poll, with no explicit refresh.
    deadline = time.monotonic() + 10
    while ray.get(observer.latest_cached.remote()).version < 4:
        assert time.monotonic() < deadline, "pushed state never reached the other process"
        time.sleep(0.05)
    ray.kill(observer)
    ray.kill(owner.handle)


@pytest.mark.vllm
def test_two_router_copies_share_ray_state_over_real_engines(
    ray_session: Any, vllm_pair_clean: VllmPair
) -> None:
    pair = vllm_pair_clean
    owner = RayShardState.create(2)
    load_a = requests(make_prompts(24, seed=21), 64, "ray-a")
    load_b = requests(make_prompts(24, seed=22), 64, "ray-b")
    later = requests(make_prompts(8, seed=23), 16, "ray-later")

    async def go() -> None:
        shards = [VllmAsyncShard(e, name=f"s{i}") for i, e in enumerate(pair.engines)]
        view_a = pickle.loads(pickle.dumps(owner))
        view_b = pickle.loads(pickle.dumps(owner))
        router_a = ShardRouter(view_a, shards)
        router_b = ShardRouter(view_b, shards)
        life = ShardLifecycle(pickle.loads(pickle.dumps(owner)), shards)
        ta = asyncio.ensure_future(run_load(router_a, load_a, 24))
        tb = asyncio.ensure_future(run_load(router_b, load_b, 24))
        await wait_until(lambda: router_a.inflight[0] >= 4 and router_b.inflight[0] >= 4)
        await wait_until(lambda: pair.engines[0].get_num_unfinished_requests() >= 8)
        record = await life.preempt([0])
        assert record.shards[0].aborted_requests > 0
        # Both copies learn the new state by push, without a request of their own.
        await wait_until(lambda: view_a.snapshot().version >= record.state_version
                         and view_b.snapshot().version >= record.state_version, timeout=10)
        assert view_a.snapshot().statuses == (ShardStatus.SLEEPING, ShardStatus.ACTIVE)
        res_later = await run_load(router_b, later, 8)
        assert {r.dp_rank for r in res_later} == {1}
        await life.wake([0])
        await life.activate([0])
        res_a, res_b = await asyncio.wait_for(asyncio.gather(ta, tb), 120)
        assert any(r.attempts > 1 for r in res_a + res_b)
        await assert_exact(pair, load_a + load_b + later, res_a + res_b + res_later)
        for v in (view_a, view_b):
            v.close()

    try:
        pair.run(go(), timeout=240)
    finally:
        ray_session.kill(owner.handle)
