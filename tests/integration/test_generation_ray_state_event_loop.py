"""RayShardState read from an event loop against a real Ray actor."""

from __future__ import annotations

import asyncio
import itertools
import pickle
from typing import Any

import pytest

from rlix_plugins.generation import (
    EngineOutput,
    GenerationRequest,
    RayShardState,
    RouterConfig,
    ShardRouter,
    ShardSnapshot,
)
from rlix_plugins.generation.ray_state import ShardStateActorImpl
from tests.unit.test_generation_accounting_and_inputs import FakeScriptedEngine

pytestmark = [pytest.mark.integration]

#: How long the owner takes to answer a snapshot read (a busy or far-away actor).
DELAY_S = 2.0


class SlowSnapshotOwner(ShardStateActorImpl):
    """The real owner actor body, answering ``snapshot`` only after ``DELAY_S``."""

    async def snapshot(self) -> ShardSnapshot:
        await asyncio.sleep(DELAY_S)
        return await super().snapshot()


async def _longest_stall(work: Any) -> tuple[Any, float]:
    """Run ``work`` while a ticker measures the longest time the loop did not serve it."""
    loop = asyncio.get_running_loop()
    ticks = [loop.time()]

    async def tick() -> None:
        while True:
            await asyncio.sleep(0.01)
            ticks.append(loop.time())

    ticker = loop.create_task(tick())
    await asyncio.sleep(0.02)  # the ticker is running before the first read starts
    try:
        result = await work
    finally:
        ticker.cancel()
    # The time since the last tick counts too: a loop blocked until ``work`` ended never
    # let the ticker record that gap.
    ticks.append(loop.time())
    return result, max(b - a for a, b in itertools.pairwise(ticks))


def test_router_first_state_read_does_not_block_the_event_loop(ray_session: Any) -> None:
    # A router unpickled in another process (NeMo RL's collector, a veRL worker) read its
    # RayShardState copy with snapshot(), whose first read is a blocking ray.get: the whole
    # event loop (every other request, the long-polls) stopped for the owner's round trip.
    handle = ray_session.remote(num_cpus=0, max_restarts=0)(SlowSnapshotOwner).remote(
        2, "active", "allow"
    )
    try:
        engines = [FakeScriptedEngine([EngineOutput((4, 5), "length")]) for _ in range(2)]
        router = ShardRouter(RayShardState(handle), engines, RouterConfig())
        copy = pickle.loads(pickle.dumps(router))  # a fresh view: nothing cached yet

        async def go() -> None:
            result, stall = await _longest_stall(copy.generate(GenerationRequest("r", (1,), 2)))
            assert result.token_ids == (4, 5)
            assert stall < DELAY_S / 2, f"event loop blocked for {stall:.2f}s"
            copy.state.close()

        asyncio.run(go())
    finally:
        ray_session.kill(handle)


def test_ray_view_async_first_read_and_sync_read(ray_session: Any) -> None:
    # snapshot_async awaits the owner on the loop; snapshot() stays for synchronous callers.
    handle = ray_session.remote(num_cpus=0, max_restarts=0)(SlowSnapshotOwner).remote(
        3, "sleeping", "allow"
    )
    try:
        view = RayShardState(handle)

        async def go() -> ShardSnapshot:
            snap: ShardSnapshot
            snap, stall = await _longest_stall(view.snapshot_async())
            assert stall < DELAY_S / 2, f"event loop blocked for {stall:.2f}s"
            assert await view.snapshot_async() is view.snapshot()  # cached now
            view.close()
            return snap

        snap = asyncio.run(go())
        assert (snap.version, snap.active, snap.num_shards) == (0, (), 3)
        sync_view = RayShardState(handle)  # never read: nothing to start from
        assert sync_view.snapshot() == snap  # outside any loop: the blocking read
    finally:
        ray_session.kill(handle)


def test_copy_of_a_view_that_read_answers_snapshot_without_blocking(ray_session: Any) -> None:
    # NeMo RL's shard-index hint and rank-load report read snapshot() synchronously on the
    # collector's loop, from a copy unpickled there: the copy used to start empty, so its first
    # read was a blocking ray.get on that loop. It now starts from the sender's snapshot, and
    # its long-poll catches up with what changed after the pickling.
    handle = ray_session.remote(num_cpus=0, max_restarts=0)(SlowSnapshotOwner).remote(
        2, "active", "allow"
    )
    try:
        view = RayShardState(handle)
        sent = view.snapshot()  # the sender has read (RayShardState.create reads once)
        blob = pickle.dumps(view)

        async def go() -> tuple[ShardSnapshot, float, ShardSnapshot]:
            copy = pickle.loads(blob)
            await view.apply([1], "preempt")  # changed after the copy was made

            async def read() -> ShardSnapshot:
                snap: ShardSnapshot = copy.snapshot()
                return snap

            first, stall = await _longest_stall(read())
            caught_up = await copy.wait_for_update(first.version, 10.0)
            copy.close()
            view.close()
            return first, stall, caught_up

        first, stall, caught_up = asyncio.run(go())
        assert first == sent
        assert stall < DELAY_S / 2, f"event loop blocked for {stall:.2f}s"
        assert caught_up.active == (0,) and caught_up.version > sent.version
    finally:
        ray_session.kill(handle)
