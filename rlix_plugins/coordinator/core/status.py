"""A read-only view of the scheduler state for people and tools (``get_status``, the CLI).

Pure: built from a :class:`SchedulerState` and ``now``; no Ray, no clock, no I/O. The records
are frozen dataclasses so they pickle across Ray and cannot be mutated by a caller.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from rlix_plugins.coordinator.core.state import SchedulerState


@dataclass(frozen=True, slots=True)
class GpuStatus:
    """One GPU: who holds it and at which stage (``owner_cluster`` None = idle)."""

    gpu: int
    node: int
    owner_cluster: str | None = None
    owner_pipeline: str | None = None
    dp_rank: int | None = None
    #: the priority name the GPU is held at (GENERATION for an active inference rank)
    stage: str | None = None


@dataclass(frozen=True, slots=True)
class ClusterStatus:
    """One registered GPU cluster of a pipeline."""

    cluster_id: str
    name: str
    tp: int
    gpus: tuple[int, ...]
    held_gpus: tuple[int, ...]
    #: generation clusters only: active DP ranks
    active_ranks: tuple[int, ...]
    #: whole-cluster holding: the priority name it was granted at
    held_at: str | None
    #: a waiting ``request_gpus``: its priority name
    pending: str | None
    #: active ranks whose background expand (wake + weight sync) has not finished: their GPUs
    #: are owned but they do not serve yet (``SchedulerState.warming``)
    warming_ranks: tuple[int, ...] = ()
    #: generation clusters only: seconds it has wanted ranks and had none
    #: (``SchedulerState.starving_since``); None when it is not starving
    starving_s: float | None = None


@dataclass(frozen=True, slots=True)
class StreamStatus:
    """One progress stream of a pipeline (``(mode, adapter_id)``: train, val, a LoRA ...)."""

    mode: str
    adapter_id: str | None
    step_target: int
    completed: int
    remaining: int
    #: requests admitted and not finished over every step its staleness bound lets it
    #: generate (the optional ``outstanding`` metric); None when not reported
    outstanding: int | None = None


@dataclass(frozen=True, slots=True)
class PipelineStatus:
    """One registered pipeline."""

    pipeline_id: str
    ray_namespace: str
    weight: float
    #: remaining trajectories (progress streams, else the last estimate); None = unknown
    demand: int | None
    progress_streams: int
    clusters: tuple[ClusterStatus, ...]
    #: failed and being killed: what it holds is frozen until it is unregistered
    #: (``SchedulerState.fenced``)
    fenced: bool = False
    #: its training run has ended (``SchedulerState.end_run``): no demand, it is saving or
    #: shutting down and unregisters next
    run_over: bool = False
    #: its progress streams, sorted by (mode, adapter): what ``demand`` adds up
    streams: tuple[StreamStatus, ...] = ()


@dataclass(frozen=True, slots=True)
class WaitingRequest:
    """A ``request_gpus`` call waiting for a grant, in queue order (priority, then FIFO)."""

    cluster_id: str
    priority: str
    waited_s: float
    global_step: int | None
    step_target_estimate: int | None


@dataclass(frozen=True, slots=True)
class DeadPipeline:
    """A pipeline the service declared dead, and why (kept for the status view)."""

    pipeline_id: str
    reason: str
    at: float


@dataclass(frozen=True, slots=True)
class CoordinatorStatus:
    """Everything ``rlix-plugins status`` shows."""

    revision: int
    num_nodes: int
    gpus_per_node: int
    gpus: tuple[GpuStatus, ...]
    pipelines: tuple[PipelineStatus, ...]
    wait_queue: tuple[WaitingRequest, ...]
    planned_releases: tuple[str, ...]
    dead_pipelines: tuple[DeadPipeline, ...] = ()
    #: pipelines fenced (failed, not yet unregistered), sorted
    fenced_pipelines: tuple[str, ...] = ()

    @property
    def idle_gpus(self) -> tuple[int, ...]:
        return tuple(g.gpu for g in self.gpus if g.owner_cluster is None)

    def owners(self) -> dict[int, str | None]:
        """GPU -> owning pipeline id (None = idle)."""
        return {g.gpu: g.owner_pipeline for g in self.gpus}

    def pipeline(self, pipeline_id: str) -> PipelineStatus | None:
        for p in self.pipelines:
            if p.pipeline_id == pipeline_id:
                return p
        return None


def build_status(
    state: SchedulerState,
    now: float,
    *,
    dead: Iterable[DeadPipeline] = (),
) -> CoordinatorStatus:
    """Snapshot ``state`` into a :class:`CoordinatorStatus` (nothing is mutated)."""
    topo = state.topology
    gpus = []
    for g, o in enumerate(state.owner):
        if o is None:
            gpus.append(GpuStatus(gpu=g, node=topo.node_of(g)))
            continue
        spec = state.clusters.get(o.cluster_id)
        gpus.append(
            GpuStatus(
                gpu=g,
                node=topo.node_of(g),
                owner_cluster=o.cluster_id,
                owner_pipeline=spec.pipeline_id if spec else None,
                dp_rank=o.dp_rank,
                stage=o.priority.name,
            )
        )
    pipelines = []
    for pid in sorted(state.pipelines):
        pspec = state.pipelines[pid]
        clusters = []
        for c in pspec.clusters:
            held = state.holdings.get(c.cluster_id)
            pending = state.pending.get(c.cluster_id)
            clusters.append(
                ClusterStatus(
                    cluster_id=c.cluster_id,
                    name=c.name,
                    tp=c.tp,
                    gpus=c.gpus,
                    held_gpus=state.held_gpus(c.cluster_id),
                    active_ranks=tuple(sorted(state.active_ranks.get(c.cluster_id, {}))),
                    held_at=held.name if held is not None else None,
                    pending=pending.priority.name if pending is not None else None,
                    warming_ranks=tuple(
                        sorted(r for cid, r in state.warming if cid == c.cluster_id)
                    ),
                    starving_s=(
                        None
                        if (since := state.starving_since.get(c.cluster_id)) is None
                        else max(0.0, now - since)
                    ),
                )
            )
        pipelines.append(
            PipelineStatus(
                pipeline_id=pid,
                ray_namespace=pspec.ray_namespace,
                weight=pspec.weight,
                demand=state.demand(pid),
                progress_streams=len(state.progress.get(pid, {})),
                clusters=tuple(clusters),
                fenced=pid in state.fenced,
                run_over=pid in state.runs_over,
                streams=_streams(state, pid),
            )
        )
    queue = sorted(state.pending.values(), key=lambda r: (int(r.priority), r.seq))
    wait_queue = tuple(
        WaitingRequest(
            cluster_id=r.cluster_id,
            priority=r.priority.name,
            waited_s=max(0.0, now - r.submitted_at),
            global_step=r.global_step,
            step_target_estimate=r.step_target_estimate,
        )
        for r in queue
    )
    return CoordinatorStatus(
        revision=state.revision,
        num_nodes=topo.num_nodes,
        gpus_per_node=topo.gpus_per_node,
        gpus=tuple(gpus),
        pipelines=tuple(pipelines),
        wait_queue=wait_queue,
        planned_releases=tuple(sorted(state.planned_releases)),
        dead_pipelines=tuple(dead),
        fenced_pipelines=tuple(sorted(state.fenced)),
    )


def _streams(state: SchedulerState, pipeline_id: str) -> tuple[StreamStatus, ...]:
    reports = state.progress.get(pipeline_id) or {}
    out = []
    for (mode, adapter), r in sorted(reports.items(), key=lambda kv: (kv[0][0], kv[0][1] or "")):
        out.append(
            StreamStatus(
                mode=mode,
                adapter_id=adapter,
                step_target=r.step_target_trajectories,
                completed=r.completed,
                remaining=r.remaining,
                outstanding=r.outstanding,
            )
        )
    return tuple(out)


def format_status(status: CoordinatorStatus, *, extra: Mapping[str, str] | None = None) -> str:
    """Render a status as the plain-text tables ``rlix-plugins status`` prints."""
    lines = [
        f"coordinator revision {status.revision}: {status.num_nodes} node(s) x "
        f"{status.gpus_per_node} GPU(s), {len(status.idle_gpus)} idle"
    ]
    for key, value in (extra or {}).items():
        lines.append(f"  {key}: {value}")
    lines.append("")
    lines.append("PIPELINES")
    if not status.pipelines:
        lines.append("  (none registered)")
    for p in status.pipelines:
        demand = "unknown" if p.demand is None else str(p.demand)
        fenced = "  FENCED" if p.fenced else ""
        fenced += "  RUN OVER" if p.run_over else ""
        lines.append(
            f"  {p.pipeline_id}{fenced}  ns={p.ray_namespace}  weight={p.weight:g}  "
            f"demand={demand}  streams={p.progress_streams}"
        )
        for s in p.streams:
            name = s.mode if s.adapter_id is None else f"{s.mode}/{s.adapter_id}"
            more = "" if s.outstanding is None else f" outstanding={s.outstanding}"
            lines.append(
                f"    stream {name:<12} {s.completed}/{s.step_target} done  "
                f"remaining={s.remaining}{more}"
            )
        for c in p.clusters:
            state = []
            if c.held_at:
                state.append(f"held@{c.held_at}")
            if c.active_ranks:
                state.append(f"active ranks {list(c.active_ranks)}")
            if c.warming_ranks:
                state.append(f"warming ranks {list(c.warming_ranks)}")
            if c.pending:
                state.append(f"waiting@{c.pending}")
            if c.starving_s is not None:
                state.append(f"no rank for {c.starving_s:.0f}s")
            lines.append(
                f"    {c.name:<12} tp={c.tp} gpus={list(c.gpus)} holds={list(c.held_gpus)} "
                f"{' '.join(state) or 'idle'}"
            )
    lines.append("")
    lines.append("GPUS")
    lines.append(f"  {'gpu':>4} {'node':>4}  {'owner':<40} {'rank':>4}  stage")
    for g in status.gpus:
        owner = g.owner_cluster or "-"
        rank = "-" if g.dp_rank is None else str(g.dp_rank)
        lines.append(f"  {g.gpu:>4} {g.node:>4}  {owner:<40} {rank:>4}  {g.stage or 'idle'}")
    lines.append("")
    lines.append("WAIT QUEUE")
    if not status.wait_queue:
        lines.append("  (empty)")
    for w in status.wait_queue:
        est = "" if w.step_target_estimate is None else f" estimate={w.step_target_estimate}"
        step = "" if w.global_step is None else f" step={w.global_step}"
        lines.append(f"  {w.cluster_id:<40} {w.priority:<15} waited {w.waited_s:.1f}s{step}{est}")
    if status.planned_releases:
        lines.append(f"  planned releases: {list(status.planned_releases)}")
    if status.fenced_pipelines:
        lines.append("")
        lines.append("FENCED PIPELINES (failed; holdings frozen until unregistered)")
        for pid in status.fenced_pipelines:
            lines.append(f"  {pid}")
    if status.dead_pipelines:
        lines.append("")
        lines.append("DEAD PIPELINES")
        for d in status.dead_pipelines:
            lines.append(f"  {d.pipeline_id}: {d.reason}")
    return "\n".join(lines)
