"""``rlix-plugins doctor`` on small real host modules written to tmp_path (no NeMo RL needed)."""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from rlix_plugins import activation
from rlix_plugins.patches import doctor, doctor_cli
from rlix_plugins.patches.base import HostPatch, PlugKind, PlugPoint

HOST = """
import not_installed_dependency_xyz  # the module cannot be imported here

class Worker:
    def sleep(self, level=1):
        return level

    async def generate(self, data, *, greedy=False):
        return data

def route(data, method_name):
    return 0
"""


@pytest.fixture
def host(tmp_path: Path) -> Iterator[str]:
    name = f"rlix_doctor_host_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(HOST))
    sys.path.insert(0, str(tmp_path))
    yield name
    sys.path.remove(str(tmp_path))
    sys.modules.pop(name, None)


def test_static_check_finds_present_targets_and_parameters(host: str) -> None:
    for target, params in [(f"{host}:Worker.sleep", ("level",)),
                           (f"{host}:Worker.generate", ("data", "greedy")),
                           (f"{host}:route", ("data", "method_name"))]:
        result = doctor.check_point("h", PlugPoint("p", target, PlugKind.READ, params))
        assert result.outcome is doctor.Outcome.OK, result
        assert result.how == "static"  # the import fails on the missing dependency


def test_moved_target_and_lost_parameter_are_drift(host: str) -> None:
    moved = doctor.check_point("h", PlugPoint("p", f"{host}:Worker.wake", PlugKind.READ))
    assert moved.outcome is doctor.Outcome.DRIFT and "'wake'" in moved.detail
    lost = doctor.check_point(
        "h", PlugPoint("p", f"{host}:route", PlugKind.READ, ("data", "shard_idx"))
    )
    assert lost.outcome is doctor.Outcome.DRIFT and "shard_idx" in lost.detail
    missing = doctor.check_point("h", PlugPoint("p", "no_such_host_module_q:x", PlugKind.READ))
    assert missing.outcome is doctor.Outcome.UNAVAILABLE


def test_importable_targets_are_checked_by_import() -> None:
    ok = doctor.check_point("h", PlugPoint("p", "textwrap:dedent", PlugKind.READ, ("text",)))
    assert ok.outcome is doctor.Outcome.OK and ok.how == "import"
    drift = doctor.check_point("h", PlugPoint("p", "textwrap:dedent", PlugKind.READ, ("nope",)))
    assert drift.outcome is doctor.Outcome.DRIFT and drift.how == "import"


_points: tuple[PlugPoint, ...] = ()


class _DoctorPatch(HostPatch):
    module = "json"
    supported = "test"

    def _apply(self) -> None:
        return None


def factory() -> HostPatch:
    patch = _DoctorPatch()
    patch.plug_points = _points
    return patch


def _run(monkeypatch: pytest.MonkeyPatch, points: tuple[PlugPoint, ...], **kw: object) -> int:
    global _points
    _points = points
    monkeypatch.setattr(activation, "PATCHES", {"testhost": f"{__name__}:factory"})
    args = argparse.Namespace(host=None, nemo_rl_src=None, json=False, strict=False)
    for k, v in kw.items():
        setattr(args, k, v)
    return doctor_cli.run(args)


def test_exit_code_is_nonzero_on_drift_for_any_registered_patch(
    host: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    good = (PlugPoint("sleep", f"{host}:Worker.sleep", PlugKind.READ, ("level",)),)
    assert _run(monkeypatch, good) == 0
    bad = (*good, PlugPoint("gone", f"{host}:Worker.gone", PlugKind.READ))
    assert _run(monkeypatch, bad) == 1
    out = capsys.readouterr().out
    assert "[drift" in out and "testhost: gone" in out
    unavailable = (PlugPoint("x", "no_such_host_module_q:y", PlugKind.READ),)
    assert _run(monkeypatch, unavailable) == 0
    assert _run(monkeypatch, unavailable, strict=True) == 1


def test_a_patch_module_that_fails_to_load_is_an_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(activation, "PATCHES", {"broken": "no_such_patch_module_q:factory"})
    args = argparse.Namespace(host=None, nemo_rl_src=None, json=True, strict=False)
    assert doctor_cli.run(args) == 1
    report = json.loads(capsys.readouterr().out)
    # an error naming the patch and its module, not drift
    assert report["drift"] == 0
    [error] = report["errors"]
    assert error.startswith("broken: patch module failed to load")
    assert "no_such_patch_module_q" in error


def test_every_registered_patch_is_iterated(monkeypatch: pytest.MonkeyPatch) -> None:
    patches = doctor.load_patches()
    assert set(patches) == set(activation.PATCHES)
    assert "nemo_rl" in patches


def test_nemo_rl_version_from_a_git_checkout(tmp_path: Path) -> None:
    import subprocess

    src = tmp_path / "rl"
    (src / "nemo_rl").mkdir(parents=True)
    (src / "nemo_rl" / "package_info.py").write_text(
        'MAJOR = 0\nMINOR = 6\nPATCH = 0\nPRE_RELEASE = ""\n'
    )
    subprocess.run(["git", "init", "-q", str(src)], check=True)
    subprocess.run(["git", "-C", str(src), "add", "."], check=True)
    subprocess.run(["git", "-C", str(src), "-c", "user.email=t@t", "-c", "user.name=t",
                    "commit", "-qm", "x"], check=True)
    found = doctor.nemo_rl_version(str(src))
    assert found.version == "0.6.0" and found.commit is not None and len(found.commit) == 40
    assert found.matches is False  # a different commit than the pinned one
