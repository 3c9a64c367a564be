"""Progress accounting: 2% buckets, 0 remaining, new batch, replay-buffer validity."""

from __future__ import annotations

import pytest

from rlix_plugins.hooks.protocol import NoOpRLixHooks
from rlix_plugins.protocol import ProgressReport, coerce_progress_report
from rlix_plugins.training.progress import (
    ProgressTracker,
    VersionRecord,
    hooks_sink,
    is_valid,
    valid_count,
)


def _tracker(max_age_steps: int = 0) -> tuple[ProgressTracker, list[ProgressReport], list[str]]:
    reports: list[ProgressReport] = []
    cleared: list[str] = []
    t = ProgressTracker(
        "ft_0123456789ab",
        reports.append,
        on_clear=lambda: cleared.append("x"),
        clock=lambda: 100.0,
        max_age_steps=max_age_steps,
    )
    return t, reports, cleared


def test_reports_once_per_two_percent_bucket_and_at_zero_remaining() -> None:
    t, reports, _ = _tracker()
    t.begin_batch(step=3, step_target=200, weight_version=3)
    assert len(reports) == 1 and reports[0].metrics is not None
    assert reports[0].metrics["new_batch"] is True and reports[0].completed == 0
    for _ in range(200):
        t.record(weight_version=3)
    # 200 trajectories, one bucket per 4 trajectories: buckets 1..50 each reported once
    buckets = [r.metrics["bucket"] for r in reports[1:] if r.metrics]
    assert buckets == list(range(1, 51))
    last = reports[-1]
    assert last.remaining == 0 and last.completed == 200 and last.fifo_timestamp == 100.0
    t.record(weight_version=3)  # beyond the target: capped, nothing new to report
    assert len(reports) == 51
    seqs = [r.metrics["seq"] for r in reports if r.metrics]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)


def test_small_target_reports_every_bucket_crossed_and_wire_type_round_trips() -> None:
    t, reports, _ = _tracker()
    t.begin_batch(step=1, step_target=3, weight_version=1)
    t.record(2, weight_version=1)
    t.record(weight_version=1)
    assert [r.completed for r in reports] == [0, 2, 3]
    assert coerce_progress_report(reports[-1]).remaining == 0


def test_only_trajectories_valid_for_the_current_version_count() -> None:
    t, reports, _ = _tracker(max_age_steps=1)
    t.begin_batch(step=5, step_target=10, weight_version=5)
    assert t.record(weight_version=3) is None  # too old (window is 4..5)
    assert t.record(weight_version=6) is None  # from the future: not for this step
    t.record(weight_version=4)
    t.record(weight_version=5)
    assert t.collected == 2 and reports[-1].completed == 2


def test_new_batch_always_reports_and_end_batch_clears() -> None:
    t, reports, cleared = _tracker()
    t.begin_batch(step=1, step_target=4, weight_version=1)
    t.record(4, weight_version=1)
    t.end_batch()
    assert cleared == ["x"] and not t.active
    assert t.record(weight_version=1) is None  # between batches nothing is counted
    t.begin_batch(step=2, step_target=4, weight_version=2, already_collected=1)
    assert reports[-1].metrics is not None and reports[-1].metrics["new_batch"] is True
    assert reports[-1].completed == 1 and reports[-1].metrics["current_train_step"] == 2
    t.set_collected(4)
    assert reports[-1].remaining == 0


def test_a_failing_sink_does_not_break_collection() -> None:
    def bad(_: ProgressReport) -> None:
        raise RuntimeError("coordinator down")

    t = ProgressTracker("p", bad)
    t.begin_batch(step=1, step_target=2, weight_version=1)
    t.record(weight_version=1)
    assert t.collected == 1


def test_valid_count_follows_the_replay_buffer_age_window() -> None:
    versions = [0, 1, 2, 3, 3, 4, 5]
    assert valid_count(versions, 4, 1) == 3  # 3, 3, 4
    assert valid_count(versions, 4, 0) == 1
    assert valid_count(versions, 1, 5) == 2  # min valid clamps at 0: 0 and 1
    recs = [VersionRecord(3, 4), VersionRecord(4, 4), VersionRecord(4, 5), VersionRecord(2, 4)]
    assert valid_count(recs, 4, 1) == 3
    assert valid_count(recs, 4, 1, intended_only=True) == 2
    assert is_valid(0, 0, 0) and not is_valid(1, 0, 3)
    with pytest.raises(ValueError):
        valid_count([1], 1, -1)


def test_hooks_sink_forwards_to_the_hook_protocol() -> None:
    calls: list[dict[str, object]] = []

    class RecordingHooks(NoOpRLixHooks):
        def report_progress(self, **kw: object) -> None:  # type: ignore[override,unused-ignore]
            calls.append(kw)

    t = ProgressTracker("p", hooks_sink(RecordingHooks()), adapter_id="lora1", mode="train")
    t.begin_batch(step=7, step_target=10, weight_version=7)
    t.record(10, weight_version=7)
    assert calls[0] == {
        "step_target_trajectories": 10,
        "collected": 0,
        "current_train_step": 7,
        "new_batch": True,
        "mode": "train",
        "adapter_id": "lora1",
    }
    assert calls[-1]["collected"] == 10 and calls[-1]["new_batch"] is False


def test_outstanding_rides_from_the_tracker_through_hooks_sink_to_the_report() -> None:
    """ProgressTracker -> outstanding_sink -> hooks_sink -> CoordinatorHooks: the report the
    scheduler receives carries the ``outstanding`` metric read at report time."""
    from rlix_plugins.hooks.coordinator_hooks import CoordinatorHooks
    from rlix_plugins.protocol import OUTSTANDING_METRIC
    from rlix_plugins.settings import load_settings
    from rlix_plugins.training.progress import outstanding_sink

    sent: list[ProgressReport] = []
    hooks = CoordinatorHooks("ft_a", load_settings({}), heartbeat=False)
    hooks._call = lambda method, report: sent.append(report)  # type: ignore[method-assign]
    count = iter([40, 30])
    t = ProgressTracker("ft_a", outstanding_sink(hooks_sink(hooks), lambda: next(count)))
    t.begin_batch(step=1, step_target=10, weight_version=1)
    t.record(5, weight_version=1)
    got = [(r.completed, (r.metrics or {})[OUTSTANDING_METRIC]) for r in sent]
    assert got == [(0, 40), (5, 30)]


def test_a_failing_outstanding_reader_drops_only_the_metric() -> None:
    from rlix_plugins.protocol import OUTSTANDING_METRIC
    from rlix_plugins.training.progress import outstanding_sink, with_outstanding

    got: list[ProgressReport] = []

    def broken() -> int:
        raise RuntimeError("router gone")

    t = ProgressTracker("p", outstanding_sink(got.append, broken))
    t.begin_batch(step=0, step_target=4, weight_version=0)
    assert len(got) == 1 and OUTSTANDING_METRIC not in (got[0].metrics or {})
    t2 = ProgressTracker("p", outstanding_sink(got.append, lambda: -1))  # invalid count
    t2.begin_batch(step=0, step_target=4, weight_version=0)
    assert len(got) == 2 and OUTSTANDING_METRIC not in (got[1].metrics or {})
    with pytest.raises(ValueError, match="outstanding must be >= 0"):
        with_outstanding(got[0], -1)
    assert with_outstanding(got[0], None) is got[0]


def test_hooks_without_the_outstanding_keyword_still_work() -> None:
    """Hooks written against the four-method protocol before ``outstanding`` existed get no
    such keyword from hooks_sink when the report does not carry it."""
    calls: list[int] = []

    class OldHooks(NoOpRLixHooks):
        def report_progress(  # type: ignore[override]
            self, *, step_target_trajectories: int, collected: int, current_train_step: int,
            new_batch: bool = False, mode: str = "train", adapter_id: str | None = None,
        ) -> None:
            calls.append(collected)

    t = ProgressTracker("p", hooks_sink(OldHooks()))
    t.begin_batch(step=0, step_target=4, weight_version=0)
    t.record(4, weight_version=0)
    assert calls == [0, 4]
