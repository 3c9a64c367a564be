"""Shard state hosted in a tiny Ray actor, for routers that live in several processes.

NeMo RL pickles its generation object into the trajectory-collector actor and veRL routes from
several agent-loop workers, so the state owner must live outside all of them. The owner is a
``num_cpus=0`` async Ray actor wrapping a :class:`~.state_store.ShardStateStore`; each process
holds a :class:`RayShardState`, a picklable view that carries only the actor handle.

Freshness: every view keeps the newest snapshot it has seen and, once used inside an event
loop, long-polls the actor (``wait_for_update``), so a transition reaches every copy one RPC
after it is applied. Staleness can never make a request run on a preempted shard: the engine
side rejects or aborts it (see :mod:`.vllm_engine`) and the router then refreshes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable
from typing import Any

from rlix_plugins.generation.shard_state import (
    LastActivePolicy,
    ShardEvent,
    ShardSnapshot,
    ShardStatus,
    normalize_ranks,
    parse_event,
    parse_last_active,
)
from rlix_plugins.generation.state_store import ShardStateStore

logger = logging.getLogger(__name__)

#: How long one long-poll RPC waits before it is re-issued (bounds a dead poll's lifetime).
_POLL_S = 30.0


class ShardStateActorImpl:
    """Body of the Ray actor that owns one pipeline's shard state (async: long-polls park)."""

    def __init__(self, num_shards: int, initial: str, last_active: str) -> None:
        self._store = ShardStateStore(
            num_shards, initial=ShardStatus(initial), last_active=LastActivePolicy(last_active)
        )
        self._changed = asyncio.Event()

    async def snapshot(self) -> ShardSnapshot:
        return self._store.snapshot()

    async def apply(self, dp_ranks: list[int], event: str) -> ShardSnapshot:
        new = self._store.apply(dp_ranks, ShardEvent(event))
        # Swap the event before setting it: waiters woken now re-check the version and a
        # waiter arriving later parks on the fresh event.
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()
        return new

    async def wait_for_update(self, after_version: int, timeout_s: float) -> ShardSnapshot:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(timeout_s, 0.0)
        while True:
            snap = self._store.snapshot()
            remaining = deadline - loop.time()
            if snap.version > after_version or remaining <= 0:
                return snap
            try:
                await asyncio.wait_for(self._changed.wait(), timeout=remaining)
            except asyncio.TimeoutError:
                return self._store.snapshot()


def _actor_class() -> Any:
    import ray  # lazy: generation/ imports without Ray

    # num_cpus=0: on a small box a CPU-reserving actor starves the engines and trainers.
    return ray.remote(num_cpus=0, max_restarts=0)(ShardStateActorImpl)


class RayShardState:
    """Picklable :class:`~.state_store.ShardStateView` of a Ray-hosted shard-state owner."""

    def __init__(self, handle: Any) -> None:
        self._handle = handle
        self._cached: ShardSnapshot | None = None
        self._poller: asyncio.Task[None] | None = None
        self._poller_loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    def create(
        cls,
        num_shards: int,
        *,
        name: str | None = None,
        namespace: str | None = None,
        initial: ShardStatus = ShardStatus.ACTIVE,
        last_active: LastActivePolicy = LastActivePolicy.ALLOW,
    ) -> RayShardState:
        """Start the owner actor (named if ``name`` is given) and return a view of it.

        Raises:
            ShardStateError: ``num_shards`` is not an int >= 1, ``initial`` is neither active
                nor sleeping, or ``last_active`` is not a policy (checked here, before any
                actor starts).
        """
        # Validate in the caller: the actor's __init__ raising would only surface as Ray's
        # ActorDiedError, after a worker process was spent on it.
        first = ShardSnapshot.initial(num_shards, initial)
        policy = parse_last_active(last_active)
        options: dict[str, Any] = {}
        if name is not None:
            options["name"] = name
        if namespace is not None:
            options["namespace"] = namespace
        actor = _actor_class().options(**options).remote(
            num_shards, first.statuses[0].value, policy.value
        )
        view = cls(actor)
        view._cached = view._get(actor.snapshot.remote())  # fail here, not at first request
        return view

    @classmethod
    def connect(cls, name: str, namespace: str | None = None) -> RayShardState:
        """View of an existing named owner actor."""
        import ray

        return cls(ray.get_actor(name, namespace=namespace))

    @property
    def handle(self) -> Any:
        """The owner actor's handle (e.g. to kill it when the pipeline ends)."""
        return self._handle

    @staticmethod
    def _get(ref: Any) -> ShardSnapshot:
        import ray

        snap: ShardSnapshot = ray.get(ref)
        return snap

    def _update(self, snap: ShardSnapshot) -> ShardSnapshot:
        if self._cached is None or snap.version > self._cached.version:
            self._cached = snap
        return self._cached

    def _ensure_poller(self) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # synchronous caller: reads stay as fresh as the last RPC
        poller, poller_loop = self._poller, self._poller_loop
        if poller is not None and not poller.done() and poller_loop is not None and (
                poller_loop is loop or poller_loop.is_running()):
            # One poller per view: it keeps the one cached snapshot fresh for every loop and
            # thread reading it. Starting one at each switch between loops (the controller's
            # LoopThread, a host's asyncio.run) left the old one polling forever: one more
            # parked RPC per switch.
            return
        self._poller_loop = loop
        self._poller = loop.create_task(self._poll())

    async def _poll(self) -> None:
        while True:
            known = -1 if self._cached is None else self._cached.version
            try:
                snap: ShardSnapshot = await self._handle.wait_for_update.remote(known, _POLL_S)
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("shard-state long-poll failed; restarted on next use")
                return
            self._update(snap)

    def snapshot(self) -> ShardSnapshot:
        """Newest snapshot this copy has seen (a copy unpickled from one that had read starts
        with that one's). Only a view that never read anything blocks, on one RPC to the owner
        (then the long-poll keeps the copy fresh): code on an event loop uses
        :meth:`snapshot_async` instead, which awaits that read."""
        self._ensure_poller()
        if self._cached is None:
            # First read in this process, from a synchronous caller: one blocking RPC.
            self._update(self._get(self._handle.snapshot.remote()))
        assert self._cached is not None
        return self._cached

    async def snapshot_async(self) -> ShardSnapshot:
        """:meth:`snapshot` for code on an event loop: the first read awaits the owner, so
        the loop keeps serving its other tasks for that round trip (the router reads the
        state through this)."""
        if self._cached is None:
            return await self.refresh()
        self._ensure_poller()
        return self._cached

    async def refresh(self) -> ShardSnapshot:
        self._ensure_poller()
        snap: ShardSnapshot = await self._handle.snapshot.remote()
        return self._update(snap)

    async def wait_for_update(self, after_version: int, timeout_s: float) -> ShardSnapshot:
        self._ensure_poller()
        if self._cached is not None and self._cached.version > after_version:
            return self._cached
        snap: ShardSnapshot = await self._handle.wait_for_update.remote(after_version, timeout_s)
        return self._update(snap)

    async def apply(self, dp_ranks: Iterable[int], event: ShardEvent) -> ShardSnapshot:
        name = parse_event(event).value
        # Checked here, with the typed error the local view gives (the shard count never
        # changes, so any snapshot can check the ranks); the owner re-checks the transition.
        known = self._cached if self._cached is not None else await self.refresh()
        ranks = normalize_ranks(known, dp_ranks)
        snap: ShardSnapshot = await self._handle.apply.remote(list(ranks), name)
        return self._update(snap)

    def close(self) -> None:
        """Stop this copy's long-poll (the owner actor keeps running)."""
        poller, loop, self._poller = self._poller, self._poller_loop, None
        if poller is None or poller.done():
            return
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if loop is None or loop is running:
            poller.cancel()
            return
        # The one poller may run on another thread's loop (see _ensure_poller), and
        # Task.cancel is not thread-safe. A closed loop never runs the task again anyway.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(poller.cancel)

    def __getstate__(self) -> dict[str, Any]:
        # The poll task belongs to this process's loop and stays. The newest snapshot travels
        # along, so the copy's first snapshot() answers at once (a synchronous reader on the
        # copy's event loop, such as NeMo RL's shard-index hint, would otherwise block it for
        # one round trip); the copy's long-poll starts from that version and catches up.
        return {"handle": self._handle, "cached": self._cached}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["handle"])  # type: ignore[misc]
        cached = state.get("cached")
        if isinstance(cached, ShardSnapshot):
            self._cached = cached
