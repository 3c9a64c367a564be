"""Progress ordering when a ROLL sender's wall clock steps back (pure, no Ray).

ROLL stamps each report's ``fifo_timestamp`` with ``time.time()`` at send (ROLL 4989ec48,
rollout_scheduler.py:624), and the coordinator orders a stream by those stamps first. An NTP
step backwards made every later report look older than the last applied one: all of them were
dropped, and the stream's demand froze until the clock passed the applied stamp again (an
hour for an hour's step). A stamp more than ``clock_step_s`` older than the applied one is now
taken as a clock step (warned), while Ray's short reorderings are still dropped.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

from rlix_plugins.adapters.pipeline_coordinator import (
    CLOCK_STEP_S,
    StreamMark,
    clock_stepped_back,
    is_stale,
    stream_mark,
)
from rlix_plugins.errors import ProtocolError
from rlix_plugins.protocol.types import ProgressReport, coerce_progress_report
from tests.support.scheduler_link import FakeSchedulerLinkCoordinator
from tests.support.stream_marks import apply_marks

# the coordinators built here install the ``rlix`` stand-in process-wide
pytestmark = pytest.mark.usefixtures("no_rlix_shim_left")

PID = "ft_c1ock0000001"
TARGET = 8
HOUR = 3600.0


def _report(step: int, collected: int, ts: float, *, new_batch: bool = False) -> ProgressReport:
    """A report shaped as ROLL's GroupQueueManager sends it (lines 621-633)."""
    metrics: dict[str, Any] = {"mode": "train", "collected": collected,
                               "bucket": collected * 50 // TARGET, "new_batch": new_batch,
                               "current_train_step": step, "adapter_id": None}
    return ProgressReport(PID, TARGET, ts, metrics)


def _mark(step: int, collected: int, ts: float, *, new_batch: bool = False) -> StreamMark:
    return stream_mark(coerce_progress_report(_report(step, collected, ts, new_batch=new_batch)))


def test_reports_sent_after_the_clock_stepped_back_an_hour_are_applied() -> None:
    """Mid-batch the sender's clock steps back an hour: before, every later report was
    dropped (count stuck at 3, demand 5 with the batch collected)."""
    last = apply_marks([
        _mark(5, 0, 10_000.0, new_batch=True),
        _mark(5, 3, 10_001.0),
        _mark(4, 6, 10_002.0 - HOUR),  # the clock stepped back before this one was sent
        _mark(4, TARGET, 10_003.0 - HOUR),
    ])
    assert last is not None and last.completed == TARGET


def test_after_a_step_back_the_stamps_order_the_stream_again() -> None:
    """Once a report after the step is applied, a late delivery of an earlier post-step
    report is dropped as before."""
    last = apply_marks([
        _mark(5, 0, 10_000.0, new_batch=True),
        _mark(5, 6, 10_002.0 - HOUR),
        _mark(5, 3, 10_001.0 - HOUR),  # sent before the one applied: dropped
    ])
    assert last is not None and last.completed == 6


def test_a_batch_opened_after_a_clear_and_a_step_back_reopens_the_stream() -> None:
    """Before, the next batch's opening report (stamped before the cleared batch's last
    report) was dropped: the stream stayed closed and the new batch had no demand."""
    last = apply_marks([
        _mark(5, 0, 10_000.0, new_batch=True),
        _mark(5, TARGET, 10_005.0),
        None,
        _mark(5, TARGET, 10_006.0 - HOUR),  # a late report of the cleared batch: still dropped
    ])
    assert last is not None and last.cleared
    last = apply_marks([
        _mark(5, 0, 10_000.0, new_batch=True),
        _mark(5, TARGET, 10_005.0),
        None,
        _mark(6, 0, 10_010.0 - HOUR, new_batch=True),
    ])
    assert last is not None and not last.cleared and last.step == 6 and last.completed == 0


def test_a_reordering_within_the_bound_is_still_dropped() -> None:
    """Ray's reordering (a report sent a few seconds earlier, delivered later) is told apart
    from a clock step by how far back its stamp is."""
    last = StreamMark(5, 100.0, 6)
    assert is_stale(StreamMark(5, 100.0 - CLOCK_STEP_S + 1, 3), last)
    assert not clock_stepped_back(StreamMark(5, 100.0 - CLOCK_STEP_S, 3), last)
    assert clock_stepped_back(StreamMark(5, 100.0 - CLOCK_STEP_S - 1, 3), last)
    assert not is_stale(StreamMark(5, 100.0 - CLOCK_STEP_S - 1, 3), last)
    # the bound is a parameter
    assert is_stale(StreamMark(5, 100.0 - 20.0, 3), last, clock_step_s=30.0)
    assert not is_stale(StreamMark(5, 100.0 - 20.0, 3), last, clock_step_s=15.0)
    assert not clock_stepped_back(StreamMark(5, None, 3), last)
    assert not clock_stepped_back(StreamMark(5, 0.0, 3), None)


def test_the_coordinator_applies_reports_after_a_step_back_and_warns(
    caplog: pytest.LogCaptureFixture,
) -> None:
    coord = FakeSchedulerLinkCoordinator(PID)
    coord.report_progress_from_scheduler(_report(5, 0, 10_000.0, new_batch=True))
    coord.report_progress_from_scheduler(_report(5, 3, 10_001.0))
    with caplog.at_level(logging.WARNING, logger="rlix_plugins.adapters.pipeline_coordinator"):
        coord.report_progress_from_scheduler(_report(5, TARGET, 10_002.0 - HOUR))
    assert any("clock stepped back" in r.getMessage() for r in caplog.records)
    method, sent = coord.sent[-1]
    assert method == "report_progress" and sent.completed == TARGET
    assert sent.remaining == 0
    # a report within the bound after it is ordered by its stamp again
    caplog.clear()
    coord.report_progress_from_scheduler(_report(5, 3, 10_001.0 - HOUR))
    assert coord.sent[-1][1].completed == TARGET and len(coord.sent) == 3
    assert not any("clock stepped back" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), True, "10"])
def test_a_bad_clock_step_bound_is_refused(bad: object) -> None:
    with pytest.raises(ProtocolError, match="clock_step_s"):
        FakeSchedulerLinkCoordinator(PID, clock_step_s=bad)
