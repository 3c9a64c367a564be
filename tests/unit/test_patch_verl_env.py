"""veRL's runtime-env wrapper forwards every RLIX_* variable (veRL itself is not needed)."""

from __future__ import annotations

from typing import Any

import pytest

from rlix_plugins.patches.verl import forwarded_env, forwarding_runtime_env

#: every RLIX_* setting a veRL worker reads, not only the coordinator's
RLIX_ENV = {
    "RLIX_CONTROL_PLANE": "rlix",
    "RLIX_NAMESPACE": "rlix_test",
    "RLIX_VERL_MIGRATION": "off",
    "RLIX_OBSERVE_DIR": "/tmp/observe",
    "RLIX_VLLM_SLEEP_LEVEL": "1",
    "RLIX_BACKGROUND_EXPANDS": "1",
}
OTHER_ENV = {
    "PIPELINE_ID": "ft_0123456789ab",
    "ROLL_RAY_NAMESPACE": "roll_ns",
    "VERL_USE_EXTERNAL_MODULES": "rlix_plugins.autoload",
}


def stock_runtime_env(config: Any = None) -> dict[str, Any]:
    """FAKE ``verl.trainer.main_ppo.get_ppo_ray_runtime_env`` (veRL is not installed here):
    like veRL's, it returns fixed worker variables and drops the driver's own."""
    del config
    return {"env_vars": {"TOKENIZERS_PARALLELISM": "true", "NCCL_DEBUG": "WARN"}}


def test_every_rlix_variable_reaches_the_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in {**RLIX_ENV, **OTHER_ENV, "UNRELATED_VAR": "x"}.items():
        monkeypatch.setenv(key, value)
    env = forwarding_runtime_env(stock_runtime_env)(None)["env_vars"]
    assert {k: env.get(k) for k in RLIX_ENV} == RLIX_ENV
    assert {k: env.get(k) for k in OTHER_ENV} == OTHER_ENV
    assert "UNRELATED_VAR" not in env
    assert {k: v for k, v in env.items() if k in stock_runtime_env()["env_vars"]} == (
        stock_runtime_env()["env_vars"]
    )


def test_forwarded_env_takes_only_what_is_set() -> None:
    environ = {"RLIX_VERL_MIGRATION": "off", "PIPELINE_ID": "ft_1", "HOME": "/root"}
    assert forwarded_env(environ) == {"RLIX_VERL_MIGRATION": "off", "PIPELINE_ID": "ft_1"}
    assert forwarded_env({}) == {}
