"""Replaying ROLL progress stream marks the way ``PipelineCoordinator`` applies them."""

from __future__ import annotations

from rlix_plugins.adapters.pipeline_coordinator import StreamMark, is_stale


def apply_marks(marks: list[StreamMark | None]) -> StreamMark | None:
    """Apply reports (None: a clear) in arrival order as the coordinator does; the last
    applied mark (``cleared`` after a clear)."""
    last: StreamMark | None = None
    for mark in marks:
        if mark is None:
            if last is not None:
                last = StreamMark(last.step, last.fifo, last.completed, True, last.new_batch)
        elif not is_stale(mark, last):
            last = mark
    return last
