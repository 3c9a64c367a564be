"""Callers blocked on the scheduler: one grant future per cluster, release futures, and when
each waiting request was queued (for the wait-time metric).

The scheduler service decides what answers them; this book only keeps them, so that a failed
pipeline, a stopping coordinator or a withdrawn request cannot leave a caller waiting forever.
Every method runs on the service's event loop (no locking: nothing here awaits).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from rlix_plugins.protocol.names import parse_cluster_id


class Waiters:
    """Grant and release futures of the callers waiting on the scheduler, per cluster id."""

    def __init__(self) -> None:
        self._grants: dict[str, asyncio.Future[list[int]]] = {}
        self._releases: dict[str, list[asyncio.Future[None]]] = {}
        self._asked_at: dict[str, float] = {}

    # -- grants ------------------------------------------------------------------------------
    def __contains__(self, cid: object) -> bool:
        return cid in self._grants

    def get(self, cid: str) -> asyncio.Future[list[int]] | None:
        """The future a request of ``cid`` waits on, if any."""
        return self._grants.get(cid)

    def open(self, cid: str, now: float) -> asyncio.Future[list[int]]:
        """A new grant future for ``cid``'s request queued at ``now`` (the service refuses a
        second pending request of a cluster, so at most one is open per cluster)."""
        fut: asyncio.Future[list[int]] = asyncio.get_running_loop().create_future()
        self._grants[cid] = fut
        self._asked_at[cid] = now
        return fut

    def withdraw(self, cid: str, fut: asyncio.Future[list[int]]) -> bool:
        """Forget ``fut`` if it is still ``cid``'s waiter (its caller stopped waiting);
        False when a later request of ``cid`` has replaced it."""
        if self._grants.get(cid) is not fut:
            return False
        del self._grants[cid]
        self._asked_at.pop(cid, None)
        return True

    def resolve(self, cid: str, gpus: tuple[int, ...]) -> float | None:
        """Answer ``cid``'s waiter with ``gpus``; returns when its request was queued (None
        when nobody was waiting, or the request never waited)."""
        asked = self._asked_at.pop(cid, None)
        fut = self._grants.pop(cid, None)
        if fut is not None and not fut.done():
            fut.set_result(list(gpus))
        return asked

    def fail(self, cid: str, error: Exception) -> None:
        """Raise ``error`` in ``cid``'s waiter (its request was cancelled)."""
        self._asked_at.pop(cid, None)
        fut = self._grants.pop(cid, None)
        if fut is not None and not fut.done():
            fut.set_exception(error)

    # -- releases ----------------------------------------------------------------------------
    def open_release(self, cid: str) -> asyncio.Future[None]:
        """A future answered once ``cid``'s planned release is done (any number may wait)."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._releases.setdefault(cid, []).append(fut)
        return fut

    def drop_release(self, cid: str, fut: asyncio.Future[None]) -> None:
        """Forget a release future whose caller stopped waiting."""
        waiting = self._releases.get(cid, [])
        if fut in waiting:
            waiting.remove(fut)

    def settle_releases(self, still_releasing: Callable[[str], bool]) -> None:
        """Answer the release waiters of every cluster whose release is done
        (``still_releasing(cid)`` is False)."""
        for cid in list(self._releases):
            if still_releasing(cid):
                continue
            for fut in self._releases.pop(cid):
                if not fut.done():
                    fut.set_result(None)

    # -- everyone of a pipeline, or everyone --------------------------------------------------
    def fail_pipeline(self, pipeline_id: str, error: Exception) -> None:
        """Raise ``error`` in every waiter of ``pipeline_id``'s clusters (fenced, dropped)."""
        prefix = f"{pipeline_id}_"

        def owned(cid: str) -> bool:
            # the prefix alone would also match pipeline "a_b"'s clusters for pipeline "a"
            return cid.startswith(prefix) and parse_cluster_id(cid)[0] == pipeline_id

        for cid in [c for c in self._grants if owned(c)]:
            self.fail(cid, error)
        for cid in [c for c in self._releases if owned(c)]:
            for fut in self._releases.pop(cid):
                if not fut.done():
                    fut.set_exception(error)

    def fail_all(self, error: Exception) -> None:
        """Raise ``error`` in every waiter (the coordinator is stopping)."""
        for fut in self._grants.values():
            if not fut.done():
                fut.set_exception(error)
        for futs in self._releases.values():
            for rfut in futs:
                if not rfut.done():
                    rfut.set_exception(error)
        self._grants.clear()
        self._asked_at.clear()
        self._releases.clear()
