"""The coordinator's progress ordering against what ROLL really sends (pure, no Ray).

Checked against ROLL's source as RLix pins it (rlops/rlix external/ROLL, ROLL commit
4989ec480ce3db4b858b9f4af4ce38afc5a90c79, roll/distributed/scheduler/rollout_scheduler.py,
``GroupQueueManager``). What a ROLL progress stream sends, in the order it sends it:

* ``fifo_timestamp`` is the report's own send time (``time.time()``, line 624), and all of a
  stream's reports come from one asyncio actor in turn: a later stamp is a later report.
* ``current_train_step`` is the batch's step only in the report opening the batch (lines
  1044-1046); a report sent when a trajectory is put carries that episode's START step (line
  770; traj_env_manager.py:109/141), which under async generation is below the batch's step.
* the count (``collected``, raw) falls inside a batch when a group is filtered or its env
  exits (lines 761-764);
* after ``clear_progress_stream`` (``end_progress_batch``, line 695) the stream sends nothing
  until the next ``begin_progress_batch`` opens a batch with ``new_batch`` (lines 590, 682).

The sequences below are those reports, replayed through :func:`is_stale` the way the
coordinator applies them.
"""

from __future__ import annotations

from typing import Any

from rlix_plugins.adapters.pipeline_coordinator import StreamMark, stream_mark
from rlix_plugins.protocol.types import ProgressReport, coerce_progress_report
from tests.support.stream_marks import apply_marks

PID = "ft_0123456789ab"
TARGET = 8


def _roll(step: int | None, collected: int, ts: float, *, new_batch: bool = False) -> StreamMark:
    """The ordering fields of a report shaped as ROLL's GroupQueueManager builds it (lines
    621-633: ``collected``, never ``completed``)."""
    metrics: dict[str, Any] = {
        "mode": "train",
        "collected": collected,
        "bucket": collected * 50 // TARGET,
        "new_batch": new_batch,
        "current_train_step": step,
        "adapter_id": None,
    }
    return stream_mark(coerce_progress_report(ProgressReport(PID, TARGET, ts, metrics)))


def test_a_report_of_an_episode_started_a_step_earlier_is_applied() -> None:
    """Async generation: batch 5 opens (step 5), then trajectories of episodes started at
    step 4 complete it. Before the fix their reports (step 4 < 5) were dropped as older, and
    the stream kept demand TARGET until a step-5 episode happened to report."""
    last = apply_marks([
        _roll(5, 0, 10.0, new_batch=True),
        _roll(4, 3, 11.0),
        _roll(4, TARGET, 12.0),
    ])
    assert last is not None and last.completed == TARGET


def test_a_count_taken_back_by_a_filter_is_applied() -> None:
    """A filtered group takes its trajectories back; the lower count is the newer report,
    whichever episode's start step it carries."""
    last = apply_marks([
        _roll(5, 0, 10.0, new_batch=True),
        _roll(5, 6, 11.0),
        _roll(4, 2, 12.0),
    ])
    assert last is not None and last.completed == 2


def test_a_report_sent_earlier_is_dropped_whatever_step_it_carries() -> None:
    """Delivered out of order: the report sent at 11.0 (an older count, step 5) arrives after
    the one sent at 12.0 (step 4): the send times order them."""
    last = apply_marks([
        _roll(5, 0, 10.0, new_batch=True),
        _roll(4, 6, 12.0),
        _roll(5, 3, 11.0),
    ])
    assert last is not None and last.completed == 6


def test_after_a_clear_only_a_new_batch_opens_the_stream() -> None:
    """A report of the cleared batch delivered after the clear is dropped even when its step
    is above the last applied one (its episode started later) and its stamp is later (it was
    sent just before the clear); the next batch's opening report reopens the stream."""
    last = apply_marks([
        _roll(5, 0, 10.0, new_batch=True),
        _roll(4, 7, 11.0),
        None,
        _roll(5, TARGET, 12.0),
    ])
    assert last is not None and last.cleared and last.completed == 7
    last = apply_marks([_roll(5, 0, 10.0, new_batch=True), None, _roll(6, 0, 20.0, new_batch=True)])
    assert last is not None and not last.cleared and last.step == 6


def test_the_opening_report_of_a_cleared_batch_delivered_late_is_dropped() -> None:
    """The batch's opening report overtaken by the batch's other reports and its clear must
    not bring back the whole batch's demand (it was sent first: the earliest stamp)."""
    last = apply_marks([_roll(5, 4, 11.0), _roll(5, TARGET, 12.0), None, _roll(5, 0, 10.0,
                                                                          new_batch=True)])
    assert last is not None and last.cleared and last.completed == TARGET
