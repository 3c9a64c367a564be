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


class _ServingController(_Controller):
    """FAKE shard controller that accepts the coordinator's resizes (nothing runs on them)."""

    def shrink(self, dp_ranks: Sequence[int]) -> None:
        del dp_ranks

    def expand(self, dp_ranks: Sequence[int]) -> None:
        del dp_ranks


def _adapter(plane: Any, pipeline_id: str, hooks_factory: Any,
             controller: _Controller | None = None) -> VerlPipelineAdapter:
    settings = load_settings({"RLIX_CONTROL_PLANE": "rlix", "RLIX_NAMESPACE": plane.namespace})
    return VerlPipelineAdapter(
        settings=settings, pipeline_id=pipeline_id,
        layout=VerlLayout(train_gpus=2, tp=1, hybrid_replicas=1, standalone_replicas=1),
        controller=controller or _Controller(),  # type: ignore[arg-type]
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

    return plane.status().pipeline(pipeline_id) is not None


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


def _demand(plane: Any, pipeline_id: str) -> int:

    status = plane.status().pipeline(pipeline_id)
    return int(status.demand)


def test_validation_is_demand_while_it_runs_and_nothing_outlives_the_last_step(
    coordinator: Any,
) -> None:
    """veRL's validation reported nothing (its replicas could be lent away mid-validation),
    and after the last step the rollouts' demand for a step nobody trains on lasted until
    ``fit`` returned. Real coordinator and CoordinatorHooks."""
    from rlix_plugins.hooks import make_hooks

    pid = "ft_verlvalid001"
    settings = load_settings(
        {"RLIX_CONTROL_PLANE": "rlix", "RLIX_NAMESPACE": coordinator.namespace}
    )
    adapter = _adapter(coordinator, pid, lambda: make_hooks(settings, pipeline_id=pid),
                       _ServingController())
    adapter.register()
    try:
        adapter.end_setup()  # veRL's init is over: the setup hold ends
        # the step's generation request carries the step's size: the scheduler's fallback
        # demand when the pipeline has no progress stream
        adapter.request_generation(1)
        adapter.report_collected(1, step=1)  # 1 of the step's 4 trajectories
        assert _demand(coordinator, pid) == 3
        adapter.begin_validation(1, 6)
        assert _demand(coordinator, pid) == 9  # its own stream, on top of the rollouts'
        adapter.end_validation(1)
        assert _demand(coordinator, pid) == 3  # the rollouts' stream untouched
        adapter.end_validation(1)  # none running: nothing sent
        assert _demand(coordinator, pid) == 3
        adapter.end_steps(1)  # the last step's end, before its release
        assert _demand(coordinator, pid) == 0
        adapter.report_collected(0, step=2)  # a report the progress thread had in flight
        assert _demand(coordinator, pid) == 0
        adapter.begin_validation(2, 5)  # the final validation still counts
        assert _demand(coordinator, pid) == 5
        adapter.end_validation(2)
        assert _demand(coordinator, pid) == 0
    finally:
        adapter.close()


@pytest.mark.parametrize("bad", [-1, 1.5, True, "3", None])
def test_bad_validation_values_are_typed_errors_before_anything_is_sent(bad: object) -> None:
    from rlix_plugins.errors import ProtocolError

    # never registered: reaching the hooks would raise AdapterNotRegisteredError instead
    adapter = _adapter(_Plane(), "ft_verlvalid002", NoOpRLixHooks)
    with pytest.raises(ProtocolError, match=r"validation target=.* valid: an int >= 0"):
        adapter.begin_validation(1, bad)
    with pytest.raises(ProtocolError, match=r"validation step=.* valid: an int >= 0"):
        adapter.begin_validation(bad, 4)
    with pytest.raises(ProtocolError, match="validation step="):
        adapter.end_validation(bad)
    with pytest.raises(ProtocolError, match="last step="):
        adapter.end_steps(bad)


class _Plane:
    """What ``_adapter`` reads of a control plane, for tests that never reach it."""

    namespace = "rlix-never-used"
