"""NeMo RL driver-side adapter (layout, collector, checkpoint hold, attach): each test pins a defect
(it failed before the fix next to it).

* The layout ``attach_generation`` registers is read by ``NemoRlLayout.from_generation_config``
  directly; the placement plan's type checks ran only on the placement path, so the direct path
  read ``"01"`` as GPUs 0 and 1, ``True`` as GPU 1, accepted a GPU named twice and failed
  untyped on a bare number.
* The collector's progress: NeMo RL generates up to ``max_trajectory_age_steps`` ahead, so
  groups for the next version are buffered before that version begins; they were dropped (the
  tracker counts only its current version) and the new step's demand started from 0 and never
  reached 0 remaining.
* async GRPO saves its checkpoint after the refit, i.e. after ``after_training`` released the
  training GPUs and destroyed the Megatron groups: the save (model and optimizer onto the GPU,
  Megatron collectives) ran on released GPUs over destroyed groups.
* The generation is pickled into NeMo RL's collector actor; its ``weight_synchronizer`` carried
  the driver's pipeline (heartbeat locks): ``cannot pickle '_thread.lock' object``.
* No coordinator in ``RLIX_NAMESPACE``: Ray's untyped ``ValueError``.
* A policy that cannot be attached left the pipeline registered, beating and current.
* ``CoordinatorHooks.report_progress`` sent a bool as a count, strings and floats on to the
  coordinator (refused there, or truncated) and failed untyped on a non-number.

NeMo RL's trajectory collector needs Python >= 3.12 (this interpreter is 3.11) and its
``Policy`` needs GPUs, so those bases are FAKE classes; the collector subclass, the Policy
subclass, the pipeline, the hooks, the progress tracker and the layout are real, and the last
two tests run on real Ray (the last against the real coordinator service).
"""

from __future__ import annotations

import asyncio
import importlib
import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest

from rlix_plugins.adapters.nemo_rl import NemoRlLayout
from rlix_plugins.adapters.nemo_rl_progress import CollectorTracker
from rlix_plugins.errors import RegistrationError, WeightSyncError
from rlix_plugins.protocol import ProgressReport
from tests.support.nemo_rl_pipeline import PID
from tests.support.recording_hooks import FakeHooks
from tests.support.recording_policy import RecordingPolicy

# ------------------------------------------------------------------ layout config


@pytest.mark.parametrize("rlix, what", [
    ({"infer_gpus": "01"}, "infer_gpus"),            # read as GPUs 0 and 1
    ({"infer_gpus": [True, 0]}, "infer_gpus"),       # True read as GPU 1
    ({"infer_gpus": [0.7, 1]}, "infer_gpus"),        # 0.7 read as GPU 0
    ({"infer_gpus": [-1, 0], "train_gpus": [0]}, "infer_gpus"),
    ({"infer_gpus": [0, 1], "train_gpus": 0}, "train_gpus"),  # was an untyped TypeError
    ({"infer_gpus": [0, 1], "train_gpu_count": "x"}, "train_gpu_count"),  # untyped ValueError
    ({"infer_gpus": [0, 1], "train_gpu_count": True}, "train_gpu_count"),  # read as 1
])
def test_layout_read_by_attach_generation_refuses_malformed_gpu_lists(
        rlix: dict[str, Any], what: str) -> None:
    with pytest.raises(RegistrationError, match=rf"policy\.generation\.rlix\.{what}") as err:
        NemoRlLayout.from_generation_config({"rlix": rlix}, 2, 1)
    assert "valid" in str(err.value)


@pytest.mark.parametrize("infer, train, what", [
    ((0, 0), (0,), "infer_gpus"),       # two shards registered on one GPU
    ((0, 1), (0, 0), "train_gpus"),     # a training world of 2 on one GPU
])
def test_layout_refuses_a_gpu_named_twice(infer: tuple[int, ...], train: tuple[int, ...],
                                          what: str) -> None:
    with pytest.raises(RegistrationError, match=rf"{what}.*\[0\] twice.*valid: distinct"):
        NemoRlLayout(infer, train)
    with pytest.raises(RegistrationError, match="twice"):
        NemoRlLayout.from_generation_config(
            {"rlix": {"infer_gpus": list(infer), "train_gpus": list(train)}}, 2, 1)


# ------------------------------------------------------------------ collector progress


class FakeCollectorImpl:
    """FAKE NeMo RL ``AsyncTrajectoryCollector`` user class (NeMo RL's needs Python 3.12):
    only what the subclass calls. ``_enqueue_rollout_group`` returns as NeMo RL's does once
    the replay buffer accepted the group."""

    def __init__(self, policy_generation: Any = None, master_config: Any = None) -> None:
        self.policy_generation = policy_generation
        self.master_config = master_config
        self.current_weight_version = 0

    def set_weight_version(self, version: int) -> None:
        self.current_weight_version = version

    async def _enqueue_rollout_group(self, rollout_result: Any, generation_weight_version: int,
                                     target_weight_version: int, expected_prompt_groups: int,
                                     buffered_group_indices: set[int],
                                     collection_started_at: float) -> None:
        buffered_group_indices.add(len(buffered_group_indices))


@pytest.fixture
def collector_module(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    import ray

    names = ["nemo_rl", "nemo_rl.algorithms", "nemo_rl.algorithms.async_utils"]
    for name in names:
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    tc = types.ModuleType("nemo_rl.algorithms.async_utils.trajectory_collector")
    tc.AsyncTrajectoryCollector = ray.remote(FakeCollectorImpl)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, tc.__name__, tc)
    monkeypatch.setattr(sys.modules["nemo_rl.algorithms.async_utils"], "trajectory_collector",
                        tc, raising=False)
    monkeypatch.delitem(sys.modules, "rlix_plugins.adapters.nemo_rl_collector", raising=False)
    module = importlib.import_module("rlix_plugins.adapters.nemo_rl_collector")
    yield module
    # monkeypatch restores sys.modules (our module under the FAKE base is dropped)


def _demand(report: ProgressReport) -> tuple[int, int, bool]:
    m = report.metrics or {}
    return int(str(m["completed"])), int(str(m["remaining"])), bool(m["new_batch"])


def test_groups_buffered_ahead_for_a_version_count_when_it_begins(
        collector_module: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RLIX_CONTROL_PLANE", raising=False)
    collector = collector_module.RLixAsyncTrajectoryCollectorImpl(
        policy_generation=None, master_config={"grpo": {"num_prompts_per_step": 4}})
    sent: list[ProgressReport] = []
    tracker = CollectorTracker(PID, sent.append, step_target=4)  # as the adapter builds it
    collector._rlix_progress = tracker

    def enqueue(target: int) -> None:
        asyncio.run(collector._enqueue_rollout_group(None, target - 1, target, 4, set(), 0.0))

    collector.set_weight_version(1)
    assert _demand(sent[-1]) == (0, 4, True)
    for _ in range(4):
        enqueue(1)
    assert _demand(sent[-1]) == (4, 0, False)
    # While step 1 trains, NeMo RL (max_trajectory_age_steps=1) generates for version 2.
    for _ in range(3):
        enqueue(2)
    collector.set_weight_version(2)
    assert _demand(sent[-1]) == (3, 1, True)  # was (0, 4): 3 buffered groups not counted
    enqueue(2)
    assert _demand(sent[-1]) == (4, 0, False)  # was (1, 3): demand never reached 0
    # A group for an old target arriving late is not counted for the new step.
    enqueue(1)
    assert tracker.collected == 4


# ------------------------------------------------------------------ checkpoint after the refit


class FakePolicyBase(RecordingPolicy):
    """FAKE NeMo RL ``Policy`` (its module cannot import here): records the worker calls and,
    at ``save_checkpoint``, what the save would run on (Megatron's save moves model and
    optimizer to the GPU and runs collectives over the parallel-state groups)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        self.hooks: FakeHooks | None = None
        self.save_error: Exception | None = None
        self.seen_at_save: tuple[str | None, str | None] | None = None

    def prepare_for_training(self) -> None:
        self.calls.append("prepare_for_training")

    def save_checkpoint(self, weights_path: str, optimizer_path: str | None = None) -> None:
        assert self.hooks is not None
        groups = [c for c in self.calls if c.endswith("parallel_state")]
        self.seen_at_save = (self.hooks.calls[-1] if self.hooks.calls else None,
                             groups[-1] if groups else None)
        self.calls.append("save_checkpoint")
        if self.save_error is not None:
            raise self.save_error


class FakeController:
    """FAKE shard controller: the active refresh of the refit is recorded only."""

    def refresh(self, active: Any, version: int, *, step: int) -> None:
        del active, version, step


@pytest.fixture
def policy_after_refit(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Any, Any]]:
    from tests.support.nemo_rl_pipeline import fake_pipeline

    # the init refit is done; FAKE: no scheduler, generation requests recorded in the hooks
    policy, pipeline, hooks = fake_pipeline(monkeypatch, FakePolicyBase, FakeController(),
                                            cached_once=True)
    # One async-GRPO step as NeMo RL runs it: train, then the refit (our after_training).
    policy.prepare_for_training()
    pipeline.after_training()
    assert hooks.calls == ["before_training:0", "after_training:0", "request_generation"]
    assert policy.calls[-1] == "rlix_destroy_parallel_state"
    yield policy, pipeline


def test_checkpoint_saved_after_the_refit_holds_the_gpus_and_groups(
        policy_after_refit: tuple[Any, Any]) -> None:
    policy, pipeline = policy_after_refit
    policy.save_checkpoint(weights_path="w", optimizer_path="o")
    # was (after_training:0, rlix_destroy_parallel_state): the save ran on released GPUs
    # over destroyed groups
    assert policy.seen_at_save == ("before_training:1", "rlix_reinit_parallel_state")
    assert policy.hooks.calls[-3:] == ["before_training:1", "after_training:1",
                                       "request_generation"]
    assert policy.calls[-3:] == ["save_checkpoint", "offload_after_refit",
                                 "rlix_destroy_parallel_state"]
    assert not pipeline._holding_train and pipeline._nccl_destroyed


def test_a_failed_checkpoint_save_still_releases_the_gpus(
        policy_after_refit: tuple[Any, Any]) -> None:
    policy, pipeline = policy_after_refit
    policy.save_error = OSError("disk full")
    with pytest.raises(OSError, match="disk full"):
        policy.save_checkpoint(weights_path="w")
    assert policy.hooks.calls[-3:] == ["before_training:1", "after_training:1",
                                       "request_generation"]
    assert not pipeline._holding_train
    assert policy.calls[-2:] == ["offload_after_refit", "rlix_destroy_parallel_state"]


def test_checkpoint_saved_while_training_holds_the_gpus_keeps_them(
        policy_after_refit: tuple[Any, Any]) -> None:
    policy, pipeline = policy_after_refit
    policy.prepare_for_training()  # the next step holds the GPUs
    policy.save_checkpoint(weights_path="w")
    assert policy.hooks.calls[-1] == "before_training:1"  # not released by the save
    assert pipeline._holding_train


class FailingRefreshController:
    """FAKE shard controller whose active refresh fails."""

    def refresh(self, active: Any, version: int, *, step: int) -> None:
        raise WeightSyncError("shard ft/1: receiver gone")


def test_a_refit_whose_refresh_failed_still_releases_the_training_gpus(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.support.nemo_rl_pipeline import fake_pipeline

    policy, pipeline, hooks = fake_pipeline(monkeypatch, FakePolicyBase,
                                            FailingRefreshController(), cached_once=True)
    policy.prepare_for_training()
    with pytest.raises(WeightSyncError):
        pipeline.after_training()
    # cached, offloaded, groups destroyed: nothing of the pipeline is on them any more
    assert policy.calls[-1] == "rlix_destroy_parallel_state"
    assert hooks.calls == ["before_training:0", "after_training:0"]
    assert not pipeline._holding_train


class ReinitFailsPolicy(FakePolicyBase):
    def run_all_workers_single_data(self, method: str, *args: Any) -> list[Any]:
        if method == "rlix_reinit_parallel_state":
            self.calls.append(method)
            raise RuntimeError("NCCL init failed")
        return super().run_all_workers_single_data(method, *args)


def test_a_checkpoint_hold_whose_regroup_failed_releases_the_gpus(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.support.nemo_rl_pipeline import fake_pipeline

    policy, pipeline, hooks = fake_pipeline(monkeypatch, ReinitFailsPolicy, FakeController(),
                                            cached_once=True)
    pipeline._nccl_destroyed = True  # as after a step's refit
    with pytest.raises(RuntimeError, match="NCCL init failed"):
        policy.save_checkpoint(weights_path="w")
    assert hooks.calls == ["before_training:0", "after_training:0", "request_generation"]
    assert not pipeline._holding_train and "save_checkpoint" not in policy.calls


class SetupHoldHooks(FakeHooks):
    """FAKE hooks holding every GPU of the pipeline for its setup."""

    holding_for_setup = True

    def hold_for_setup(self, cluster: str = "actor_infer") -> tuple[int, ...]:
        return (0, 1)

    def release_setup_hold(self) -> None:
        self.holding_for_setup = False
        self.calls.append("release_setup_hold")


class ShrinkFailsController:
    def shrink(self, dp_ranks: Any) -> None:
        raise TimeoutError("shard 1 did not drain")


def test_a_first_refit_whose_shrink_failed_has_not_happened(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Its shards may still be awake: the setup hold stays, and a retry takes the init path
    again (it used to count as done, so the per-step path ran and the hold never ended)."""
    from tests.support.nemo_rl_pipeline import fake_pipeline

    _, pipeline, recorded = fake_pipeline(monkeypatch, RecordingPolicy,
                                          ShrinkFailsController(), cached_once=False)
    hooks = SetupHoldHooks()
    pipeline.hooks = hooks  # type: ignore[assignment]
    with pytest.raises(TimeoutError):
        pipeline.after_training()
    assert not pipeline._cached_once and hooks.holding_for_setup
    pipeline._controller = FakeShrinkingController()  # type: ignore[assignment]
    assert pipeline.after_training() == {"rlix/cached_version": 0.0}
    assert hooks.calls == ["release_setup_hold"] and not hooks.holding_for_setup
    assert recorded.calls == ["request_generation"] and pipeline._cached_once


class FakeShrinkingController:
    def shrink(self, dp_ranks: Any) -> None:
        del dp_ranks


# ------------------------------------------------------------------ the collector's copy


def test_generation_with_the_synchronizer_pickles_into_the_collector() -> None:
    """async_grpo_train passes the generation to ``AsyncTrajectoryCollector.remote`` (Ray
    pickles it with cloudpickle); its ``weight_synchronizer`` held the driver's pipeline with
    the hooks' heartbeat locks: ``TypeError: cannot pickle '_thread.lock' object``."""
    import pickle
    from types import SimpleNamespace

    from ray.cloudpickle import dumps as ray_dumps  # Ray's serializer for actor arguments

    from rlix_plugins.adapters import nemo_rl
    from rlix_plugins.hooks.coordinator_hooks import CoordinatorHooks
    from rlix_plugins.settings import load_settings

    settings = load_settings({})
    # FAKE scheduler handle (never called: no heartbeat, nothing reported)
    hooks = CoordinatorHooks(PID, settings, scheduler=object(), heartbeat=False)
    generation = SimpleNamespace(cfg={"max_new_tokens": 8})
    pipeline = nemo_rl.NemoRlPipeline(settings, generation, NemoRlLayout((0, 1), (0,)), hooks,
                                      PID)
    generation.weight_synchronizer = nemo_rl.RLixWeightSynchronizer(pipeline)

    copy = pickle.loads(ray_dumps(generation))  # type: ignore[no-untyped-call]

    assert copy.cfg == {"max_new_tokens": 8}
    synchronizer = copy.weight_synchronizer
    assert not isinstance(synchronizer, nemo_rl.RLixWeightSynchronizer)  # no pipeline copy
    synchronizer.shutdown()  # a copy going away leaves the driver's pipeline registered
    assert not pipeline._closed
    with pytest.raises(RegistrationError, match="copy"):
        synchronizer.sync_weights()


# ------------------------------------------------------------------ coordinator not found


@pytest.mark.integration
def test_no_coordinator_in_the_namespace_is_a_typed_error_naming_it(
        ray_session: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Real Ray, no coordinator in ``RLIX_NAMESPACE``: was Ray's untyped ``ValueError``
    ("Failed to look up actor ...")."""
    import os
    import uuid
    from types import SimpleNamespace

    from rlix_plugins.adapters import nemo_rl
    from rlix_plugins.errors import CoordinatorUnavailableError
    from rlix_plugins.settings import ENV_PIPELINE_ID

    namespace = f"rlix_absent_{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("RLIX_CONTROL_PLANE", "rlix")
    monkeypatch.setenv("RLIX_NAMESPACE", namespace)
    monkeypatch.delenv(ENV_PIPELINE_ID, raising=False)
    monkeypatch.setattr(nemo_rl, "_pipeline", None)
    generation = SimpleNamespace(cfg={}, dp_size=2, model_parallel_size=1)
    with pytest.raises(CoordinatorUnavailableError, match=rf"RLIX_NAMESPACE.*{namespace}|"
                                                          rf"{namespace}.*RLIX_NAMESPACE"):
        nemo_rl.attach_generation(generation)
    assert nemo_rl.current_pipeline() is None
    assert ENV_PIPELINE_ID not in os.environ
    assert not hasattr(generation, "weight_synchronizer")


# ------------------------------------------------------------------ policy attach fails


class FakePolicyWithoutWorkers:
    """FAKE policy whose workers cannot be reached: the shard controller cannot be built."""

    @property
    def worker_group(self) -> Any:
        raise RuntimeError("policy workers unreachable")


@pytest.mark.integration
def test_a_policy_that_cannot_be_attached_makes_the_pipeline_leave(
        coordinator: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Real Ray and coordinator: the policy finished first, then its attach fails inside
    attach_generation. The pipeline was left registered with its heartbeat running (and set
    as this driver's pipeline) although it can never be resized."""
    from types import SimpleNamespace

    from rlix_plugins.adapters import nemo_rl
    from rlix_plugins.settings import ENV_PIPELINE_ID

    monkeypatch.setenv("RLIX_CONTROL_PLANE", "rlix")
    monkeypatch.setenv("RLIX_NAMESPACE", coordinator.namespace)
    monkeypatch.setenv("RLIX_LEASE_S", "1.5")
    monkeypatch.setenv(ENV_PIPELINE_ID, "ft_00000000a77a")
    monkeypatch.setattr(nemo_rl, "_pipeline", None)
    monkeypatch.setattr(nemo_rl, "_pending_policy", FakePolicyWithoutWorkers())
    # FAKE router attach and shards (NeMo RL's generation needs GPUs)
    workers = SimpleNamespace(cluster=None, workers=[None, None], dp_size=2,
                              get_dp_leader_worker_idx=lambda r: r)
    generation = SimpleNamespace(cfg={}, dp_size=2, model_parallel_size=1, worker_group=workers,
                                 rlix_attach=lambda *a, **k: None, rlix_shards=lambda: [])
    registered: list[Any] = []
    real_register = nemo_rl.NemoRlPipeline.register

    def register(self: Any) -> None:
        registered.append(self)
        real_register(self)

    monkeypatch.setattr(nemo_rl.NemoRlPipeline, "register", register)
    with pytest.raises(RuntimeError, match="policy workers unreachable"):
        nemo_rl.attach_generation(generation)
    (pipeline,) = registered
    status = coordinator.status()
    assert status.pipeline("ft_00000000a77a") is None  # was still registered
    assert nemo_rl.current_pipeline() is None
    assert pipeline.hooks._heartbeat_thread is None  # stopped and joined by close()


# ------------------------------------------------------------------ hook arguments


@pytest.mark.parametrize("bad, what", [
    ({"collected": True}, "collected"),                     # was sent as 1 trajectory
    ({"step_target_trajectories": 4.0}, "step_target_trajectories"),  # refused remotely
    ({"step_target_trajectories": -1}, "step_target_trajectories"),   # refused remotely
    ({"current_train_step": "3"}, "current_train_step"),    # was sent as a string
    ({"outstanding": 2.5}, "outstanding"),                  # was sent as 2
    ({"outstanding": "x"}, "outstanding"),                  # was an untyped ValueError
])
def test_report_progress_refuses_values_it_would_misreport(bad: dict[str, Any],
                                                           what: str) -> None:
    import numpy as np

    from rlix_plugins.errors import ProtocolError
    from rlix_plugins.hooks.coordinator_hooks import CoordinatorHooks
    from rlix_plugins.settings import load_settings

    hooks = CoordinatorHooks(PID, load_settings({}), scheduler=object(), heartbeat=False)
    sent: list[ProgressReport] = []

    def fake_call(method: str, *args: Any, **kwargs: Any) -> None:
        """FAKE scheduler call (no Ray here): records the report."""
        assert method == "report_progress"
        sent.append(args[0])

    hooks._call = fake_call  # type: ignore[method-assign]
    args: dict[str, Any] = {"step_target_trajectories": 4, "collected": 1,
                            "current_train_step": 0, **bad}
    with pytest.raises(ProtocolError, match=rf"{what}=.*valid: an int"):
        hooks.report_progress(**args)
    assert sent == []
    # numpy ints are ints; the refused call throttled nothing
    numpy_ints: dict[str, Any] = {"step_target_trajectories": np.int64(4),
                                  "collected": np.int64(1), "outstanding": np.int64(3)}
    hooks.report_progress(current_train_step=0, **numpy_ints)
    (report,) = sent
    assert report.step_target_trajectories == 4 and type(report.step_target_trajectories) is int
    assert report.completed == 1 and (report.metrics or {})["outstanding"] == 3
