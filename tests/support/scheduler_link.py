"""FAKE link from a :class:`PipelineCoordinator` to the ``rlix:scheduler`` actor (no Ray): what
the coordinator forwards is recorded instead of sent (the same path runs on real Ray in
tests/integration/test_pipeline_coordinator_ordering.py)."""

from __future__ import annotations

import threading
from typing import Any

from rlix_plugins.adapters.pipeline_coordinator import PipelineCoordinator


class FakeSchedulerLinkCoordinator(PipelineCoordinator):
    """The real coordinator whose ``_call`` records ``(method, report or kwargs)`` in ``sent``.

    ``failures``: exceptions the next forwards raise, one each, in order (a failed forward is
    recorded in ``failed``, not in ``sent``: the scheduler never got it). ``delivered`` is set
    at each forward that reached the "scheduler".
    """

    def __init__(self, pipeline_id: str, **kwargs: Any) -> None:
        super().__init__(pipeline_id, lambda pid: None, **kwargs)  # type: ignore[arg-type,return-value]
        self.sent: list[tuple[str, Any]] = []
        self.failed: list[tuple[str, Any]] = []
        self.failures: list[BaseException] = []
        self.delivered = threading.Event()

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        what = args[0] if args else kwargs
        if self.failures:
            self.failed.append((method, what))
            raise self.failures.pop(0)
        self.sent.append((method, what))
        self.delivered.set()
        return None

    def scheduler_demand(self) -> int | None:
        """What the scheduler holds after the forwards it got: the last report's remaining
        trajectories, None once cleared (or before anything arrived)."""
        if not self.sent:
            return None
        method, what = self.sent[-1]
        return None if method == "clear_progress" else int(what.remaining)
