"""veRL adapter close, refresh, client and layout regressions (see also
tests/unit/test_verl_routing_and_checkpoint.py). Tests marked ``verl`` use the real verl 0.9.1
classes."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.fixtures.verl_env import VerlEnv


# ---------------------------------------------------------------- adapter: close
def test_adapter_close_stops_the_heartbeat_when_clearing_progress_fails() -> None:
    """A coordinator that cannot be reached when the run ends must not leave the heartbeat
    thread beating for a job that is over (it would keep the pipeline's lease alive)."""
    from rlix_plugins.adapters.verl import VerlLayout, VerlPipelineAdapter
    from rlix_plugins.errors import CoordinatorUnavailableError
    from rlix_plugins.hooks.protocol import NoOpRLixHooks
    from rlix_plugins.settings import load_settings

    class FakeHooks(NoOpRLixHooks):
        """FAKE: CoordinatorHooks needs a live coordinator; this one fails to clear progress
        (the scheduler is gone) and records whether its heartbeat was stopped."""

        closed = False

        def clear_progress(self) -> None:
            raise CoordinatorUnavailableError("scheduler unreachable calling clear_progress")

        def close(self) -> None:
            self.closed = True

    hooks = FakeHooks()
    adapter = VerlPipelineAdapter(
        settings=load_settings({"RLIX_CONTROL_PLANE": "rlix"}), pipeline_id="ft_0123456789ab",
        layout=VerlLayout(train_gpus=1, tp=1, hybrid_replicas=1, standalone_replicas=0),
        controller=None,  # type: ignore[arg-type]  # close never touches it
        hooks_factory=lambda: hooks, step_target=4,
    )
    adapter._hooks = hooks  # what register() leaves once the pipeline is admitted
    with pytest.raises(CoordinatorUnavailableError):
        adapter.close()
    assert hooks.closed, "heartbeat left running after a failed clear_progress"


# ---------------------------------------------------------------- checkpoint: refresh abort
class FakeReplica:
    """FAKE veRL ``RolloutReplica`` (real ones need vLLM servers on GPUs). Like a Ray call, an
    abort that was started keeps running on the server even when the caller stops awaiting
    it; a resume that reaches the server while its abort is still running is the bug: the
    abort's pause then lands after the resume (engine paused behind an open gate)."""

    def __init__(self, fail: bool, steps: int) -> None:
        self.fail = fail
        self.steps = steps
        self.aborting = False
        self.resumed_while_aborting = False
        self.paused = False

    async def abort_all_requests(self) -> None:
        self.aborting = True
        if self.fail:
            raise RuntimeError("server died")
        # A cancelled await ends here with ``aborting`` still set: the caller gave up, the
        # server-side abort (a Ray call) is still running.
        for _ in range(self.steps):
            await asyncio.sleep(0)
        self.paused = True
        self.aborting = False

    async def resume_generation(self) -> None:
        if self.aborting and not self.fail:
            self.resumed_while_aborting = True
        self.paused = False


@pytest.mark.verl
def test_refresh_resumes_only_after_every_abort_finished(verl_env: VerlEnv) -> None:
    """One replica's abort failing fast must not make the refresh resume another replica
    whose abort is still running (veRL's abort closes the gate, then pauses the engine: a
    resume in between leaves the engine paused with the gate open, so requests hang)."""
    from tests.support.verl_checkpoint import bare_refresh_manager

    bad, slow = FakeReplica(fail=True, steps=0), FakeReplica(fail=False, steps=20)
    mgr = bare_refresh_manager([bad, slow])
    with pytest.raises(RuntimeError, match="server died"):
        mgr._refresh(5, {})
    assert not slow.resumed_while_aborting
    assert not slow.paused and not bad.paused
    assert mgr.refreshed == [], "a refresh that failed was recorded as done"


# ---------------------------------------------------------------- routing: client arguments
@pytest.mark.verl
@pytest.mark.parametrize(("kwargs", "named"), [
    ({"max_attempts": 0}, "max_attempts"),
    ({"max_attempts": 2.5}, "max_attempts"),
    ({"max_attempts": True}, "max_attempts"),
    ({"max_attempts": "3"}, "max_attempts"),
    ({"wait_timeout_s": 0}, "wait_timeout_s"),
    ({"wait_timeout_s": float("nan")}, "wait_timeout_s"),
    ({"wait_timeout_s": "5"}, "wait_timeout_s"),
])
def test_client_bad_arguments_are_typed_errors(
    verl_env: VerlEnv, kwargs: dict[str, Any], named: str
) -> None:
    from omegaconf import OmegaConf

    from rlix_plugins.errors import SettingsError
    from rlix_plugins.patches.verl_routing import RLixLLMServerClient

    cfg = OmegaConf.create({"actor_rollout_ref": {"rollout": {"name": "vllm"}}})
    with pytest.raises(SettingsError, match=rf"{named}.*valid"):
        RLixLLMServerClient(config=cfg, load_balancer_handle=None, **kwargs)


@pytest.mark.verl
def test_client_waits_for_a_replica_as_long_as_a_generation_request_waits(
    verl_env: VerlEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In colocate_async every replica sleeps through each training step: a fixed 600 s wait
    failed every in-flight rollout of a longer step. The default is RLIX_REQUEST_TIMEOUT_S."""
    from omegaconf import OmegaConf

    from rlix_plugins.patches.verl_routing import RLixLLMServerClient

    cfg = OmegaConf.create({"actor_rollout_ref": {"rollout": {"name": "vllm"}}})
    monkeypatch.delenv("RLIX_REQUEST_TIMEOUT_S", raising=False)
    assert RLixLLMServerClient(config=cfg, load_balancer_handle=None).wait_timeout_s == 1800.0
    monkeypatch.setenv("RLIX_REQUEST_TIMEOUT_S", "3600")
    assert RLixLLMServerClient(config=cfg, load_balancer_handle=None).wait_timeout_s == 3600.0
    explicit = RLixLLMServerClient(config=cfg, load_balancer_handle=None, wait_timeout_s=5)
    assert explicit.wait_timeout_s == 5


# ---------------------------------------------------------------- agent loop: progress unit
class FakeTwoOutputAgentLoop:
    """FAKE agent loop (veRL's need a tokenizer and an LLM server): one session returns two
    outputs, as veRL's TQ worker supports (``output: list[AgentLoopOutput]``)."""

    def __init__(self, **kwargs: Any) -> None:
        del kwargs

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> Any:
        from verl.experimental.agent_loop import AgentLoopOutput
        from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics

        return [
            AgentLoopOutput(
                prompt_ids=[1, 2, 3], response_ids=[4 + i, 5], response_mask=[1, 1],
                metrics=AgentLoopMetrics(),
                extra_fields={"min_global_steps": 1, "max_global_steps": 1},
            )
            for i in range(2)
        ]


@pytest.mark.verl
@pytest.mark.integration
def test_a_multi_output_session_counts_as_one_trajectory(patched: Any, verl_ray: Any) -> None:
    """Progress counts what the trainer consumes: ``train_batch_size * rollout.n`` sessions per
    step (and the step target is in sessions too). A session whose agent loop returns several
    outputs must count once, or pending work grows every step and the coordinator sees the
    step's demand as met before it is."""
    import transfer_queue as tq

    from rlix_plugins.patches.verl_trainer import RLixTrainerMixin
    from tests.support.verl_agent_loop import agent_loop_worker

    n = 2

    class _Trainer(RLixTrainerMixin):
        pass

    with agent_loop_worker(verl_ray, loop_name="rlix_test_two",
                           loop_target=f"{__name__}.FakeTwoOutputAgentLoop",
                           n=n, data={"train_batch_size": 1}) as rig:
        trainer = _Trainer()
        trainer.config = rig.config
        prompt = {"uid": "u1", "agent_name": "rlix_test_two", "global_steps": 1}
        asyncio.run(rig.worker._run_prompt(
            prompt, {"temperature": 1.0},
            trajectory={"step": 1, "sample_index": 0, "rollout_n": 0, "validate": False},
        ))
        stored = tq.kv_list("train")["train"]
        assert sorted(k for k in stored if k != "u1") == [
            f"u1_{s}_{i}" for s in range(n) for i in range(2)
        ]
        # one sample (one prompt, n sessions) takes the whole group: nothing is left pending
        lb = rig.load_balancer
        assert verl_ray.get(lb.rlix_consume.remote(trainer._sample_trajectories())) == 0


# ---------------------------------------------------------------- adapter: layout
@pytest.mark.parametrize(("layout", "match"), [
    ((2, 2, 2, 0), "exceed the 2 trainer GPUs"),
    ((2, 1, -1, 1), r"hybrid_replicas.*int >= 0"),  # would slice train GPUs from the end
    ((2, 1, 1, -2), r"standalone_replicas.*int >= 0"),
])
def test_bad_layout_is_a_registration_error(layout: tuple[int, int, int, int],
                                            match: str) -> None:
    from rlix_plugins.adapters.verl import VerlLayout
    from rlix_plugins.errors import RegistrationError

    with pytest.raises(RegistrationError, match=match):
        VerlLayout(*layout).device_mappings()


def _no_sync(dp_ranks: Any, version: int) -> None:
    del dp_ranks, version


def _no_version() -> int | None:
    return None


def test_the_shard_controller_keeps_its_shrink_budget_when_pickled() -> None:
    """It travels to the pipeline's coordinator actor pickled; the base class's state
    dropped the subclass's budget."""
    import pickle

    from rlix_plugins.adapters.verl import make_shard_controller
    from rlix_plugins.settings import load_settings

    ctl = make_shard_controller("lb-handle", [["server0"]], _no_sync, _no_version,
                                settings=load_settings({"RLIX_RESIZE_TIMEOUT_S": "300"}))
    copy = pickle.loads(pickle.dumps(ctl))
    try:
        assert copy.shrink_budget == ctl.shrink_budget
    finally:
        copy.close()
        ctl.close()
