"""Edge cases of the hooks, settings, activation gate and gate criteria: each test pins a defect
found in review (it failed before the fix next to it)."""

from __future__ import annotations

import sys
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rlix_plugins import activation
from rlix_plugins.adapters.observability import (
    BusyObserved,
    ObservationWriter,
    RouterCountersObserved,
    read_observations,
    write_all,
)
from rlix_plugins.errors import HostDriftError, SettingsError
from rlix_plugins.gates.criteria import IdleShare, idle_below_exclusive
from rlix_plugins.gates.observed import ownership_from_records, requests_from_records
from rlix_plugins.hooks import coordinator_hooks
from rlix_plugins.hooks.coordinator_hooks import CoordinatorHooks
from rlix_plugins.patches.base import HostPatch
from rlix_plugins.settings import load_settings

A = "ft_aaaaaaaaaaaa"
B = "ft_bbbbbbbbbbbb"


# ---------------------------------------------------------------------------- gate criteria


def test_idle_share_cannot_pass_on_an_exclusive_run_without_busy_evidence() -> None:
    """An exclusive run whose busy log is empty (no samples, no intervals) reads as 100% idle;
    a criterion judged against it must fail, not pass trivially."""
    shared = IdleShare(busy_share=0.6, window_s=10.0, num_gpus=2)
    empty_exclusive = IdleShare(busy_share=0.0, window_s=12.0, num_gpus=2)
    res = idle_below_exclusive(shared, empty_exclusive)
    assert not res.passed, res.measured
    assert "no busy" in res.measured
    # the ordinary case still passes
    assert idle_below_exclusive(shared, IdleShare(0.4, 12.0, 2)).passed


def test_ownership_records_need_generation_records_of_every_pipeline(tmp_path: Path) -> None:
    """docs/gates.md: "every pipeline must have both kinds" (generation and train)."""
    write_all(tmp_path, [BusyObserved(A, "train", (0,), 0.0, 1.0),
                         BusyObserved(B, "train", (1,), 0.0, 1.0)])
    res = ownership_from_records(tmp_path, expected_pipelines=2)
    assert not res.passed, res.measured
    assert f"no generation records of ['{A}', '{B}']" in res.measured


def test_requests_cannot_pass_when_nothing_completed(tmp_path: Path) -> None:
    """Every request cancelled by the caller: nothing was served, so "zero lost" has no
    evidence behind it (no requests = FAIL)."""
    write_all(tmp_path, [RouterCountersObserved(A, "c0", 10, 0, 0, 0, 0, 10, 0, time=1.0)])
    res = requests_from_records([("shared", read_observations(tmp_path))])
    assert not res.passed, res.measured


# ---------------------------------------------------------------------------- settings


def test_a_non_number_names_the_real_valid_range() -> None:
    with pytest.raises(SettingsError, match=r"RLIX_LEASE_S='ten' is not a number.*>= 0\.1"):
        load_settings({"RLIX_CONTROL_PLANE": "rlix", "RLIX_LEASE_S": "ten"})


# ---------------------------------------------------------------------------- hooks


def test_release_is_sent_even_when_the_wall_clock_stepped_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A wall-clock step back (NTP) between grant and release must not stop the release
    (the busy record is evidence only; the GPUs must go back to the coordinator)."""
    hooks = CoordinatorHooks(A, load_settings({"RLIX_CONTROL_PLANE": "rlix"}), scheduler=object(),
                             heartbeat=False, observer=ObservationWriter(tmp_path, A))
    calls: list[str] = []

    def fake_call(method: str, *args: Any, **kwargs: Any) -> Any:
        """FAKE scheduler call (no Ray here): grants GPU 0, accepts the release."""
        calls.append(method)
        return [0] if method == "request_gpus" else None

    hooks._call = fake_call  # type: ignore[method-assign]
    wall = iter([1000.0, 990.0])  # FAKE wall clock: grant at 1000 s, release read 10 s earlier
    fake_time = types.SimpleNamespace(time=lambda: next(wall, None) or time.time(),
                                      monotonic=time.monotonic, sleep=time.sleep)
    monkeypatch.setattr(coordinator_hooks, "time", fake_time)  # this module's clock only
    hooks.before_training(0)
    hooks.after_training(0)
    assert calls == ["request_gpus", "notify_release_gpus"]
    (rec,) = read_observations(tmp_path).busy
    assert rec.stage == "train" and rec.gpus == (0,) and rec.end >= rec.start


# ---------------------------------------------------------------------------- activation

#: FAKE host modules (plain module objects in sys.modules) and what their patches do
_BEHAVIOUR: dict[str, str] = {}


class _FakePatch(HostPatch):
    """FAKE host patch: replaces ``route`` on its module; optionally fails to apply or fails
    the first revert."""

    def __init__(self, module: str, behaviour: str) -> None:
        super().__init__()
        self.module = module
        self.behaviour = behaviour

    def _apply(self) -> None:
        if self.behaviour == "drift":
            raise HostDriftError(f"{self.module}: route moved")
        self.set_attribute(sys.modules[self.module], "route", "rlix")
        if self.behaviour == "revert_fails_once":
            def fail() -> None:
                raise RuntimeError(f"cannot revert {self.module}")
            self._undo.append(fail)


def factory_for(module: str) -> HostPatch:
    return _FakePatch(module, _BEHAVIOUR[module])


def fake_factory_a() -> HostPatch:
    return factory_for(_NAMES[0])


def fake_factory_b() -> HostPatch:
    return factory_for(_NAMES[1])


_NAMES: list[str] = ["", ""]


@pytest.fixture
def hosts(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Two FAKE hosts already imported, registered with the gate, module state isolated."""
    tag = request.node.name.replace("[", "_").replace("]", "_")
    names = [f"rlix_review_host_a_{tag}", f"rlix_review_host_b_{tag}"]
    _NAMES[:] = names
    for name in names:
        mod = types.ModuleType(name)
        mod.route = "stock"  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(activation, "PATCHES", {
        names[0]: f"{__name__}:fake_factory_a", names[1]: f"{__name__}:fake_factory_b"})
    monkeypatch.setattr(activation, "_hooked", False)
    monkeypatch.setattr(activation, "_enabled", False)
    monkeypatch.setattr(activation, "_active", {})
    yield names
    try:
        activation.deactivate()
    finally:
        _BEHAVIOUR.clear()


def _route(name: str) -> str:
    value: str = sys.modules[name].route
    return value


def test_deactivate_reverts_every_patch_even_when_one_revert_fails(hosts: list[str]) -> None:
    a, b = hosts
    _BEHAVIOUR.update({a: "ok", b: "revert_fails_once"})
    assert activation.activate(load_settings({"RLIX_CONTROL_PLANE": "rlix"})) is True
    assert _route(a) == _route(b) == "rlix"
    with pytest.raises(RuntimeError, match=f"cannot revert {b}"):
        activation.deactivate()
    # the other host is reverted; the one that failed is still reported as applied
    assert _route(a) == "stock"
    assert list(activation.applied_patches()) == [b]
    activation.deactivate()  # retried: now reverted
    assert _route(b) == "stock" and activation.applied_patches() == {}


def test_a_host_that_fails_to_patch_does_not_leave_the_others_unhooked(hosts: list[str]) -> None:
    a, b = hosts
    _BEHAVIOUR.update({a: "drift", b: "ok"})
    on = load_settings({"RLIX_CONTROL_PLANE": "rlix"})
    with pytest.raises(HostDriftError, match="route moved"):
        activation.activate(on)
    # the drifted host is left stock (loudly); every other host is still patched
    assert _route(a) == "stock" and _route(b) == "rlix"
    assert list(activation.applied_patches()) == [b]
