"""Writing the scheduler's GPU-ownership timeline to its file (Chrome trace events).

The scheduler records ownership into an :class:`OwnershipTrace` on its event loop;
:class:`TraceWriter` writes that timeline to ``{trace_dir}/rlix_gpu_timeline_{namespace}.json``
at most once every :data:`TRACE_WRITE_INTERVAL_S` (in a thread, so the loop never waits on a
large file) and, awaited, when asked (``flush_trace``) and when the scheduler stops.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlix_plugins.coordinator.service.trace import OwnershipTrace

logger = logging.getLogger(__name__)

#: The GPU timeline file is rewritten at most this often (and on flush_trace / stop).
TRACE_WRITE_INTERVAL_S = 5.0


class TraceWriter:
    """Writes one scheduler's :class:`OwnershipTrace` to its timeline file.

    ``trace_dir`` None (or empty): nothing is ever written. ``keep_task`` is given each
    periodic write's task, so the scheduler holds a reference to it (the loop holds tasks
    weakly) and cancels it when it stops. The snapshot is always taken on the event loop, so
    it is consistent; only serialising and writing it runs in a thread.
    """

    def __init__(
        self,
        trace: OwnershipTrace,
        *,
        trace_dir: str | None,
        namespace: str,
        keep_task: Callable[[asyncio.Task[None]], None],
    ) -> None:
        self._trace = trace
        self._trace_dir = trace_dir
        self._namespace = namespace
        self._keep_task = keep_task
        #: when the last snapshot was taken for a write (periodic or requested)
        self._last_write = 0.0

    @property
    def path(self) -> Path | None:
        """The timeline file, or None without a trace dir."""
        if not self._trace_dir:
            return None
        return Path(self._trace_dir) / f"rlix_gpu_timeline_{self._namespace}.json"

    def maybe_write(self, now: float) -> None:
        """Start a periodic write (in the background) when the last one is old enough."""
        if self._trace_dir and now - self._last_write >= TRACE_WRITE_INTERVAL_S:
            self._write_in_background(now)

    async def write(self, now: float) -> None:
        """A requested or final write, awaited; also in a thread (a periodic write may hold
        the file's lock, and serialising a long timeline takes a while)."""
        snap = self._snapshot(now)
        if snap is not None:
            await asyncio.to_thread(self._write_file, *snap)

    def _snapshot(self, now: float) -> tuple[Path, dict[str, Any]] | None:
        """The file and the timeline to write into it, taken here, on the loop (consistent)."""
        path = self.path
        if path is None:
            return None
        self._last_write = now
        return path, self._trace.to_json(now)

    @staticmethod
    def _write_file(path: Path, data: dict[str, Any]) -> None:
        try:
            OwnershipTrace.write_json(path, data)
        except OSError:
            logger.exception("writing the GPU timeline to %s failed", path)

    def _write_in_background(self, now: float) -> None:
        """Periodic write: serialised and written in a thread, so the event loop never waits
        on a large file."""
        snap = self._snapshot(now)
        if snap is None:
            return
        task = asyncio.get_running_loop().create_task(asyncio.to_thread(self._write_file, *snap))
        self._keep_task(task)
