"""Records of the scheduling core: topology, registered clusters, owners, pending requests."""

from __future__ import annotations

from dataclasses import dataclass

from rlix_plugins.errors import SettingsError
from rlix_plugins.protocol.names import GENERATION_CLUSTER
from rlix_plugins.protocol.types import Priority


@dataclass(frozen=True, slots=True)
class Topology:
    """The GPUs the coordinator arbitrates: ``num_nodes`` x ``gpus_per_node``.

    A global GPU id is ``node_rank * gpus_per_node + local_gpu``.
    """

    num_nodes: int
    gpus_per_node: int

    def __post_init__(self) -> None:
        if self.num_nodes < 1 or self.gpus_per_node < 1:
            raise ValueError(
                f"topology needs num_nodes >= 1 and gpus_per_node >= 1, got "
                f"{self.num_nodes} x {self.gpus_per_node}"
            )

    @property
    def num_gpus(self) -> int:
        return self.num_nodes * self.gpus_per_node

    def node_of(self, gpu: int) -> int:
        return gpu // self.gpus_per_node


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    """One registered GPU cluster of a pipeline (validated, immutable)."""

    cluster_id: str
    pipeline_id: str
    name: str
    tp: int
    gpus: tuple[int, ...]

    @property
    def is_generation(self) -> bool:
        return self.name == GENERATION_CLUSTER

    @property
    def dp_size(self) -> int:
        return len(self.gpus) // self.tp

    def rank_gpus(self, dp_rank: int) -> tuple[int, ...]:
        """GPUs of generation DP rank ``dp_rank``: ``gpus[d*tp:(d+1)*tp]``."""
        return self.gpus[dp_rank * self.tp : (dp_rank + 1) * self.tp]


@dataclass(frozen=True, slots=True)
class PipelineSpec:
    """A registered pipeline: its namespace, clusters and scheduling weight."""

    pipeline_id: str
    ray_namespace: str
    clusters: tuple[ClusterSpec, ...]
    weight: float = 1.0

    def cluster(self, name: str) -> ClusterSpec | None:
        for spec in self.clusters:
            if spec.name == name:
                return spec
        return None

    @property
    def generation(self) -> ClusterSpec | None:
        return self.cluster(GENERATION_CLUSTER)


@dataclass(frozen=True, slots=True)
class GpuOwner:
    """Who holds a GPU: a whole-cluster grant (``dp_rank`` None) or one generation rank."""

    cluster_id: str
    dp_rank: int | None
    priority: Priority


@dataclass(frozen=True, slots=True)
class PendingRequest:
    """A ``request_gpus`` call waiting for a grant."""

    cluster_id: str
    priority: Priority
    seq: int
    submitted_at: float
    global_step: int | None = None
    step_target_estimate: int | None = None
    lora_name: str | None = None


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    """Knobs of our scheduling policy (see planner.py for what each does)."""

    #: A non-generation request gains one priority level per ``aging_s`` waited, so nothing
    #: starves behind a stream of higher-priority requests.
    aging_s: float = 60.0
    #: A generation rank activated less than ``min_hold_s`` ago is not taken away to rebalance
    #: generation (it still yields to training), so shards do not flip-flop.
    min_hold_s: float = 5.0
    #: Rebalancing between generation pipelines only happens when the receiver's shortfall is at
    #: least this fraction of its target (hysteresis band); free GPUs are always used.
    rebalance_threshold: float = 0.25
    #: After targets are met, leftover free GPUs go to pipelines with remaining demand.
    work_conserving: bool = True
    #: Rebalancing takes the donor rank carrying the least work: lowest ``rank_load`` the
    #: pipeline reported (optional progress metric), then the most recently activated.
    prefer_idle_donors: bool = True
    #: A pipeline's demand is ``max(remaining, outstanding)`` when it reports the optional
    #: ``outstanding`` metric: an async pipeline already generating for its next step needs
    #: GPUs for those requests too, not only for what is left of its oldest batch.
    count_outstanding: bool = True
    #: A non-generation request that cannot be granted reserves its GPUs against lower-ranked
    #: requests only once it has waited ``reserve_after_s`` (before that they may take them:
    #: holding GPUs back for a request that has barely waited costs more than it saves).
    reserve_after_s: float = 600.0
    #: A lower-ranked request may still take reserved GPUs when its expected holding (its
    #: cluster's last one) ends before the reserving request may start (EASY backfilling).
    backfill: bool = True
    #: While a rank of a group of overlapping generation clusters is still waking (background
    #: expands, ``SchedulerState.warming``), no rank is moved between that group's pipelines:
    #: moves wait for the wakes, as they do when every cycle awaits its expands, so rebalancing
    #: does not act on shares that are still changing. Idle GPUs and non-generation requests
    #: are still granted, and other groups are not held. No effect when cycles await their
    #: expands (nothing is warming when a cycle plans).
    pace_moves_by_wakes: bool = True
    #: A generation cluster that has wanted ranks and had none for ``starve_after_s``
    #: (``SchedulerState.starving_since``) takes its one guaranteed rank from a pipeline at or
    #: below its target, as long as that pipeline keeps a rank of its own. Shares alone can
    #: leave it waiting as long as its neighbour's demand lasts: in a chain of overlapping
    #: spans, idle GPUs only one end reaches inflate the other end's targets, so no donor is
    #: ever above target (docs/coordinator.md, "Generation shares"). ``math.inf`` turns it off.
    starve_after_s: float = 300.0

    def __post_init__(self) -> None:
        # Written as "not (valid)" so NaN, which fails every comparison, is refused too.
        if not (
            self.aging_s > 0
            and self.min_hold_s >= 0
            and 0 <= self.rebalance_threshold <= 1
            and self.reserve_after_s >= 0
            and self.starve_after_s >= 0
        ):
            raise SettingsError(
                "PolicyConfig needs aging_s > 0, min_hold_s >= 0, 0 <= rebalance_threshold <= 1, "
                f"reserve_after_s >= 0, starve_after_s >= 0; got {self!r}"
            )
