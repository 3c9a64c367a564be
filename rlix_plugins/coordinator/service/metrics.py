"""Prometheus metrics of the scheduler through Ray's metrics API (``ray.util.metrics``).

Ray exports them on each node's metrics endpoint (scraped by Prometheus, shown in Ray's
dashboard). Names are prefixed ``rlix_``; tags carry the control-plane namespace so two
coordinators on one Ray cluster do not mix.
"""

from __future__ import annotations

from typing import Any

_CYCLE_BOUNDARIES_S = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0, 30.0]
_WAIT_BOUNDARIES_S = [0.001, 0.01, 0.1, 0.5, 1.0, 5.0, 15.0, 60.0, 300.0, 1800.0]


class SchedulerMetrics:
    """Counters, histograms and gauges the scheduler actor updates."""

    def __init__(self, namespace: str) -> None:
        from ray.util import metrics

        self._tags = {"namespace": namespace}
        keys = ("namespace",)
        self.allocations = metrics.Counter(
            "rlix_allocations",
            description="Grants and generation-rank activations",
            tag_keys=(*keys, "kind", "priority"),
        )
        self.preemptions = metrics.Counter(
            "rlix_preemptions",
            description="Generation ranks shrunk, by reason",
            tag_keys=(*keys, "reason"),
        )
        self.waits = metrics.Histogram(
            "rlix_wait_seconds",
            description="Time a request_gpus call waited for its grant",
            boundaries=_WAIT_BOUNDARIES_S,
            tag_keys=(*keys, "priority"),
        )
        self.cycle_latency = metrics.Histogram(
            "rlix_cycle_seconds",
            description="Scheduling cycle latency: plan + RPCs + commit",
            boundaries=_CYCLE_BOUNDARIES_S,
            tag_keys=keys,
        )
        self.failures = metrics.Counter(
            "rlix_pipeline_failures",
            description="Pipelines declared dead, by cause",
            tag_keys=(*keys, "cause"),
        )
        self.call_failures = metrics.Counter(
            "rlix_protocol_call_failures",
            description="Protocol calls that raised (refused, timed out), by method and error",
            tag_keys=(*keys, "method", "error"),
        )
        self.gpus_allocated = metrics.Gauge(
            "rlix_gpus_allocated", description="GPUs with an owner", tag_keys=keys
        )
        self.pending = metrics.Gauge(
            "rlix_pending_requests", description="request_gpus calls waiting", tag_keys=keys
        )
        self.pipelines = metrics.Gauge(
            "rlix_pipelines", description="Registered pipelines", tag_keys=keys
        )

    def _t(self, **extra: Any) -> dict[str, str]:
        return {**self._tags, **{k: str(v) for k, v in extra.items()}}

    def allocated(self, kind: str, priority: str, n: int = 1) -> None:
        self.allocations.inc(n, tags=self._t(kind=kind, priority=priority))

    def preempted(self, reason: str, n: int = 1) -> None:
        self.preemptions.inc(n, tags=self._t(reason=reason))

    def waited(self, priority: str, seconds: float) -> None:
        self.waits.observe(seconds, tags=self._t(priority=priority))

    def cycle(self, seconds: float) -> None:
        self.cycle_latency.observe(seconds, tags=self._t())

    def failed(self, cause: str) -> None:
        self.failures.inc(1, tags=self._t(cause=cause))

    def call_failed(self, method: str, error: str) -> None:
        self.call_failures.inc(1, tags=self._t(method=method, error=error))

    def gauges(self, *, allocated: int, pending: int, pipelines: int) -> None:
        self.gpus_allocated.set(allocated, tags=self._t())
        self.pending.set(pending, tags=self._t())
        self.pipelines.set(pipelines, tags=self._t())
