"""VerlPatch against the real verl 0.9.1 classes: plug points, apply/revert, drift, the gate."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from typing import Any

import pytest

from tests.fixtures.verl_env import ACTIVATION_ENV, REPO_ROOT, VerlEnv

pytestmark = pytest.mark.verl


def _stock() -> dict[str, Any]:
    import verl.trainer.constants_ppo as constants_ppo
    import verl.trainer.main_ppo as main_ppo
    import verl.trainer.ppo.v1.agent_loop_tq as agent_loop_tq
    import verl.trainer.ppo.v1.trainer_base as trainer_base
    import verl.workers.rollout.router as router
    from verl.checkpoint_engine.base import CheckpointEngineRegistry
    from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    return {
        "trainers": dict(TRAINER_REGISTRY),
        "lb": router.GlobalRequestLoadBalancer,
        "vllm": RolloutReplicaRegistry._registry["vllm"],
        "engines": dict(CheckpointEngineRegistry._registry),
        "env": main_ppo.get_ppo_ray_runtime_env,
        "env_definition": constants_ppo.get_ppo_ray_runtime_env,
        "agent": agent_loop_tq.AgentLoopWorkerTQ,
        "colocated": trainer_base.create_colocated_worker_cls,
    }


def test_plug_points_resolve_on_the_real_release(verl_env: VerlEnv) -> None:
    from rlix_plugins.patches.verl import VerlPatch

    patch = VerlPatch()
    assert patch.version_supported(patch.version()), patch.version()
    bad = [(s.point.name, s.detail) for s in patch.check_all() if not s.ok]
    assert bad == []


def test_apply_replaces_the_real_classes_and_revert_restores_them(verl_env: VerlEnv) -> None:
    from rlix_plugins.patches.verl import VerlPatch
    from rlix_plugins.patches.verl_checkpoint import BACKEND, RLixCacheCheckpointEngine
    from rlix_plugins.patches.verl_routing import RLixRequestLoadBalancer

    before = _stock()
    patch = VerlPatch()
    patch.apply()
    patch.apply()  # idempotent
    try:
        now = _stock()
        for name, cls in before["trainers"].items():
            sub = now["trainers"][name]
            assert issubclass(sub, cls) and sub is not cls and sub.__name__ == f"RLix{cls.__name__}"
        assert now["lb"] is RLixRequestLoadBalancer
        assert now["vllm"]().__name__ == "RLixvLLMReplica"
        assert now["engines"][BACKEND] is RLixCacheCheckpointEngine
        assert now["env"] is not before["env"]
        assert now["env_definition"] is not before["env_definition"]
        assert now["agent"] is not before["agent"]
        assert now["colocated"].__wrapped__ is before["colocated"]
    finally:
        patch.revert()
        patch.revert()
    assert _stock() == before


def test_drift_is_reported_before_anything_changes(
    verl_env: VerlEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    import verl.workers.rollout.router as router

    from rlix_plugins.errors import HostDriftError
    from rlix_plugins.patches.verl import VerlPatch

    before = _stock()

    def acquire_server(self: Any, session_key: str) -> None:  # a renamed parameter
        del self, session_key

    monkeypatch.setattr(router.GlobalRequestLoadBalancer, "acquire_server", acquire_server)
    patch = VerlPatch()
    with pytest.raises(HostDriftError, match=r"lb acquire .*lacks parameters \['request_id'\]"):
        patch.apply()
    assert not patch.applied and _stock() == before


def test_runtime_env_forwards_rlix_variables(
    verl_env: VerlEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rlix_plugins.patches.verl import forwarding_runtime_env

    monkeypatch.setenv("RLIX_CONTROL_PLANE", "rlix")
    monkeypatch.setenv("VERL_USE_EXTERNAL_MODULES", "rlix_plugins.autoload")
    monkeypatch.setenv("PIPELINE_ID", "ft_0123456789ab")
    monkeypatch.setenv("ROLL_RAY_NAMESPACE", "roll_ns")
    extra = {"RLIX_VERL_MIGRATION": "off", "RLIX_OBSERVE_DIR": "/tmp/observe",
             "RLIX_VLLM_SLEEP_LEVEL": "1", "RLIX_BACKGROUND_EXPANDS": "1"}
    for key, value in extra.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("RLIX_NAMESPACE", raising=False)
    import verl.trainer.main_ppo as main_ppo

    stock = main_ppo.get_ppo_ray_runtime_env(None)["env_vars"]
    env = forwarding_runtime_env(main_ppo.get_ppo_ray_runtime_env)(None)["env_vars"]
    # veRL's own filter drops variables set in the driver's shell; the wrapper adds them back.
    assert "RLIX_CONTROL_PLANE" not in stock
    assert env["RLIX_CONTROL_PLANE"] == "rlix"
    assert env["VERL_USE_EXTERNAL_MODULES"] == "rlix_plugins.autoload"
    assert env["PIPELINE_ID"] == "ft_0123456789ab"
    assert env["ROLL_RAY_NAMESPACE"] == "roll_ns"
    assert {k: env.get(k) for k in extra} == extra  # every RLIX_* variable, not a fixed list
    assert "RLIX_NAMESPACE" not in env
    assert {k: v for k, v in env.items() if k in stock} == stock


def test_gate_off_leaves_verl_untouched(verl_env: VerlEnv) -> None:
    from rlix_plugins import activation
    from rlix_plugins.settings import load_settings

    assert activation.PATCHES["verl"] == "rlix_plugins.patches.verl:factory"
    before = _stock()
    assert activation.activate(load_settings({})) is False
    assert activation.activate(load_settings({"RLIX_CONTROL_PLANE": "off"})) is False
    import verl  # noqa: F401

    assert "verl" not in activation.applied_patches()
    assert _stock() == before
    assert before["lb"].__module__ == "verl.workers.rollout.router"


SCRIPT = textwrap.dedent(
    """
    import verl
    from rlix_plugins import activation
    import verl.workers.rollout.router as router
    from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY
    print("RESULT", sorted(activation.applied_patches()), router.GlobalRequestLoadBalancer.__name__,
          sorted(c.__name__ for c in TRAINER_REGISTRY.values()))
    """
)


@pytest.mark.slow  # two fresh processes importing veRL: ~80 s here
@pytest.mark.parametrize("plane", ["rlix", None])
def test_verl_external_modules_hook_activates_only_with_the_gate(
    verl_env: VerlEnv, plane: str | None
) -> None:
    """A fresh process importing veRL with VERL_USE_EXTERNAL_MODULES=rlix_plugins.autoload."""
    env = dict(os.environ)
    env["VERL_USE_EXTERNAL_MODULES"] = "rlix_plugins.autoload"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    env.pop("RLIX_CONTROL_PLANE", None)
    if plane is not None:
        env["RLIX_CONTROL_PLANE"] = plane
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300,
        check=True,
    ).stdout
    line = next(ln for ln in out.splitlines() if ln.startswith("RESULT"))
    if plane == "rlix":
        assert "['verl'] RLixRequestLoadBalancer" in line
        assert "RLixPPOTrainerSync" in line
    else:
        assert "[] GlobalRequestLoadBalancer" in line
        assert "RLix" not in line


def test_worker_subclass_installed_in_the_role_mapping(verl_env: VerlEnv) -> None:
    """The training role of veRL's mapping becomes RLix's subclass, with its methods marked
    for veRL's worker-group binding; the critic (no rollout) is left alone."""
    import ray
    from verl.single_controller.base.decorator import MAGIC_ATTR
    from verl.trainer.ppo.utils import Role
    from verl.workers.engine_workers import ActorRolloutRefWorker, TrainingWorker

    from rlix_plugins.patches.verl_workers import install_worker_classes

    critic = ray.remote(TrainingWorker)
    mapping: dict[Any, Any] = {Role.ActorRollout: ray.remote(ActorRolloutRefWorker),
                               Role.Critic: critic}
    assert install_worker_classes(mapping) == ["ActorRollout"]
    cls = mapping[Role.ActorRollout].__ray_actor_class__
    assert issubclass(cls, ActorRolloutRefWorker) and cls.__name__ == "RLixActorRolloutRefWorker"
    for name in ("rlix_receive_weights", "rlix_serve", "rlix_release_parallel_state",
                 "rlix_restore_parallel_state", "init_model", "update_weights"):
        assert hasattr(getattr(cls, name), MAGIC_ATTR), name
    assert mapping[Role.Critic] is critic
    assert install_worker_classes(mapping) == []  # already RLix's


def test_colocated_worker_class_serves_the_cache_in_its_own_group(verl_env: VerlEnv) -> None:
    """veRL's ``WorkerDict`` class of RLix training workers declares the cache's concurrency
    group and runs the role's cache methods in it; one of stock workers is veRL's own."""
    import ray
    from verl.single_controller.ray import RayClassWithInitArgs
    from verl.single_controller.ray.base import create_colocated_worker_cls
    from verl.workers.engine_workers import ActorRolloutRefWorker

    from rlix_plugins.patches.verl_workers import (
        CACHE_GROUP_METHODS,
        colocated_worker_class,
        rlix_worker_class,
    )
    from rlix_plugins.training.cache_group import cache_group_options, runs_in_cache_group

    wrapped = colocated_worker_class(create_colocated_worker_cls)
    assert colocated_worker_class(wrapped) is wrapped  # wrapping a wrapper changes nothing
    rlix = wrapped({"actor_rollout": RayClassWithInitArgs(
        cls=ray.remote(rlix_worker_class(ActorRolloutRefWorker)))})
    groups = cache_group_options()["concurrency_groups"]
    assert rlix.cls.__ray_metadata__.concurrency_groups == groups
    worker_dict = rlix.cls.__ray_actor_class__
    for method in CACHE_GROUP_METHODS:
        assert runs_in_cache_group(getattr(worker_dict, f"actor_rollout_{method}")), method
    for method in ("actor_rollout_rlix_receive_weights", "actor_rollout_update_weights",
                   "actor_rollout_init_model"):  # training's own calls keep the default group
        assert not runs_in_cache_group(getattr(worker_dict, method)), method
    stock = wrapped({"actor_rollout": RayClassWithInitArgs(cls=ray.remote(ActorRolloutRefWorker))})
    assert stock.cls.__ray_metadata__.concurrency_groups is None


#: A job veRL's own config checks accept on this CPU box, with an engine and a checkpoint
#: backend the coordinator cannot time-share.
UNSUPPORTED_JOB = (
    "trainer.v1.trainer_mode=separate_async", "algorithm.adv_estimator=grpo",
    "actor_rollout_ref.rollout.name=sglang", "trainer.device=cpu", "trainer.n_gpus_per_node=1",
    "actor_rollout_ref.rollout.n_gpus_per_node=1", "data.train_batch_size=2",
    "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=1",
)


def test_main_ppo_as_a_module_refuses_an_unsupported_job_before_ray_starts(
    verl_env: VerlEnv, tmp_path: Any
) -> None:
    """The documented launch line, ``python -m verl.trainer.main_ppo``: veRL's driver runs as
    ``__main__`` and binds ``get_ppo_ray_runtime_env`` from ``constants_ppo``; the refusal
    coming from our wrapper shows it bound ours (before the fix it bound veRL's own there, so
    an existing Ray cluster's workers never got the RLix variables)."""
    env = {**os.environ, **ACTIVATION_ENV, "HYDRA_FULL_ERROR": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, "-m", "verl.trainer.main_ppo", *UNSUPPORTED_JOB],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "UnsupportedJobError" in out and "rlix_plugins/patches/verl.py" in out
    assert "actor_rollout_ref.rollout.name='sglang' (valid: 'vllm')" in out
    assert ("actor_rollout_ref.rollout.checkpoint_engine.backend='naive' "
            "(valid: 'rlix_cache')") in out
    assert "ray init kwargs" not in out  # veRL prints it right before ray.init

