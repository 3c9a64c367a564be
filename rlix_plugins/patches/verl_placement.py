"""veRL's workers and standalone replicas on the coordinator's shared per-node groups.

Stock veRL reserves whole GPUs through placement groups of its own (one ``{CPU, GPU: 1}``
bundle per GPU), so no other pipeline can share them under Ray's accounting, and once the
coordinator's shared groups hold every GPU (a ROLL or NeMo RL pipeline asked for them) veRL's
cannot be placed at all. Under the coordinator, when its manager runs
(:func:`~rlix_plugins.adapters.shared_groups.find_manager`), the pipeline's claim pins it
(:func:`pin_pipeline`):

* every veRL resource pool of the layout (the trainer's ``global_pool``; each standalone
  replica's ``rollout_pool_<rank>``) is mapped to the layout's global GPUs
  (:func:`pool_gpus`; the layout starts at ``RLIX_VERL_FIRST_GPU``, default 0);
* ``ResourcePoolManager.create_resource_pool`` (the trainer's and each standalone replica's)
  builds :class:`PinnedResourcePool` objects for them, skipping veRL's free-GPU check (the
  shared groups already hold every GPU; the coordinator's claim is the check);
* ``RayWorkerGroup._init_with_resource_pool`` creates each worker of a pinned pool on the
  group of its GPU's node (its one bundle), asking ``1 / PINNED_WORKER_GROUPS`` GPU and no CPU,
  with ``CUDA_VISIBLE_DEVICES`` set to its local GPU. veRL's own ``_create_worker`` still
  builds each worker (its environment, its name ``<prefix><class>_<node>:<local GPU>``).

``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES`` is switched off on pinned workers (set empty,
whatever the job's or the node's environment sets): Ray maps the ids it assigns through the
``CUDA_VISIBLE_DEVICES`` a worker started with, so a worker started with one id gets exactly
that id back (``ray.get_gpu_ids() == ["g"]``, checked in
``tests/integration/test_verl_pinned_placement.py``) and Ray sets ``CUDA_VISIBLE_DEVICES=g``.
veRL's ``Worker`` then takes its default path (CUDA device 0 is GPU ``g``), and veRL's vLLM
server launch, which reads the workers' accelerator ids, starts each engine on the physical
GPUs its workers were pinned to. (With the flag set, veRL's ``Worker`` would call
``set_device(g)`` in a process that sees one GPU.)

Pins are per driver process (:func:`active_pins`): veRL's driver runs one trainer, and the
replicas' pools are created by objects that know nothing of the pipeline. Not pinned (no
manager, or not under the coordinator): veRL places as it always did.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from verl.single_controller.ray.base import RayResourcePool, get_master_addr_port

from rlix_plugins.adapters.shared_groups import (
    PINNED_WORKER_GROUPS,
    SHARED_NODE_BUNDLE,
    PlacementError,
    SharedGroups,
)
from rlix_plugins.errors import SettingsError
from rlix_plugins.protocol.names import ACTOR_INFER, ACTOR_TRAIN

logger = logging.getLogger(__name__)

#: First global GPU of a veRL pipeline's layout on a shared cluster.
ENV_VERL_FIRST_GPU = "RLIX_VERL_FIRST_GPU"
#: veRL's name for the trainer's pool (``PPOTrainer._init_resource_pool_mgr``).
TRAINER_POOL = "global_pool"


def standalone_pool(replica_rank: int) -> str:
    """veRL's name for a standalone replica's pool (``RolloutReplica.init_standalone``)."""
    return f"rollout_pool_{replica_rank}"


def first_gpu(environ: Mapping[str, str] | None = None) -> int:
    """``RLIX_VERL_FIRST_GPU`` (default 0): where the pipeline's layout starts.

    Raises:
        SettingsError: not an int >= 0.
    """
    raw = (os.environ if environ is None else environ).get(ENV_VERL_FIRST_GPU, "").strip()
    if not raw:
        return 0
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise SettingsError(
            f"{ENV_VERL_FIRST_GPU}={raw!r}: must be an int >= 0 (the global GPU id where the "
            "pipeline's trainer GPUs start; node rank * GPUs per node + local GPU)"
        )
    return value


def pool_gpus(layout: Any) -> dict[str, tuple[int, ...]]:
    """veRL pool name -> the global GPUs its ranks take, in rank order, for a
    :class:`~rlix_plugins.adapters.verl.VerlLayout`: the trainer's pool on the trainer GPUs;
    standalone replica ``r`` (ranks after the hybrid ones, as veRL numbers them) on inference
    GPUs ``[r * tp, (r + 1) * tp)`` (hybrid replicas live in the trainer's workers)."""
    mappings = layout.device_mappings()
    infer = mappings[ACTOR_INFER]
    pools = {TRAINER_POOL: tuple(mappings[ACTOR_TRAIN])}
    tp = layout.tp
    for rank in range(layout.hybrid_replicas, layout.num_replicas):
        pools[standalone_pool(rank)] = tuple(infer[rank * tp:(rank + 1) * tp])
    return pools


@dataclass(frozen=True, slots=True)
class PinnedPools:
    """Where each pool of a pinned pipeline puts its ranks."""

    groups: SharedGroups
    #: pool name -> global GPUs in rank order
    pools: Mapping[str, tuple[int, ...]]

    @classmethod
    def plan(cls, layout: Any, groups: SharedGroups) -> PinnedPools:
        """Raises :class:`PlacementError` for a layout GPU the groups do not have."""
        pools = pool_gpus(layout)
        for gpus in pools.values():
            for gpu in gpus:
                groups.locate(gpu)
        return cls(groups, MappingProxyType(pools))

    def gpus_of(self, name: str, count: int) -> tuple[int, ...]:
        """The GPUs of pool ``name``, which veRL builds with ``count`` ranks.

        Raises:
            PlacementError: a pool the layout does not have (e.g. a reward model's or a
                teacher's pool), or another rank count than the layout's.
        """
        gpus = self.pools.get(name)
        if gpus is None:
            raise PlacementError(
                f"veRL resource pool {name!r} is not part of the pipeline's layout; on the "
                f"coordinator's shared groups veRL may build only {sorted(self.pools)}"
            )
        if len(gpus) != count:
            raise PlacementError(
                f"veRL resource pool {name!r} asks for {count} workers, the pipeline's layout "
                f"gives it {len(gpus)} GPUs {list(gpus)}"
            )
        return gpus


_lock = threading.Lock()
_active: PinnedPools | None = None


def active_pins() -> PinnedPools | None:
    """The pins of this process's pipeline (None: veRL places as it always did)."""
    return _active


def set_pins(pins: PinnedPools | None) -> None:
    """Pin this process's pipeline (None unpins). One pipeline per process: pinning a
    second while one is pinned raises :class:`PlacementError` and changes nothing."""
    global _active
    with _lock:
        if pins is not None and _active is not None and _active is not pins:
            raise PlacementError(
                "a veRL pipeline of this process is pinned already; unpin it (its close) "
                "before pinning another"
            )
        _active = pins


def refuse_unpinnable(config: Any) -> None:
    """Raise :class:`PlacementError` for a job part a pinned pipeline cannot place: a
    reward model served by rollout replicas of its own (``reward.reward_model.enable``). On
    the trainer's GPUs veRL splits the trainer's pool by bundle index
    (:meth:`PinnedResourcePool.get_placement_groups` refuses that, but only once the actor's
    models have loaded); on a pool of its own, or standalone, its GPUs are not in the layout
    the coordinator was told. Checked before any pool is made."""
    try:
        reward_model = bool(config.reward.reward_model.enable)
    except AttributeError:
        return
    if reward_model:
        raise PlacementError(
            "reward.reward_model.enable=true: the reward model's rollout replicas are not part "
            "of the pipeline's layout, so they cannot be placed on the coordinator's shared "
            "groups; valid on a shared cluster: a rule-based reward (reward_model.enable=false)"
            ", or run this job without the control plane (unset RLIX_CONTROL_PLANE)"
        )


def refuse_unclaimed() -> None:
    """Raise :class:`PlacementError` when the coordinator's shared groups exist but the
    pipeline could not claim (its layout cannot be told before veRL builds it: disaggregated
    prefill/decode replicas, or a config without the layout's fields): veRL would reserve
    whole GPUs of its own, which cannot be placed beside the groups (veRL's own check fails
    with "Total available GPUs 0"). Without the manager it returns (veRL places as always)."""
    from rlix_plugins.adapters.shared_groups import find_manager

    found = find_manager()
    if found is None:
        return
    raise PlacementError(
        f"the coordinator's shared placement groups (namespace {found[1]!r}) hold every GPU, "
        "and this veRL job's replica layout cannot be told before veRL builds it "
        "(disaggregated prefill/decode replicas, or a config without trainer.n_gpus_per_node "
        "/ rollout parallel sizes), so it cannot be pinned to GPUs there; valid on a shared "
        "cluster: non-disaggregated vLLM replicas, or run this job without the control plane "
        "(unset RLIX_CONTROL_PLANE)"
    )


def pin_pipeline(layout: Any, config: Any = None) -> PinnedPools | None:
    """Pin the pipeline of ``layout`` when the coordinator's shared groups exist (this
    process under ``RLIX_CONTROL_PLANE=rlix``, the manager in its namespace); None
    otherwise (veRL reserves its own GPUs: a warning says no other pipeline can share them).
    ``config``: the job's veRL config, checked first (:func:`refuse_unpinnable`).

    Raises:
        PlacementError: the layout names GPUs the groups do not have, the groups share a
            Ray node, or the job has a part that cannot be pinned (nothing is pinned).
    """
    from rlix_plugins.adapters.shared_groups import find_manager, read_groups

    found = find_manager()
    if found is None:
        return None
    if config is not None:
        refuse_unpinnable(config)
    pins = PinnedPools.plan(layout, read_groups(found[0]))
    set_pins(pins)
    logger.info("rlix: veRL pools on the coordinator's shared groups (namespace %r): %s",
                found[1], dict(pins.pools))
    return pins


class PinnedResourcePool(RayResourcePool):  # type: ignore[misc]
    """A veRL pool whose rank ``r`` runs on global GPU ``gpus[r]`` of the shared groups.

    Its ``store`` is veRL's own spec (``process_on_nodes``: ``[n_gpus_per_node] * nnodes``),
    so ``RAY_LOCAL_WORLD_SIZE`` is what stock veRL gives (its vLLM rollout adapter takes its
    server's node rank from it); ``pgs`` holds the groups of the nodes it spans;
    ``max_colocate_count`` is :data:`PINNED_WORKER_GROUPS`, so veRL's ``_create_worker`` asks
    for that sliver of GPU. veRL's bundle-index placement of sub-pools
    (``split_resource_pool``: a colocated reward model or teacher) is refused
    (:meth:`get_placement_groups`)."""

    def __init__(self, name: str, gpus: tuple[int, ...], groups: SharedGroups,
                 process_on_nodes: list[int] | None = None) -> None:
        nodes = list(dict.fromkeys(groups.locate(g)[0] for g in gpus))
        if process_on_nodes is None:
            process_on_nodes = [sum(1 for g in gpus if groups.locate(g)[0] == n) for n in nodes]
        super().__init__(process_on_nodes=list(process_on_nodes), use_gpu=True,
                         name_prefix=name, max_colocate_count=PINNED_WORKER_GROUPS)
        self.rlix_gpus = gpus
        self.rlix_groups = groups
        self.pgs = [groups.placement_groups[n] for n in nodes]

    def get_placement_groups(self, strategy: str = "STRICT_PACK", name: str | None = None,
                             device_name: str = "cuda") -> Any:
        """Raises :class:`PlacementError`: veRL asks for a pool's groups only to place
        workers by bundle index outside ``_init_with_resource_pool`` (``split_resource_pool``
        for a colocated reward model or teacher, ``merge_resource_pool``); the shared groups
        have one bundle per node, and such workers would not be pinned."""
        raise PlacementError(
            f"veRL resource pool {self.name_prefix!r} is pinned to the coordinator's shared "
            "groups and cannot be split or merged (split_resource_pool / merge_resource_pool: "
            "a reward model or teacher colocated on the trainer's GPUs): their workers would "
            "be placed by bundle index, unpinned, on groups of one bundle per node"
        )


def pinned_create_resource_pool(original: Callable[[Any], None]) -> Callable[[Any], None]:
    """Wrap ``ResourcePoolManager.create_resource_pool``: with pins, every pool of the spec
    becomes a pinned pool (all checked before any is made); without, veRL's own."""
    if getattr(original, "_rlix_pinned", False):
        return original

    def create_resource_pool(self: Any) -> None:
        pins = active_pins()
        if pins is None:
            original(self)
            return
        gpus = {name: pins.gpus_of(name, sum(int(c) for c in counts))
                for name, counts in self.resource_pool_spec.items()}
        for name, pool_gpus_ in gpus.items():
            self.resource_pool_dict[name] = PinnedResourcePool(
                name, pool_gpus_, pins.groups, [int(c) for c in self.resource_pool_spec[name]])

    create_resource_pool.__wrapped__ = original  # type: ignore[attr-defined]
    create_resource_pool._rlix_pinned = True  # type: ignore[attr-defined]
    return create_resource_pool


class _PinnedClassWithInit:
    """veRL's ``RayClassWithInitArgs`` of a pinned pool: each worker goes to its node group's
    one bundle (veRL passes the local GPU as the bundle index: see :func:`_init_pinned`) and
    asks for no CPU (the shared bundles hold GPUs only, as ROLL's workers ask none)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __call__(self, placement_group: Any, placement_group_bundle_idx: int,
                 use_gpu: bool = True, num_gpus: float = 1, sharing_with: Any = None,
                 device_name: str = "cuda") -> Any:
        self._inner.update_options({"num_cpus": 0})
        return self._inner(placement_group, SHARED_NODE_BUNDLE, use_gpu=use_gpu,
                           num_gpus=num_gpus, sharing_with=sharing_with,
                           device_name=device_name)


#: Ray's switch that leaves a worker's ``CUDA_VISIBLE_DEVICES`` alone (and veRL's ``Worker``
#: then calls ``set_device(<Ray's GPU id>)``); see the module docstring.
NOSET_CUDA_ENV = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"


def _pinned_env(local_gpu: int) -> dict[str, str]:
    """A pinned worker's environment: ``CUDA_VISIBLE_DEVICES`` its local GPU, and
    :data:`NOSET_CUDA_ENV` off (empty: false for Ray and for veRL) whatever the job's or the
    node's environment sets, or veRL's ``Worker`` would select device ``g`` in a process that
    sees one GPU."""
    return {"CUDA_VISIBLE_DEVICES": str(local_gpu), NOSET_CUDA_ENV: ""}


def _init_pinned(group: Any, pool: Any, ray_cls_with_init: Any, detached: bool,
                 worker_env: Mapping[str, str] | None) -> None:
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    groups: SharedGroups = pool.rlix_groups
    group.resource_pool = pool
    group._world_size = pool.world_size
    node, _ = groups.locate(pool.rlix_gpus[0])
    if group._master_addr is None and group._master_port is None:
        group._master_addr, group._master_port = ray.get(
            get_master_addr_port.options(
                num_cpus=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=groups.placement_groups[node],
                    placement_group_bundle_index=SHARED_NODE_BUNDLE,
                ),
            ).remote(master_port_range=group._ray_master_port_range)
        )
    pinned_cls = _PinnedClassWithInit(ray_cls_with_init)
    for rank, gpu in enumerate(pool.rlix_gpus):
        node, local = groups.locate(gpu)
        group._create_worker(
            rank=rank, pg_idx=node, pg=groups.placement_groups[node], local_rank=local,
            resource_pool=pool, ray_cls_with_init=pinned_cls,
            worker_env={**(worker_env or {}), **_pinned_env(local)},
            detached=detached,
        )
    logger.info("rlix: veRL worker group %s pinned to GPUs %s", group.name_prefix,
                list(pool.rlix_gpus))


def pinned_init_with_resource_pool(original: Callable[..., None]) -> Callable[..., None]:
    """Wrap ``RayWorkerGroup._init_with_resource_pool``: a pinned pool's workers go on the
    shared groups (:func:`_init_pinned`); any other pool is veRL's."""
    if getattr(original, "_rlix_pinned", False):
        return original

    def _init_with_resource_pool(self: Any, resource_pool: Any, ray_cls_with_init: Any,
                                 bin_pack: bool, detached: bool,
                                 worker_env: Mapping[str, str] | None = None) -> None:
        if not isinstance(resource_pool, PinnedResourcePool):
            original(self, resource_pool, ray_cls_with_init, bin_pack, detached,
                     worker_env=worker_env)
            return
        _init_pinned(self, resource_pool, ray_cls_with_init, detached, worker_env)

    _init_with_resource_pool.__wrapped__ = original  # type: ignore[attr-defined]
    _init_with_resource_pool._rlix_pinned = True  # type: ignore[attr-defined]
    return _init_with_resource_pool


__all__ = [
    "ENV_VERL_FIRST_GPU",
    "TRAINER_POOL",
    "PinnedPools",
    "PinnedResourcePool",
    "active_pins",
    "first_gpu",
    "pin_pipeline",
    "pinned_create_resource_pool",
    "pinned_init_with_resource_pool",
    "pool_gpus",
    "refuse_unclaimed",
    "refuse_unpinnable",
    "set_pins",
    "standalone_pool",
]
