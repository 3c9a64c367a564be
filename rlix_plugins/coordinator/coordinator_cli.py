"""``rlix-plugins coordinator start|stop``: run or remove the coordinator's detached actors.

Needs a running Ray cluster (``ray start --head`` or a cluster address): the actors are
detached, so they outlive this command; a local Ray started by the command would not.
"""

from __future__ import annotations

import argparse
import dataclasses

from rlix_plugins.cli import positive_int
from rlix_plugins.coordinator.core.model import Topology
from rlix_plugins.settings import load_settings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=("start", "stop"), help="start or stop")
    parser.add_argument(
        "--namespace",
        default=None,
        help="control-plane namespace (default: $RLIX_NAMESPACE or rlix)",
    )
    parser.add_argument("--address", default=None, help="Ray cluster address (default: auto)")
    # positive_int: 0 would otherwise read as "not given" below (the topology from Ray).
    parser.add_argument(
        "--nodes", type=positive_int, default=None, help="GPU nodes (default: from Ray)"
    )
    parser.add_argument(
        "--gpus-per-node", type=positive_int, default=None, help="GPUs per node (default: from Ray)"
    )
    parser.add_argument("--trace-dir", default=None, help="write the GPU timeline here")
    parser.add_argument(
        "--state-file", default=None, help="persist state to this file (default: Ray's KV)"
    )
    parser.add_argument(
        "--keep-state", action="store_true", help="stop: keep the saved allocation state"
    )


def run(args: argparse.Namespace) -> int:
    from rlix_plugins.coordinator.service.client import connect, stop_coordinator
    from rlix_plugins.coordinator.service.config import ServiceConfig
    from rlix_plugins.coordinator.service.resource_manager import topology_from_ray

    settings = load_settings()
    namespace = args.namespace or settings.namespace
    if args.action == "stop":
        import ray

        if not ray.is_initialized():
            ray.init(address=args.address or "auto", log_to_driver=False)
        stopped = stop_coordinator(namespace, clear_state=not args.keep_state)
        if stopped:
            print(f"stopped {', '.join(stopped)} in namespace {namespace!r}")
        else:
            print(f"no coordinator was running in namespace {namespace!r}")
        return 0
    overrides: dict[str, object] = {"namespace": namespace}
    if args.trace_dir:
        overrides["trace_dir"] = args.trace_dir
    if args.state_file:
        overrides["state_file"] = args.state_file
    config = ServiceConfig.from_settings(settings, **overrides)
    topology = None
    if args.nodes is not None or args.gpus_per_node is not None:
        import ray

        if not ray.is_initialized():
            ray.init(address=args.address or "auto", log_to_driver=False)
        auto = topology_from_ray(args.gpus_per_node)
        topology = Topology(args.nodes or auto.num_nodes, args.gpus_per_node or auto.gpus_per_node)
        config = dataclasses.replace(config, topology=topology)
    plane = connect(settings, namespace=namespace, config=config, address=args.address)
    status = plane.status()
    print(
        f"coordinator running in namespace {namespace!r}: {status.num_nodes} node(s) x "
        f"{status.gpus_per_node} GPU(s), {len(status.pipelines)} pipeline(s) registered"
    )
    return 0
