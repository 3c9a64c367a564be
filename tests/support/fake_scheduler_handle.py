"""FAKE ``rlix:scheduler`` actor handle for progress sinks (no Ray): ``report_progress.remote``
and ``clear_progress.remote`` are recorded in order, as the coordinator would receive them."""

from __future__ import annotations

from typing import Any

from rlix_plugins.protocol import ProgressReport


class FakeSchedulerHandle:
    """Records what a sink sends (``sent``: ``("report", report)`` / ``("clear", pid)``);
    ``clear_progress`` raises ``clear_error`` when it is set."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, Any]] = []
        self.clear_error: Exception | None = None
        outer = self

        class _Report:
            def remote(self, report: ProgressReport) -> None:
                outer.sent.append(("report", report))

        class _Clear:
            def remote(self, *, pipeline_id: str) -> None:
                if outer.clear_error is not None:
                    raise outer.clear_error
                outer.sent.append(("clear", pipeline_id))

        self.report_progress = _Report()
        self.clear_progress = _Clear()

    @property
    def reports(self) -> list[ProgressReport]:
        """The progress reports received, in order."""
        return [what for kind, what in self.sent if kind == "report"]

    def demand(self) -> int | None:
        """What the coordinator keeps after these messages: the last report's remaining
        trajectories, None once cleared (``SchedulerState.clear_progress``)."""
        kind, last = self.sent[-1]
        return None if kind == "clear" else int(str((last.metrics or {})["remaining"]))
