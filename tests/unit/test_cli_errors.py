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


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--policies", ","], "--policies names no deployment"),
        (["--policies", "ours,foo"], "unknown deployments ['foo']"),
        (["--seed", "-1"], "--seed must be >= 0, got -1"),
        (["--jobs", "0"], "--jobs must be >= 1"),
        (["--switch-cost", "nccl=1"], "--switch-cost expects NAME=SECONDS"),
    ],
)
def test_simulate_errors_go_to_stderr_in_the_prog_form(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    """They were ``error: ...`` lines on stdout: a script reading the command's output got
    the error mixed into it, and the line did not name the command as argparse's do."""
    out = tmp_path / "out"
    assert main(["simulate", *argv, "--no-plots", "--out", str(out)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"rlix-plugins simulate: error: {message}"), captured.err
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err
    assert not out.exists()


def test_simulate_scenario_errors_go_to_stderr(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "missing.json"
    assert main(["simulate", "--scenario", str(missing), "--out", str(tmp_path / "o")]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"rlix-plugins simulate: error: scenario {missing}: ")


@pytest.mark.parametrize(("argv", "message"), [
    (["--count", "2"], "--count needs --watch SECONDS"),
    (["--wire", "--watch", "1"], "--wire prints once"),
])
def test_status_errors_go_to_stderr_in_the_prog_form(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    assert main(["status", *argv]) == 2
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err.startswith(f"rlix-plugins status: error: {message}")
