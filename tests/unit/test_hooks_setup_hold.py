"""``CoordinatorHooks.hold_for_setup`` / ``release_setup_hold``: the exact calls sent, and a
scheduler unreachable mid-call.

The scheduler is a FAKE ``_call``: it records the arguments and injects an unreachable
scheduler once. The hold against the real coordinator (taken once, given back once, other
pipelines held back) is ``tests/integration/test_nemo_rl_setup_hold.py``.
"""

from __future__ import annotations

from typing import Any

import pytest

from rlix_plugins.errors import CoordinatorUnavailableError, ProtocolError
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


def test_two_clusters_are_held_in_order_and_given_back_last_first(
    hooks: tuple[CoordinatorHooks, FakeScheduler],
) -> None:
    """A layout whose training GPUs lie outside the inference cluster (veRL without its
    hybrid engine) holds both while the host loads its models."""
    h, sched = hooks
    assert h.hold_for_setup("actor_train", "actor_infer") == (0, 1)
    assert h.hold_for_setup("actor_train", "actor_infer") == (0, 1)  # held: answered at once
    with pytest.raises(ProtocolError, match=r"_actor_train, .*_actor_infer are already held"):
        h.hold_for_setup()
    h.release_setup_hold()
    assert [(m, k["cluster_id"][len(PID) + 1:]) for m, k in sched.calls] == [
        ("request_gpus", "actor_train"), ("request_gpus", "actor_infer"),
        ("notify_release_gpus", "actor_infer"), ("notify_release_gpus", "actor_train")]
    assert not h.holding_for_setup


def test_a_second_cluster_that_cannot_be_held_gives_the_first_back(
    hooks: tuple[CoordinatorHooks, FakeScheduler],
) -> None:
    h, sched = hooks
    real = sched.__call__

    def second_fails(method: str, **kwargs: Any) -> Any:
        if kwargs.get("cluster_id", "").endswith("actor_infer") and method == "request_gpus":
            raise CoordinatorUnavailableError("scheduler unreachable")
        return real(method, **kwargs)

    h._call = second_fails  # type: ignore[method-assign]
    with pytest.raises(CoordinatorUnavailableError):
        h.hold_for_setup("actor_train", "actor_infer")
    assert [(m, k["cluster_id"][len(PID) + 1:]) for m, k in sched.calls] == [
        ("request_gpus", "actor_train"), ("notify_release_gpus", "actor_train")]
    assert not h.holding_for_setup
