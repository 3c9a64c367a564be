"""NeMo RL driver-adapter cleanup on shutdown, the layout's input checks,
and the NCCL re-init after a failed attempt (cleanup after a failed registration is checked on
real Ray in tests/integration/test_nemo_rl_registration_cleanup.py).

No Ray runs here: these checks must hold before anything is contacted, so ``ray.get_actor`` /
``ray.kill`` are replaced by FAKE recorders; the hooks and the policy are FAKE stand-ins
carrying only what the adapter calls; the adapter, the layout and the shard controller are
real.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from rlix_plugins.adapters import nemo_rl
from rlix_plugins.adapters.nemo_rl import NemoRlLayout, NemoRlPipeline
from rlix_plugins.adapters.nemo_rl_placement_plan import (
    PlacementPlan,
)
from rlix_plugins.adapters.observability import ObservationWriter
from rlix_plugins.adapters.shard_controller import LifecycleShardController
from rlix_plugins.errors import RegistrationError
from rlix_plugins.generation import ShardLifecycle
from rlix_plugins.generation.state_store import LocalShardState, ShardStateStore
from rlix_plugins.settings import load_settings
from tests.support.recording_hooks import FakeHooks

PID = "ft_000000000042"


class FakeOrchestrator:
    """FAKE ``rlix:orchestrator`` handle: records remote calls (``.remote`` returns None)."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        def remote(*args: Any, **kwargs: Any) -> None:
            self.calls.append(name)

        return SimpleNamespace(remote=remote)


@pytest.fixture
def fake_ray(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeOrchestrator]:
    import ray

    orch = FakeOrchestrator()
    monkeypatch.setattr(ray, "get_actor", lambda name, namespace=None: orch)
    monkeypatch.setattr(ray, "get", lambda ref, **_: ref)
    monkeypatch.setattr(ray, "kill", lambda handle, no_restart=True: None)
    yield orch


def _generation(dp_size: int, plan: PlacementPlan | None = None, cfg: Any = None) -> Any:
    cluster = None if plan is None else SimpleNamespace(rlix_plan=plan)
    return SimpleNamespace(cfg=cfg or {}, dp_size=dp_size, model_parallel_size=1,
                           worker_group=SimpleNamespace(cluster=cluster))


# ------------------------------------------------------------------ shutdown


def test_shutdown_stops_the_shard_controllers_event_loop_thread(
    fake_ray: FakeOrchestrator,
) -> None:
    pipeline = NemoRlPipeline(load_settings({"RLIX_CONTROL_PLANE": "rlix"}), _generation(1),
                              NemoRlLayout((0,), (0,)), FakeHooks(), PID)  # type: ignore[arg-type]
    view = LocalShardState(ShardStateStore(1))
    ctrl = LifecycleShardController(ShardLifecycle(view, []), view, lambda r, v: None,
                                    lambda: None, observer=ObservationWriter(None, None))
    loop = ctrl._loop_thread()  # started by the controller, as its first resize does
    pipeline._controller = ctrl  # type: ignore[assignment]
    pipeline.shutdown()
    assert loop.closed


# ------------------------------------------------------------------ layout input


@pytest.mark.parametrize("tp", [0, -2])
def test_layout_refuses_a_tensor_parallel_size_below_one(tp: int) -> None:
    with pytest.raises(RegistrationError, match=rf"tp={tp} .*must be >= 1"):
        NemoRlLayout((0, 1), (0,), infer_tp=tp)


@pytest.mark.parametrize("count", [-1, 0, 3])
def test_layout_refuses_a_train_gpu_count_outside_the_inference_gpus(count: int) -> None:
    with pytest.raises(RegistrationError, match=rf"train_gpu_count={count} .*valid: 1\.\.2"):
        NemoRlLayout.from_generation_config({"rlix": {"train_gpu_count": count}}, 2, 1)


def test_layout_must_give_the_generation_one_shard_per_dp_rank(
    monkeypatch: pytest.MonkeyPatch, fake_ray: FakeOrchestrator,
) -> None:
    made: list[str] = []
    import rlix_plugins.hooks as hooks_module

    def make_hooks(settings: Any, pipeline_id: str | None = None) -> FakeHooks:
        made.append("hooks")
        return FakeHooks()

    monkeypatch.setattr(hooks_module, "make_hooks", make_hooks)
    monkeypatch.setattr(nemo_rl, "settings_if_enabled",
                        lambda: load_settings({"RLIX_CONTROL_PLANE": "rlix", "PIPELINE_ID": PID}))
    # Four inference GPUs told to the coordinator, but NeMo RL built two vLLM shards.
    gen = _generation(2, cfg={"rlix": {"infer_gpus": [0, 1, 2, 3]}})
    with pytest.raises(RegistrationError, match=r"4 shard\(s\).*2 dp rank"):
        nemo_rl.attach_generation(gen)
    assert made == [] and fake_ray.calls == []  # refused before anything was started


# ------------------------------------------------------------------ NCCL re-init


def test_a_failed_nccl_reinit_is_retried_by_the_next_before_training() -> None:
    hooks = FakeHooks()
    calls: list[str] = []

    class Policy:
        fail = True

        def run_all_workers_single_data(self, method: str, *args: Any) -> None:
            calls.append(method)
            if self.fail:
                self.fail = False
                raise RuntimeError("NCCL init failed")

    pipeline = NemoRlPipeline(load_settings({"RLIX_CONTROL_PLANE": "rlix"}), _generation(1),
                              NemoRlLayout((0,), (0,)), hooks, PID)  # type: ignore[arg-type]
    pipeline.policy = Policy()
    pipeline._nccl_destroyed = True
    with pytest.raises(RuntimeError, match="NCCL init failed"):
        pipeline.before_training()
    pipeline.before_training()  # the groups must be re-made before training uses them
    assert calls == ["rlix_reinit_parallel_state", "rlix_reinit_parallel_state"]
    assert hooks.calls == ["before_training:0"]  # the GPUs were requested once
    pipeline.before_training()
    assert len(calls) == 2  # idempotent once done
