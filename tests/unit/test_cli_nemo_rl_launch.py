"""``python -m rlix_plugins.adapters.nemo_rl_launch SCRIPT`` behaves like ``python SCRIPT``."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent(
    """
    import sys

    import helper  # a sibling module, found only through sys.path[0] = the script's directory

    print(sys.path[0])
    print(helper.VALUE, sys.argv[1:], __name__)
    """
)


def _launch(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLIX_")}
    return subprocess.run(
        [sys.executable, "-m", "rlix_plugins.adapters.nemo_rl_launch", *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=120,
    )


def test_script_directory_is_sys_path_0_as_with_python(tmp_path: Path) -> None:
    scripts = tmp_path / "examples"
    scripts.mkdir()
    (scripts / "run_grpo.py").write_text(SCRIPT)
    (scripts / "helper.py").write_text("VALUE = 'sibling'\n")
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    launched = _launch(elsewhere, "../examples/run_grpo.py", "--config", "x.yaml")
    assert launched.returncode == 0, launched.stderr
    plain = subprocess.run([sys.executable, "../examples/run_grpo.py", "--config", "x.yaml"],
                           cwd=elsewhere, capture_output=True, text=True, timeout=120)
    assert plain.returncode == 0, plain.stderr
    assert launched.stdout == plain.stdout
    assert launched.stdout.splitlines() == [
        str(scripts.resolve()), "sibling ['--config', 'x.yaml'] __main__"
    ]


def test_a_missing_script_is_refused_like_python(tmp_path: Path) -> None:
    launched = _launch(tmp_path, "no_such_script.py")
    assert launched.returncode == 2
    assert "can't open file 'no_such_script.py'" in launched.stderr
    assert "Traceback" not in launched.stderr
