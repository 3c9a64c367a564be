"""``rlix-plugins`` on bad input: one ``error:`` line on stderr, exit 2, nothing created."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rlix_plugins.cli import main
from rlix_plugins.errors import UnknownHostError
from rlix_plugins.gates import gate_cli, rehearsal
from rlix_plugins.patches import doctor


@pytest.fixture
def no_rehearsal(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bad arguments must be refused before any of this runs; were they not, the test fails
    here instead of starting Ray and a whole rehearsal."""

    def refuse(*_args: Any, **_kwargs: Any) -> Any:
        raise AssertionError("the rehearsal ran although an argument was invalid")

    monkeypatch.setattr(gate_cli, "_ensure_ray", refuse)
    monkeypatch.setattr(rehearsal, "run_cpu_gate", refuse)


@pytest.mark.parametrize(
    ("flag", "value"),
    [("--steps", "-2"), ("--steps", "0"), ("--steps", "two"), ("--batch", "0"),
     ("--max-tokens", "0")],
)
def test_gate_refuses_a_count_below_one(
    no_rehearsal: None, tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str, value: str
) -> None:
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exited:
        main(["gate", "1", "--cpu", flag, value, "--out", str(out)])
    err = capsys.readouterr().err
    assert exited.value.code == 2
    assert f"rlix-plugins gate: error: argument {flag}: " in err and "expected" in err
    assert "Traceback" not in err
    assert not out.exists()


def test_gate_refuses_an_out_path_that_is_a_file(
    no_rehearsal: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "report.txt"
    out.write_text("keep")
    with pytest.raises(SystemExit) as exited:
        main(["gate", "1", "--cpu", "--out", str(out)])
    err = capsys.readouterr().err
    assert exited.value.code == 2
    assert "argument --out: " in err and "is not a directory" in err and "Traceback" not in err
    assert out.read_text() == "keep"


def test_a_bad_setting_is_one_error_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("RLIX_LEASE_S", "abc")
    assert main(["status"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rlix-plugins status: error: RLIX_LEASE_S='abc' is not a number")
    assert "Traceback" not in err


def test_doctor_refuses_an_unknown_host(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["doctor", "--host", "bogus"])
    err = capsys.readouterr().err
    assert exited.value.code == 2
    assert "argument --host: invalid choice: 'bogus'" in err
    assert "'nemo_rl'" in err and "'verl'" in err
    with pytest.raises(UnknownHostError, match=r"unknown host\(s\) \['bogus'\]; valid hosts are "
                                         r"\['nemo_rl', 'verl'\]"):
        doctor.collect(["bogus"])
