"""``rlix-plugins gate N --cpu``: a rehearsal that started and then broke exits 1 (the gate did
not pass), never 2, which means "prerequisites missing or an argument invalid" (docs/gates.md).
A timeout inside the run (Ray's GetTimeoutError is an OSError) used to exit 2. No Ray here:
every fake is marked FAKE."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rlix_plugins.cli import main
from rlix_plugins.gates import gate_cli, rehearsal


@pytest.mark.parametrize("error", [TimeoutError("Get timed out: some object(s) not ready"),
                                   OSError("engine core died"), ValueError("bad reply")])
def test_a_rehearsal_that_breaks_mid_run_exits_1_not_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    error: Exception,
) -> None:
    def run_breaks(cfg: Any) -> Any:  # FAKE: the run started, then broke
        raise error

    monkeypatch.setattr(gate_cli, "_ensure_ray", lambda: False)  # FAKE: no Ray started
    monkeypatch.setattr(rehearsal, "run_cpu_gate", run_breaks)
    code = main(["gate", "1", "--cpu", "--steps", "1", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 1
    assert "gate 1 --cpu: the run failed" in err and str(error) in err
    assert "Traceback" not in err


def test_an_unusable_out_is_still_exit_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def refuse(*_a: Any, **_k: Any) -> Any:
        raise AssertionError("the rehearsal ran although --out cannot be made")

    monkeypatch.setattr(gate_cli, "_ensure_ray", refuse)
    monkeypatch.setattr(rehearsal, "run_cpu_gate", refuse)
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["gate", "1", "--cpu", "--out", str(blocker / "sub")]) == 2
    assert "error:" in capsys.readouterr().err
