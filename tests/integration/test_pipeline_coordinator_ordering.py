"""A ROLL pipeline's progress reports reach the scheduler newest-last, whatever Ray's order.

The pipeline coordinator is a threaded Ray actor: Ray runs its calls in no guaranteed order
(``max_concurrency > 1`` forces out-of-order execution), and ROLL's reports carry no sequence
number. Before the fix an older report could be applied after a newer one, and the scheduler
then held a stale demand: GPUs kept for a pipeline that reported 0 remaining, or a pipeline
starved after it reported work.

Real Ray, real scheduler actor, real pipeline coordinator actors. The interleaving is made by
the test, never by timing: a report that asks to be held waits inside the coordinator until
the test releases it, and "Ray delivered the older report last" is sent in that order.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import ray

from rlix_plugins.adapters.pipeline_coordinator import (
    PipelineCoordinator,
    start_pipeline_coordinator,
)
from rlix_plugins.coordinator.core.status import PipelineStatus
from rlix_plugins.protocol.types import ProgressReport
from tests.support.roll_pipeline import GpuLedger, ShardFactory, register_pipeline

pytestmark = pytest.mark.integration

TARGET = 8


class HeldProgressCoordinator(PipelineCoordinator):
    """The real coordinator; a report whose metrics carry ``hold`` waits inside the call (as
    a thread descheduled mid-call would) until the test calls :meth:`release`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._held = threading.Event()
        self._release = threading.Event()

    def report_progress_from_scheduler(self, report: Any) -> None:
        if (report.metrics or {}).get("hold"):
            self._held.set()
            self._release.wait(60)
        super().report_progress_from_scheduler(report)

    def wait_held(self, timeout: float) -> bool:
        return self._held.wait(timeout)

    def release(self) -> None:
        self._release.set()


def _report(
    pid: str, *, step: int, completed: int, new_batch: bool = False, hold: bool = False
) -> ProgressReport:
    metrics: dict[str, Any] = {
        "mode": "train",
        "completed": completed,
        "new_batch": new_batch,
        "current_train_step": step,
        "adapter_id": None,
    }
    if hold:
        metrics["hold"] = True
    return ProgressReport(pid, TARGET, 100.0 + step, metrics)


def _status(plane: Any, pid: str) -> PipelineStatus:
    status = plane.status().pipeline(pid)
    assert isinstance(status, PipelineStatus)
    return status


def _start(plane: Any, pid: str, cls: type[PipelineCoordinator] = PipelineCoordinator) -> Any:
    """``pid``'s coordinator (one generation rank on GPU 0, simulated shards: its demand makes
    the scheduler expand it), registered."""
    shards = ShardFactory((0,), 1, GpuLedger.remote())
    actor = start_pipeline_coordinator(pid, shards, control_namespace=plane.namespace, cls=cls)
    ray.get(actor.__ray_ready__.remote())
    register_pipeline(plane, pid, {"actor_infer": [0]})
    return actor


def test_a_report_sent_later_is_applied_later_even_if_the_first_is_slow(
    coordinator: Any,
) -> None:
    """ROLL reports ``remaining 8`` then ``remaining 0``; the first is still inside the
    coordinator when the second arrives. Before the fix the second ran on another thread at
    once and the first was applied after it: the scheduler kept demand 8 for a pipeline that
    had collected its batch."""
    pid = "ft_0rder0000001"
    actor = _start(coordinator, pid, HeldProgressCoordinator)

    first = actor.report_progress_from_scheduler.remote(
        _report(pid, step=1, completed=0, new_batch=True, hold=True)
    )
    assert ray.get(actor.wait_held.remote(30.0)), "the first report never reached the gate"
    second = actor.report_progress_from_scheduler.remote(_report(pid, step=1, completed=TARGET))
    # The progress calls share one thread: the second cannot run while the first is held.
    # (Waiting longer cannot make this pass wrongly; the old code answered at once.)
    done, _ = ray.wait([second], timeout=3.0)
    assert not done, "the later report was applied while the earlier one was still in flight"
    ray.get(actor.release.remote())
    ray.get([first, second], timeout=60)

    status = _status(coordinator, pid)
    assert status.demand == 0 and status.progress_streams == 1 and not status.fenced


def test_an_older_report_delivered_last_does_not_overwrite_a_newer_one(
    coordinator: Any,
) -> None:
    """Ray may deliver ROLL's reports in any order; what each report says (step,
    fifo_timestamp, completed) decides which is newer, and a late old one is dropped."""
    pid = "ft_0rder0000002"
    actor = _start(coordinator, pid)

    def send(report: ProgressReport) -> None:
        ray.get(actor.report_progress_from_scheduler.remote(report), timeout=60)

    # step 2's new batch, then step 1's last report (0 remaining): the pipeline must not be
    # starved by the old step's "done"
    send(_report(pid, step=2, completed=0, new_batch=True))
    send(_report(pid, step=1, completed=TARGET))
    assert _status(coordinator, pid).demand == TARGET

    # within step 2: "all collected", then an earlier bucket: GPUs must not be kept for it
    send(_report(pid, step=2, completed=TARGET))
    send(_report(pid, step=2, completed=3))
    assert _status(coordinator, pid).demand == 0

    # the stream is cleared; a late report of its batch must not bring the demand back
    ray.get(actor.clear_progress_stream.remote(mode="train", adapter_id=None), timeout=60)
    send(_report(pid, step=2, completed=5))
    assert _status(coordinator, pid).progress_streams == 0

    # the next step opens the stream again
    send(_report(pid, step=3, completed=0, new_batch=True))
    status = _status(coordinator, pid)
    assert status.demand == TARGET and status.progress_streams == 1 and not status.fenced


def _roll_report(pid: str, *, step: int, collected: int, ts: float,
                 new_batch: bool = False) -> ProgressReport:
    """A report as ROLL's GroupQueueManager sends it (ROLL 4989ec48,
    roll/distributed/scheduler/rollout_scheduler.py:621-633): raw ``collected``, the send time
    as ``fifo_timestamp``, and as step the batch's (opening report) or the episode's start."""
    metrics = {"mode": "train", "collected": collected, "bucket": collected * 50 // TARGET,
               "new_batch": new_batch, "current_train_step": step, "adapter_id": None}
    return ProgressReport(pid, TARGET, ts, metrics)


def test_roll_reports_of_episodes_started_a_step_earlier_count(coordinator: Any) -> None:
    """Async generation: batch 2 is filled by episodes started at step 1, whose reports carry
    step 1. Before the fix they were dropped as older (demand stayed 8 with the batch done).
    Once they count, a late report of the cleared batch carrying a higher step than the last
    applied one must still not bring the demand back."""
    pid = "ft_0rder0000003"
    actor = _start(coordinator, pid)

    def send(report: ProgressReport) -> None:
        ray.get(actor.report_progress_from_scheduler.remote(report), timeout=60)

    send(_roll_report(pid, step=2, collected=0, ts=10.0, new_batch=True))
    send(_roll_report(pid, step=1, collected=5, ts=11.0))
    assert _status(coordinator, pid).demand == TARGET - 5
    send(_roll_report(pid, step=1, collected=TARGET - 1, ts=12.0))
    ray.get(actor.clear_progress_stream.remote(mode="train", adapter_id=None), timeout=60)
    send(_roll_report(pid, step=2, collected=TARGET, ts=13.0))  # sent before the clear
    assert _status(coordinator, pid).progress_streams == 0
