"""What the scheduler shows of itself: its GPU-ownership timeline (and the file it is written
to) and, when enabled, its Prometheus metrics.

One object, so the scheduler reports each event once (``granted``, ``shrunk``, ...) and never
checks whether metrics are on.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlix_plugins.coordinator.core import RankMove, SchedulerState
from rlix_plugins.coordinator.service.trace import Holder, OwnershipTrace
from rlix_plugins.coordinator.service.trace_writer import TraceWriter

if TYPE_CHECKING:
    from rlix_plugins.coordinator.service.metrics import SchedulerMetrics


class Observer:
    """The scheduler's timeline, its file and (``metrics``) its Prometheus metrics."""

    def __init__(
        self,
        num_gpus: int,
        *,
        namespace: str,
        t0: float,
        trace_dir: str | None,
        metrics: bool,
        keep_task: Callable[[asyncio.Task[None]], None],
    ) -> None:
        self._trace = OwnershipTrace(num_gpus, t0=t0, label=f"rlix ({namespace})")
        self._writer = TraceWriter(
            self._trace, trace_dir=trace_dir, namespace=namespace, keep_task=keep_task
        )
        self.metrics: SchedulerMetrics | None = None
        if metrics:
            # Ray's metrics API is imported only when asked for (it needs a Ray worker).
            from rlix_plugins.coordinator.service.metrics import SchedulerMetrics

            self.metrics = SchedulerMetrics(namespace)

    # -- timeline ------------------------------------------------------------------------------
    def observe(self, state: SchedulerState, now: float) -> None:
        """Record who owns each GPU now (and refresh the gauges; the file is rewritten when
        its last write is old enough)."""
        holders: list[Holder | None] = [
            None if o is None else Holder(o.cluster_id, o.priority.name, o.dp_rank)
            for o in state.owner
        ]
        self._trace.observe(holders, now)
        self.gauges(state)
        self._writer.maybe_write(now)

    def to_json(self, now: float) -> dict[str, Any]:
        """The timeline so far (Chrome trace-event JSON)."""
        return self._trace.to_json(now)

    async def write(self, now: float) -> Path | None:
        """Write the timeline file now; its path (None without a trace dir)."""
        await self._writer.write(now)
        return self._writer.path

    # -- events --------------------------------------------------------------------------------
    def gauges(self, state: SchedulerState) -> None:
        """Allocated GPUs, waiting requests and registered pipelines."""
        if self.metrics is not None:
            self.metrics.gauges(
                allocated=sum(o is not None for o in state.owner),
                pending=len(state.pending),
                pipelines=len(state.pipelines),
            )

    def granted(self, priority: str, waited_s: float | None) -> None:
        """A waiting request was answered (``waited_s`` None: its wait is unknown)."""
        if self.metrics is not None:
            self.metrics.allocated("grant", priority)
            if waited_s is not None:
                self.metrics.waited(priority, waited_s)

    def answered_at_once(self, priority: str) -> None:
        """A request answered from GPUs its cluster already held."""
        if self.metrics is not None:
            self.metrics.waited(priority, 0.0)

    def shrunk(self, move: RankMove, now: float) -> None:
        """A generation rank was shrunk for a reason (preemption, rebalance, ...)."""
        assert move.reason is not None
        if self.metrics is not None:
            self.metrics.preempted(move.reason.value)
        self._trace.instant(
            f"{move.reason.value}: {move.cluster_id}[{move.dp_rank}]",
            move.gpus,
            now,
            beneficiary=move.beneficiary,
        )

    def expanded(self, ranks: int) -> None:
        """Generation ranks activated by a commit."""
        if self.metrics is not None and ranks:
            self.metrics.allocated("generation_rank", "GENERATION", ranks)

    def call_failed(self, method: str, error: str) -> None:
        """A protocol call raised ``error`` (a type name): refused, timed out, cancelled."""
        if self.metrics is not None:
            self.metrics.call_failed(method, error)

    def failed(self, cause: str) -> None:
        """A pipeline was declared dead."""
        if self.metrics is not None:
            self.metrics.failed(cause)

    def cycle(self, seconds: float) -> None:
        """One scheduling cycle's latency (plan + RPCs + commit)."""
        if self.metrics is not None:
            self.metrics.cycle(seconds)
