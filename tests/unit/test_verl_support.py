"""Which veRL jobs the coordinator takes: the check the driver (``get_ppo_ray_runtime_env``,
before ``ray.init``) and the RLix trainer (before any worker) run under the gate. The rules on
plain dicts always run; on veRL's real ``ppo_trainer.yaml`` (Hydra) in the veRL venv. The
refusal of ``python -m verl.trainer.main_ppo`` itself: ``tests/unit/test_verl_patch.py``."""

from __future__ import annotations

from typing import Any

import pytest

from rlix_plugins.adapters.job_support import UNSET
from rlix_plugins.adapters.verl_support import (
    CACHE_BACKEND,
    CHECKED_KEYS,
    check_supported_job,
    unsupported_settings,
)
from rlix_plugins.errors import UnsupportedJobError

BACKEND_KEY = "actor_rollout_ref.rollout.checkpoint_engine.backend"


ROUTER_KEY = "actor_rollout_ref.rollout.router_config_path"
DETERMINISM_KEY = "actor_rollout_ref.rollout.full_determinism"


def _job(name: object = "vllm", backend: object = CACHE_BACKEND,
         use_v1: object = True, **rollout: object) -> dict[str, Any]:
    return {"trainer": {"use_v1": use_v1},
            "actor_rollout_ref": {"rollout": {"name": name,
                                              "checkpoint_engine": {"backend": backend},
                                              **rollout}}}


def test_a_v1_vllm_job_on_the_cache_backend_is_supported() -> None:
    assert unsupported_settings(_job()) == ()
    assert unsupported_settings(_job(router_config_path=None)) == ()
    assert unsupported_settings(_job(full_determinism=False)) == ()
    check_supported_job(_job())


@pytest.mark.parametrize(("key", "job"), [
    ("trainer.use_v1", _job(use_v1=False)),
    ("actor_rollout_ref.rollout.name", _job(name="sglang")),
    (BACKEND_KEY, _job(backend="naive")),
    (BACKEND_KEY, _job(backend="nccl")),
    # veRL would build its router plugin instead of the balancer RLix's subclasses, and the
    # job failed only after loading every model (Ray's AttributeError in build_adapter)
    (ROUTER_KEY, _job(router_config_path="/etc/my_router.yaml")),
    # the RLix balancer routed among the awake replicas only: the flag was silently not kept
    (DETERMINISM_KEY, _job(full_determinism=True)),
])
def test_each_unsupported_setting_is_named_with_what_is_valid(key: str, job: Any) -> None:
    (problem,) = unsupported_settings(job)
    assert problem.key == key
    with pytest.raises(UnsupportedJobError) as info:
        check_supported_job(job)
    assert f"{key}={problem.found!r} (valid: {problem.valid})" in str(info.value)
    assert "veRL job" in str(info.value) and info.value.problems == (problem,)


def test_the_error_survives_pickling_with_its_problems() -> None:
    # The trainer's check raises inside veRL's TaskRunner actor; Ray pickles the error back.
    import pickle

    with pytest.raises(UnsupportedJobError) as info:
        check_supported_job(_job(backend="naive"))
    again = pickle.loads(pickle.dumps(info.value))
    assert type(again) is UnsupportedJobError and str(again) == str(info.value)
    assert again.problems == info.value.problems


def test_the_trainers_own_check_skips_use_v1() -> None:
    # A v1 trainer is running; a driver of the job's own may not have set the flag.
    assert unsupported_settings(_job(use_v1=False), driver=False) == ()
    assert [p.key for p in unsupported_settings(_job(backend="naive"), driver=False)] == [
        BACKEND_KEY]


@pytest.mark.parametrize(("strategy", "section"), [
    ("megatron", "actor_rollout_ref.actor.megatron"),
    ("fsdp", "actor_rollout_ref.actor.fsdp_config"),
    ("fsdp2", "actor_rollout_ref.actor.fsdp_config"),
])
def test_the_actors_engine_must_offload_between_steps(strategy: str, section: str) -> None:
    job = _job()
    job["actor_rollout_ref"]["actor"] = {"strategy": strategy, section.rsplit(".", 1)[1]: {
        "param_offload": True, "optimizer_offload": False}}
    (problem,) = unsupported_settings(job)
    assert (problem.key, problem.found) == (f"{section}.optimizer_offload", False)
    assert "lent between steps" in problem.why
    job["actor_rollout_ref"]["actor"][section.rsplit(".", 1)[1]]["optimizer_offload"] = True
    assert unsupported_settings(job) == ()


def test_absent_settings_are_named_unset() -> None:
    problems = unsupported_settings({})
    # unset is what the router and determinism rules ask for
    assert [p.key for p in problems] == [k for k in CHECKED_KEYS
                                         if k not in (ROUTER_KEY, DETERMINISM_KEY)]
    assert all(p.found is UNSET for p in problems)


def _verl_config(*overrides: str) -> Any:
    pytest.importorskip("verl")
    from tests.integration.test_verl_trainer_loop import verl_config

    return verl_config(1, overrides)


@pytest.mark.verl
def test_verls_real_config_of_the_trainer_loop_test_is_supported() -> None:
    assert unsupported_settings(_verl_config()) == ()


@pytest.mark.verl
def test_verls_real_config_with_its_default_backend_is_refused() -> None:
    config = _verl_config(f"{BACKEND_KEY}=naive", "actor_rollout_ref.rollout.name=sglang",
                          "trainer.use_v1=false")
    assert [(p.key, p.found) for p in unsupported_settings(config)] == [
        ("trainer.use_v1", False), ("actor_rollout_ref.rollout.name", "sglang"),
        (BACKEND_KEY, "naive")]


@pytest.mark.verl
def test_verls_real_config_without_the_actors_offload_is_refused() -> None:
    """veRL's defaults keep the actor's parameters and optimizer on the trainer GPUs; the
    coordinator lends those GPUs between steps."""
    config = _verl_config("actor_rollout_ref.actor.fsdp_config.param_offload=false",
                          "actor_rollout_ref.actor.fsdp_config.optimizer_offload=false")
    assert [(p.key, p.found) for p in unsupported_settings(config, driver=False)] == [
        ("actor_rollout_ref.actor.fsdp_config.param_offload", False),
        ("actor_rollout_ref.actor.fsdp_config.optimizer_offload", False)]


@pytest.mark.verl
def test_verls_bare_defaults_name_the_engine_unset() -> None:
    """veRL's ppo_trainer.yaml leaves the rollout engine mandatory (``???``) and the backend
    ``naive``: an OmegaConf missing value reads as unset, never raises."""
    pytest.importorskip("verl")
    import os.path

    import verl
    from hydra import compose, initialize_config_dir

    cfgdir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=cfgdir, version_base=None):
        config = compose(config_name="ppo_trainer")
    assert [(p.key, p.found) for p in unsupported_settings(config)] == [
        ("actor_rollout_ref.rollout.name", UNSET), (BACKEND_KEY, "naive"),
        ("actor_rollout_ref.actor.fsdp_config.param_offload", False),
        ("actor_rollout_ref.actor.fsdp_config.optimizer_offload", False)]
