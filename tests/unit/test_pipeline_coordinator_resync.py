"""A progress forward that fails is sent again (no Ray; FAKE scheduler link).

ROLL calls ``clear_progress_stream`` and ``report_progress_from_scheduler`` fire-and-forget
(ROLL 4989ec48, rollout_scheduler.py:621-635, 685-698), so when the coordinator's forward to
the scheduler failed (no answer within ``call_timeout_s``, scheduler being re-created) the
error reached nobody. The coordinator had already closed the stream, so the scheduler kept the
ended batch's demand, planning generation GPUs for it, until the next batch opened, and
nothing sent the clear again.
"""

from __future__ import annotations

from typing import Any

import pytest

from rlix_plugins.errors import CoordinatorUnavailableError, PipelineFailedError
from rlix_plugins.protocol.types import ProgressReport
from tests.support.scheduler_link import FakeSchedulerLinkCoordinator

# the coordinators built here install the ``rlix`` stand-in process-wide
pytestmark = pytest.mark.usefixtures("no_rlix_shim_left")

PID = "ft_resync000001"
TARGET = 8
#: how long a test waits for a re-send scheduled after a failure (the first is due after
#: ``RESYNC_S``, 1 s, the next after 2 s)
WAIT_S = 6.0


def _report(step: int, collected: int, ts: float, *, new_batch: bool = False,
            mode: str = "train") -> ProgressReport:
    """A report shaped as ROLL's GroupQueueManager sends it (lines 621-633)."""
    metrics: dict[str, Any] = {"mode": mode, "collected": collected,
                               "bucket": collected * 50 // TARGET, "new_batch": new_batch,
                               "current_train_step": step, "adapter_id": None}
    return ProgressReport(PID, TARGET, ts, metrics)


def _unavailable() -> CoordinatorUnavailableError:
    return CoordinatorUnavailableError("clear_progress to rlix:scheduler got no answer (test)")


def test_a_clear_whose_forward_failed_is_sent_again_without_another_call() -> None:
    coord = FakeSchedulerLinkCoordinator(PID)
    coord.report_progress_from_scheduler(_report(3, 0, 100.0, new_batch=True))
    coord.report_progress_from_scheduler(_report(3, 5, 101.0))
    assert coord.scheduler_demand() == 3
    coord.failures.append(_unavailable())
    coord.delivered.clear()
    with pytest.raises(CoordinatorUnavailableError):
        coord.clear_progress_stream(mode="train")  # ROLL never sees this error
    assert coord.failed == [("clear_progress", {"pipeline_id": PID})]
    assert coord.scheduler_demand() == 3  # the ended batch's demand, still planned for
    # Nothing more comes from ROLL until its next batch: the coordinator sends the clear again.
    assert coord.delivered.wait(WAIT_S), "the failed clear was never sent again"
    assert coord.sent[-1] == ("clear_progress", {"pipeline_id": PID})
    assert coord.scheduler_demand() is None


def test_a_stream_cleared_while_another_runs_sends_the_remaining_sum_again() -> None:
    coord = FakeSchedulerLinkCoordinator(PID)
    coord.report_progress_from_scheduler(_report(3, 2, 100.0, new_batch=True))
    coord.report_progress_from_scheduler(_report(3, 4, 100.5, new_batch=True, mode="val"))
    assert coord.scheduler_demand() == 6 + 4
    coord.failures.append(_unavailable())
    coord.delivered.clear()
    with pytest.raises(CoordinatorUnavailableError):
        coord.clear_progress_stream(mode="val")
    assert coord.delivered.wait(WAIT_S), "the failed forward was never sent again"
    method, sent = coord.sent[-1]
    assert method == "report_progress" and sent.remaining == 6


def test_a_late_report_of_the_cleared_batch_neither_reopens_it_nor_is_resent() -> None:
    """The symmetric case: while the clear waits to be sent again, a late report of the
    cleared batch (Ray delivered it after the clear) is dropped, and what is sent again is
    the clear, not that report."""
    coord = FakeSchedulerLinkCoordinator(PID)
    coord.report_progress_from_scheduler(_report(3, 0, 100.0, new_batch=True))
    coord.report_progress_from_scheduler(_report(3, 5, 102.0))
    coord.failures.append(_unavailable())
    coord.delivered.clear()
    with pytest.raises(CoordinatorUnavailableError):
        coord.clear_progress_stream(mode="train")
    coord.report_progress_from_scheduler(_report(3, 4, 101.0))  # stale: dropped, not sent
    assert not coord.failures and coord.scheduler_demand() == 3
    assert coord.delivered.wait(WAIT_S)
    assert coord.sent[-1] == ("clear_progress", {"pipeline_id": PID})


def test_a_forward_delivered_before_the_resend_makes_it_a_no_op() -> None:
    coord = FakeSchedulerLinkCoordinator(PID)
    coord.report_progress_from_scheduler(_report(3, 0, 100.0, new_batch=True))
    coord.failures.append(_unavailable())
    with pytest.raises(CoordinatorUnavailableError):
        coord.clear_progress_stream(mode="train")
    # the next batch opens (and reaches the scheduler) before the re-send is due
    coord.report_progress_from_scheduler(_report(4, 0, 200.0, new_batch=True))
    sent = list(coord.sent)
    assert coord.resync_progress() is True  # what the pending re-send does when it fires
    assert coord.sent == sent, "an older state was sent over the newer one"
    assert coord.scheduler_demand() == TARGET


def test_a_resend_that_fails_again_is_tried_again() -> None:
    coord = FakeSchedulerLinkCoordinator(PID)
    coord.report_progress_from_scheduler(_report(3, 0, 100.0, new_batch=True))
    coord.failures.extend([_unavailable(), _unavailable()])
    coord.delivered.clear()
    with pytest.raises(CoordinatorUnavailableError):
        coord.clear_progress_stream(mode="train")
    assert coord.resync_progress() is False  # the second failure; another try is scheduled
    assert coord.delivered.wait(WAIT_S), "not tried again after a second failure"
    assert coord.sent[-1] == ("clear_progress", {"pipeline_id": PID})
    assert len(coord.failed) == 2


def test_a_refusal_by_the_scheduler_is_not_sent_again() -> None:
    """A typed refusal (the pipeline was fenced) is an answer, not a lost call."""
    coord = FakeSchedulerLinkCoordinator(PID)
    coord.report_progress_from_scheduler(_report(3, 0, 100.0, new_batch=True))
    coord.failures.append(PipelineFailedError(f"pipeline {PID!r} was fenced (test)"))
    with pytest.raises(PipelineFailedError):
        coord.clear_progress_stream(mode="train")
    assert coord.resync_progress() is True  # nothing pending: nothing sent
    assert coord.sent[-1][0] == "report_progress" and len(coord.failed) == 1
