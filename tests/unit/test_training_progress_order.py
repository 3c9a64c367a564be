"""Progress reports reach the sink in order, and a failed send is not taken as sent.

The coordinator keeps the last report that arrives, so a stale report delivered after a newer
one (two collector threads, a slow RPC) would bring back demand that is already met.
"""

from __future__ import annotations

import threading

from rlix_plugins.protocol import ProgressReport
from rlix_plugins.training.progress import ProgressTracker

WAIT_S = 10.0


def test_a_slow_older_report_never_arrives_after_the_newer_one() -> None:
    got: list[tuple[int, int]] = []
    older_in_sink = threading.Event()
    newer_delivered = threading.Event()

    def sink(report: ProgressReport) -> None:
        metrics = report.metrics or {}
        if report.completed == 63:  # the older report's RPC is slow ...
            older_in_sink.set()
            # ... until the newer report was delivered; with sends serialised that cannot
            # happen, so this waits out the timeout and the newer report goes second
            newer_delivered.wait(1.0)
        got.append((int(str(metrics["seq"])), report.remaining))
        if report.completed == 64:
            newer_delivered.set()

    t = ProgressTracker("p", sink)
    t.begin_batch(step=1, step_target=64, weight_version=0, already_collected=62)
    older = threading.Thread(target=t.record, kwargs={"weight_version": 0})
    older.start()
    assert older_in_sink.wait(WAIT_S)
    newer = threading.Thread(target=t.record, kwargs={"weight_version": 0})
    newer.start()
    older.join(WAIT_S)
    newer.join(WAIT_S)
    assert got == [(1, 2), (2, 1), (3, 0)]
    assert got[-1][1] == 0  # what the coordinator keeps: nothing remaining


def test_end_batch_clears_after_a_report_in_flight_not_before() -> None:
    events: list[str] = []
    in_sink = threading.Event()
    cleared = threading.Event()

    def sink(report: ProgressReport) -> None:
        if report.completed == 1:
            in_sink.set()
            cleared.wait(1.0)  # returns early only if the clear overtook this report
        events.append(f"report {report.completed}")

    def on_clear() -> None:
        events.append("clear")
        cleared.set()

    t = ProgressTracker("p", sink, on_clear=on_clear)
    t.begin_batch(step=1, step_target=2, weight_version=0)
    sender = threading.Thread(target=t.record, kwargs={"weight_version": 0})
    sender.start()
    assert in_sink.wait(WAIT_S)
    ender = threading.Thread(target=t.end_batch)
    ender.start()
    sender.join(WAIT_S)
    ender.join(WAIT_S)
    assert events == ["report 0", "report 1", "clear"]


def test_a_failed_report_is_sent_again_by_the_next_record() -> None:
    got: list[int] = []
    failures = 1

    def sink(report: ProgressReport) -> None:
        nonlocal failures
        if report.remaining == 0 and failures:
            failures -= 1
            raise ConnectionError("coordinator restarting")
        got.append(report.remaining)

    t = ProgressTracker("p", sink)
    t.begin_batch(step=1, step_target=4, weight_version=0)
    t.record(4, weight_version=0)  # "0 remaining" fails to send
    assert got == [4]
    t.record(weight_version=0)  # beyond the target, same bucket: the lost report is re-sent
    assert got == [4, 0]
    assert t.record(weight_version=0) is None  # delivered now: no more repeats
    assert got == [4, 0]


def test_a_failed_new_batch_report_is_announced_by_the_next_one() -> None:
    """The coordinator must learn a batch started even when its first report failed: the
    next report carries ``new_batch`` again, once, until one is delivered."""
    delivered: list[tuple[bool, int]] = []
    failures = 1

    def sink(report: ProgressReport) -> None:
        nonlocal failures
        if failures:
            failures -= 1
            raise ConnectionError("coordinator unreachable (test)")
        delivered.append((bool((report.metrics or {})["new_batch"]), report.completed))

    t = ProgressTracker("p", sink)
    t.begin_batch(step=1, step_target=100, weight_version=0)  # lost
    t.record(10, weight_version=0)
    t.record(10, weight_version=0)
    assert delivered == [(True, 10), (False, 20)]


class _GatedSendLock:
    """The tracker's send lock; a thread named ``late`` waits for ``go`` before taking it
    (its report was built and is on its way, as behind a slow send)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.go = threading.Event()
        self.waiting = threading.Event()

    def __enter__(self) -> None:
        if threading.current_thread().name == "late":
            self.waiting.set()
            self.go.wait(WAIT_S)
        self._lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


def test_a_report_built_but_not_yet_sent_is_never_the_last_word_on_a_newer_count() -> None:
    # The count went 20 -> 16 -> 20: the report of 16 (bucket 8) was built and waited for the
    # send lock; back at 20, the tracker compared with the last DELIVERED bucket (10), built
    # nothing, and the report of 16 then went out last: demand stayed too high.
    got: list[int] = []
    t = ProgressTracker("p", lambda r: got.append(r.completed))
    gate = _GatedSendLock()
    t._send_lock = gate  # type: ignore[assignment]
    t.begin_batch(step=1, step_target=100, weight_version=0)
    t.record(20, weight_version=0)  # bucket 10, delivered
    late = threading.Thread(target=t.set_collected, args=(16,), name="late")
    late.start()
    assert gate.waiting.wait(WAIT_S)  # the report of 16 is built, not sent
    t.record(4, weight_version=0)  # back to 20
    gate.go.set()
    late.join(WAIT_S)
    assert t.collected == 20 and got[-1] == 20, got
