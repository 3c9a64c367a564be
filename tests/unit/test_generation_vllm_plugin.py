"""The vLLM general-plugin entry point in this process (vLLM imported, no engine started)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from rlix_plugins.errors import HostDriftError, SettingsError
from rlix_plugins.patches import vllm as vllm_patch

pytest.importorskip("vllm")

_ADDED = ("rlix_shard", "rlix_abort_all", "rlix_num_running", "rlix_sleep")


@pytest.fixture
def clean_plugin() -> Iterator[None]:
    was = vllm_patch.registered()
    vllm_patch.revert()
    yield
    vllm_patch.revert()
    assert not was, "another test left the plugin applied"


def _async_llm() -> type:
    from vllm.v1.engine.async_llm import AsyncLLM

    return AsyncLLM


def test_register_is_inert_without_rlix(
    clean_plugin: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("RLIX_CONTROL_PLANE", raising=False)
    vllm_patch.register()
    assert not vllm_patch.registered()
    assert not any(hasattr(_async_llm(), n) for n in _ADDED)
    monkeypatch.setenv("RLIX_CONTROL_PLANE", "off")
    vllm_patch.register()
    assert not vllm_patch.registered()


def test_register_applies_once_and_reverts(
    clean_plugin: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RLIX_CONTROL_PLANE", "rlix")
    monkeypatch.setenv("RLIX_VLLM_SLEEP_LEVEL", "1")
    vllm_patch.register()
    first = _async_llm().rlix_sleep  # type: ignore[attr-defined]
    vllm_patch.register()  # a second load in the same process changes nothing
    assert vllm_patch.registered() and _async_llm().rlix_sleep is first  # type: ignore[attr-defined]
    assert vllm_patch.RlixWorkerExtension().rlix_worker_info()["sleep_level"] == 1
    vllm_patch.revert()
    assert not any(hasattr(_async_llm(), n) for n in _ADDED)
    assert callable(_async_llm().sleep), "revert removed one of vLLM's own methods"


def test_invalid_settings_are_typed_errors(
    clean_plugin: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RLIX_CONTROL_PLANE", "yes")
    with pytest.raises(SettingsError, match="RLIX_CONTROL_PLANE"):
        vllm_patch.register()
    monkeypatch.setenv("RLIX_CONTROL_PLANE", "rlix")
    monkeypatch.setenv("RLIX_VLLM_SLEEP_LEVEL", "3")
    with pytest.raises(SettingsError, match="expected 0, 1 or 2"):
        vllm_patch.register()
    assert not vllm_patch.registered()


def test_plug_points_match_installed_vllm() -> None:
    patch = vllm_patch.VllmPatch()
    bad = [s for s in patch.check() if not s.ok]
    assert not bad, bad
    assert patch.version_supported(patch.version())


def test_drifted_plug_point_refuses_to_apply(monkeypatch: pytest.MonkeyPatch) -> None:
    from rlix_plugins.patches.base import PlugKind, PlugPoint

    drifted = vllm_patch.VllmPatch()
    monkeypatch.setattr(drifted, "plug_points", (*drifted.plug_points, PlugPoint(
        "moved", "vllm.v1.engine.async_llm:AsyncLLM.sleep", PlugKind.READ,
        params=("level", "gone_param"))))
    with pytest.raises(HostDriftError, match="gone_param"):
        drifted.apply()
    assert not any(hasattr(_async_llm(), n) for n in _ADDED)
