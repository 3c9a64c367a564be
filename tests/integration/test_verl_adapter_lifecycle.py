"""The veRL adapter leaves the coordinator cleanly: at close (unregistered, GPUs free,
coordinator actor gone) and when registration fails halfway (nothing left holding GPUs).
Real Ray and the real coordinator; the shard controller is a FAKE (it is only carried to the
coordinator actor here, never driven: no veRL replicas run in these tests)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from rlix_plugins.adapters.verl import VerlLayout, VerlPipelineAdapter
from rlix_plugins.hooks.protocol import NoOpRLixHooks
from rlix_plugins.protocol.names import pipeline_coordinator_actor, pipeline_namespace
from rlix_plugins.settings import load_settings

pytestmark = pytest.mark.integration


class _Controller:
    """FAKE shard controller: records close(); shrink/expand are never called here."""

    closed = False

    def shrink(self, dp_ranks: Sequence[int]) -> None:
        raise AssertionError("not driven in these tests")

    def expand(self, dp_ranks: Sequence[int]) -> None:
        raise AssertionError("not driven in these tests")

    def close(self) -> None:
        self.closed = True


def _adapter(plane: Any, pipeline_id: str, hooks_factory: Any) -> VerlPipelineAdapter:
    settings = load_settings({"RLIX_CONTROL_PLANE": "rlix", "RLIX_NAMESPACE": plane.namespace})
    return VerlPipelineAdapter(
        settings=settings, pipeline_id=pipeline_id,
        layout=VerlLayout(train_gpus=2, tp=1, hybrid_replicas=1, standalone_replicas=1),
        controller=_Controller(),  # type: ignore[arg-type]
        hooks_factory=hooks_factory, step_target=4,
    )


def _coordinator_actor_exists(pipeline_id: str) -> bool:
    import ray

    try:
        ray.get_actor(pipeline_coordinator_actor(pipeline_id),
                      namespace=pipeline_namespace(pipeline_id))
    except ValueError:
        return False
    return True


def _registered(plane: Any, pipeline_id: str) -> bool:
    import ray

    return ray.get(plane.scheduler.get_status.remote()).pipeline(pipeline_id) is not None


def test_close_unregisters_and_stops_what_register_started(coordinator: Any) -> None:
    pid = "ft_verlclose001"
    adapter = _adapter(coordinator, pid, NoOpRLixHooks)
    adapter.register()
    assert _registered(coordinator, pid) and _coordinator_actor_exists(pid)
    adapter.close()
    assert not _registered(coordinator, pid), "a closed veRL pipeline stayed registered"
    assert not _coordinator_actor_exists(pid)
    assert adapter.controller.closed  # type: ignore[attr-defined]
    adapter.close()  # idempotent


def test_a_registration_failing_after_register_pipeline_leaves_nothing_behind(
    coordinator: Any,
) -> None:
    pid = "ft_verlfail0001"

    def hooks_factory() -> NoOpRLixHooks:
        raise RuntimeError("hooks could not be built")

    adapter = _adapter(coordinator, pid, hooks_factory)
    with pytest.raises(RuntimeError, match="hooks could not be built"):
        adapter.register()
    assert not _registered(coordinator, pid), "a half-registered pipeline kept its GPUs"
    assert not _coordinator_actor_exists(pid)
