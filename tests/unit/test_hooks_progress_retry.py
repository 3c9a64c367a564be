"""A progress report whose send failed is not throttled away when it is sent again."""

from __future__ import annotations

from typing import Any

import pytest

from rlix_plugins.errors import CoordinatorUnavailableError
from rlix_plugins.hooks.coordinator_hooks import CoordinatorHooks
from rlix_plugins.protocol import ProgressReport
from rlix_plugins.settings import load_settings


def test_a_failed_report_is_retried_by_the_identical_next_one() -> None:
    hooks = CoordinatorHooks("p1", load_settings({}), scheduler=object(), heartbeat=False)
    delivered: list[ProgressReport] = []
    failures = 1

    def fake_call(method: str, *args: Any, **kwargs: Any) -> None:
        """FAKE scheduler call (no Ray here): unreachable once, then delivers."""
        nonlocal failures
        assert method == "report_progress" and not kwargs
        if failures:
            failures -= 1
            raise CoordinatorUnavailableError("scheduler unreachable")
        delivered.append(args[0])

    hooks._call = fake_call  # type: ignore[method-assign]

    def report() -> None:
        hooks.report_progress(step_target_trajectories=64, collected=64, current_train_step=3)

    with pytest.raises(CoordinatorUnavailableError, match="scheduler unreachable"):
        report()
    report()  # the retry reaches the coordinator
    assert [r.completed for r in delivered] == [64]
    report()  # delivered once: identical repeats are throttled again
    assert len(delivered) == 1
