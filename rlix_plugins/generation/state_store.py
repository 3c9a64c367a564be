"""The one owner of a pipeline's shard state, and the views routers read it through.

:class:`ShardStateStore` owns the current :class:`~.shard_state.ShardSnapshot` of one pipeline
and applies transitions atomically. It is deliberately NOT picklable: a pickled copy would be a
second owner with its own, diverging state (the bug of NeMo RL PR 2336, where the driver's copy
of the routing flags never reached the collector's copy). To share it across processes host it
in a Ray actor (:class:`~.ray_state.RayShardState`); in one process use :class:`LocalShardState`.

Both views implement :class:`ShardStateView`, the only interface routers and the preemption
controller use, so neither knows where the owner lives.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any, NoReturn, Protocol, runtime_checkable

from rlix_plugins.generation.shard_state import (
    LastActivePolicy,
    ShardEvent,
    ShardSnapshot,
    ShardStatus,
    apply_event,
    parse_last_active,
)

logger = logging.getLogger(__name__)

Listener = Callable[[ShardSnapshot], None]


@runtime_checkable
class ShardStateView(Protocol):
    """How routers and controllers read and change one pipeline's shard state."""

    def snapshot(self) -> ShardSnapshot:
        """Newest snapshot this view knows, without blocking on the owner (cheap; per request)."""
        ...

    async def refresh(self) -> ShardSnapshot:
        """Read the owner's current snapshot (authoritative; one round trip for remote owners)."""
        ...

    async def wait_for_update(self, after_version: int, timeout_s: float) -> ShardSnapshot:
        """Return a snapshot newer than ``after_version``, or the newest known one on timeout."""
        ...

    async def apply(self, dp_ranks: Iterable[int], event: ShardEvent) -> ShardSnapshot:
        """Apply ``event`` on the owner (all ranks or none) and return the new snapshot."""
        ...


class ShardStateStore:
    """Single owner of one pipeline's shard state (thread-safe, in-process).

    Args:
        num_shards: number of generation shards (dp ranks ``0..num_shards-1``).
        initial: status every shard starts in (``ACTIVE`` or ``SLEEPING``).
        last_active: what preempting the last active shard does (see :class:`LastActivePolicy`).
    """

    def __init__(
        self,
        num_shards: int,
        *,
        initial: ShardStatus = ShardStatus.ACTIVE,
        last_active: LastActivePolicy = LastActivePolicy.ALLOW,
    ) -> None:
        self._lock = threading.Lock()
        self._snapshot = ShardSnapshot.initial(num_shards, initial)
        self._last_active = parse_last_active(last_active)
        self._listeners: list[Listener] = []

    @property
    def last_active(self) -> LastActivePolicy:
        return self._last_active

    def snapshot(self) -> ShardSnapshot:
        """Current snapshot (an immutable object; reading the attribute needs no lock)."""
        return self._snapshot

    def apply(self, dp_ranks: Iterable[int], event: ShardEvent) -> ShardSnapshot:
        """Apply ``event`` to ``dp_ranks`` atomically; typed error and no change if invalid."""
        with self._lock:
            new = apply_event(self._snapshot, dp_ranks, event, self._last_active)
            self._snapshot = new
            listeners = list(self._listeners)
        logger.debug("shard state %s after %s", new.describe(), ShardEvent(event).value)
        # Listeners run outside the lock so a slow one never blocks the next transition.
        for listener in listeners:
            try:
                listener(new)
            except Exception:
                logger.exception("shard-state listener failed; other listeners still notified")
        return new

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        """Call ``listener(snapshot)`` after every transition; returns the unsubscribe call."""
        with self._lock:
            self._listeners.append(listener)

        def unsubscribe() -> None:
            with self._lock:
                if listener in self._listeners:
                    self._listeners.remove(listener)

        return unsubscribe

    def __reduce__(self) -> NoReturn:
        raise TypeError(
            "ShardStateStore is the single owner of a pipeline's shard state and cannot be "
            "copied; share it across processes with RayShardState.create(...) and pickle that"
        )


class LocalShardState:
    """:class:`ShardStateView` over a :class:`ShardStateStore` in the same process.

    Reads are always current (the store's snapshot attribute), so an in-process router can
    never act on a stale active set.
    """

    def __init__(self, store: ShardStateStore) -> None:
        self._store = store

    @property
    def store(self) -> ShardStateStore:
        return self._store

    def snapshot(self) -> ShardSnapshot:
        return self._store.snapshot()

    async def refresh(self) -> ShardSnapshot:
        return self._store.snapshot()

    async def wait_for_update(self, after_version: int, timeout_s: float) -> ShardSnapshot:
        snap = self._store.snapshot()
        if snap.version > after_version:
            return snap
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[ShardSnapshot] = loop.create_future()

        def _resolve(s: ShardSnapshot) -> None:
            if not fut.done():
                fut.set_result(s)

        def _listener(s: ShardSnapshot) -> None:
            # Transitions may be applied from another thread or event loop.
            # RuntimeError: the waiting loop is closed; nobody waits any more.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_resolve, s)

        unsubscribe = self._store.subscribe(_listener)
        try:
            snap = self._store.snapshot()  # a transition may have landed before subscribing
            if snap.version > after_version:
                return snap
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(fut, timeout=max(timeout_s, 0.0))
            return self._store.snapshot()
        finally:
            unsubscribe()

    async def apply(self, dp_ranks: Iterable[int], event: ShardEvent) -> ShardSnapshot:
        return self._store.apply(dp_ranks, event)

    def __reduce__(self) -> Any:
        raise TypeError(
            "LocalShardState only works inside the process that owns the store; use "
            "RayShardState to share shard state with routers in other processes"
        )
