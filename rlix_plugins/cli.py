"""The ``rlix-plugins`` command.

Each subcommand lives in the module that owns its subject and exposes
``add_arguments(parser)`` and ``run(args) -> int``; this file only wires them up, importing a
subcommand's module when it is used (so ``rlix-plugins doctor`` does not import Ray's dashboard,
and ``simulate`` does not import Ray at all).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import math
import sys
from collections.abc import Sequence

from rlix_plugins.errors import RlixPluginsError

logger = logging.getLogger(__name__)

#: The command's name, as usage and error lines start.
PROG = "rlix-plugins"
#: Exit status of a usage error (argparse's): a bad argument, setting, value or path.
USAGE_ERROR = 2

#: name -> (module, help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "coordinator": (
        "rlix_plugins.coordinator.coordinator_cli",
        "start or stop the coordinator actors (namespace rlix)",
    ),
    "status": ("rlix_plugins.coordinator.status_cli", "pipelines, GPUs, demand, wait queue"),
    "doctor": ("rlix_plugins.patches.doctor_cli", "check host frameworks' plug points for drift"),
    "gate": (
        "rlix_plugins.gates.gate_cli",
        "run validation gate 1, 2 or 3 (--cpu: rehearsal on this box)",
    ),
    "simulate": ("rlix_plugins.sim.simulate_cli", "cluster simulation on the production scheduler"),
}


def report_error(command: str, message: object) -> int:
    """Print ``rlix-plugins COMMAND: error: MESSAGE`` on stderr, argparse's form (stdout keeps
    only the command's output, e.g. its JSON), and return :data:`USAGE_ERROR` to exit with."""
    print(f"{PROG} {command}: error: {message}", file=sys.stderr)
    return USAGE_ERROR


def positive_int(text: str) -> int:
    """argparse ``type`` of a count that must be >= 1 (steps, batch, tokens)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer; expected >= 1") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is out of range; expected an integer >= 1")
    return value


def positive_seconds(text: str) -> float:
    """argparse ``type`` of a duration that must be finite and > 0 (intervals, timeouts)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a number; expected seconds > 0"
        ) from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text} is out of range; expected finite seconds > 0")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (_module, help_text) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    # Parse only the subcommand name first; its own module then parses the rest.
    head, rest = parser.parse_known_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if head.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    module_name, help_text = SUBCOMMANDS[head.command]
    module = importlib.import_module(module_name)
    prog = f"{PROG} {head.command}"
    sub_parser = argparse.ArgumentParser(prog=prog, description=help_text)
    module.add_arguments(sub_parser)
    args = sub_parser.parse_args(rest)  # bad arguments: usage + message, exit 2
    try:
        return int(module.run(args))
    except (RlixPluginsError, ValueError, OSError) as exc:
        # A bad setting, value or path is the user's to fix: one line, as argparse does
        # (-v logs the traceback). Anything else is a bug and keeps its traceback.
        logger.debug("%s failed", prog, exc_info=True)
        return report_error(head.command, exc)


if __name__ == "__main__":
    sys.exit(main())
