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


def test_a_file_missing_inside_the_script_keeps_its_traceback(tmp_path: Path) -> None:
    """Only the launcher's OWN missing-script error becomes python's one-line exit 2: e.g.
    run_grpo.py with a --config path that does not exist needs its traceback (which open,
    where), and python exits 1, not 2, for an error in the script."""
    (tmp_path / "run.py").write_text("open('missing_config.yaml')\n")
    launched = _launch(tmp_path, "run.py")
    plain = subprocess.run([sys.executable, "run.py"], cwd=tmp_path, capture_output=True,
                           text=True, timeout=120)
    assert plain.returncode == 1
    assert launched.returncode == plain.returncode, launched.stderr
    assert "Traceback" in launched.stderr
    assert "missing_config.yaml" in launched.stderr
