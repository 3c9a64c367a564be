"""The host-agnostic :class:`ShardController`: the generation lifecycle plus a weight sync.

``shrink`` = preempt (abort -> drain -> sleep); ``expand`` = wake -> selective sync of the newest
cached version to exactly those ranks -> activate. Both are idempotent per rank, as the protocol
requires (a restarted scheduler may repeat a move it cannot prove happened). Host adapters only
supply the sync and version functions and the engines behind the lifecycle.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from rlix_plugins.generation.loop_thread import LoopThread
from rlix_plugins.generation.preemption import ShardLifecycle
from rlix_plugins.generation.shard_state import ShardStatus
from rlix_plugins.generation.state_store import ShardStateView

#: ``sync(dp_ranks, version)`` streams cached ``version`` to exactly those shards.
SyncFn = Callable[[Sequence[int], int], object]


class LifecycleShardController:
    """ShardController over a :class:`ShardLifecycle` (picklable if its parts are)."""

    def __init__(
        self,
        lifecycle: ShardLifecycle,
        state: ShardStateView,
        sync: SyncFn,
        version: Callable[[], int | None],
    ) -> None:
        self._lifecycle = lifecycle
        self._state = state
        self._sync = sync
        self._version = version
        self._loop: LoopThread | None = None
        self._lock = threading.Lock()

    def _loop_thread(self) -> LoopThread:
        with self._lock:
            if self._loop is None:
                self._loop = LoopThread()
            return self._loop

    def _statuses(self) -> tuple[ShardStatus, ...]:
        async def read() -> tuple[ShardStatus, ...]:
            return (await self._state.refresh()).statuses

        return self._loop_thread().run(read())

    def shrink(self, dp_ranks: Sequence[int]) -> None:
        """Preempt ranks that still run or are half taken down; sleeping ones are left alone."""
        statuses = self._statuses()
        todo = [r for r in dp_ranks if statuses[r] is not ShardStatus.SLEEPING]
        if todo:
            self._loop_thread().run(self._lifecycle.preempt(todo))

    def expand(self, dp_ranks: Sequence[int]) -> None:
        """Wake sleeping ranks, sync the newest cached weights to exactly them, activate."""
        statuses = self._statuses()
        sleeping = [r for r in dp_ranks if statuses[r] is ShardStatus.SLEEPING]
        if sleeping:
            self._loop_thread().run(self._lifecycle.wake(sleeping))
        woken = [r for r in dp_ranks if statuses[r] in (ShardStatus.SLEEPING, ShardStatus.WOKEN)]
        if not woken:
            return
        version = self._version()
        if version is not None:
            # Woken from level-2 sleep a shard has no valid weights: routed only after this.
            self._sync(woken, version)
        self._loop_thread().run(self._lifecycle.activate(woken))

    def __getstate__(self) -> dict[str, Any]:
        return {
            "lifecycle": self._lifecycle,
            "state": self._state,
            "sync": self._sync,
            "version": self._version,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        LifecycleShardController.__init__(
            self, state["lifecycle"], state["state"], state["sync"], state["version"]
        )
