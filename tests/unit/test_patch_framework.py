"""HostPatch guards and the activation gate, on a small real module written to tmp_path."""

from __future__ import annotations

import logging
import sys
import textwrap
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

from rlix_plugins import activation
from rlix_plugins.errors import HostDriftError
from rlix_plugins.patches.base import HostPatch, PlugKind, PlugPoint, check_plug_point
from rlix_plugins.patches.nemo_rl import SUPPORTED_VERSION, NemoRlPatch
from rlix_plugins.settings import load_settings

HOST_SRC = """
class Engine:
    def sleep(self, level=1):
        return ("sleep", level)

def route(data, method_name, greedy=False):
    return "stock"
"""


@pytest.fixture
def host_module(tmp_path: Path) -> Iterator[str]:
    name = f"rlix_test_host_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(HOST_SRC))
    sys.path.insert(0, str(tmp_path))
    yield name
    sys.path.remove(str(tmp_path))
    sys.modules.pop(name, None)


def make_patch(module: str, params: tuple[str, ...] = ("data", "method_name")) -> HostPatch:
    class RoutePatch(HostPatch):
        plug_points = (
            PlugPoint("route", f"{module}:route", PlugKind.ATTRIBUTE, params),
            PlugPoint("engine sleep", f"{module}:Engine.sleep", PlugKind.READ, ("level",)),
        )

        def _apply(self) -> None:
            host = sys.modules[module]
            self.set_attribute(host, "route", lambda *a, **k: "rlix")

    RoutePatch.module = module
    return RoutePatch()


def test_apply_revert_are_symmetric_and_idempotent(host_module: str) -> None:
    __import__(host_module)
    host = sys.modules[host_module]
    patch = make_patch(host_module)
    patch.apply()
    patch.apply()
    assert host.route(1, "m") == "rlix" and patch.applied
    patch.revert()
    patch.revert()
    assert host.route(1, "m") == "stock" and not patch.applied


def test_drift_is_reported_and_nothing_is_changed(host_module: str) -> None:
    __import__(host_module)
    host = sys.modules[host_module]
    patch = make_patch(host_module, params=("data", "shard_idx"))
    with pytest.raises(HostDriftError, match=r"lacks parameters \['shard_idx'\]"):
        patch.apply()
    assert host.route(1, "m") == "stock" and not patch.applied
    moved = check_plug_point(PlugPoint("x", f"{host_module}:Gone", PlugKind.READ))
    assert not moved.ok and "drift" in moved.detail


def test_activation_off_installs_nothing(host_module: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(activation.PATCHES, host_module, "tests.unit.test_patch_framework:never")
    assert activation.activate(load_settings({})) is False
    assert activation.activate(load_settings({"RLIX_CONTROL_PLANE": "off"})) is False
    __import__(host_module)
    assert sys.modules[host_module].route(1, "m") == "stock"
    assert host_module not in activation.applied_patches()


@pytest.fixture
def gate(host_module: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The activation gate of this process with only ``host_module`` registered (not yet
    imported) and its module state isolated; everything applied is reverted afterwards."""
    global _factory_module
    _factory_module = host_module
    monkeypatch.setattr(activation, "PATCHES", {host_module: f"{__name__}:factory"})
    monkeypatch.setattr(activation, "_hooked", False)
    monkeypatch.setattr(activation, "_enabled", False)
    monkeypatch.setattr(activation, "_active", {})
    yield host_module
    activation.deactivate()


def _route(host_module: str) -> str:
    result: str = sys.modules[host_module].route(1, "m")
    return result


def test_activation_on_patches_at_import(gate: str) -> None:
    assert activation.activate(load_settings({"RLIX_CONTROL_PLANE": "rlix"})) is True
    assert gate not in sys.modules  # nothing imported eagerly
    __import__(gate)
    assert _route(gate) == "rlix"
    assert gate in activation.applied_patches()
    activation.deactivate()
    assert _route(gate) == "stock"


def test_deactivate_before_the_host_import_keeps_the_host_stock(gate: str) -> None:
    on = load_settings({"RLIX_CONTROL_PLANE": "rlix"})
    assert activation.activate(on) is True
    activation.deactivate()
    __import__(gate)  # the registered hook fires now, while disabled
    assert _route(gate) == "stock" and activation.applied_patches() == {}
    # Re-activation patches the host imported meanwhile at once (its hook will not fire again).
    assert activation.activate(on) is True
    assert _route(gate) == "rlix" and gate in activation.applied_patches()
    activation.deactivate()
    activation.deactivate()
    assert _route(gate) == "stock" and activation.applied_patches() == {}


def test_activate_after_deactivate_reapplies_an_imported_host(gate: str) -> None:
    on = load_settings({"RLIX_CONTROL_PLANE": "rlix"})
    __import__(gate)
    assert activation.activate(on) is True  # host imported already: patched at once
    assert _route(gate) == "rlix"
    activation.deactivate()
    assert _route(gate) == "stock"
    assert activation.activate(on) is True
    assert activation.activate(on) is True  # idempotent: patched once
    assert _route(gate) == "rlix" and list(activation.applied_patches()) == [gate]
    activation.deactivate()
    assert _route(gate) == "stock"


def test_an_unsupported_host_version_is_applied_with_a_warning(
    host_module: str, caplog: pytest.LogCaptureFixture
) -> None:
    __import__(host_module)
    base = type(make_patch(host_module))

    class VersionedPatch(base):  # type: ignore[valid-type,misc]
        """The tmp_path host has no distribution: the version it reports is set here."""

        supported = "testhost 1.x"
        reported = "0.9"

        def version(self) -> str | None:
            return self.reported

        def version_supported(self, version: str | None) -> bool:
            return version == "1.0"

    patch = VersionedPatch()
    with caplog.at_level(logging.WARNING, logger="rlix_plugins.patches.base"):
        patch.apply()
    try:
        assert _route(host_module) == "rlix"  # warned, not refused
        [record] = [r for r in caplog.records if r.levelno == logging.WARNING]
        message = record.getMessage()
        assert f"{host_module} 0.9 is not the supported version" in message
        assert "supported: testhost 1.x" in message
    finally:
        patch.revert()
    caplog.clear()
    patch.reported = "1.0"
    with caplog.at_level(logging.WARNING, logger="rlix_plugins.patches.base"):
        patch.apply()
    patch.revert()
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]


def test_an_unsupported_nemo_rl_version_is_warned_about(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # FAKE nemo_rl top-level module (NeMo RL is not installed here): only its __version__ is
    # read; none of its part modules is imported, so nothing else is checked or patched.
    fake = types.ModuleType("nemo_rl")
    fake.__version__ = "0.0.1"  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "nemo_rl", fake)
    patch = NemoRlPatch()
    with caplog.at_level(logging.WARNING, logger="rlix_plugins.patches.base"):
        patch.apply()
    patch.revert()
    [record] = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "NemoRlPatch: nemo_rl 0.0.1 is not the supported version" in record.getMessage()
    assert f"nemo_rl {SUPPORTED_VERSION}" in record.getMessage()


_factory_module = ""


def factory() -> HostPatch:
    return make_patch(_factory_module)
