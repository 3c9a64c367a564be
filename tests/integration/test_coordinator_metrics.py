"""The scheduler's Prometheus metrics, read back from Ray's metrics endpoint."""

from __future__ import annotations

import re
import time
import urllib.request
from typing import Any

import pytest

from rlix_plugins.errors import ProtocolError
from rlix_plugins.protocol import Priority

pytestmark = pytest.mark.integration


def scrape(ray: Any) -> str:
    port = ray._private.worker.global_worker.node.metrics_export_port
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        body: str = resp.read().decode()
    return body


def sample(body: str, name: str, namespace: str, **tags: str) -> float | None:
    """Sum of the samples of ``name`` carrying ``namespace`` and ``tags`` (None if absent)."""
    total: float | None = None
    for line in body.splitlines():
        if not line.startswith(name + "{"):
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0]))
        if labels.get("namespace") != namespace:
            continue
        if any(labels.get(k) != v for k, v in tags.items()):
            continue
        total = (total or 0.0) + float(line.rsplit(" ", 1)[1])
    return total


def test_grants_gauges_and_cycle_latency_reach_prometheus(coordinator: Any) -> None:
    import ray

    orch, sched, ns = coordinator.orchestrator, coordinator.scheduler, coordinator.namespace
    pid = ray.get(orch.allocate_pipeline_id.remote("ft"))
    ray.get(
        orch.register_pipeline.remote(
            pipeline_id=pid,
            ray_namespace=f"pipeline_{pid}_NS",
            cluster_tp_configs={"actor_train": 1},
            cluster_device_mappings={"actor_train": [0, 1]},
        )
    )
    ray.get(orch.admit_pipeline.remote(pipeline_id=pid))
    gpus = ray.get(
        sched.request_gpus.remote(cluster_id=f"{pid}_actor_train", priority=Priority.ACTOR_TRAINING)
    )
    assert gpus == [0, 1]
    with pytest.raises(ProtocolError):  # a refused call is counted by method and error
        ray.get(sched.request_gpus.remote(cluster_id=f"{pid}_actor_train", priority=9))
    # Ray exports application metrics every few seconds: poll, bounded.
    deadline = time.monotonic() + 60
    allocated = grants = cycles = refused = None
    while time.monotonic() < deadline:
        body = scrape(ray)
        allocated = sample(body, "ray_rlix_gpus_allocated", ns)
        grants = sample(body, "ray_rlix_allocations_total", ns, priority="ACTOR_TRAINING")
        cycles = sample(body, "ray_rlix_cycle_seconds_count", ns)
        refused = sample(body, "ray_rlix_protocol_call_failures_total", ns,
                         method="request_gpus", error="ProtocolError")
        if allocated == 2 and grants and cycles and refused:
            break
        time.sleep(1)
    assert allocated == 2, f"gpus_allocated gauge = {allocated}"
    assert grants is not None and grants >= 1, f"allocations counter = {grants}"
    assert cycles is not None and cycles >= 1, f"cycle latency histogram count = {cycles}"
    assert refused == 1, f"protocol call failures counter = {refused}"
