"""NeMo RL driver-side adapter (last step, heartbeat, resume, async save): each test pins a defect
(it failed before the fix next to it).

* The run's final step: after its refit NeMo RL sets weight version ``max_num_steps``, which
  no step trains, and its collector goes on generating until it is killed. The collector's
  tracker started a batch for that version, so the coordinator kept the pipeline's demand
  (and its GPUs) until the pipeline unregistered; ``clear_progress`` was never called.
* The heartbeat thread started when the hooks were made, before ``register_pipeline``: its
  first beat was refused (``UnknownPipelineError``, a warning logged).
* A resumed run (``grpo_save_state.current_step`` > 0) counted its steps from 0: GPU requests
  and releases carried step 0.. while NeMo RL's weight version (and the collector's reports)
  carried the resumed step, and the first cache was version 0 instead of the resumed version.
* An async checkpoint's finalisation: the save's GPU hold now finalises it explicitly before
  offloading and releasing (see :meth:`NemoRlPipeline.release_training` for why).

NeMo RL's collector needs Python >= 3.12 and its ``Policy`` needs GPUs: those bases are the
FAKE classes of ``test_nemo_rl_adapter_collector_and_checkpoint`` (imported, not copied). The
collector subclass, the tracker, the sink, the pipeline, the Policy subclass, the hooks and the
patch's ``async_grpo_train`` wrapper are real; the heartbeat test runs against the real
coordinator.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from rlix_plugins.adapters import nemo_rl, nemo_rl_progress
from rlix_plugins.errors import RegistrationError
from tests.support.fake_scheduler_handle import FakeSchedulerHandle
from tests.support.nemo_rl_pipeline import fake_pipeline
from tests.support.recording_hooks import FakeHooks
from tests.unit.test_nemo_rl_adapter_collector_and_checkpoint import (  # noqa: F401  (fixture)
    PID,
    FakeController,
    FakePolicyBase,
    collector_module,
)

# ------------------------------------------------------------------ 1. the final step's demand


@pytest.fixture
def collector(collector_module: Any,  # noqa: F811  (the imported fixture)
              monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Any, FakeSchedulerHandle]]:
    """The real collector subclass over the FAKE NeMo RL base, its tracker made by the real
    ``progress_tracker_for_collector`` for a 3-step run of 4 prompt groups per step."""
    import ray

    sched = FakeSchedulerHandle()
    monkeypatch.setenv("RLIX_CONTROL_PLANE", "rlix")
    monkeypatch.setenv("PIPELINE_ID", PID)
    monkeypatch.setattr(ray, "get_actor", lambda name, namespace=None: sched)
    instance = collector_module.RLixAsyncTrajectoryCollectorImpl(
        policy_generation=None,
        master_config={"grpo": {"num_prompts_per_step": 4, "max_num_steps": 3}})
    assert instance._rlix_progress is not None
    yield instance, sched


def _enqueue(collector: Any, target: int, n: int = 1) -> None:
    for _ in range(n):
        asyncio.run(collector._enqueue_rollout_group(None, target - 1, target, 4, set(), 0.0))


def test_demand_is_cleared_once_the_run_sets_a_version_it_never_trains(
        collector: tuple[Any, FakeSchedulerHandle]) -> None:
    c, sched = collector
    # Steps 0, 1, 2 as NeMo RL runs them (max_trajectory_age_steps=1: one step ahead).
    c.set_weight_version(0)
    _enqueue(c, 0, 4)
    _enqueue(c, 1, 4)
    assert sched.demand() == 0
    c.set_weight_version(1)  # the normal per-step flow: a new batch, nothing cleared
    assert sched.demand() == 0 and ("clear", PID) not in sched.sent
    _enqueue(c, 2, 3)
    c.set_weight_version(2)  # the final step's batch (3 of 4 groups buffered ahead)
    assert sched.demand() == 1 and ("clear", PID) not in sched.sent
    _enqueue(c, 2)
    _enqueue(c, 3, 2)  # NeMo RL's collector generates for a version no step trains
    assert sched.demand() == 0
    c.set_weight_version(3)  # the final step's refit: version max_num_steps
    assert sched.sent[-1] == ("clear", PID)  # was a new batch: demand 4 - 2 = 2 kept
    assert sched.demand() is None
    sent = len(sched.sent)
    _enqueue(c, 4, 4)  # the collector runs on until NeMo RL kills it: nothing more reported
    assert len(sched.sent) == sent


def test_a_resumed_run_past_its_last_step_reports_no_demand(
        collector: tuple[Any, FakeSchedulerHandle]) -> None:
    c, sched = collector
    c.set_weight_version(3)  # resumed at step 3 of 3: NeMo RL's loop runs no step
    assert sched.sent == [("clear", PID)]


def test_a_failing_clear_never_fails_the_drivers_set_weight_version(
        collector: tuple[Any, FakeSchedulerHandle], caplog: pytest.LogCaptureFixture) -> None:
    """NeMo RL's driver waits on ``set_weight_version``: a coordinator that cannot be told
    must not stop the run."""
    c, sched = collector
    c.set_weight_version(2)
    sched.clear_error = RuntimeError("scheduler gone")
    with caplog.at_level(logging.ERROR, logger="rlix_plugins.adapters.nemo_rl_collector"):
        c.set_weight_version(3)
    assert c.current_weight_version == 3
    assert "progress for weight version 3 failed" in caplog.text


@pytest.mark.parametrize("raw", ["3", 2.5, True, -1])
def test_a_malformed_max_num_steps_is_logged_and_never_clears(
        raw: object, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="rlix_plugins.adapters.nemo_rl_progress"):
        assert nemo_rl_progress.max_num_steps({"grpo": {"max_num_steps": raw}}) is None
    assert "grpo.max_num_steps" in caplog.text
    assert nemo_rl_progress.max_num_steps({"grpo": {}}) is None
    config = SimpleNamespace(grpo=SimpleNamespace(max_num_steps=7))
    assert nemo_rl_progress.max_num_steps(config) == 7


# ------------------------------------------------------------------ 2. heartbeat after registration


@pytest.mark.integration
def test_the_first_heartbeat_comes_after_the_registration(
        coordinator: Any, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """Real Ray and coordinator; the generation's router attach and shards are FAKE (NeMo RL's
    generation needs GPUs). The hooks' heartbeat thread was running before
    ``register_pipeline``: its first beat was refused and logged as a warning."""
    from rlix_plugins.settings import ENV_PIPELINE_ID

    monkeypatch.setenv("RLIX_CONTROL_PLANE", "rlix")
    monkeypatch.setenv("RLIX_NAMESPACE", coordinator.namespace)
    monkeypatch.setenv("RLIX_LEASE_S", "3")
    monkeypatch.setenv(ENV_PIPELINE_ID, "ft_00000000b3a7")
    monkeypatch.setattr(nemo_rl, "_pipeline", None)
    monkeypatch.setattr(nemo_rl, "_pending_policy", None)
    generation = SimpleNamespace(cfg={}, dp_size=2, model_parallel_size=1,
                                 worker_group=SimpleNamespace(cluster=None),
                                 rlix_attach=lambda *a, **k: None, rlix_shards=lambda: [])
    beating_at_registration: list[bool] = []
    real_check = nemo_rl.NemoRlPipeline.check_placement

    def check_placement(self: Any) -> None:  # the first thing _register does
        beating_at_registration.append(self.hooks._heartbeat_thread is not None)
        real_check(self)

    monkeypatch.setattr(nemo_rl.NemoRlPipeline, "check_placement", check_placement)
    with caplog.at_level(logging.WARNING, logger="rlix_plugins.hooks.coordinator_hooks"):
        nemo_rl.attach_generation(generation)
        pipeline = nemo_rl.current_pipeline()
        assert pipeline is not None
        try:
            assert beating_at_registration == [False]  # was [True]
            thread = pipeline.hooks._heartbeat_thread  # type: ignore[attr-defined]
            assert thread is not None and thread.is_alive()  # started once registered
            time.sleep(2.2)  # two beat intervals (lease 3 s / 3; 1.5 s expired on a busy box)
        finally:
            generation.weight_synchronizer.shutdown()
    assert "heartbeat failed" not in caplog.text, caplog.text


# ------------------------------------------------------------------ 3. resumed run


class FakeVersionPolicy(FakePolicyBase):
    """The review-2 FAKE ``Policy`` that also records each worker call's arguments."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.worker_calls: list[tuple[str, tuple[Any, ...]]] = []

    def run_all_workers_single_data(self, method: str, *args: Any) -> list[Any]:
        self.worker_calls.append((method, args))
        return super().run_all_workers_single_data(method, *args)


class FakeInitController(FakeController):
    """FAKE shard controller: the init refit's sleep of every shard is recorded only."""

    def shrink(self, dp_ranks: Any) -> None:
        del dp_ranks


@pytest.fixture
def fresh_pipeline(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Any, Any, FakeHooks]]:
    """A registered-looking pipeline before NeMo RL's first refit (FAKE policy and shards)."""
    policy, pipeline, hooks = fake_pipeline(monkeypatch, FakeVersionPolicy,
                                            FakeInitController(), cached_once=False,
                                            request_with_step=True)
    yield policy, pipeline, hooks


def _caches(policy: Any) -> list[int]:
    return [args[0] for method, args in policy.worker_calls if method == "rlix_build_cache"]


def fake_async_grpo_train(policy: Any, policy_generation: Any, dataloader: Any,
                          val_dataloader: Any, tokenizer: Any, loss_fn: Any, task_to_env: Any,
                          val_task_to_env: Any, logger: Any, checkpointer: Any,
                          grpo_save_state: Any, master_config: Any,
                          max_trajectory_age_steps: int = 1, teacher_worker_groups: Any = None,
                          alias_to_group_alias: Any = None, processor: Any = None) -> None:
    """FAKE NeMo RL ``async_grpo_train`` (``grpo`` needs Python 3.12): its signature at
    7ea279abf, and one step of its loop as it drives the pipeline (init refit, one train
    step, its refit)."""
    policy_generation.weight_synchronizer.sync_weights()  # refit_policy_generation at start
    policy.prepare_for_training()
    policy_generation.weight_synchronizer.sync_weights()


def test_a_resumed_run_counts_from_the_resumed_step(
        fresh_pipeline: tuple[Any, Any, FakeHooks]) -> None:
    from rlix_plugins.patches.nemo_rl import wrap_async_grpo_train

    policy, pipeline, hooks = fresh_pipeline
    generation = SimpleNamespace(weight_synchronizer=nemo_rl.RLixWeightSynchronizer(pipeline))
    # Through the patch's wrapper, as examples/run_grpo.py calls it (keywords; NeMo RL
    # resumed at step 5, its weight version 5).
    wrap_async_grpo_train(fake_async_grpo_train)(
        policy=policy, policy_generation=generation, dataloader=None, val_dataloader=None,
        tokenizer=None, loss_fn=None, task_to_env={}, val_task_to_env=None, logger=None,
        checkpointer=None, grpo_save_state=SimpleNamespace(current_step=5), master_config={})
    # was [0, 1] and step 0: the GPU requests and releases of NeMo RL's step 5 said step 0
    assert _caches(policy) == [5, 6]
    assert hooks.calls == ["request_generation:5", "before_training:5", "after_training:5",
                           "request_generation:6"]
    assert pipeline.step == 6


def test_a_fresh_run_still_starts_at_zero_and_the_state_may_be_positional(
        fresh_pipeline: tuple[Any, Any, FakeHooks]) -> None:
    from rlix_plugins.patches.nemo_rl import wrap_async_grpo_train

    policy, pipeline, _ = fresh_pipeline
    generation = SimpleNamespace(weight_synchronizer=nemo_rl.RLixWeightSynchronizer(pipeline))
    wrap_async_grpo_train(fake_async_grpo_train)(
        policy, generation, None, None, None, None, {}, None, None, None,
        {"current_step": 0}, {})
    assert _caches(policy) == [0, 1] and pipeline.step == 1


@pytest.mark.parametrize("bad", ["5", 5.0, True, -1, None])
def test_a_malformed_start_step_is_refused_and_changes_nothing(
        fresh_pipeline: tuple[Any, Any, FakeHooks], bad: object) -> None:
    _, pipeline, _ = fresh_pipeline
    with pytest.raises(RegistrationError, match=r"start step .* valid: an int >= 0"):
        nemo_rl.start_run(SimpleNamespace(current_step=bad))
    assert pipeline.step == 0


def test_a_start_step_after_the_first_refit_is_refused(
        fresh_pipeline: tuple[Any, Any, FakeHooks]) -> None:
    policy, pipeline, _ = fresh_pipeline
    pipeline.after_training()  # the init refit cached version 0
    with pytest.raises(RegistrationError, match="after the run started"):
        pipeline.start_at(5)
    assert pipeline.step == 0 and _caches(policy) == [0]


def test_no_pipeline_no_start_step(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nemo_rl, "_pipeline", None)
    nemo_rl.start_run(SimpleNamespace(current_step="ignored: standalone job"))


# ------------------------------------------------------------------ 4. async checkpoint


class FakeAsyncSavePolicy(FakePolicyBase):
    """The review-2 FAKE ``Policy`` with Megatron's ``async_save``: the save returns with the
    write still pending; ``finalize_async_save`` completes it (a collective on the GPUs)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pending = False

    def save_checkpoint(self, weights_path: str, optimizer_path: str | None = None) -> None:
        super().save_checkpoint(weights_path, optimizer_path)
        self.pending = True

    def finalize_async_save(self) -> None:
        assert self.hooks is not None
        # what holds the GPUs while the write is finalised
        self.calls.append(f"finalize_async_save(pending={self.pending}, "
                          f"{self.hooks.calls[-1]})")
        self.pending = False


def test_an_async_save_is_finalised_before_the_gpus_are_released(
        monkeypatch: pytest.MonkeyPatch) -> None:
    policy, pipeline, hooks = fake_pipeline(monkeypatch, FakeAsyncSavePolicy, FakeController(),
                                            cached_once=True)
    policy.prepare_for_training()
    pipeline.after_training()  # the refit released the GPUs

    policy.save_checkpoint(weights_path="w", optimizer_path="o")

    # was: nothing finalised before the release (NeMo RL finalises at its next save / exit)
    assert not policy.pending
    assert policy.calls[-4:] == ["save_checkpoint",
                                 "finalize_async_save(pending=True, before_training:1)",
                                 "offload_after_refit", "rlix_destroy_parallel_state"]
    assert hooks.calls[-2:] == ["after_training:1", "request_generation"]
