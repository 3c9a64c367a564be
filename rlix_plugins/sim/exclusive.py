"""Exclusive allocation as a :class:`~rlix_plugins.coordinator.core.Planner`.

Each job owns its GPUs (the placer gives disjoint training and rollout GPUs; the engine runs
with resident shards), so the planner never moves a GPU between jobs: it grants requests whose
GPUs are idle, activates every rank a generating pipeline has, and honours planned releases.
"""

from __future__ import annotations

from rlix_plugins.coordinator.core import (
    GpuOwner,
    Grant,
    Plan,
    RankMove,
    SchedulerState,
    ShrinkReason,
)
from rlix_plugins.protocol.types import Priority

#: Marks GPUs handed out within the cycle being planned.
_TAKEN = GpuOwner("<taken>", None, Priority.INITIALIZATION)


class ExclusivePlanner:
    """Dedicated GPUs per job: no preemption, no sharing."""

    def plan(self, state: SchedulerState, now: float) -> Plan:
        owner = list(state.owner)
        shrinks: list[RankMove] = []
        released: list[str] = []
        for cid in state.planned_releases:
            spec = state.clusters[cid]
            for rank in sorted(state.active_ranks.get(cid, {})):
                gpus = spec.rank_gpus(rank)
                shrinks.append(RankMove(cid, rank, gpus, ShrinkReason.PLANNED_RELEASE))
                for g in gpus:
                    owner[g] = None
            released.append(cid)
        grants: list[Grant] = []
        for req in sorted(state.pending.values(), key=lambda r: (r.priority, r.seq)):
            if req.priority is Priority.GENERATION:
                continue
            spec = state.clusters[req.cluster_id]
            if all(owner[g] is None for g in spec.gpus):
                grants.append(Grant(req.cluster_id, spec.gpus))
                for g in spec.gpus:
                    owner[g] = _TAKEN
        expands: list[RankMove] = []
        shrunk = {(m.cluster_id, m.dp_rank) for m in shrinks}
        for cid, ranks in state.active_ranks.items():
            if cid in state.holdings or cid in state.planned_releases:
                continue
            pending = state.pending.get(cid)
            if not ranks and (pending is None or pending.priority is not Priority.GENERATION):
                continue
            spec = state.clusters[cid]
            for rank in range(spec.dp_size):
                gpus = spec.rank_gpus(rank)
                if rank in ranks or (cid, rank) in shrunk:
                    continue
                if all(owner[g] is None for g in gpus):
                    expands.append(RankMove(cid, rank, gpus))
                    for g in gpus:
                        owner[g] = _TAKEN
        return Plan(
            revision=state.revision,
            shrinks=tuple(shrinks),
            expands=tuple(expands),
            grants=tuple(grants),
            completed_releases=tuple(released),
        )
