"""Which placement-group bundle each NeMo RL worker takes under partial overlap (pure).

The coordinator is told, per pipeline, the global GPU ids of its inference and training
clusters (:meth:`NemoRlLayout.device_mappings`; global id = ``node_rank * gpus_per_node +
local_gpu``, node ranks in the coordinator's order). Ray decides which physical GPU each
placement-group bundle gets and never lets a caller choose, so the adapter asks Ray where the
bundles landed (one probe per bundle) and this module turns that answer into each role's
bundle list, or raises :class:`PlacementError` when the layout cannot be honoured. Rank ``r``
of a role takes the bundle of the role's ``r``-th GPU in ascending order, the order
``device_mappings`` uses, so inference dp shard ``s`` sits on GPUs
``sorted(infer)[s*tp:(s+1)*tp]``.

Nothing here imports Ray or NeMo RL: :mod:`rlix_plugins.adapters.nemo_rl_placement` does the
probing and the NeMo RL side.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rlix_plugins.adapters.shared_groups import (
    PINNED_WORKER_GROUPS,
    SHARED_NODE_BUNDLE,
    PlacementError,
    check_one_group_per_node,
)
from rlix_plugins.protocol.names import ACTOR_INFER, ACTOR_TRAIN
from rlix_plugins.values import is_int

#: ``RayVirtualCluster`` names ``grpo.setup`` gives its non-colocated clusters -> our roles.
GRPO_CLUSTER_ROLES: Mapping[str, str] = {
    "grpo_train_cluster": ACTOR_TRAIN,
    "grpo_inference_cluster": ACTOR_INFER,
}
#: Name of the colocated cluster (policy and vLLM on every GPU): left as NeMo RL builds it.
GRPO_COLOCATED_CLUSTER = "grpo_policy_cluster"
#: Worker groups sharing a bundle, as NeMo RL's colocated mode: each worker asks for
#: ``1 / SHARED_WORKER_GROUPS`` of the bundle's GPU, so Ray's accounting lets a training and
#: an inference worker sit on the same GPU; the coordinator decides which one computes.
SHARED_WORKER_GROUPS = 2


@dataclass(frozen=True, slots=True)
class BundleGpu:
    """Where Ray put one bundle of the shared placement group."""

    bundle_index: int
    node_id: str
    local_gpu: int


@dataclass(frozen=True, slots=True)
class RolePlacement:
    """One role's workers: rank ``r`` takes ``bundles[r]``, which is GPU ``gpus[r]``."""

    role: str
    gpus: tuple[int, ...]
    bundles: tuple[int, ...]
    #: index of each bundle's node among the placement group's sorted node ids (NeMo RL's
    #: ``node_idx`` of a tied group)
    node_indices: tuple[int, ...]

    @property
    def world_size(self) -> int:
        return len(self.gpus)

    def bundle_groups(self, group_size: int = 1) -> list[tuple[int, list[int]]]:
        """NeMo RL's ``bundle_indices_list``: consecutive ``group_size`` bundles per group."""
        if group_size < 1 or self.world_size % group_size:
            raise PlacementError(
                f"{self.role}: {self.world_size} GPUs do not split into groups of {group_size}"
            )
        return [
            (self.node_indices[i], list(self.bundles[i:i + group_size]))
            for i in range(0, self.world_size, group_size)
        ]


@dataclass(frozen=True, slots=True)
class PlacementPlan:
    """Both roles on one placement group: training bundles are a subset of inference ones."""

    gpus_per_node: int
    node_ranks: Mapping[str, int]
    bundle_gpus: tuple[BundleGpu, ...]
    infer: RolePlacement
    train: RolePlacement
    #: True on the coordinator's shared per-node groups: every worker of node ``n`` takes
    #: bundle 0 of group ``n`` and is pinned to its GPU by CUDA_VISIBLE_DEVICES
    #: (:func:`pinned_worker_env`); ``bundle_gpus`` is then empty.
    pinned: bool = False
    #: Ray node id of each node rank's shared group (pinned plans only).
    node_ids: tuple[str, ...] = ()

    def local_gpu(self, role: str, rank: int) -> int:
        """Node-local GPU of rank ``rank`` of ``role``."""
        return self.role(role).gpus[rank] % self.gpus_per_node

    def role(self, role: str) -> RolePlacement:
        if role == ACTOR_INFER:
            return self.infer
        if role == ACTOR_TRAIN:
            return self.train
        raise PlacementError(f"unknown role {role!r}; valid: {ACTOR_INFER!r}, {ACTOR_TRAIN!r}")

    def global_gpu_of_bundle(self, bundle_index: int) -> int:
        if self.pinned:
            raise PlacementError("a pinned plan has one bundle per node, not one per GPU")
        b = self.bundle_gpus[bundle_index]
        return self.node_ranks[b.node_id] * self.gpus_per_node + b.local_gpu

    def device_mappings(self) -> dict[str, list[int]]:
        """The device mappings this placement realises (what the coordinator must be told)."""
        return {ACTOR_INFER: list(self.infer.gpus), ACTOR_TRAIN: list(self.train.gpus)}


def bundles_per_node(gpus: Sequence[int], gpus_per_node: int) -> dict[int, int]:
    """How many bundles each node rank needs for ``gpus`` (global ids)."""
    counts: dict[int, int] = {}
    for g in gpus:
        counts[g // gpus_per_node] = counts.get(g // gpus_per_node, 0) + 1
    return dict(sorted(counts.items()))


def _refuse_repeats(infer_gpus: Sequence[int], train_gpus: Sequence[int]) -> None:
    """A GPU named twice in one role would put two of its ranks on one GPU."""
    for name, gpus in (("inference", infer_gpus), ("training", train_gpus)):
        if len(set(gpus)) != len(gpus):
            raise PlacementError(
                f"{name} GPUs {list(gpus)} name a GPU twice; each rank needs a GPU of its own"
            )


def plan_placement(
    infer_gpus: Sequence[int],
    train_gpus: Sequence[int],
    bundle_gpus: Sequence[BundleGpu],
    node_ranks: Mapping[str, int],
    gpus_per_node: int,
) -> PlacementPlan:
    """Map each layout GPU to the bundle Ray put on it; raise if the two disagree.

    ``bundle_gpus`` is what Ray answered for the shared placement group (one bundle per
    inference GPU); ``node_ranks`` gives each Ray node id its coordinator node rank.
    """
    if gpus_per_node < 1:
        raise PlacementError(f"gpus_per_node must be >= 1, got {gpus_per_node}")
    if sorted(b.bundle_index for b in bundle_gpus) != list(range(len(bundle_gpus))):
        raise PlacementError("bundle probe must name every bundle 0..n-1 exactly once")
    _refuse_repeats(infer_gpus, train_gpus)
    extra = sorted(set(train_gpus) - set(infer_gpus))
    if extra:
        raise PlacementError(
            f"training GPUs {extra} are not inference GPUs; partial overlap needs training "
            "GPUs to be a subset of the inference GPUs"
        )
    where: dict[int, int] = {}
    for b in sorted(bundle_gpus, key=lambda b: b.bundle_index):
        if b.node_id not in node_ranks:
            raise PlacementError(
                f"bundle {b.bundle_index} is on Ray node {b.node_id}, which has no node rank "
                f"(GPU nodes known: {sorted(node_ranks)})"
            )
        if not 0 <= b.local_gpu < gpus_per_node:
            raise PlacementError(
                f"bundle {b.bundle_index} reports local GPU {b.local_gpu}, outside 0.."
                f"{gpus_per_node - 1} of its node"
            )
        g = node_ranks[b.node_id] * gpus_per_node + b.local_gpu
        if g in where:
            raise PlacementError(
                f"bundles {where[g]} and {b.bundle_index} both report GPU {g}; each "
                "inference GPU needs a bundle of its own"
            )
        where[g] = b.bundle_index
    wanted = sorted(set(infer_gpus))
    if sorted(where) != wanted:
        placed = ", ".join(f"bundle {b} -> GPU {g}" for g, b in sorted(where.items(),
                                                                         key=lambda x: x[1]))
        raise PlacementError(
            f"the layout puts inference on GPUs {wanted} but Ray placed the shared bundles "
            f"on GPUs {sorted(where)} ({placed}); Ray picks the GPU of each bundle, so the "
            "GPUs the layout names must be free (not held by other actors or placement "
            "groups) when the pipeline starts, or policy.generation.rlix.infer_gpus / "
            "train_gpus must name the GPUs Ray gives"
        )
    node_ids = sorted({b.node_id for b in bundle_gpus})
    node_index = {nid: i for i, nid in enumerate(node_ids)}
    by_bundle = {b.bundle_index: b for b in bundle_gpus}

    def role(name: str, gpus: Sequence[int]) -> RolePlacement:
        ordered = tuple(sorted(gpus))
        bundles = tuple(where[g] for g in ordered)
        return RolePlacement(
            name, ordered, bundles, tuple(node_index[by_bundle[b].node_id] for b in bundles)
        )

    return PlacementPlan(
        gpus_per_node=gpus_per_node,
        node_ranks=dict(node_ranks),
        bundle_gpus=tuple(sorted(bundle_gpus, key=lambda b: b.bundle_index)),
        infer=role(ACTOR_INFER, infer_gpus),
        train=role(ACTOR_TRAIN, train_gpus),
    )


def plan_pinned(
    infer_gpus: Sequence[int],
    train_gpus: Sequence[int],
    node_ids: Sequence[str],
    gpus_per_node: int,
) -> PlacementPlan:
    """Plan on the coordinator's shared per-node groups (one ``{GPU: gpus_per_node}`` bundle
    per node; ``node_ids[n]`` is where node rank ``n``'s group sits). Every layout GPU exists
    there, so the only errors are layouts that name no such GPU or break partial overlap, and
    groups that share a Ray node (their GPU ids would alias)."""
    if gpus_per_node < 1:
        raise PlacementError(f"gpus_per_node must be >= 1, got {gpus_per_node}")
    check_one_group_per_node(node_ids)
    total = len(node_ids) * gpus_per_node
    extra = sorted(set(train_gpus) - set(infer_gpus))
    if extra:
        raise PlacementError(
            f"training GPUs {extra} are not inference GPUs; partial overlap needs training "
            "GPUs to be a subset of the inference GPUs"
        )
    _refuse_repeats(infer_gpus, train_gpus)
    for name, gpus in (("inference", infer_gpus), ("training", train_gpus)):
        outside = sorted(g for g in gpus if not 0 <= g < total)
        if outside:
            raise PlacementError(
                f"{name} GPUs {outside} do not exist: the coordinator's shared placement "
                f"groups cover {len(node_ids)} node(s) of {gpus_per_node} GPUs (global GPU "
                f"ids 0..{total - 1})"
            )

    def role(name: str, gpus: Sequence[int]) -> RolePlacement:
        ordered = tuple(sorted(gpus))
        return RolePlacement(name, ordered, tuple(SHARED_NODE_BUNDLE for _ in ordered),
                             tuple(g // gpus_per_node for g in ordered))

    return PlacementPlan(
        gpus_per_node=gpus_per_node,
        node_ranks={nid: i for i, nid in enumerate(node_ids)},
        bundle_gpus=(),
        infer=role(ACTOR_INFER, infer_gpus),
        train=role(ACTOR_TRAIN, train_gpus),
        pinned=True,
        node_ids=tuple(node_ids),
    )


#: Set on pinned workers: the node's GPUs, for workers that address GPUs by physical index
#: (:func:`widen_to_node_gpus`).
NODE_GPUS_ENV = "RLIX_NODE_GPUS"


def pinned_worker_env(local_gpu: int, gpus_per_node: int | None = None) -> dict[str, str]:
    """Environment that pins a worker to ``local_gpu`` of its node, as ROLL does: Ray's own
    CUDA_VISIBLE_DEVICES (from its fractional-GPU accounting) is switched off for the actor.
    With ``gpus_per_node`` the node's GPU list is passed too (:data:`NODE_GPUS_ENV`), for
    workers that must widen their visibility (:func:`widen_to_node_gpus`)."""
    env = {
        "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1",
        "CUDA_VISIBLE_DEVICES": str(local_gpu),
    }
    if gpus_per_node is not None:
        env[NODE_GPUS_ENV] = ",".join(str(g) for g in range(gpus_per_node))
    return env


def widen_to_node_gpus(environ: dict[str, str] | Any) -> str | None:
    """Make a pinned worker see every GPU of its node; returns the pinned GPU (None when the
    worker is not pinned, or already widened).

    NeMo RL's Megatron policy worker runs ``torch.cuda.set_device(ray.get_gpu_ids()[0])``:
    it expects CUDA_VISIBLE_DEVICES to list the node's GPUs, so that Ray's GPU id is also the
    CUDA ordinal (its ``configure_worker`` sets RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES).
    Pinned with CUDA_VISIBLE_DEVICES=g, Ray reports ``[g]`` (its ids are mapped through the
    variable the worker started with), so for g >= 1 that ordinal does not exist. With the
    node's list visible, ordinal g is physical GPU g: the pinned one. Must run before the
    process initialises CUDA (the worker's ``__init__`` is the first CUDA call).
    """
    node = environ.get(NODE_GPUS_ENV)
    pinned = environ.get("CUDA_VISIBLE_DEVICES")
    if not node or pinned is None or pinned == node:
        return None
    if pinned not in node.split(","):
        raise PlacementError(
            f"pinned worker: CUDA_VISIBLE_DEVICES={pinned} is not one of the node's GPUs "
            f"{NODE_GPUS_ENV}={node}"
        )
    import sys

    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        raise PlacementError(
            f"pinned worker on GPU {pinned}: CUDA is already initialised, so the node's GPUs "
            "can no longer be made visible; widen before the first CUDA call"
        )
    environ["CUDA_VISIBLE_DEVICES"] = node
    return pinned


def check_device_mappings(plan: PlacementPlan, registered: Mapping[str, Sequence[int]]) -> None:
    """Raise unless the mappings told to the coordinator are the ones this plan realises."""
    actual = plan.device_mappings()
    wrong = {
        role: (sorted(registered.get(role, [])), gpus)
        for role, gpus in actual.items()
        if sorted(registered.get(role, [])) != gpus
    }
    if wrong:
        lines = "; ".join(f"{r}: coordinator told {told}, workers placed on {placed}"
                          for r, (told, placed) in sorted(wrong.items()))
        raise PlacementError(f"device mappings disagree with the placement: {lines}")


@dataclass(frozen=True, slots=True)
class WorkerGpu:
    """What one worker process reports about its GPU (``ray.get_gpu_ids()``, env)."""

    rank: int
    gpu_ids: tuple[int, ...]
    cuda_visible_devices: str | None
    node_id: str


def check_worker_gpus(
    plan: PlacementPlan, role: str, observed: Sequence[WorkerGpu],
    ranks: Sequence[int] | None = None,
) -> None:
    """Raise unless each worker holding a GPU is on its rank's planned GPU.

    On a pinned plan the check is what the worker sees: CUDA_VISIBLE_DEVICES must be exactly
    its rank's node-local GPU (or, widened, the node's GPUs with Ray's id = that GPU), on the
    node of that node rank's shared group.

    ``ranks``: the role ranks that hold a GPU in Ray's accounting (default: all). A vLLM
    tensor-parallel follower asks Ray for no GPU (vLLM places it itself) and reports none.
    """
    placement = plan.role(role)
    expected_ranks = list(range(placement.world_size)) if ranks is None else list(ranks)
    got = {w.rank: w for w in observed}
    problems: list[str] = []
    for r in expected_ranks:
        w = got.get(r)
        if w is None:
            problems.append(f"rank {r}: no report")
            continue
        want = placement.gpus[r]
        local = want % plan.gpus_per_node
        if plan.pinned:
            want_node = plan.node_ids[placement.node_indices[r]]
            # A widened worker (widen_to_node_gpus) sees the node's GPUs and addresses its
            # own by Ray's id, which Ray mapped through the pinned variable.
            widened = w.gpu_ids == (local,) and w.cuda_visible_devices == ",".join(
                str(g) for g in range(plan.gpus_per_node)
            )
            if (w.cuda_visible_devices != str(local) and not widened) or w.node_id != want_node:
                problems.append(
                    f"rank {r}: sees CUDA_VISIBLE_DEVICES={w.cuda_visible_devices} on node "
                    f"{w.node_id[:12]}, planned GPU {want} = CUDA_VISIBLE_DEVICES={local} on "
                    f"node {want_node[:12]} (shared group of node rank "
                    f"{placement.node_indices[r]})"
                )
            continue
        want_node = plan.bundle_gpus[placement.bundles[r]].node_id
        if w.gpu_ids != (local,) or w.node_id != want_node:
            problems.append(
                f"rank {r}: on GPU {list(w.gpu_ids)} of node {w.node_id[:12]} "
                f"(CUDA_VISIBLE_DEVICES={w.cuda_visible_devices}), planned GPU {want} = local "
                f"{local} of node {want_node[:12]} (bundle {placement.bundles[r]})"
            )
    if problems:
        raise PlacementError(f"{role} workers are not where the layout says: "
                             + "; ".join(problems))


def _checked_rlix_section(generation_cfg: Mapping[str, Any] | None) -> dict[str, Any]:
    """``policy.generation.rlix`` after checking the types of its layout keys.

    :class:`NemoRlLayout` converts with ``int(...)``, which would read ``"01"`` as GPUs 0 and
    1, ``0.7`` as GPU 0 and ``True`` as GPU 1, and fails untyped on a bare number.
    """
    raw = (generation_cfg or {}).get("rlix") or {}
    if not isinstance(raw, Mapping):
        raise PlacementError(
            f"policy.generation.rlix must be a mapping (keys infer_gpus, train_gpus, "
            f"train_gpu_count), got {type(raw).__name__} {raw!r}"
        )
    section = dict(raw)
    for key in ("infer_gpus", "train_gpus"):
        if key not in section:
            continue
        gpus = section[key]
        if isinstance(gpus, (str, bytes, Mapping)) or not isinstance(gpus, Sequence) or any(
            not is_int(g) or g < 0 for g in gpus
        ):
            raise PlacementError(
                f"policy.generation.rlix.{key}={gpus!r} is not valid; valid: a list of global "
                "GPU ids, integers >= 0 (e.g. [0, 1])"
            )
    count = section.get("train_gpu_count", 1)
    if not is_int(count):
        raise PlacementError(
            f"policy.generation.rlix.train_gpu_count={count!r} is not valid; valid: an "
            "integer >= 1 (at most the number of inference GPUs)"
        )
    return section


def layout_gpus(generation_cfg: Mapping[str, Any] | None, default_world: int,
                model_parallel: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(inference GPUs, training GPUs) from ``policy.generation.rlix``, as
    :meth:`NemoRlLayout.from_generation_config` reads them (defaults: inference on
    ``range(default_world)``, training on the first ``train_gpu_count`` (1) of them)."""
    from rlix_plugins.adapters.nemo_rl import NemoRlLayout

    explicit = "infer_gpus" in _checked_rlix_section(generation_cfg)
    if not explicit and default_world % model_parallel:
        raise PlacementError(
            f"inference world size {default_world} is not a multiple of tp*pp={model_parallel}"
        )
    layout = NemoRlLayout.from_generation_config(
        generation_cfg, 0 if explicit else default_world // model_parallel, model_parallel
    )
    return tuple(layout.infer_gpus), tuple(layout.train_gpus)


def report_worker_gpu(actor_self: Any) -> tuple[list[int], str | None, str]:
    """Run inside a worker (``actor.__ray_call__``): its GPU ids, CUDA_VISIBLE_DEVICES, node.

    Lives in this light module so any NeMo RL venv that imports ``rlix_plugins`` can run it.
    """
    import os

    import ray

    gpus = [int(g) for g in ray.get_gpu_ids()]
    node: str = ray.get_runtime_context().get_node_id()
    return gpus, os.environ.get("CUDA_VISIBLE_DEVICES"), node


__all__ = [
    "GRPO_CLUSTER_ROLES",
    "GRPO_COLOCATED_CLUSTER",
    "NODE_GPUS_ENV",
    "PINNED_WORKER_GROUPS",
    "SHARED_NODE_BUNDLE",
    "SHARED_WORKER_GROUPS",
    "BundleGpu",
    "PlacementError",
    "PlacementPlan",
    "RolePlacement",
    "WorkerGpu",
    "bundles_per_node",
    "check_device_mappings",
    "check_worker_gpus",
    "layout_gpus",
    "pinned_worker_env",
    "plan_pinned",
    "plan_placement",
    "report_worker_gpu",
    "widen_to_node_gpus",
]
