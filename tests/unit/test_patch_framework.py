"""HostPatch guards and the activation gate, on a small real module written to tmp_path."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from rlix_plugins import activation
from rlix_plugins.errors import HostDriftError
from rlix_plugins.patches.base import HostPatch, PlugKind, PlugPoint, check_plug_point
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


def test_activation_on_patches_at_import(host_module: str, monkeypatch: pytest.MonkeyPatch) -> None:
    global _factory_module
    _factory_module = host_module
    monkeypatch.setattr(activation, "PATCHES", {host_module: f"{__name__}:factory"})
    monkeypatch.setattr(activation, "_hooked", False)
    assert activation.activate(load_settings({"RLIX_CONTROL_PLANE": "rlix"})) is True
    assert host_module not in sys.modules  # nothing imported eagerly
    __import__(host_module)
    try:
        assert sys.modules[host_module].route(1, "m") == "rlix"
        assert host_module in activation.applied_patches()
    finally:
        activation.deactivate()
    assert sys.modules[host_module].route(1, "m") == "stock"


_factory_module = ""


def factory() -> HostPatch:
    return make_patch(_factory_module)
