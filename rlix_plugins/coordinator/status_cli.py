"""``rlix-plugins status``: pipelines, clusters, each GPU's owner and stage, demand, wait queue.

Once, or every ``--watch`` seconds (``--count`` times, or until interrupted). Each call to the
scheduler is bounded by ``--timeout``: a scheduler that does not answer is an error naming it,
never a hang.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rlix_plugins.cli import positive_int, positive_seconds, report_error
from rlix_plugins.settings import load_settings

if TYPE_CHECKING:
    from rlix_plugins.coordinator.core.status import CoordinatorStatus

#: How long one status call may take by default (seconds).
DEFAULT_TIMEOUT_S = 30.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--namespace",
        default=None,
        help="control-plane namespace (default: $RLIX_NAMESPACE or rlix)",
    )
    parser.add_argument("--address", default=None, help="Ray cluster address (default: auto)")
    parser.add_argument(
        "--json",
        action="store_true",
        help="print the status record as JSON (with --watch: one record per line)",
    )
    parser.add_argument(
        "--watch",
        type=positive_seconds,
        default=None,
        metavar="SECONDS",
        help="print the status again every SECONDS until interrupted (or --count times)",
    )
    parser.add_argument(
        "--count",
        type=positive_int,
        default=None,
        metavar="N",
        help="with --watch: stop after N prints",
    )
    parser.add_argument(
        "--wire",
        action="store_true",
        help="print what each pipeline sent over the protocol instead: calls, refused calls, "
        "the classes of its progress reports and priorities (RLix's own for ROLL pipelines)",
    )
    parser.add_argument(
        "--timeout",
        type=positive_seconds,
        default=DEFAULT_TIMEOUT_S,
        metavar="SECONDS",
        help=f"how long one status call may take (default {DEFAULT_TIMEOUT_S:g})",
    )


def render(status: CoordinatorStatus, *, namespace: str, as_json: bool, watching: bool) -> str:
    """One print of ``status``: the table, or JSON (compact, one line, while watching)."""
    from rlix_plugins.coordinator.core.status import format_status

    if as_json:
        record = dataclasses.asdict(status)
        return json.dumps(record) if watching else json.dumps(record, indent=2)
    text = format_status(status, extra={"namespace": namespace})
    if watching:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        return f"--- {stamp} ---\n{text}"
    return text


def watch(
    fetch: Callable[[], CoordinatorStatus],
    show: Callable[[CoordinatorStatus], None],
    *,
    every_s: float | None,
    count: int | None,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """Fetch and show the status once, or every ``every_s`` seconds ``count`` times (None:
    until interrupted); returns how many were shown."""
    shown = 0
    while True:
        show(fetch())
        shown += 1
        if every_s is None or (count is not None and shown >= count):
            return shown
        sleep(every_s)


def run(args: argparse.Namespace) -> int:
    from ray.exceptions import GetTimeoutError

    from rlix_plugins.coordinator.service.client import connect
    from rlix_plugins.errors import CoordinatorUnavailableError

    if args.count is not None and args.watch is None:
        return report_error("status", "--count needs --watch SECONDS")
    if args.wire and args.watch is not None:
        return report_error("status", "--wire prints once; it does not take --watch")
    settings = load_settings()
    namespace = args.namespace or settings.namespace
    try:
        plane = connect(
            settings, namespace=namespace, create_if_missing=False, address=args.address
        )
    except CoordinatorUnavailableError as exc:
        return report_error("status", exc)
    if args.wire:
        return _show_wire(plane.scheduler, namespace, timeout_s=args.timeout, as_json=args.json)
    watching = args.watch is not None

    def show(status: CoordinatorStatus) -> None:
        print(render(status, namespace=namespace, as_json=args.json, watching=watching),
              flush=True)

    try:
        watch(lambda: plane.status(args.timeout), show, every_s=args.watch, count=args.count)
    except GetTimeoutError:
        return report_error("status", _no_answer(namespace, args.timeout))
    except KeyboardInterrupt:
        pass  # the way out of --watch
    return 0


def _show_wire(scheduler: Any, namespace: str, *, timeout_s: float, as_json: bool) -> int:
    """Print the scheduler's wire log (``--wire``): a block per pipeline, or JSON."""
    import ray
    from ray.exceptions import GetTimeoutError

    from rlix_plugins.coordinator.service.wire_log import format_wire

    try:
        wire = ray.get(scheduler.get_wire_log.remote(), timeout=timeout_s)
    except GetTimeoutError:
        return report_error("status", _no_answer(namespace, timeout_s))
    if as_json:
        print(json.dumps({pid: dataclasses.asdict(w) for pid, w in wire.items()}, indent=2))
    else:
        print(format_wire(wire))
    return 0


def _no_answer(namespace: str, timeout_s: float) -> str:
    return (f"the scheduler in namespace {namespace!r} did not answer within "
            f"{timeout_s:g}s (busy or stuck: see its log); retry with a larger --timeout")
