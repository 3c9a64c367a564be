"""A gate run that crashes must not leave an earlier run's report in ``--out`` to speak for it
(it did: ``gate1_report.json`` kept ``"passed": true`` next to the crash), and the report is
written whole. No Ray, no engine, no GPU: every fake here is marked FAKE."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from rlix_plugins.gates import gpu_mode, rehearsal
from rlix_plugins.gates.gpu_mode import GpuGateOptions
from rlix_plugins.gates.outputs import output_names, write_text_atomic
from rlix_plugins.gates.rehearsal import RehearsalConfig
from tests.unit.test_gates_flow_failures import _fake_gpu_run, gpu_run_whose_jobs_fail


def _earlier_run(out: Path, gate: int) -> None:
    """What a PASSED run of ``gate`` left in ``out``, plus a file that is not the gate's."""
    out.mkdir(parents=True, exist_ok=True)
    for name in output_names(gate):
        (out / name).write_text(json.dumps({"gate": gate, "passed": True}))
    (out / "notes.txt").write_text("mine")


class _CrashingRehearsal:
    """FAKE _Rehearsal: the engines never come up."""

    def __init__(self, cfg: RehearsalConfig) -> None:
        self.closed = False

    def start_nemo(self, specs: Any) -> None:
        raise RuntimeError("engine start timed out")

    def close(self) -> None:
        self.closed = True


def test_a_crashed_rehearsal_leaves_no_earlier_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out"
    _earlier_run(out, 1)
    _earlier_run(out, 2)  # another gate's outputs in the same directory stay
    monkeypatch.setattr(rehearsal, "_Rehearsal", _CrashingRehearsal)
    with pytest.raises(RuntimeError, match="engine start"):
        rehearsal.run_cpu_gate(RehearsalConfig(gate=1, steps=1, out_dir=out))
    assert not [n for n in output_names(1) if (out / n).exists()]
    assert all((out / n).exists() for n in output_names(2))
    assert (out / "notes.txt").read_text() == "mine"


def test_a_crashed_gpu_run_leaves_no_earlier_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stopped: list[str] = []
    gpu_run_whose_jobs_fail(monkeypatch, stopped)
    out = tmp_path / "out"
    _earlier_run(out, 1)
    with pytest.raises(RuntimeError, match="job launch"):
        gpu_mode.run_gpu_gate(GpuGateOptions(1, out))
    assert not (out / "gate1_report.json").exists()
    assert (out / "notes.txt").read_text() == "mine"


def test_a_failed_write_keeps_the_old_file_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "gate1_report.json"
    write_text_atomic(path, '{"old": 1}')
    real_fdopen = os.fdopen

    def fdopen(fd: int, mode: str) -> Any:
        fh = real_fdopen(fd, mode)

        class _Half:
            def __enter__(self) -> Any:
                return self

            def __exit__(self, *exc: Any) -> None:
                fh.close()

            def write(self, text: str) -> None:
                fh.write(text[:3])
                raise OSError("disk full")

        return _Half()

    monkeypatch.setattr(os, "fdopen", fdopen)
    with pytest.raises(OSError, match="disk full"):
        write_text_atomic(path, '{"new": 2}')
    assert path.read_text() == '{"old": 1}'
    assert [p.name for p in tmp_path.iterdir()] == ["gate1_report.json"]  # no temporary left


def test_a_busy_rlix_namespace_is_refused_before_out_is_created(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gate_cli's contract: a prerequisite missing (exit 2) creates no --out; gate 3's check
    for a control plane already in namespace ``rlix`` ran after the directory was made."""
    import shutil

    stopped: list[str] = []
    _fake_gpu_run(monkeypatch, stopped)
    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/" + name)
    roll = gpu_mode.JobSpec("roll", ("true",), tmp_path)
    monkeypatch.setattr(gpu_mode, "load_jobs", lambda opts, exclusive: [roll])
    monkeypatch.setattr(gpu_mode, "_namespace_free", lambda ray, ns: False)  # FAKE: taken
    out = tmp_path / "out"
    with pytest.raises(gpu_mode.PrerequisiteError, match="already runs in namespace 'rlix'"):
        gpu_mode.run_gpu_gate(GpuGateOptions(3, out))
    assert not out.exists() and stopped == []
