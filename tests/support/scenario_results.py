"""Results of a scenario runner started in a child process (``tests.support.*_run``): one
``RESULT <name> <json>`` line per scenario, ``{"ok": result}`` or ``{"failed": reason}``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def read_results(module: str, nemo_rl_src: Path, timeout_s: float = 540) -> dict[str, Any]:
    """Run ``python -m module`` with NeMo RL's source and return ``{name: result}``."""
    env = dict(os.environ, OMP_NUM_THREADS="1", NEMO_RL_SRC=str(nemo_rl_src))
    proc = subprocess.run([sys.executable, "-m", module], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout_s)
    out: dict[str, Any] = {}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            _, name, payload = line.split(" ", 2)
            out[name] = json.loads(payload)
    assert out, f"no scenario reported (rc={proc.returncode}):\n{proc.stderr[-4000:]}"
    return out


def ok(results: dict[str, Any], name: str) -> dict[str, Any]:
    """Scenario ``name``'s result; fails the test naming the scenario's error."""
    got = results.get(name)
    assert got is not None, f"scenario {name} did not report"
    assert "ok" in got, f"scenario {name} failed: {got.get('failed')}"
    result: dict[str, Any] = got["ok"]
    return result
