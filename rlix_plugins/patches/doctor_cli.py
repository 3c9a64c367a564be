"""``rlix-plugins doctor``: print the plug-point report of :mod:`rlix_plugins.patches.doctor`."""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict

from rlix_plugins import activation
from rlix_plugins.patches.doctor import ENV_NEMO_RL_SRC, Outcome, collect


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``rlix-plugins doctor``."""
    # choices: an unknown name is refused (exit 2, valid hosts listed) instead of checking
    # nothing and passing with "0 plug points".
    parser.add_argument("--host", action="append", choices=sorted(activation.PATCHES),
                        help="only this host (repeatable)")
    parser.add_argument("--nemo-rl-src", default=None,
                        help=f"NeMo RL source checkout (default: ${ENV_NEMO_RL_SRC})")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("--strict", action="store_true",
                        help="also fail when a plug point's module cannot be found at all")


def run(args: argparse.Namespace) -> int:
    """Print the report; 1 on drift (or, with --strict, on anything unavailable), else 0."""
    src = args.nemo_rl_src or os.environ.get(ENV_NEMO_RL_SRC)
    if src:
        os.environ[ENV_NEMO_RL_SRC] = src
        if src not in sys.path:
            sys.path.insert(0, src)
    versions, results, errors = collect(args.host)
    drift = [r for r in results if r.outcome is Outcome.DRIFT]
    unavailable = [r for r in results if r.outcome is Outcome.UNAVAILABLE]
    if args.json:
        print(json.dumps({
            "versions": [asdict(v) for v in versions],
            "plug_points": [{**asdict(r), "outcome": r.outcome.value} for r in results],
            "errors": errors,
            "drift": len(drift),
        }, indent=2))
    else:
        for v in versions:
            state = {True: "supported", False: "NOT the supported version", None: "not found"}
            print(f"{v.host}: version={v.version} commit={v.commit} at {v.source} "
                  f"-> {state[v.matches]} (supported: {v.supported})")
        for r in results:
            print(f"  [{r.outcome.value:11}] {r.host}: {r.name} ({r.target}) via {r.how}: "
                  f"{r.detail}")
        for e in errors:
            print(f"  [error      ] {e}")
        print(f"{len(results)} plug points: {len(drift)} drift, {len(unavailable)} unavailable")
    failed = bool(drift) or bool(errors) or (args.strict and bool(unavailable))
    return 1 if failed else 0
