"""RLix's scheduling policy (protocol.md, "RLix's scheduling policy") as a core ``Planner``.

The baseline the simulator compares against, implemented from the written description:
  1. planned releases: shrink every rank of those generation clusters;
  2. non-generation requests by priority, FIFO within a priority, needing the whole mapping:
     every generation rank of ANY pipeline on a needed GPU is shrunk at once (EAGER: even when
     the request still cannot be granted this cycle); granted when all its GPUs are free;
     later requests may backfill (no reservation);
  3. generation by gap ratio: remaining demand x tp weights, budget = idle GPUs + active
     generation GPUs of the considered pipelines, target = max(tp, round_half_up(share x
     budget / tp) x tp); repeatedly activate a rank of the pipeline with the largest positive
     normalised gap, on free GPUs or GPUs of pipelines with a negative gap (never below one
     rank, never a rank moved earlier in the cycle); stop when no move helps.
Pipelines that never reported progress are skipped in step 3 (their ranks are invisible).
Moving ranks away from pipelines (rebalancing) only happens when a request is pending or demand
and active shares differ by more than 10 percentage points (RLix's background rebalancing).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from rlix_plugins.coordinator.core import (
    GpuOwner,
    Grant,
    Plan,
    RankMove,
    SchedulerState,
    ShrinkReason,
)
from rlix_plugins.protocol.types import Priority

_TAKEN = GpuOwner("<taken>", None, Priority.INITIALIZATION)


def round_half_up(x: float) -> int:
    """Round to nearest, halves up (not Python's banker's rounding)."""
    return math.floor(x + 0.5)


@dataclass(slots=True)
class _Pipe:
    cluster_id: str
    tp: int
    dp_size: int
    remaining: int
    active: set[int]
    target_gpus: int = 0
    fresh: set[int] = field(default_factory=set)

    @property
    def active_gpus(self) -> int:
        return len(self.active) * self.tp

    def gap(self) -> float:
        if self.target_gpus <= 0:
            return 0.0
        return (self.target_gpus - self.active_gpus) / self.target_gpus


class RlixPlanner:
    """RLix's policy, for comparison (see module docstring)."""

    #: RLix activates at most this many ranks per cycle ("planning exceeded limits")
    max_activations = 1000
    #: background rebalancing threshold (share difference)
    rebalance_threshold = 0.10

    def plan(self, state: SchedulerState, now: float) -> Plan:
        owner: list[GpuOwner | None] = list(state.owner)
        active = {c: set(r) for c, r in state.active_ranks.items()}
        shrinks: list[RankMove] = []
        moved: set[tuple[str, int]] = set()

        def shrink(cid: str, rank: int, reason: ShrinkReason, to: str | None) -> None:
            gpus = state.clusters[cid].rank_gpus(rank)
            active[cid].discard(rank)
            for g in gpus:
                owner[g] = None
            moved.add((cid, rank))
            shrinks.append(RankMove(cid, rank, gpus, reason, to))

        # 1. planned releases
        released: list[str] = []
        for cid in state.planned_releases:
            for rank in sorted(active.get(cid, ())):
                shrink(cid, rank, ShrinkReason.PLANNED_RELEASE, None)
            released.append(cid)
        # 2. non-generation requests: eager preemption, no reservation
        grants: list[Grant] = []
        for req in sorted(
            (r for r in state.pending.values() if r.priority is not Priority.GENERATION),
            key=lambda r: (r.priority, r.seq),
        ):
            spec = state.clusters[req.cluster_id]
            for g in spec.gpus:
                o = owner[g]
                if o is not None and o.dp_rank is not None and o.cluster_id != "<taken>":
                    shrink(o.cluster_id, o.dp_rank, ShrinkReason.PREEMPT, req.cluster_id)
            if all(owner[g] is None for g in spec.gpus):
                grants.append(Grant(req.cluster_id, spec.gpus))
                for g in spec.gpus:
                    owner[g] = _TAKEN
        # 3. generation by gap ratio
        expands = self._generation(state, owner, active, moved, shrinks)
        return Plan(
            revision=state.revision,
            shrinks=tuple(shrinks),
            expands=tuple(expands),
            grants=tuple(grants),
            completed_releases=tuple(released),
        )

    def _remaining(self, state: SchedulerState, pipeline_id: str, cid: str) -> int | None:
        streams = state.progress.get(pipeline_id)
        if not streams:
            return None  # never reported: invisible to step 3
        remaining = sum(r.remaining for r in streams.values())
        pending = state.pending.get(cid)
        if (
            pending is not None
            and pending.priority is Priority.GENERATION
            and pending.step_target_estimate is not None
        ):
            remaining += pending.step_target_estimate
        return remaining

    def _generation(
        self,
        state: SchedulerState,
        owner: list[GpuOwner | None],
        active: dict[str, set[int]],
        moved: set[tuple[str, int]],
        shrinks: list[RankMove],
    ) -> list[RankMove]:
        pipes: dict[str, _Pipe] = {}
        for cid, ranks in active.items():
            if cid in state.holdings or cid in state.planned_releases:
                continue
            spec = state.clusters[cid]
            pending = state.pending.get(cid)
            has_pending = pending is not None and pending.priority is Priority.GENERATION
            remaining = self._remaining(state, spec.pipeline_id, cid)
            if remaining is None:
                continue
            # eligible: a pending request, active ranks, or an allocation (demand this step)
            if not (has_pending or ranks or remaining > 0):
                continue
            pipes[cid] = _Pipe(cid, spec.tp, spec.dp_size, remaining, ranks)
        if not pipes:
            return []
        budget = sum(1 for o in owner if o is None) + sum(p.active_gpus for p in pipes.values())
        total = sum(p.remaining * p.tp for p in pipes.values())
        for p in pipes.values():
            share = p.remaining * p.tp / total if total > 0 else 0.0
            p.target_gpus = max(p.tp, round_half_up(share * budget / p.tp) * p.tp)
        may_rebalance = any(
            r.priority is Priority.GENERATION for r in state.pending.values()
        ) or self._shares_differ(pipes, budget)
        expands: list[RankMove] = []
        blocked: set[str] = set()
        while len(expands) < self.max_activations:
            candidates = sorted(
                (p for p in pipes.values() if p.gap() > 0 and p.cluster_id not in blocked),
                key=lambda p: (-p.gap(), p.cluster_id),
            )
            if not candidates:
                break
            p = candidates[0]
            choice = self._find_rank(state, owner, pipes, p, moved, may_rebalance)
            if choice is None:
                blocked.add(p.cluster_id)
                continue
            rank, donors = choice
            for dcid, drank in donors:
                gpus = state.clusters[dcid].rank_gpus(drank)
                active[dcid].discard(drank)
                for g in gpus:
                    owner[g] = None
                moved.add((dcid, drank))
                shrinks.append(RankMove(dcid, drank, gpus, ShrinkReason.REBALANCE, p.cluster_id))
            gpus = state.clusters[p.cluster_id].rank_gpus(rank)
            for g in gpus:
                owner[g] = GpuOwner(p.cluster_id, rank, Priority.GENERATION)
            p.active.add(rank)
            p.fresh.add(rank)
            moved.add((p.cluster_id, rank))
            expands.append(RankMove(p.cluster_id, rank, gpus))
            blocked.clear()  # a move changes gaps: everyone may try again
        return expands

    def _shares_differ(self, pipes: dict[str, _Pipe], budget: int) -> bool:
        total_w = sum(p.remaining * p.tp for p in pipes.values())
        total_a = sum(p.active_gpus for p in pipes.values())
        if total_w <= 0 or total_a <= 0 or budget <= 0:
            return False
        return any(
            abs(p.remaining * p.tp / total_w - p.active_gpus / total_a) > self.rebalance_threshold
            for p in pipes.values()
        )

    def _find_rank(
        self,
        state: SchedulerState,
        owner: list[GpuOwner | None],
        pipes: dict[str, _Pipe],
        p: _Pipe,
        moved: set[tuple[str, int]],
        may_rebalance: bool,
    ) -> tuple[int, list[tuple[str, int]]] | None:
        spec = state.clusters[p.cluster_id]
        takeable: tuple[int, list[tuple[str, int]]] | None = None
        for rank in range(spec.dp_size):
            if rank in p.active or (p.cluster_id, rank) in moved:
                continue
            donors: dict[tuple[str, int], None] = {}
            ok = True
            for g in spec.rank_gpus(rank):
                o = owner[g]
                if o is None:
                    continue
                if o.dp_rank is None or not may_rebalance:
                    ok = False
                    break
                d = pipes.get(o.cluster_id)
                if d is None or d is p or d.gap() >= 0 or (o.cluster_id, o.dp_rank) in moved:
                    ok = False
                    break
                donors[(o.cluster_id, o.dp_rank)] = None
            if not ok:
                continue
            if not donors:
                return rank, []
            if takeable is None:
                per: dict[str, int] = {}
                for dcid, _ in donors:
                    per[dcid] = per.get(dcid, 0) + 1
                if all(len(pipes[c].active) - n >= 1 for c, n in per.items()):
                    takeable = (rank, list(donors))
        return takeable
