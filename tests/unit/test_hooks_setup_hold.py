"""``CoordinatorHooks.hold_for_setup`` / ``release_setup_hold``: the exact calls sent, and a
scheduler unreachable mid-call.

The scheduler is a FAKE ``_call``: it records the arguments and injects an unreachable
scheduler once. The hold against the real coordinator (taken once, given back once, other
pipelines held back) is ``tests/integration/test_nemo_rl_setup_hold.py``.
"""

from __future__ import annotations

from typing import Any

import pytest

from rlix_plugins.errors import CoordinatorUnavailableError
from rlix_plugins.hooks.coordinator_hooks import CoordinatorHooks
from rlix_plugins.protocol.types import Priority
from rlix_plugins.settings import load_settings

PID = "ft_000000000051"


class FakeScheduler:
    """FAKE scheduler calls: records them; ``fail`` makes the next one unreachable."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.fail = False

    def __call__(self, method: str, *args: Any, **kwargs: Any) -> Any:
        assert not args
        if self.fail:
            self.fail = False
            raise CoordinatorUnavailableError("scheduler unreachable")
        self.calls.append((method, kwargs))
        return [0, 1] if method == "request_gpus" else None


@pytest.fixture
def hooks() -> tuple[CoordinatorHooks, FakeScheduler]:
    h = CoordinatorHooks(PID, load_settings({}), scheduler=object(), heartbeat=False)
    sched = FakeScheduler()
    h._call = sched  # type: ignore[method-assign]
    return h, sched


def test_the_hold_requests_the_inference_cluster_at_initialization(
    hooks: tuple[CoordinatorHooks, FakeScheduler],
) -> None:
    h, sched = hooks
    assert h.hold_for_setup() == (0, 1)
    assert sched.calls == [("request_gpus", {
        "cluster_id": f"{PID}_actor_infer", "priority": Priority.INITIALIZATION,
        "global_step": None, "pipeline_id": PID})]
    h.release_setup_hold()
    assert sched.calls[-1] == ("notify_release_gpus", {
        "cluster_id": f"{PID}_actor_infer", "global_step": None, "pipeline_id": PID})


def test_a_failed_call_changes_nothing_and_can_be_retried(
    hooks: tuple[CoordinatorHooks, FakeScheduler],
) -> None:
    h, sched = hooks
    sched.fail = True
    with pytest.raises(CoordinatorUnavailableError):
        h.hold_for_setup()
    assert not h.holding_for_setup
    h.hold_for_setup()
    sched.fail = True
    with pytest.raises(CoordinatorUnavailableError):
        h.release_setup_hold()
    assert h.holding_for_setup  # still held: the release is sent again by the retry
    h.release_setup_hold()
    assert [m for m, _ in sched.calls] == ["request_gpus", "notify_release_gpus"]
    assert not h.holding_for_setup
