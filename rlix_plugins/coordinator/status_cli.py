"""``rlix-plugins status``: pipelines, clusters, each GPU's owner and stage, demand, wait queue."""

from __future__ import annotations

import argparse
import dataclasses
import json

from rlix_plugins.settings import load_settings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--namespace",
        default=None,
        help="control-plane namespace (default: $RLIX_NAMESPACE or rlix)",
    )
    parser.add_argument("--address", default=None, help="Ray cluster address (default: auto)")
    parser.add_argument("--json", action="store_true", help="print the status record as JSON")


def run(args: argparse.Namespace) -> int:

    from rlix_plugins.coordinator.core.status import format_status
    from rlix_plugins.coordinator.service.client import connect
    from rlix_plugins.errors import CoordinatorUnavailableError

    settings = load_settings()
    namespace = args.namespace or settings.namespace
    try:
        plane = connect(
            settings, namespace=namespace, create_if_missing=False, address=args.address
        )
    except CoordinatorUnavailableError as exc:
        print(f"error: {exc}")
        return 2
    status = plane.status()
    if args.json:
        print(json.dumps(dataclasses.asdict(status), indent=2))
    else:
        print(format_status(status, extra={"namespace": namespace}))
    return 0
