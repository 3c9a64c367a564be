"""The scheduler's calls to pipeline coordinator actors: ``resize_infer`` and the lookups.

A scheduling cycle sends each affected cluster one ``resize_infer`` (shrinks, then expands),
OUTSIDE the scheduler's lock, each bounded by ``resize_timeout_s``. A call is meant for the
registration of the pipeline it was planned for: it is not sent once that registration is gone,
and a failure fences the pipeline only while it is still that registration. Every ``await``
here may let the scheduler's event handlers run, so what they may have changed (registrations,
fencing) is checked again after each one.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Any

from rlix_plugins.coordinator.core import SchedulerState
from rlix_plugins.coordinator.service.liveness import lookup_coordinator
from rlix_plugins.protocol.names import parse_cluster_id

logger = logging.getLogger(__name__)


class LookupFailedError(Exception):
    """Ray's name lookup of a pipeline's coordinator actor raised (a GCS timeout or RPC
    failure, not "no such actor"): no verdict on the pipeline either way."""

#: Fence a pipeline: ``(pipeline_id, reason)``; does nothing for an unknown or fenced one.
FenceFn = Callable[[str, str], None]
#: Save the scheduler's state; False when the save failed (the scheduler logs it).
PersistFn = Callable[[], bool]


class Resizer:
    """Sends ``resize_infer`` to pipelines' coordinator actors on the scheduler's behalf.

    It shares the scheduler's state and maps, which the scheduler keeps mutating: ``state``
    (registrations and pipeline specs), ``fencing`` (fenced pipeline -> reason; read only),
    ``handles`` (pipeline -> coordinator actor handle, filled here, dropped by the scheduler
    when a pipeline goes or its actor died), ``seen`` (pipelines whose coordinator actor was
    found once; added here) and ``expand_tails`` (the running background expand of each
    cluster; read only). ``fence`` is called for a failed call, ``persist`` when a pipeline's
    actor is seen for the first time.
    """

    def __init__(
        self,
        state: SchedulerState,
        *,
        fencing: Mapping[str, str],
        handles: dict[str, Any],
        seen: set[str],
        expand_tails: Mapping[str, asyncio.Task[None]],
        fence: FenceFn,
        persist: PersistFn,
        resize_timeout_s: float,
    ) -> None:
        self._state = state
        self._fencing = fencing
        self._handles = handles
        self._seen = seen
        self._expand_tails = expand_tails
        self._fence = fence
        self._persist = persist
        self._resize_timeout_s = resize_timeout_s

    async def reachable(self, cid: str) -> bool:
        """Whether an expand of ``cid`` can be sent now (see :meth:`handle`)."""
        return await self.handle(cid, f"expand of {cid}", remove=False) is not None

    async def handle(self, cid: str, what: str, *, remove: bool) -> Any:
        """The coordinator actor to send ``what`` to, or None: the pipeline is fenced, or has
        no actor (fenced too if it had one, or if ``what`` is a shrink), or the lookup itself
        failed (nothing sent, nobody fenced: planned again next cycle)."""
        pid = parse_cluster_id(cid)[0]
        if pid in self._fencing:
            return None
        registration = self._state.registrations.get(pid)
        try:
            handle = await self.coordinator(pid)
        except LookupFailedError as exc:
            # Ray's own lookup failed (a GCS hiccup): no verdict on the pipeline. Not sent; a
            # shrink not sent leaves its ranks owned, an expand not sent is not committed.
            logger.warning("%s not sent this cycle: %s", what, exc)
            return None
        if self._state.registrations.get(pid) != registration:
            return None  # unregistered meanwhile: nothing to send, nobody to fence
        if handle is None:
            if remove or pid in self._seen:
                self._fence(pid, f"{what}: coordinator actor not found")
            else:
                # Registered before its coordinator actor exists: not an error, just not yet.
                logger.info("%s skipped: the pipeline has no coordinator actor yet", what)
        return handle

    async def resize_all(
        self,
        calls: dict[str, list[int]],
        *,
        remove: bool,
        planned: dict[str, int],
    ) -> set[str]:
        """Send ``resize_infer`` per cluster concurrently; return the clusters NOT applied.

        For shrinks every one of them failed and fenced its pipeline, or was not sent because
        the coordinator's lookup failed (its ranks stay owned; planned again). For expands
        these are only the calls that were never sent (no coordinator actor yet, or a failed
        lookup): nothing changed on the pipeline side, so they are not committed. A sent
        expand that failed is not in the set (see ``SchedulerService._cycle``).
        """
        if not calls:
            return set()
        results = await asyncio.gather(
            *(
                self.resize_one(
                    cid, ranks, remove=remove, expected=planned.get(parse_cluster_id(cid)[0])
                )
                for cid, ranks in calls.items()
            )
        )
        return {cid for cid, ok in zip(calls, results, strict=True) if not ok}

    async def resize_one(
        self, cid: str, ranks: list[int], *, remove: bool, expected: int | None
    ) -> bool:
        """One ``resize_infer`` for the registration (token) ``expected`` of ``cid``'s
        pipeline; True when applied. Not sent once that registration is gone, and a failure
        fences the pipeline only while it is still that registration (not a successor under
        its id)."""
        pid = parse_cluster_id(cid)[0]
        what = f"resize_infer({'remove' if remove else 'add'}={ranks}) on {cid}"
        tail = self._expand_tails.get(cid) if remove else None
        if tail is not None:
            # A background expand of this cluster is still running: the pipeline must see the
            # calls in plan order (a shrink overtaking the expand of the same rank would leave
            # it awake on GPUs handed on).
            await asyncio.wait([tail])
        if self._state.registrations.get(pid) != expected:
            # Unregistered: a shrink has nothing left to do (its GPUs were given back), an
            # expand is not sent (and not committed).
            return remove
        handle = await self.handle(cid, what, remove=remove)
        if self._state.registrations.get(pid) != expected:
            return remove
        if handle is None:
            return False

        def fence(reason: str) -> None:
            if self._state.registrations.get(pid) == expected:
                self._fence(pid, reason)

        try:
            # Sent here, with no await since the check above.
            sent = handle.resize_infer.remote(
                dp_ranks_to_remove=ranks if remove else [],
                dp_ranks_to_add=[] if remove else ranks,
            )

            async def call() -> Any:
                return await sent

            response = await asyncio.wait_for(call(), self._resize_timeout_s)
        except asyncio.TimeoutError:
            fence(f"{what} timed out after {self._resize_timeout_s:g}s")
            return False
        except Exception as exc:
            fence(f"{what} failed: {type(exc).__name__}: {exc}")
            return False
        ok = bool(getattr(response, "success", response is True or response is None))
        if not ok:
            msg = getattr(response, "message", None) or getattr(response, "error", None)
            fence(f"{what} answered success=False ({msg})")
        return ok

    async def coordinator(self, pipeline_id: str) -> Any:
        """The pipeline's coordinator actor handle (cached), or None while Ray has none; the
        first time one is found the pipeline is marked seen and the state saved.

        Raises:
            LookupFailedError: Ray's lookup raised (not "no such actor"): no verdict.
        """
        handle = self._handles.get(pipeline_id)
        if handle is not None:
            return handle
        spec = self._state.pipelines.get(pipeline_id)
        registration = self._state.registrations.get(pipeline_id)
        try:
            handle = await lookup_coordinator(pipeline_id, spec.ray_namespace if spec else None)
        except Exception as exc:
            raise LookupFailedError(
                f"looking up the coordinator actor of {pipeline_id!r} failed: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        if self._state.registrations.get(pipeline_id) != registration:
            # Unregistered (and maybe registered again) during the lookup: the handle found
            # may be the old registration's actor; nothing is cached for the new one.
            return None
        if handle is not None:
            self._handles[pipeline_id] = handle
            if pipeline_id not in self._seen:
                self._seen.add(pipeline_id)
                self._persist()
        return handle
