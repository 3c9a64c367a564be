"""Generation progress accounting: what a pipeline reports as its demand.

Per train step the pipeline needs ``step_target`` trajectories valid for the current weight
version. :class:`ProgressTracker` counts them and calls its sink with a
:class:`~rlix_plugins.protocol.ProgressReport` only when something the coordinator schedules on
changes: a new batch (always), a new 2% bucket (:func:`~rlix_plugins.protocol.progress_bucket`),
and 0 remaining. Reporting every trajectory would flood the coordinator for no decision change.

"Valid" follows NeMo RL's replay buffer: a trajectory generated with weight version ``v`` is
usable at step ``current`` when ``max(0, current - max_age_steps) <= v <= current``
(:func:`valid_count`). ``max_age_steps=0`` counts only the current version.

The sink is any callable (the hooks implementation forwards to the coordinator; tests collect);
:func:`hooks_sink` adapts an :class:`~rlix_plugins.hooks.protocol.RLixHooks`.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from rlix_plugins.errors import ProtocolError
from rlix_plugins.hooks.protocol import RLixHooks
from rlix_plugins.protocol import (
    OUTSTANDING_METRIC,
    ProgressReport,
    progress_bucket,
    validate_pipeline_id,
)
from rlix_plugins.values import as_index, is_int

logger = logging.getLogger(__name__)

ProgressSink = Callable[[ProgressReport], None]
#: Reads a pipeline's outstanding requests (admitted, not finished) at report time; None when
#: unknown. Typically a router's ``outstanding`` property.
OutstandingReader = Callable[[], "int | None"]


@dataclass(frozen=True, slots=True)
class VersionRecord:
    """A replay-buffer entry's versions: generated with ``trajectory_version``, intended for
    the step that trains ``target_version`` (None when the buffer does not track it)."""

    trajectory_version: int
    target_version: int | None = None


def _int_arg(name: str, value: object, *, minimum: int | None = None) -> int:
    """``value`` as a plain int (numpy ints too), else :class:`ProtocolError` naming it.

    The counts end up in a ProgressReport, whose wire check refuses anything but an int; that
    refusal happens inside the sink, where it is only logged, so demand would be lost.
    """
    out = as_index(value)
    if out is None:
        raise ProtocolError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if minimum is not None and out < minimum:
        raise ProtocolError(f"{name} must be >= {minimum}, got {value}")
    return out


def is_valid(version: int, current_weight_version: int, max_age_steps: int) -> bool:
    """NeMo RL's age window: ``max(0, current - max_age) <= version <= current``."""
    if max_age_steps < 0:
        raise ValueError(f"max_age_steps must be >= 0, got {max_age_steps}")
    return max(0, current_weight_version - max_age_steps) <= version <= current_weight_version


def valid_count(
    records: Iterable[int | VersionRecord],
    current_weight_version: int,
    max_age_steps: int,
    *,
    intended_only: bool = False,
) -> int:
    """How many replay-buffer records are usable at ``current_weight_version``.

    ``intended_only`` additionally requires ``target_version == current_weight_version``
    (records without a target version never match then).
    """
    n = 0
    for rec in records:
        if isinstance(rec, VersionRecord):
            v, target = rec.trajectory_version, rec.target_version
        else:
            v, target = int(rec), None
        if not is_valid(v, current_weight_version, max_age_steps):
            continue
        if intended_only and target != current_weight_version:
            continue
        n += 1
    return n


class ProgressTracker:
    """Counts valid trajectories for the current batch and reports in 2% buckets.

    Thread-safe (several collector threads may record). The sink runs outside the counting
    lock, so a slow coordinator RPC never blocks counting or readers; sends are serialised by a
    second lock and a report older than one already handed to the sink is dropped, so reports
    reach the sink in order and a stale one never overwrites a newer state (the coordinator
    keeps the last arrival). Each report carries a sequence number (``metrics["seq"]``).

    A bucket counts as reported only once the sink accepted it: after a failed send the next
    record (even in the same bucket) reports again.
    """

    def __init__(
        self,
        pipeline_id: str,
        sink: ProgressSink,
        *,
        on_clear: Callable[[], None] | None = None,
        mode: str = "train",
        adapter_id: str | None = None,
        max_age_steps: int = 0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        # Checked here: a bad id fails every report at the coordinator (only logged here).
        self.pipeline_id = validate_pipeline_id(pipeline_id)
        self._sink = sink
        self._on_clear = on_clear
        self.mode = mode
        self.adapter_id = adapter_id
        self.max_age_steps = _int_arg("max_age_steps", max_age_steps, minimum=0)
        self._clock = clock
        self._lock = threading.Lock()
        # held while a report is handed to the sink: one send at a time, in seq order
        self._send_lock = threading.Lock()
        self._target = 0
        self._collected = 0
        self._step = 0
        self._version = 0
        self._batch_ts: float | None = None
        #: bucket of the last report the sink accepted in the current batch
        self._last_bucket: int | None = None
        #: bucket of the newest report built (it may still wait for the send lock)
        self._built_bucket: int | None = None
        self._seq = 0
        #: highest seq handed to the sink; older reports are stale and dropped
        self._sent_seq = 0
        #: reports with a lower seq belong to an earlier batch
        self._batch_seq = 0
        #: the current batch's ``new_batch`` report has not reached the sink yet: the next
        #: report carries the flag again (a failed first report must not lose the batch start)
        self._unannounced = False
        self._active = False

    @property
    def collected(self) -> int:
        with self._lock:
            return self._collected

    @property
    def active(self) -> bool:
        with self._lock:
            return self._active

    def begin_batch(
        self, *, step: int, step_target: int, weight_version: int, already_collected: int = 0
    ) -> ProgressReport:
        """Start counting for a new step; always reports (``new_batch``).

        Raises:
            ProtocolError: an argument is not an int (or ``step_target`` < 0); nothing changed.
        """
        step = _int_arg("step", step)
        step_target = _int_arg("step_target", step_target, minimum=0)
        weight_version = _int_arg("weight_version", weight_version)
        already_collected = _int_arg("already_collected", already_collected)
        with self._lock:
            self._active = True
            self._step = step
            self._target = step_target
            self._version = weight_version
            self._collected = min(max(0, already_collected), step_target)
            self._batch_ts = self._clock()
            self._last_bucket = None
            self._unannounced = True
            report = self._report_locked(new_batch=True)
            self._batch_seq = self._seq
        self._emit(report)
        return report

    def record(self, n: int = 1, *, weight_version: int) -> ProgressReport | None:
        """Count ``n`` trajectories generated with ``weight_version`` (ignored if not valid
        for the current step); reports when the 2% bucket changes."""
        n = _int_arg("n", n, minimum=0)
        weight_version = _int_arg("weight_version", weight_version)
        with self._lock:
            if not self._active or not is_valid(weight_version, self._version, self.max_age_steps):
                return None
            report = self._set_locked(self._collected + n)
        if report is not None:
            self._emit(report)
        return report

    def set_collected(self, collected: int) -> ProgressReport | None:
        """Set the count outright (e.g. from :func:`valid_count` over the replay buffer)."""
        collected = _int_arg("collected", collected)
        with self._lock:
            if not self._active:
                return None
            report = self._set_locked(max(0, collected))
        if report is not None:
            self._emit(report)
        return report

    def _set_locked(self, collected: int) -> ProgressReport | None:
        self._collected = min(collected, self._target)
        bucket = progress_bucket(self._collected, self._target)
        if bucket == self._last_bucket and bucket == self._built_bucket:
            # Same 2% bucket as the report delivered and as the newest one built (0 remaining
            # is bucket 50, so it is reported once). Another bucket built meanwhile and not
            # sent yet would otherwise be the coordinator's last word.
            return None
        return self._report_locked(new_batch=False)

    def end_batch(self) -> None:
        """The batch is consumed by training: clear the pipeline's demand."""
        # Under the send lock: a report in flight reaches the sink before the clear, never
        # after it (it would bring the cleared demand back).
        with self._send_lock:
            with self._lock:
                self._active = False
                self._last_bucket = None
                self._unannounced = False
                self._batch_seq = self._seq + 1  # reports built so far are of the old batch
            if self._on_clear is not None:
                self._on_clear()

    def _report_locked(self, *, new_batch: bool) -> ProgressReport:
        new_batch = new_batch or self._unannounced
        self._seq += 1
        bucket = progress_bucket(self._collected, self._target)
        self._built_bucket = bucket
        metrics: dict[str, object] = {
            "completed": self._collected,
            "collected": self._collected,
            "remaining": self._target - self._collected,
            "bucket": bucket,
            "new_batch": new_batch,
            "current_train_step": self._step,
            "weight_version": self._version,
            "mode": self.mode,
            "seq": self._seq,
        }
        if self.adapter_id is not None:
            metrics["adapter_id"] = self.adapter_id
        return ProgressReport(
            pipeline_id=self.pipeline_id,
            step_target_trajectories=self._target,
            fifo_timestamp=self._batch_ts,
            metrics=metrics,
        )

    def _emit(self, report: ProgressReport) -> None:
        metrics = report.metrics or {}
        seq, bucket = metrics["seq"], metrics["bucket"]
        assert isinstance(seq, int) and isinstance(bucket, int)
        with self._send_lock:
            with self._lock:
                if seq <= self._sent_seq or seq < self._batch_seq:
                    return  # superseded (newer report sent, or its batch is over): stale
                if seq > self._batch_seq and bucket == self._last_bucket:
                    # Another thread's report of this bucket was accepted meanwhile: what the
                    # sink holds is this report's news. Taken as sent, so an older report of
                    # another bucket still waiting to be sent is stale and never goes last.
                    self._sent_seq = seq
                    return
                self._sent_seq = seq
            try:
                self._sink(report)
            except Exception:
                # progress is advisory: a failing sink must not break trajectory collection
                logger.exception("progress sink failed for pipeline %s", self.pipeline_id)
                return
            with self._lock:
                if self._active and seq >= self._batch_seq:
                    self._last_bucket = bucket
                    if metrics.get("new_batch"):
                        self._unannounced = False


def with_outstanding(report: ProgressReport, outstanding: int | None) -> ProgressReport:
    """``report`` with the ``outstanding`` metric set (unchanged when None)."""
    if outstanding is None:
        return report
    if outstanding < 0:
        raise ValueError(f"outstanding must be >= 0, got {outstanding}")
    metrics = dict(report.metrics or {})
    metrics[OUTSTANDING_METRIC] = int(outstanding)
    return dataclasses.replace(report, metrics=metrics)


def outstanding_sink(sink: ProgressSink, read: OutstandingReader) -> ProgressSink:
    """``sink`` with every report carrying ``read()`` as its ``outstanding`` metric.

    The count is advisory: a failing or invalid reader drops only the metric, never the
    report.
    """

    def wrapped(report: ProgressReport) -> None:
        try:
            n = read()
            report = with_outstanding(report, n)
        except Exception:
            logger.warning("outstanding count unavailable; report sent without it",
                           exc_info=True)
        sink(report)

    return wrapped


def _outstanding_of(report: ProgressReport) -> int | None:
    raw = (report.metrics or {}).get(OUTSTANDING_METRIC)
    if not is_int(raw):
        return None
    return raw


def hooks_sink(hooks: RLixHooks) -> ProgressSink:
    """A sink that forwards reports to ``hooks.report_progress`` (``outstanding`` included
    when the report carries it)."""

    def sink(report: ProgressReport) -> None:
        m = report.metrics or {}
        adapter = m.get("adapter_id")
        outstanding = _outstanding_of(report)
        # Passed only when known: hooks written against the original four-method protocol
        # (without ``outstanding``) keep working.
        kwargs: dict[str, int] = {} if outstanding is None else {"outstanding": outstanding}
        hooks.report_progress(
            step_target_trajectories=report.step_target_trajectories,
            collected=report.completed,
            current_train_step=int(str(m.get("current_train_step", 0))),
            new_batch=bool(m.get("new_batch", False)),
            mode=str(m.get("mode", "train")),
            adapter_id=None if adapter is None else str(adapter),
            **kwargs,
        )

    return sink
