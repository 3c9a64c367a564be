"""Run an unchanged NeMo RL entry script with rlix-plugins activated in the driver.

    python -m rlix_plugins.adapters.nemo_rl_launch examples/run_grpo.py --config ... [overrides]

Equivalent to ``python examples/run_grpo.py ...`` plus ``rlix_plugins.activation.activate()``
first (a no-op unless ``RLIX_CONTROL_PLANE=rlix``). Only the driver needs this: worker, vLLM,
collector and replay-buffer processes get our classes by FQN or by pickle, and vLLM's engine
processes load the ``vllm.general_plugins`` entry point.
"""

from __future__ import annotations

import runpy
import sys

from rlix_plugins.activation import activate


def main(argv: list[str] | None = None) -> None:
    """Activate, then run ``argv[0]`` as ``__main__`` with ``argv`` as its ``sys.argv``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        raise SystemExit("usage: python -m rlix_plugins.adapters.nemo_rl_launch SCRIPT [ARGS...]")
    activate()
    sys.argv = args
    runpy.run_path(args[0], run_name="__main__")


if __name__ == "__main__":
    main()
