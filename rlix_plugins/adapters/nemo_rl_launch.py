"""Run an unchanged NeMo RL entry script with rlix-plugins activated in the driver.

    python -m rlix_plugins.adapters.nemo_rl_launch examples/run_grpo.py --config ... [overrides]

Equivalent to ``python examples/run_grpo.py ...`` plus ``rlix_plugins.activation.activate()``
first (a no-op unless ``RLIX_CONTROL_PLANE=rlix``). Only the driver needs this: worker, vLLM,
collector and replay-buffer processes get our classes by FQN or by pickle, and vLLM's engine
processes load the ``vllm.general_plugins`` entry point.
"""

from __future__ import annotations

import os
import runpy
import sys

from rlix_plugins.activation import activate


class ScriptNotFoundError(FileNotFoundError):
    """The script to launch does not exist (raised before anything is activated)."""


def main(argv: list[str] | None = None) -> None:
    """Activate, then run ``argv[0]`` as ``__main__`` with ``argv`` as its ``sys.argv``.

    ``sys.path[0]`` becomes the script's directory (symlinks resolved), as ``python SCRIPT``
    sets it, so the script's sibling imports work; ``-m`` had set it to the working directory.
    A missing script raises :class:`ScriptNotFoundError` (a :class:`FileNotFoundError`) before
    anything is activated (run as ``-m``, it exits 2 with the message, as ``python`` does); a
    ``FileNotFoundError`` from the script itself propagates with its traceback.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        raise SystemExit("usage: python -m rlix_plugins.adapters.nemo_rl_launch SCRIPT [ARGS...]")
    script = args[0]
    if not os.path.exists(script):
        raise ScriptNotFoundError(f"nemo_rl_launch: can't open file {script!r}: no such file")
    activate()
    sys.argv = args
    # A directory or zip with __main__.py is put on sys.path by run_path itself; under -P
    # (safe_path) neither ``-m`` nor ``python SCRIPT`` prepends anything, so nothing is replaced.
    if os.path.isfile(script) and not sys.flags.safe_path and sys.path:
        sys.path[0] = os.path.dirname(os.path.realpath(script))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    try:
        main()
    # Only the launcher's own error: one the script raises keeps its traceback (exit 1).
    except ScriptNotFoundError as exc:
        sys.stderr.write(f"{exc}\n")
        raise SystemExit(2) from None  # python's own status for a missing script
