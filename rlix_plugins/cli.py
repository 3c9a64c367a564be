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
import sys
from collections.abc import Sequence

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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlix-plugins", description=__doc__.splitlines()[0])
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
    sub_parser = argparse.ArgumentParser(prog=f"rlix-plugins {head.command}", description=help_text)
    module.add_arguments(sub_parser)
    args = sub_parser.parse_args(rest)
    return int(module.run(args))


if __name__ == "__main__":
    sys.exit(main())
