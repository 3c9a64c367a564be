"""A scheduling plan: what one cycle decides, before anything is applied."""

from __future__ import annotations

import enum
from collections import defaultdict
from dataclasses import dataclass

from rlix_plugins.protocol.names import parse_cluster_id


class ShrinkReason(str, enum.Enum):
    """Why a generation rank is shrunk (kept in the trace and metrics)."""

    PLANNED_RELEASE = "planned_release"  # await_release_gpus
    PREEMPT = "preempt"  # its GPUs go to a non-generation grant in this plan
    REBALANCE = "rebalance"  # its GPUs go to another pipeline's generation rank
    #: its GPUs go to a pipeline that has had no rank for ``PolicyConfig.starve_after_s``
    #: although its pipeline was not above its target (the planner's starvation guard)
    STARVATION = "starvation"


@dataclass(frozen=True, slots=True)
class RankMove:
    """Shrink or expand one generation DP rank."""

    cluster_id: str
    dp_rank: int
    gpus: tuple[int, ...]
    reason: ShrinkReason | None = None
    #: for a shrink: the cluster that takes its GPUs in this plan (None for a planned release)
    beneficiary: str | None = None


@dataclass(frozen=True, slots=True)
class Grant:
    """A non-generation (or whole-cluster) request granted its whole mapping."""

    cluster_id: str
    gpus: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Plan:
    """One cycle's decisions; RPCs apply shrinks (all of them) before expands."""

    revision: int
    shrinks: tuple[RankMove, ...] = ()
    expands: tuple[RankMove, ...] = ()
    grants: tuple[Grant, ...] = ()
    completed_releases: tuple[str, ...] = ()
    #: ``(pipeline_id, registration token)`` of each pipeline the plan touches, as when it was
    #: planned (:meth:`SchedulerState.stamp`): the plan's resizes run outside the lock, and a
    #: pipeline may unregister meanwhile and register again under the same id; its commit
    #: applies nothing to that successor. A pipeline with no token here is not checked (a
    #: plan committed as soon as it is made: recovery, the simulator's policies).
    registrations: tuple[tuple[str, int], ...] = ()

    @property
    def empty(self) -> bool:
        return not (self.shrinks or self.expands or self.grants or self.completed_releases)

    def cluster_ids(self) -> set[str]:
        """Every cluster the plan shrinks, expands, grants or completes a release of."""
        cids = {m.cluster_id for m in (*self.shrinks, *self.expands)}
        cids.update(g.cluster_id for g in self.grants)
        cids.update(self.completed_releases)
        return cids

    def pipeline_ids(self) -> set[str]:
        """Every pipeline the plan touches."""
        return {parse_cluster_id(c)[0] for c in self.cluster_ids()}

    def shrinks_by_cluster(self) -> dict[str, list[int]]:
        """``resize_infer(dp_ranks_to_remove=...)`` calls, one per cluster."""
        out: dict[str, list[int]] = defaultdict(list)
        for m in self.shrinks:
            out[m.cluster_id].append(m.dp_rank)
        return {c: sorted(r) for c, r in out.items()}

    def expands_by_cluster(self) -> dict[str, list[int]]:
        """``resize_infer(dp_ranks_to_add=...)`` calls, one per cluster."""
        out: dict[str, list[int]] = defaultdict(list)
        for m in self.expands:
            out[m.cluster_id].append(m.dp_rank)
        return {c: sorted(r) for c, r in out.items()}
