"""The gate reads only RLIX_CONTROL_PLANE until it is ``rlix``: a standalone job never fails on
other RLix variables, in a fresh process exactly as veRL's autoload and vLLM's plugin run."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from rlix_plugins import activation
from rlix_plugins.errors import SettingsError
from rlix_plugins.settings import ControlPlane, control_plane_from_env

STANDALONE = textwrap.dedent(
    """
    import rlix_plugins.autoload as autoload
    from rlix_plugins import activation
    from rlix_plugins.patches import vllm

    vllm.register()
    assert autoload.ACTIVE is False and not vllm.registered(), "standalone job was patched"
    assert activation.applied_patches() == {} and not activation._hooked
    print("standalone ok")
    """
)


def _run(env_extra: dict[str, str]) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLIX_")}
    env.pop("PIPELINE_ID", None)
    env.update(env_extra)
    return subprocess.run([sys.executable, "-c", STANDALONE], env=env, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize(
    "env",
    [
        {"PIPELINE_ID": ""},
        {"RLIX_LEASE_S": "5s", "RLIX_VLLM_SLEEP_LEVEL": "3", "ROLL_RAY_NAMESPACE": " "},
        {"RLIX_CONTROL_PLANE": "", "RLIX_NAMESPACE": ""},
        {"RLIX_CONTROL_PLANE": "off", "RLIX_BACKGROUND_EXPANDS": "yes"},
    ],
)
def test_standalone_ignores_every_other_rlix_variable(env: dict[str, str]) -> None:
    done = _run(env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "standalone ok"


def test_control_plane_is_read_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    assert control_plane_from_env({}) is ControlPlane.OFF
    assert control_plane_from_env({"RLIX_CONTROL_PLANE": " RLIX "}) is ControlPlane.RLIX
    assert control_plane_from_env({"RLIX_CONTROL_PLANE": "off", "RLIX_LEASE_S": "x"}) is (
        ControlPlane.OFF
    )
    # An explicit value other than off/rlix is a request with a typo: still an error.
    with pytest.raises(SettingsError, match=r"RLIX_CONTROL_PLANE='roll'.*'off', 'rlix'"):
        control_plane_from_env({"RLIX_CONTROL_PLANE": "roll"})
    monkeypatch.setattr(activation, "_hooked", False)
    monkeypatch.setenv("RLIX_CONTROL_PLANE", "yes")
    with pytest.raises(SettingsError, match="RLIX_CONTROL_PLANE='yes' is not valid"):
        activation.activate()
    assert activation._hooked is False


def test_activate_validates_the_other_variables_only_when_rlix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(activation, "_hooked", False)
    monkeypatch.setenv("PIPELINE_ID", "")
    monkeypatch.setenv("RLIX_CONTROL_PLANE", "off")
    assert activation.activate() is False
    monkeypatch.setenv("RLIX_CONTROL_PLANE", "rlix")
    with pytest.raises(SettingsError, match="PIPELINE_ID is set but empty"):
        activation.activate()
    assert activation._hooked is False  # refused before any hook was registered


def test_hooks_and_adapters_read_nothing_else_when_off(monkeypatch: pytest.MonkeyPatch) -> None:
    from rlix_plugins.hooks import NoOpRLixHooks, make_hooks
    from rlix_plugins.settings import settings_if_enabled

    monkeypatch.delenv("RLIX_CONTROL_PLANE", raising=False)
    monkeypatch.setenv("PIPELINE_ID", "")  # invalid, but a standalone job never reads it
    monkeypatch.setenv("RLIX_LEASE_S", "5s")
    assert settings_if_enabled() is None
    assert isinstance(make_hooks(), NoOpRLixHooks)
    monkeypatch.setenv("RLIX_CONTROL_PLANE", "rlix")
    with pytest.raises(SettingsError, match="RLIX_LEASE_S"):
        settings_if_enabled()
