"""Virtual time for the simulator: a heap of timed callbacks, never the wall clock."""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(order=True, slots=True)
class _Entry:
    time: float
    seq: int
    action: Callable[[], None] = field(compare=False)
    cancelled: bool = field(default=False, compare=False)


class Timer:
    """Handle of a scheduled callback; :meth:`cancel` makes it a no-op (lazy deletion)."""

    __slots__ = ("_entry",)

    def __init__(self, entry: _Entry) -> None:
        self._entry = entry

    @property
    def time(self) -> float:
        return self._entry.time

    def cancel(self) -> None:
        self._entry.cancelled = True


class ClockQueue:
    """Discrete-event clock: callbacks run in (time, insertion) order; time never goes back.

    Ties are broken by insertion order so a run is deterministic for a given seed.
    """

    def __init__(self) -> None:
        self._heap: list[_Entry] = []
        self._seq = 0
        self.now = 0.0
        self.processed = 0

    def at(self, time: float, action: Callable[[], None]) -> Timer:
        """Run ``action`` at virtual ``time`` (clamped to now: the past cannot be scheduled).

        A NaN time is refused (ValueError): it has no place in the heap's order.
        """
        if math.isnan(time):
            raise ValueError("a virtual time must be a number, got NaN")
        self._seq += 1
        entry = _Entry(max(time, self.now), self._seq, action)
        heapq.heappush(self._heap, entry)
        return Timer(entry)

    def after(self, delay: float, action: Callable[[], None]) -> Timer:
        """Run ``action`` ``delay`` seconds from now (a negative delay means now; NaN is
        refused)."""
        if math.isnan(delay):
            raise ValueError("a delay must be a number of seconds, got NaN")
        return self.at(self.now + max(0.0, delay), action)

    def __len__(self) -> int:
        return len(self._heap)

    def run(self, until: float | None = None, max_events: int | None = None) -> None:
        """Process events in order until the heap is empty, ``until`` or ``max_events``."""
        heap = self._heap
        count = 0
        while heap:
            if until is not None and heap[0].time > until:
                self.now = until
                return
            entry = heapq.heappop(heap)
            if entry.cancelled:
                continue
            self.now = entry.time
            entry.action()
            count += 1
            self.processed += 1
            if max_events is not None and count >= max_events:
                return
