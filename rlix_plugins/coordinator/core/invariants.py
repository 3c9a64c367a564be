"""Numbered invariants, checked on every plan before it is applied and on state after commit.

State invariants
  S1  every owned GPU names a registered cluster whose mapping contains that GPU
  S2  ownership is consistent both ways: a whole-cluster holding owns exactly its mapping, an
      active generation rank owns exactly ``mapping[d*tp:(d+1)*tp]``, nothing else is owned
  S3  idle GPUs + allocated GPUs = all GPUs (no GPU lost, none counted twice): the ownership
      table has exactly one entry per GPU of the topology
  S4  a cluster is never both a whole-cluster holding and has active generation ranks
  S5  at most one pending request per cluster, and never for a cluster that already has it
      (a whole-cluster holding, or active ranks for a GENERATION request)
  S6  a warming rank (committed, its expand still running) is an active rank
  S7  a pipeline whose run is over (``SchedulerState.end_run``) is registered and has no
      progress stream and no pending GENERATION request
  S8  a cluster recorded as starving (``SchedulerState.starving_since``) is a registered
      generation cluster with no active rank

Plan invariants
  P1  a shrink names an active rank; an expand names an inactive rank of a generation cluster;
      either names exactly that rank's GPUs; no rank is both shrunk and expanded, nor moved
      twice, in one plan
  P2  every GPU a grant or expand takes is idle once the plan's shrinks are applied
      (no GPU is ever handed to two owners)
  P3  no GPU is taken twice within one plan
  P4  a grant covers the cluster's whole registered mapping and answers a pending request
  P5  every shrink is a planned release or frees GPUs that this same plan gives to someone else
      (never preempt for a request that still cannot be satisfied)
  P6  a completed release leaves its cluster with no active rank (counting the plan's expands)
  P7  nothing of a fenced pipeline moves: no grant to it, no expand or shrink of its ranks
      (its shards cannot be told to sleep; what it holds stays until it is unregistered)
  P8  a registration token the plan carries is its pipeline's current registration (a plan
      is checked as it is made; its commit skips a registration that ended meanwhile)
"""

from __future__ import annotations

from rlix_plugins.coordinator.core.model import ClusterSpec, GpuOwner
from rlix_plugins.coordinator.core.plan import Plan, ShrinkReason
from rlix_plugins.coordinator.core.state import SchedulerState
from rlix_plugins.errors import RlixPluginsError
from rlix_plugins.protocol.types import Priority


class InvariantViolation(RlixPluginsError, AssertionError):
    """A plan or state broke a numbered invariant; the plan is not applied."""

    def __init__(self, code: str, detail: str) -> None:
        super().__init__(f"{code}: {detail}")
        self.code = code


def _registered(state: SchedulerState, cid: str, what: str) -> ClusterSpec:
    spec = state.clusters.get(cid)
    if spec is None:
        raise InvariantViolation("S1", f"{what} of {cid!r}, which is not a registered cluster")
    return spec


def _expected_owners(state: SchedulerState) -> dict[int, tuple[str, int | None]]:
    expected: dict[int, tuple[str, int | None]] = {}
    for cid in state.holdings:
        for g in _registered(state, cid, "whole-cluster holding").gpus:
            if g in expected:
                raise InvariantViolation("S2", f"GPU {g} expected for {expected[g]} and {cid}")
            expected[g] = (cid, None)
    for cid, ranks in state.active_ranks.items():
        if ranks and cid in state.holdings:
            raise InvariantViolation("S4", f"{cid} is held whole and has active ranks")
        if not ranks:
            continue
        spec = _registered(state, cid, "active ranks")
        for r in ranks:
            if not 0 <= r < spec.dp_size:
                raise InvariantViolation(
                    "S2", f"{cid} has active rank {r} outside 0..{spec.dp_size}"
                )
            for g in spec.rank_gpus(r):
                if g in expected:
                    raise InvariantViolation(
                        "S2", f"GPU {g} claimed by {expected[g]} and ({cid}, {r})"
                    )
                expected[g] = (cid, r)
    return expected


def check_state(state: SchedulerState) -> None:
    """Raise :class:`InvariantViolation` if the state breaks S1-S8."""
    if len(state.owner) != state.topology.num_gpus:
        raise InvariantViolation(
            "S3",
            f"ownership table has {len(state.owner)} entries for {state.topology.num_gpus} GPUs",
        )
    expected = _expected_owners(state)
    owned = 0
    for g, o in enumerate(state.owner):
        if o is None:
            if g in expected:
                raise InvariantViolation("S2", f"GPU {g} should be owned by {expected[g]}")
            continue
        owned += 1
        spec = state.clusters.get(o.cluster_id)
        if spec is None or g not in spec.gpus:
            raise InvariantViolation("S1", f"GPU {g} owned by unknown/unmapped {o.cluster_id}")
        if expected.get(g) != (o.cluster_id, o.dp_rank):
            raise InvariantViolation(
                "S2", f"GPU {g} owned by {(o.cluster_id, o.dp_rank)}, expected {expected.get(g)}"
            )
    if owned != len(expected):
        idle = state.topology.num_gpus - owned
        raise InvariantViolation(
            "S3", f"idle {idle} + allocated {len(expected)} != {state.topology.num_gpus}"
        )
    for cid, req in state.pending.items():
        if req.cluster_id != cid or cid not in state.clusters:
            raise InvariantViolation("S5", f"pending request {req} filed under {cid}")
        if cid in state.holdings:
            raise InvariantViolation("S5", f"{cid} has a pending request and holds its GPUs")
        if req.priority is Priority.GENERATION and state.active_ranks.get(cid):
            raise InvariantViolation(
                "S5", f"{cid} has a pending GENERATION request and active ranks (answered)"
            )
    for cid, rank in state.warming:
        if rank not in state.active_ranks.get(cid, {}):
            raise InvariantViolation("S6", f"warming rank ({cid}, {rank}) is not active")
    for pid in state.runs_over:
        if pid not in state.pipelines or state.progress.get(pid):
            raise InvariantViolation("S7", f"run-over pipeline {pid} is unknown or has demand")
        for c in state.pipelines[pid].clusters:
            waiting = state.pending.get(c.cluster_id)
            if waiting is not None and waiting.priority is Priority.GENERATION:
                raise InvariantViolation("S7", f"run-over {c.cluster_id} has a GENERATION request")
    for cid in state.starving_since:
        ranks = state.active_ranks.get(cid)  # None: not a registered generation cluster
        if ranks is None or ranks:
            raise InvariantViolation(
                "S8", f"{cid} is recorded as starving but is not a rank-less generation cluster"
            )


def check_plan(state: SchedulerState, plan: Plan) -> None:
    """Raise :class:`InvariantViolation` if applying ``plan`` to ``state`` would break P1-P8."""
    owner: list[GpuOwner | None] = list(state.owner)
    moved: set[tuple[str, int]] = set()
    active_after = {c: set(r) for c, r in state.active_ranks.items()}
    for m in plan.shrinks:
        key = (m.cluster_id, m.dp_rank)
        if key in moved or m.dp_rank not in state.active_ranks.get(m.cluster_id, {}):
            raise InvariantViolation("P1", f"shrink of {key}: not active or moved twice")
        gpus = state.clusters[m.cluster_id].rank_gpus(m.dp_rank)
        if m.gpus != gpus:
            raise InvariantViolation("P1", f"shrink of {key} names GPUs {m.gpus}, not {gpus}")
        moved.add(key)
        active_after[m.cluster_id].discard(m.dp_rank)
        for g in gpus:
            owner[g] = None
    taken: dict[int, str] = {}

    def take(gpus: tuple[int, ...], who: str) -> None:
        for g in gpus:
            if g in taken:
                raise InvariantViolation("P3", f"GPU {g} taken by {taken[g]} and {who}")
            if owner[g] is not None:
                raise InvariantViolation("P2", f"GPU {g} given to {who} but held by {owner[g]}")
            taken[g] = who

    for grant in plan.grants:
        spec = state.clusters.get(grant.cluster_id)
        if spec is None or grant.gpus != spec.gpus:
            raise InvariantViolation("P4", f"grant {grant.cluster_id} is not its whole mapping")
        if grant.cluster_id not in state.pending:
            raise InvariantViolation("P4", f"grant {grant.cluster_id} answers no pending request")
        take(grant.gpus, grant.cluster_id)
    for m in plan.expands:
        key = (m.cluster_id, m.dp_rank)
        spec = state.clusters.get(m.cluster_id)
        if spec is None or not spec.is_generation or not 0 <= m.dp_rank < spec.dp_size:
            raise InvariantViolation("P1", f"expand of {key}: not a generation rank")
        if key in moved or m.dp_rank in active_after.get(m.cluster_id, set()):
            raise InvariantViolation("P1", f"expand of {key}: already active or moved twice")
        if m.gpus != spec.rank_gpus(m.dp_rank):
            raise InvariantViolation("P1", f"expand of {key} names GPUs {m.gpus}")
        moved.add(key)
        active_after.setdefault(m.cluster_id, set()).add(m.dp_rank)
        take(m.gpus, m.cluster_id)
    for m in plan.shrinks:
        if m.reason is ShrinkReason.PLANNED_RELEASE:
            if m.cluster_id not in state.planned_releases:
                raise InvariantViolation("P5", f"planned-release shrink of {m.cluster_id} unasked")
            continue
        if not any(g in taken for g in m.gpus):
            raise InvariantViolation(
                "P5", f"shrink of ({m.cluster_id}, {m.dp_rank}) frees GPUs nobody takes"
            )
    for cid in plan.completed_releases:
        if active_after.get(cid):
            raise InvariantViolation("P6", f"release of {cid} completed with ranks still active")
    if state.fenced:
        for cid in (
            *(g.cluster_id for g in plan.grants),
            *(m.cluster_id for m in (*plan.shrinks, *plan.expands)),
        ):
            spec = state.clusters.get(cid)
            if spec is not None and spec.pipeline_id in state.fenced:
                raise InvariantViolation("P7", f"plan moves {cid} of fenced {spec.pipeline_id}")
    for entry in plan.registrations:
        pid, token = entry
        if state.registrations.get(pid) != token:
            raise InvariantViolation(
                "P8",
                f"plan is for registration {token} of {pid!r}; current is "
                f"{state.registrations.get(pid)}",
            )
