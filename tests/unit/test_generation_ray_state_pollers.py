"""RayShardState's long-poll when one view is read from several event loops.

The owner actor is replaced by a FAKE handle (no Ray cluster in a unit test; the real actor
body binds its change event to one loop, so it cannot serve two loops of one process either):
``wait_for_update`` parks for a moment and returns the snapshot, as a long-poll that times out.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from rlix_plugins.generation import RayShardState, ShardSnapshot
from rlix_plugins.generation.loop_thread import LoopThread


class FakeParkingHandle:
    """FAKE actor handle: ``handle.method.remote(...)`` returns an awaitable reply;
    ``wait_for_update`` parks up to 50 ms (a long-poll that times out)."""

    def __init__(self) -> None:
        self.snap = ShardSnapshot.initial(2)

    def __getattr__(self, name: str) -> Any:
        handle = self

        class _Remote:
            @staticmethod
            def remote(*args: Any) -> Any:
                async def reply() -> ShardSnapshot:
                    if name == "wait_for_update":
                        await asyncio.sleep(min(float(args[1]), 0.05))
                    return handle.snap

                return reply()

        return _Remote


async def _pollers() -> int:
    return sum(1 for t in asyncio.all_tasks()
               if getattr(t.get_coro(), "__qualname__", "") == "RayShardState._poll")


def test_a_view_read_from_two_loops_keeps_one_poller() -> None:
    # The controller's LoopThread refreshes the view; the host reads it from asyncio.run
    # (a validation round). Each switch started a new poller and left the old one polling
    # on the loop thread forever: 10 rounds, 10 parked long-polls per view.
    view = RayShardState(FakeParkingHandle())
    loop = LoopThread(name="test-ray-state-pollers")
    try:
        for _ in range(10):
            loop.run(view.refresh())
            asyncio.run(view.snapshot_async())
        assert loop.run(_pollers()) == 1
        # The one poller keeps serving a reader on another loop: no second one is started.
        async def read_twice() -> int:
            await view.snapshot_async()
            await view.refresh()
            return await _pollers()

        assert asyncio.run(read_twice()) == 0
        assert loop.run(_pollers()) == 1
        view.close()  # from this thread: the poller runs on the loop thread's loop
        for _ in range(100):
            if loop.run(_pollers()) == 0:
                break
            time.sleep(0.01)
        assert loop.run(_pollers()) == 0
    finally:
        loop.close()
