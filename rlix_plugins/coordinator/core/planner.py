"""Our scheduling policy: a pure ``(state, now) -> Plan`` function.

One cycle:
  1. Planned releases (``await_release_gpus``): shrink every active rank of those clusters.
  2. Non-generation requests by effective priority (priority minus one level per ``aging_s``
     waited), FIFO within a level. A request needs its whole mapping. It is granted only when it
     can be satisfied now: every GPU idle or held by a generation rank (which is preempted).
     A request that cannot be satisfied preempts nothing (unlike RLix). Once it has waited
     ``reserve_after_s`` it reserves its GPUs against lower-ranked requests, so it is not
     starved by backfill; a lower-ranked request still takes reserved GPUs when its expected
     holding (its cluster's last grant-to-release time) ends before the reserving request may
     start (EASY backfilling; unknown durations count as ending now, so nothing unknown
     backfills).
  3. Generation: each eligible pipeline (pending GENERATION request or active ranks) gets a
     target number of TP ranks proportional to ``weight x remaining demand`` over the GPUs
     generation may use (idle + its active ranks). Pipelines furthest below target pick first.
     A pipeline with a pending request and no active rank always gets one rank if any can be
     made free (no starvation; one taken from another pipeline waits for the wakes of its
     group, see below). Ranks are moved from pipelines above target only outside a
     hysteresis band and never when activated less than ``min_hold_s`` ago, so shards do not
     flip-flop; a rank still waking (``state.warming``) is never moved to another pipeline,
     and while one is, no rank is moved between the pipelines of its group of overlapping
     clusters (``pace_moves_by_wakes``; idle GPUs are still given).
     Leftover idle GPUs go to pipelines with remaining demand (work conserving).
A pipeline that never reported progress is still visible: its demand is the estimate of its
last GENERATION request, and its ranks can be given to others. A fenced pipeline
(``SchedulerState.fence``) is frozen: its ranks block requests and are never moved (P7).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from rlix_plugins.coordinator.core.model import GpuOwner, PolicyConfig
from rlix_plugins.coordinator.core.plan import Grant, Plan, RankMove, ShrinkReason
from rlix_plugins.coordinator.core.state import SchedulerState
from rlix_plugins.protocol.types import Priority


class Planner(Protocol):
    """A scheduling policy: reads state, returns a plan, mutates nothing."""

    def plan(self, state: SchedulerState, now: float) -> Plan: ...


#: Marker owner for GPUs given away within the cycle being planned.
_TAKEN = GpuOwner("<taken>", None, Priority.INITIALIZATION)


@dataclass(slots=True)
class _Gen:
    """Per generation cluster bookkeeping during one cycle."""

    cluster_id: str
    gpus: tuple[int, ...]
    tp: int
    dp_size: int
    weight: float
    demand: int
    pending_seq: int | None
    active: set[int]
    target: int = 0
    #: ranks activated in this cycle (never taken back in the same cycle)
    fresh: set[int] = field(default_factory=set)
    #: outside the hysteresis band at the start of the cycle: may take ranks from others
    may_rebalance: bool = False
    #: ranks below this one have no fully idle GPU set. Within the generation step idle GPUs
    #: only ever get taken (a donor's GPUs go straight to a receiver), so this only grows.
    free_cursor: int = 0

    @property
    def gap(self) -> float:
        return (self.target - len(self.active)) / self.target if self.target else 0.0


class _Cycle:
    def __init__(self, state: SchedulerState, now: float, config: PolicyConfig) -> None:
        self.state = state
        self.now = now
        self.config = config
        self.owner: list[GpuOwner | None] = list(state.owner)
        self.active: dict[str, set[int]] = {c: set(r) for c, r in state.active_ranks.items()}
        self.shrinks: list[RankMove] = []
        self.expands: list[RankMove] = []
        self.grants: list[Grant] = []
        self.released: list[str] = []
        self._hints: dict[str, dict[int, float] | None] = {}

    # -- primitives on the scratch ownership -----------------------------------------------
    def _shrink(self, cid: str, rank: int, reason: ShrinkReason, beneficiary: str | None) -> None:
        gpus = self.state.clusters[cid].rank_gpus(rank)
        self.active[cid].discard(rank)
        for g in gpus:
            self.owner[g] = None
        self.shrinks.append(RankMove(cid, rank, gpus, reason, beneficiary))

    def _grow(self, g: _Gen, rank: int) -> None:
        """Expand a rank of an eligible generation cluster (the hot path of big cycles)."""
        tp = g.tp
        gpus = g.gpus[rank * tp : rank * tp + tp]
        g.active.add(rank)
        g.fresh.add(rank)
        marker = GpuOwner(g.cluster_id, rank, Priority.GENERATION)
        owner = self.owner
        for x in gpus:
            owner[x] = marker
        self.expands.append(RankMove(g.cluster_id, rank, gpus))

    # -- 1. planned releases -----------------------------------------------------------------
    def planned_releases(self) -> None:
        for cid in self.state.planned_releases:
            for rank in sorted(self.active.get(cid, ())):
                self._shrink(cid, rank, ShrinkReason.PLANNED_RELEASE, None)
            self.released.append(cid)

    # -- 2. non-generation requests --------------------------------------------------------
    def _effective_priority(self, priority: Priority, waited: float) -> int:
        return max(0, int(priority) - int(max(0.0, waited) // self.config.aging_s))

    def non_generation(self) -> None:
        state = self.state
        requests = sorted(
            (r for r in state.pending.values() if r.priority is not Priority.GENERATION),
            key=lambda r: (self._effective_priority(r.priority, self.now - r.submitted_at), r.seq),
        )
        # GPU -> the earliest a blocked request reserving it may start (a backfill must end
        # by then), and GPU -> the earliest it may be free of holdings and reservations.
        # Both are lower bounds: an unknown duration counts as ending now.
        reserved: dict[int, float] = {}
        free_at: dict[int, float] = {}
        for req in requests:
            spec = state.clusters[req.cluster_id]
            expected = state.last_hold_s.get(req.cluster_id)
            if self._blocked(spec.gpus, reserved, expected):
                if self.now - req.submitted_at < self.config.reserve_after_s:
                    continue  # not waited long enough to hold others back
                start = max(self._free_at(g, free_at) for g in spec.gpus)
                for g in spec.gpus:
                    reserved[g] = min(reserved.get(g, math.inf), start)
                    free_at[g] = start + (expected or 0.0)
                continue
            owner = self.owner
            for g in spec.gpus:
                o = owner[g]
                if o is not None and o.dp_rank is not None:
                    self._shrink(o.cluster_id, o.dp_rank, ShrinkReason.PREEMPT, req.cluster_id)
            for g in spec.gpus:
                owner[g] = _TAKEN
                free_at[g] = self.now + (expected or 0.0)
            self.grants.append(Grant(req.cluster_id, spec.gpus))

    def _blocked(
        self, gpus: tuple[int, ...], reserved: dict[int, float], expected: float | None
    ) -> bool:
        """A request cannot be granted now: a GPU is held whole (or granted this cycle) or by
        a fenced pipeline's rank (which cannot be told to sleep), or reserved by a
        higher-ranked blocked request that it would not leave before that request may start
        (backfill needs its own expected duration)."""
        owner = self.owner
        state = self.state
        for g in gpus:
            o = owner[g]
            if o is not None and (
                o.dp_rank is None
                or (state.fenced and state.clusters[o.cluster_id].pipeline_id in state.fenced)
            ):
                return True
            until = reserved.get(g)
            if until is not None and (
                not self.config.backfill or expected is None or self.now + expected > until
            ):
                return True
        return False

    def _free_at(self, gpu: int, free_at: dict[int, float]) -> float:
        """Earliest time ``gpu`` may be free: a holding ends at its grant time plus the
        cluster's last holding duration (now when unknown or overdue); a generation rank
        yields at once."""
        if gpu in free_at:
            return free_at[gpu]
        o = self.owner[gpu]
        if o is None or o.dp_rank is not None:
            return self.now
        since = self.state.held_since.get(o.cluster_id)
        last = self.state.last_hold_s.get(o.cluster_id)
        if since is None or last is None:
            return self.now
        return max(self.now, since + last)

    # -- 3. generation -----------------------------------------------------------------------
    def _eligible(self) -> dict[str, _Gen]:
        state = self.state
        gens: dict[str, _Gen] = {}
        for cid, active in self.active.items():
            if cid in state.holdings or cid in state.planned_releases:
                continue
            if state.clusters[cid].pipeline_id in state.fenced:
                continue  # frozen: its ranks are neither grown nor given away (P7)
            pending = state.pending.get(cid)
            pending_seq = (
                pending.seq if pending and pending.priority is Priority.GENERATION else None
            )
            spec = state.clusters[cid]
            # A pipeline still collecting must stay eligible after every rank it had was
            # preempted (no pending request then), or it would wait for ranks nobody plans.
            if pending_seq is None and not active and not state.collecting(spec.pipeline_id):
                continue
            demand = state.demand(spec.pipeline_id) or 0
            if self.config.count_outstanding:
                demand = max(demand, state.outstanding(spec.pipeline_id) or 0)
            weight = state.pipelines[spec.pipeline_id].weight
            gens[cid] = _Gen(
                cid, spec.gpus, spec.tp, spec.dp_size, weight, demand, pending_seq, active
            )
        return gens

    def _set_targets(self, gens: dict[str, _Gen]) -> None:
        """Apportion the generation budget (in TP ranks) by weight x remaining demand, per
        group of clusters whose GPUs overlap (:meth:`_groups`).

        A group's budget is its clusters' active ranks plus the idle GPUs they map (RLix's
        gap ratio splits one budget counting every idle GPU of the cluster): an idle GPU no
        cluster of the group maps would inflate its targets until no donor is above target,
        and a pipeline with demand but no rank would never be given one.

        Every pipeline with a pending request or remaining demand is first guaranteed one rank
        (pending requests first, FIFO), the rest is split by largest remainder, so targets
        never add up to more than the budget.
        """
        for group, idle in self._groups(gens):
            self._set_group_targets(group, idle)

    def _groups(self, gens: dict[str, _Gen]) -> list[tuple[list[_Gen], int]]:
        """Clusters joined by shared GPUs (transitively), each with its idle GPU count."""
        items = list(gens.values())
        parent = list(range(len(items)))

        def find(i: int) -> int:
            while parent[i] != i:
                parent[i] = parent[parent[i]]
                i = parent[i]
            return i

        first = [-1] * len(self.owner)  # GPU -> first cluster mapping it
        for i, g in enumerate(items):
            for gpu in g.gpus:
                j = first[gpu]
                if j < 0:
                    first[gpu] = i
                else:
                    ri, rj = find(i), find(j)
                    if ri != rj:
                        parent[ri] = rj
        members: dict[int, list[_Gen]] = {}
        for i, g in enumerate(items):
            members.setdefault(find(i), []).append(g)
        idle = dict.fromkeys(members, 0)
        for gpu, o in enumerate(self.owner):
            if o is None and (j := first[gpu]) >= 0:
                idle[find(j)] += 1
        return [(m, idle[root]) for root, m in members.items()]

    def _set_group_targets(self, group: list[_Gen], idle: int) -> None:
        budget = idle + sum(len(g.active) * g.tp for g in group)
        order = sorted(
            group, key=lambda g: (g.pending_seq is None, g.pending_seq or 0, g.cluster_id)
        )
        for g in order:
            g.target = 0
            if (g.pending_seq is not None or g.demand > 0) and budget >= g.tp:
                g.target = 1
                budget -= g.tp
        total = sum(g.weight * g.demand for g in group)
        if total > 0:
            quotas = {g.cluster_id: g.weight * g.demand / total * budget / g.tp for g in order}
            spare = budget
            for g in order:
                add = min(int(quotas[g.cluster_id]), g.dp_size - g.target)
                g.target += add
                spare -= add * g.tp
            by_remainder = sorted(order, key=lambda g: -(quotas[g.cluster_id] % 1))
            for g in by_remainder:
                if spare >= g.tp and g.target < g.dp_size and g.demand > 0:
                    g.target += 1
                    spare -= g.tp
        else:  # nobody's demand is known: keep what each has
            for g in order:
                g.target = max(g.target, len(g.active))
        for g in order:
            g.may_rebalance = not g.active or g.gap >= self.config.rebalance_threshold

    def _next_free_rank(self, g: _Gen) -> int | None:
        """Lowest inactive rank of ``g`` whose GPUs are all idle (amortised O(1) per cycle)."""
        owner = self.owner
        tp, gpus, active = g.tp, g.gpus, g.active
        rank = g.free_cursor
        while rank < g.dp_size:
            if rank not in active:
                if tp == 1:
                    if owner[gpus[rank]] is None:
                        g.free_cursor = rank
                        return rank
                elif all(owner[gpus[rank * tp + i]] is None for i in range(tp)):
                    g.free_cursor = rank
                    return rank
            rank += 1
        g.free_cursor = rank
        return None

    def _find_rank(self, g: _Gen, gens: dict[str, _Gen]) -> tuple[int, list[GpuOwner]] | None:
        """Cheapest inactive rank of ``g``: all GPUs idle, else taken from donors above target.

        Among ranks that need the same number of donor ranks, the one whose donors carry the
        least work is taken (see :meth:`_donor_cost`): a move aborts what the donor is running.
        """
        free = self._next_free_rank(g)
        if free is not None:
            return free, []
        if not g.may_rebalance:
            return None
        starving = not g.active
        forced = starving and self._starved_long(g)
        best: tuple[int, list[GpuOwner]] | None = None
        best_key: tuple[int, float, float] | None = None
        owner = self.owner
        tp, gpus, active = g.tp, g.gpus, g.active
        for rank in range(g.dp_size):
            if rank in active:
                continue
            donors: dict[tuple[str, int], GpuOwner] = {}
            blocked = False
            for gpu in gpus[rank * tp : rank * tp + tp]:
                o = owner[gpu]
                if o is None:
                    continue
                # Cheap filters first: a whole-cluster holding (or this cycle's grant), or a
                # rank of a pipeline that is not above its target, can never be taken (nor,
                # for a receiver starved too long, a pipeline's last rank).
                r = o.dp_rank
                d = gens.get(o.cluster_id) if r is not None else None
                if (
                    r is None
                    or d is None
                    or r in d.fresh
                    or len(d.active) <= (min(d.target, 1) if forced else d.target)
                ):
                    blocked = True
                    break
                donors[(o.cluster_id, r)] = o
            if blocked or not donors:
                continue
            key = (len(donors), *self._donor_cost(donors.values()))
            if (best_key is None or key < best_key) and self._donors_allowed(
                list(donors.values()), gens, starving, forced
            ):
                best, best_key = (rank, list(donors.values())), key
                if key[:2] == (1, 0.0) and self.config.prefer_idle_donors:
                    break  # one donor rank reported idle: nothing is cheaper
        return best

    def _donor_cost(self, donors: Iterable[GpuOwner]) -> tuple[float, float]:
        """``(reported load, -activation time)`` of the donor ranks: prefer ranks that run the
        fewest requests (``rank_load`` progress metric, when the pipeline reports it), then the
        most recently activated (a router fills old ranks first, so late ranks hold least)."""
        if not self.config.prefer_idle_donors:
            return (0.0, 0.0)
        load = 0.0
        newest = -math.inf
        for o in donors:
            assert o.dp_rank is not None
            hints = self._load_hints(o.cluster_id)
            load += hints.get(o.dp_rank, 0.0) if hints else 0.0
            activated = self.state.active_ranks.get(o.cluster_id, {}).get(o.dp_rank)
            if activated is not None:
                newest = max(newest, activated)
        return (load, -newest)

    def _load_hints(self, cluster_id: str) -> dict[int, float] | None:
        """Per-rank load a pipeline reported in its progress metrics (``rank_load``), cached
        for the cycle; None when it reports none."""
        if cluster_id in self._hints:
            return self._hints[cluster_id]
        hints: dict[int, float] | None = None
        spec = self.state.clusters[cluster_id]
        for report in (self.state.progress.get(spec.pipeline_id) or {}).values():
            raw = (report.metrics or {}).get("rank_load")
            if isinstance(raw, dict):
                hints = hints or {}
                for k, v in raw.items():
                    try:
                        hints[int(k)] = hints.get(int(k), 0.0) + float(v)
                    except (TypeError, ValueError):
                        continue  # a malformed hint is ignored, never an error
        self._hints[cluster_id] = hints
        return hints

    def _starved_long(self, g: _Gen) -> bool:
        """``g`` has wanted ranks and had none for ``starve_after_s``: its guaranteed rank may
        come from a pipeline at or below its target (``PolicyConfig.starve_after_s``)."""
        since = self.state.starving_since.get(g.cluster_id)
        return since is not None and self.now - since >= self.config.starve_after_s

    def _donors_allowed(
        self, donors: list[GpuOwner], gens: dict[str, _Gen], starving: bool, forced: bool = False
    ) -> bool:
        per_cluster: dict[str, int] = {}
        for o in donors:
            assert o.dp_rank is not None
            d = gens.get(o.cluster_id)
            if d is None or o.dp_rank in d.fresh:
                return False
            if (o.cluster_id, o.dp_rank) in self.state.warming:
                # Its wake + sync still runs: taking it would wait for the wake and then throw
                # it away (also for a starving receiver: the GPUs are no sooner free).
                return False
            activated = self.state.active_ranks.get(o.cluster_id, {}).get(o.dp_rank)
            held_briefly = activated is not None and self.now - activated < self.config.min_hold_s
            if held_briefly and d.demand > 0 and not starving:
                return False
            per_cluster[o.cluster_id] = per_cluster.get(o.cluster_id, 0) + 1
        for cid, n in per_cluster.items():
            d = gens[cid]
            floor = 1 if d.demand > 0 and not starving else 0
            keep = max(d.target, floor)
            if forced:  # starved too long: every donor keeps one rank, not its share
                keep = min(keep, 1)
            if len(d.active) - n < keep:
                return False
        return True

    def generation(self) -> None:
        gens = self._eligible()
        if not gens:
            return
        self._set_targets(gens)
        if self.config.pace_moves_by_wakes and self.state.warming:
            self._pace_moves(gens)
        # Pass 1, idle GPUs: receivers in order (starving first, then largest relative gap)
        # take idle ranks up to their target. No one loses anything here, so there is nothing
        # to interleave; this is the bulk of a large cycle and must stay cheap.
        order = sorted(
            (g for g in gens.values() if len(g.active) < g.target),
            key=lambda g: (bool(g.active), -g.gap, g.pending_seq or 0, g.cluster_id),
        )
        for g in order:
            while len(g.active) < g.target and (rank := self._next_free_rank(g)) is not None:
                self._grow(g, rank)
        # Pass 2, moves between pipelines: one rank at a time to whoever is furthest below
        # target, taken from pipelines above theirs (subject to hysteresis and min hold).
        heap = [
            (bool(g.active), -g.gap, g.pending_seq or 0, g.cluster_id)
            for g in order
            if len(g.active) < g.target
        ]
        if not any(len(g.active) > g.target for g in gens.values()) and not any(
            not g.active and self._starved_long(g) for g in order
        ):
            heap = []  # nobody has a rank to give
        heapq.heapify(heap)
        while heap:
            *_, cid = heapq.heappop(heap)
            g = gens[cid]
            found = self._find_rank(g, gens)
            if found is None:
                continue
            rank, donors = found
            # Only the starvation guard takes from a pipeline that is not above its target.
            reason = (
                ShrinkReason.STARVATION
                if any(len(gens[o.cluster_id].active) <= gens[o.cluster_id].target for o in donors)
                else ShrinkReason.REBALANCE
            )
            for o in donors:
                assert o.dp_rank is not None
                self._shrink(o.cluster_id, o.dp_rank, reason, cid)
            self._grow(g, rank)
            if len(g.active) < g.target:
                heapq.heappush(heap, (True, -g.gap, g.pending_seq or 0, cid))
        if self.config.work_conserving:
            self._fill_idle(gens)

    def _pace_moves(self, gens: dict[str, _Gen]) -> None:
        """No moves within a group of overlapping clusters while one of its ranks is waking.

        Under background expands a cycle plans while earlier expands still wake; moving ranks
        then reacts to shares that are still changing and aborts running requests for it
        (unpaced, the saturated long-tail benchmark needed 2.4% more GPU-h/step than with
        cycles that await their expands, paced 0.9%: docs/simulator.md "Background
        expands"). Only the group with the wake waits: a wake elsewhere says nothing about
        its shares, and on a large cluster some wake is almost always running."""
        waking = {cid for cid, _ in self.state.warming}
        for group, _ in self._groups(gens):
            if any(g.cluster_id in waking for g in group):
                for g in group:
                    g.may_rebalance = False

    def _fill_idle(self, gens: dict[str, _Gen]) -> None:
        """Give idle GPUs to pipelines with remaining demand, lowest ranks-per-demand first."""
        heap = [
            (len(g.active) / (g.weight * g.demand), g.cluster_id)
            for g in gens.values()
            if g.demand > 0 and len(g.active) < g.dp_size
        ]
        heapq.heapify(heap)
        while heap:
            _, cid = heapq.heappop(heap)
            g = gens[cid]
            while (rank := self._next_free_rank(g)) is not None:
                self._grow(g, rank)
                if len(g.active) >= g.dp_size:
                    break
                key = (len(g.active) / (g.weight * g.demand), cid)
                if heap and key > heap[0]:
                    heapq.heappush(heap, key)
                    break

    def build(self) -> Plan:
        return self.state.stamp(
            Plan(
                revision=self.state.revision,
                shrinks=tuple(self.shrinks),
                expands=tuple(self.expands),
                grants=tuple(self.grants),
                completed_releases=tuple(self.released),
            )
        )


class DemandSharePlanner:
    """Our policy (see module docstring)."""

    #: the per-cycle planner; a variant overrides one of its steps in a subclass
    cycle_class: type[_Cycle] = _Cycle

    def __init__(self, config: PolicyConfig | None = None) -> None:
        self.config = config or PolicyConfig()

    def plan(self, state: SchedulerState, now: float) -> Plan:
        cycle = self.cycle_class(state, now, self.config)
        cycle.planned_releases()
        cycle.non_generation()
        cycle.generation()
        return cycle.build()
