"""``nemo_rl_launch`` turns only ITS OWN missing-script error into python's one-line exit 2; a
``FileNotFoundError`` raised by the launched script keeps its traceback, as ``python SCRIPT``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def _launch(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLIX_")}
    return subprocess.run(
        [sys.executable, "-m", "rlix_plugins.adapters.nemo_rl_launch", *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=120,
    )


def test_a_file_missing_inside_the_script_keeps_its_traceback(tmp_path: Path) -> None:
    # e.g. run_grpo.py with a --config path that does not exist: the user needs the
    # traceback (which open, where), and python exits 1, not 2, for an error in the script.
    (tmp_path / "run.py").write_text("open('missing_config.yaml')\n")
    launched = _launch(tmp_path, "run.py")
    plain = subprocess.run([sys.executable, "run.py"], cwd=tmp_path, capture_output=True,
                           text=True, timeout=120)
    assert plain.returncode == 1
    assert launched.returncode == plain.returncode, launched.stderr
    assert "Traceback" in launched.stderr
    assert "missing_config.yaml" in launched.stderr
