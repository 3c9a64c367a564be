"""The pipeline coordinator's progress ordering (pure parts; the Ray side is in
tests/integration/test_pipeline_coordinator_ordering.py).

ROLL's progress reports carry no sequence number and Ray may run them out of order on the
threaded coordinator actor; what orders them is what they say (step, fifo_timestamp,
completed) and the one-thread concurrency group their calls run in.
"""

from __future__ import annotations

from typing import Any

import pytest

from rlix_plugins.adapters.pipeline_coordinator import (
    PROGRESS_GROUP,
    PROGRESS_METHODS,
    PipelineCoordinator,
    StreamMark,
    is_stale,
    stream_mark,
)
from rlix_plugins.errors import ProtocolError
from rlix_plugins.protocol.types import ProgressReport


def _mark(step: int | None, completed: int, fifo: float | None = 1.0, *,
          cleared: bool = False, new_batch: bool = False) -> StreamMark:
    return StreamMark(step, fifo, completed, cleared, new_batch)


@pytest.mark.parametrize(
    ("new", "last", "stale"),
    [
        (_mark(1, 0), None, False),                       # first report of a stream
        (_mark(1, 8), _mark(2, 0), True),                 # an older step
        (_mark(3, 0), _mark(2, 8), False),                # a newer step, count restarts
        (_mark(2, 3), _mark(2, 8), True),                 # an earlier bucket of the step
        (_mark(2, 8), _mark(2, 8), False),                # the same state again
        (_mark(2, 0, 5.0), _mark(2, 8, 4.0), False),      # same step, a later batch
        (_mark(2, 8, 3.0), _mark(2, 0, 4.0), True),       # same step, an earlier batch
        (_mark(2, 3, None), _mark(2, 8), True),           # unknown time: the count decides
        (_mark(None, 0), _mark(2, 8), False),             # no step: nothing orders them
        (_mark(2, 0), _mark(None, 8), False),
        (_mark(2, 8), _mark(2, 3, cleared=True), True),   # the cleared batch's late report
        # a cleared step stays closed, even to a later timestamp (it may be the report's
        # own time, taken before the clear)
        (_mark(2, 0, 5.0), _mark(2, 3, cleared=True), True),
        (_mark(3, 0), _mark(2, 3, cleared=True), False),  # the next step after a clear
        # the same step's batch opened again after its clear (collected again): reopens
        (_mark(2, 0, new_batch=True), _mark(2, 3, cleared=True), False),
        # a batch of the same step opened again while open: its count restarts
        (_mark(2, 0, None, new_batch=True), _mark(2, 8), False),
        # ... unless its own timestamp says it is the older one
        (_mark(2, 0, 3.0, new_batch=True), _mark(2, 8, 4.0), True),
    ],
)
def test_is_stale_orders_reports_by_their_own_fields(
    new: StreamMark, last: StreamMark | None, stale: bool
) -> None:
    assert is_stale(new, last) is stale


def test_stream_mark_reads_step_time_and_raw_count() -> None:
    rep = ProgressReport("ft_a", 4, 7.5, {"collected": 9, "current_train_step": 3})
    # the raw count, not the capped one: a count past the target still orders reports
    assert stream_mark(rep) == StreamMark(3, 7.5, 9)
    opening = ProgressReport("ft_a", 4, None, {"completed": 0, "new_batch": True})
    assert stream_mark(opening) == StreamMark(None, None, 0, new_batch=True)
    assert stream_mark(ProgressReport("ft_a", 4)) == StreamMark(None, None, 0)


@pytest.mark.usefixtures("no_rlix_shim_left")  # the coordinator installs the stand-in
@pytest.mark.parametrize("step", [True, -1, 2.5, "3"])
def test_a_malformed_step_is_refused_and_changes_nothing(step: object) -> None:
    coord = PipelineCoordinator("ft_a", lambda pid: None)  # type: ignore[arg-type,return-value]
    rep = ProgressReport("ft_a", 4, None, {"completed": 1, "current_train_step": step})
    with pytest.raises(ProtocolError, match="current_train_step"):
        coord.report_progress_from_scheduler(rep)
    assert coord._streams == {} and coord._marks == {}


def test_progress_calls_and_their_overrides_run_in_the_one_thread_group() -> None:
    class Override(PipelineCoordinator):
        def report_progress_from_scheduler(self, report: Any) -> None:
            super().report_progress_from_scheduler(report)

        def clear_progress_stream(
            self, *, mode: str = "train", adapter_id: str | None = None
        ) -> None:
            super().clear_progress_stream(mode=mode, adapter_id=adapter_id)

    for cls in (PipelineCoordinator, Override):
        for name in PROGRESS_METHODS:
            assert getattr(cls, name).__ray_concurrency_group__ == PROGRESS_GROUP
    assert not hasattr(PipelineCoordinator.resize_infer, "__ray_concurrency_group__")
