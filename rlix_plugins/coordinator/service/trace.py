"""GPU-ownership timeline as a Chrome trace-event file (open it in https://ui.perfetto.dev).

One track per GPU; a slice per interval a GPU had one owner at one stage; instant events for
preemptions. The recorder is plain Python fed with the ownership list after every commit; the
scheduler writes the file to ``settings.trace_dir`` (throttled) and when it stops.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import threading
import uuid
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlix_plugins.files import write_text_atomic

logger = logging.getLogger(__name__)

#: Trace events kept in memory (the oldest are dropped first); a slice is ~150 bytes.
MAX_EVENTS = 200_000

#: Serialises timeline writes in this process: the scheduler writes from a thread (periodic)
#: and on its event loop (``flush_trace``, ``stop``) at once.
_WRITE_LOCK = threading.Lock()
#: Per file: ``(trace id, snapshot number)`` of the newest snapshot written there.
_WRITTEN: dict[str, tuple[str, int]] = {}


@dataclass(frozen=True, slots=True)
class Holder:
    """Who holds a GPU, as the trace names it."""

    cluster_id: str
    stage: str
    dp_rank: int | None = None


class OwnershipTrace:
    """Turns successive ownership lists into per-GPU slices (times in seconds)."""

    def __init__(self, num_gpus: int, *, t0: float, label: str = "rlix coordinator") -> None:
        self.num_gpus = num_gpus
        self.t0 = t0
        self.label = label
        self._open: list[tuple[Holder, float] | None] = [None] * num_gpus
        self._events: deque[dict[str, Any]] = deque(maxlen=MAX_EVENTS)
        #: tells this trace's snapshots apart from another's in the same file
        self._id = uuid.uuid4().hex
        self._snapshots = itertools.count(1)

    def _us(self, t: float) -> float:
        return round((t - self.t0) * 1e6, 1)

    def _close(self, gpu: int, now: float) -> None:
        cur = self._open[gpu]
        if cur is None:
            return
        holder, since = cur
        self._events.append(self._slice(gpu, holder, since, now))
        self._open[gpu] = None

    def _slice(self, gpu: int, holder: Holder, since: float, until: float) -> dict[str, Any]:
        args: dict[str, Any] = {"cluster_id": holder.cluster_id, "stage": holder.stage}
        if holder.dp_rank is not None:
            args["dp_rank"] = holder.dp_rank
        return {
            "name": f"{holder.cluster_id} {holder.stage}",
            "cat": holder.stage,
            "ph": "X",
            "pid": 1,
            "tid": gpu,
            "ts": self._us(since),
            # From the rounded ends, so a slice ends exactly where the next one starts.
            "dur": max(0.0, round(self._us(until) - self._us(since), 1)),
            "args": args,
        }

    def observe(self, holders: Sequence[Holder | None], now: float) -> None:
        """Record the ownership after a commit; only GPUs whose holder changed get events."""
        for gpu, holder in enumerate(holders):
            cur = self._open[gpu]
            if (cur[0] if cur else None) == holder:
                continue
            self._close(gpu, now)
            if holder is not None:
                self._open[gpu] = (holder, now)

    def instant(self, name: str, gpus: Sequence[int], now: float, **args: Any) -> None:
        """A point event (e.g. a preemption) on each of ``gpus``' tracks."""
        for gpu in gpus:
            self._events.append(
                {
                    "name": name,
                    "ph": "i",
                    "s": "t",
                    "pid": 1,
                    "tid": gpu,
                    "ts": self._us(now),
                    "args": dict(args),
                }
            )

    def to_json(self, now: float) -> dict[str, Any]:
        """The trace so far, with still-open slices cut at ``now``."""
        meta: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": 1, "args": {"name": self.label}}
        ]
        for gpu in range(self.num_gpus):
            meta.append(
                {
                    "name": "thread_name",
                    "ph": "M",
                    "pid": 1,
                    "tid": gpu,
                    "args": {"name": f"GPU {gpu}"},
                }
            )
            meta.append(
                {
                    "name": "thread_sort_index",
                    "ph": "M",
                    "pid": 1,
                    "tid": gpu,
                    "args": {"sort_index": gpu},
                }
            )
        open_slices = [
            self._slice(gpu, cur[0], cur[1], now)
            for gpu, cur in enumerate(self._open)
            if cur is not None
        ]
        return {
            "traceEvents": meta + list(self._events) + open_slices,
            "displayTimeUnit": "ms",
            # The snapshot number orders this trace's snapshots (see write_json).
            "otherData": {
                "t0_unix_s": self.t0,
                "trace_id": self._id,
                "snapshot": next(self._snapshots),
            },
        }

    @staticmethod
    def write_json(path: Path, data: dict[str, Any]) -> None:
        """Write a trace atomically (a reader never sees half a file).

        Writes in one process are serialised, and a snapshot of a trace older than the one
        already in ``path`` is skipped: a periodic write finishing in its thread after the
        final one (at stop) must not bring back an older timeline.
        """
        other = data.get("otherData") or {}
        trace_id, snapshot = other.get("trace_id"), other.get("snapshot")
        key = os.path.abspath(path)
        with _WRITE_LOCK:
            last = _WRITTEN.get(key)
            if (
                isinstance(snapshot, int)
                and last is not None
                and last[0] == trace_id
                and last[1] > snapshot
            ):
                logger.debug("trace snapshot %d older than the one in %s; skipped", snapshot, path)
                return
            path.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomic(path, json.dumps(data))
            if isinstance(trace_id, str) and isinstance(snapshot, int):
                _WRITTEN[key] = (trace_id, snapshot)
