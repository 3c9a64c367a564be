"""Partial-overlap placement for NeMo RL: training GPUs a subset of inference GPUs.

Stock ``grpo.setup`` builds either one colocated ``RayVirtualCluster`` (policy and vLLM on
every GPU, each worker asking for half of its bundle's GPU) or two disjoint clusters of whole
GPUs. Under the coordinator a pipeline's inference workers cover ``infer_gpus`` and its
training workers ``train_gpus`` (a subset), on the SAME GPUs. This module builds that through
NeMo RL's seams, editing nothing of NeMo RL:

* ``grpo.RayVirtualCluster`` (looked up at call time in ``setup``) ->
  :class:`RLixPlacementCluster`. The two clusters ``setup`` builds in non-colocated mode
  (``grpo_train_cluster``, ``grpo_inference_cluster``) become role views of one
  :class:`SharedPlacement`; any other cluster (teachers, reward models, the colocated one) is
  NeMo RL's class unchanged.
* ``grpo.VllmGeneration`` ->
  :class:`~rlix_plugins.adapters.nemo_rl_placement_generation.RLixPlacedVllmGeneration` and
  ``grpo.Policy`` -> the class from :func:`make_placed_policy_class`: before NeMo RL's
  constructor reads the cluster, they bind the view to the layout in
  ``policy.generation.rlix`` (the config both receive). The first bind creates the shared
  placement group: one bundle ``{CPU: 2, GPU: 1}`` per inference GPU (a real NeMo RL
  ``RayVirtualCluster``, one unified placement group, bundles pinned to their node), asks Ray
  where each bundle landed (NeMo RL's own ``get_reordered_bundle`` probe) and maps layout GPU
  -> bundle (:func:`~rlix_plugins.adapters.nemo_rl_placement_plan.plan_placement`; a layout
  Ray did not honour raises :class:`PlacementError`).
  Under the coordinator the first bind then claims the layout's GPUs for setup
  (:func:`~rlix_plugins.adapters.nemo_rl.claim_setup`): neither role's workers load
  before the coordinator granted them. With the coordinator's manager running the views take
  its shared per-node groups instead (:class:`CoordinatorPlacement`), and a vLLM tp*pp > 1
  pipeline is refused there before anything is reserved or claimed
  (:func:`coordinator_groups`).
* Bound views report the role's world size, ``max_colocated_worker_groups = 2`` (so every
  worker asks for 0.5 GPU, NeMo RL's colocated fraction), the shared placement group and the
  role's bundles as ``_sorted_bundle_indices`` (``Policy`` and vLLM's tensor-parallel path
  place workers by it).
* ``RayWorkerGroup`` as looked up by ``vllm_generation`` and ``lm_policy`` ->
  :class:`RLixRayWorkerGroup`: on a bound view it passes the role's bundles where NeMo RL
  would place one worker per bundle in bundle order (vLLM with tp=1), and once the workers
  exist checks each one's GPU (``ray.get_gpu_ids()`` in the worker) against the layout.

So on a 2-GPU box with ``infer_gpus: [0, 1]``, ``train_gpus: [0]``: vLLM shard 0 on GPU 0,
shard 1 on GPU 1, the Megatron worker on GPU 0, all of them in one placement group.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from nemo_rl.distributed.virtual_cluster import RayVirtualCluster, get_reordered_bundle
from nemo_rl.distributed.worker_groups import RayWorkerGroup

from rlix_plugins.adapters.nemo_rl_placement_plan import (
    GRPO_CLUSTER_ROLES,
    GRPO_COLOCATED_CLUSTER,
    PINNED_WORKER_GROUPS,
    SHARED_NODE_BUNDLE,
    SHARED_WORKER_GROUPS,
    BundleGpu,
    PlacementError,
    PlacementPlan,
    WorkerGpu,
    bundles_per_node,
    check_worker_gpus,
    layout_gpus,
    pinned_worker_env,
    plan_pinned,
    plan_placement,
    report_worker_gpu,
)
from rlix_plugins.adapters.nemo_rl_support import refuse_model_parallel, vllm_model_parallel
from rlix_plugins.adapters.shared_groups import find_manager, read_groups
from rlix_plugins.protocol.names import ACTOR_INFER

logger = logging.getLogger(__name__)


class SharedPlacement:
    """One unified placement group, one bundle per inference GPU, shared by both roles.

    Owned by a real NeMo RL ``RayVirtualCluster`` (``max_colocated_worker_groups = 2``), so its
    bundles are exactly those of NeMo RL's colocated mode: ``{CPU: 2, GPU: 1}``.
    """

    def __init__(self, owner: RayVirtualCluster, plan: PlacementPlan) -> None:
        self.owner = owner
        self.plan = plan
        (self.placement_group,) = owner.get_placement_groups()
        self.placement_groups: list[Any] = [self.placement_group]

    @classmethod
    def create(cls, infer_gpus: Sequence[int], train_gpus: Sequence[int],
               name: str = "rlix_nemo_rl_shared") -> SharedPlacement:
        """Reserve the bundles, ask Ray where they are, map them to the layout (or raise)."""
        import ray
        from ray.util.placement_group import placement_group_table

        from rlix_plugins.coordinator.service.resource_manager import (
            gpu_nodes,
            topology_from_nodes,
        )

        nodes = gpu_nodes(ray.nodes())  # type: ignore[no-untyped-call]
        topology = topology_from_nodes(nodes)
        gpn = topology.gpus_per_node
        per_node = bundles_per_node(infer_gpus, gpn)
        missing = [r for r in per_node if r >= len(nodes)]
        if missing:
            raise PlacementError(
                f"inference GPUs {sorted(infer_gpus)} need node ranks {missing}, but the Ray "
                f"cluster has {len(nodes)} GPU node(s) of {gpn} GPUs (global GPU ids "
                f"0..{len(nodes) * gpn - 1})"
            )
        # Pin each node's bundles to that node (NeMo RL's node_resource_constraints; Ray's
        # built-in "node:<ip>" resource). One GPU node: nothing to pin.
        constraints = (
            [{f"node:{nodes[r]['NodeManagerAddress']}": 0.001} for r in per_node]
            if len(nodes) > 1 else None
        )
        owner = RayVirtualCluster(
            bundle_ct_per_node_list=list(per_node.values()),
            use_gpus=True,
            max_colocated_worker_groups=SHARED_WORKER_GROUPS,
            num_gpus_per_node=gpn,
            name=name,
            placement_group_strategy="PACK",
            node_resource_constraints=constraints,
        )
        try:
            (pg,) = owner._init_placement_groups(strategy="PACK", use_unified_pg=True)
            # NeMo RL's own probe: one tiny task per bundle reports ray.get_gpu_ids().
            order, gpu_ids, _ = get_reordered_bundle(pg)
            to_node = placement_group_table(pg)["bundles_to_node_id"]
            bundles = [BundleGpu(int(b), str(to_node[b]), int(g))
                       for b, g in zip(order, gpu_ids, strict=True)]
            plan = plan_placement(
                infer_gpus, train_gpus, bundles,
                {str(n["NodeID"]): i for i, n in enumerate(nodes)}, gpn,
            )
        except BaseException:
            owner.shutdown()
            raise
        logger.info(
            "rlix: shared placement group %s: inference GPUs %s -> bundles %s, training GPUs "
            "%s -> bundles %s", name, plan.infer.gpus, plan.infer.bundles, plan.train.gpus,
            plan.train.bundles,
        )
        return cls(owner, plan)

    def shutdown(self) -> None:
        """Remove the placement group (kills what is still placed on it)."""
        self.owner.shutdown()


class CoordinatorPlacement:
    """The coordinator's shared per-node placement groups (``rlix:roll_resource_manager``, one
    bundle ``{GPU: gpus_per_node}`` per node, named ``rlix_pg_node{i}``), the ones ROLL places
    on. Several pipelines place on them at once; each worker asks for
    ``1 / PINNED_WORKER_GROUPS`` GPU and is pinned to its layout GPU by CUDA_VISIBLE_DEVICES.
    The groups belong to the coordinator: :meth:`shutdown` leaves them in place."""

    def __init__(self, placement_groups: Sequence[Any], plan: PlacementPlan,
                 namespace: str) -> None:
        self.placement_groups = list(placement_groups)
        self.plan = plan
        self.namespace = namespace

    @classmethod
    def create(cls, infer_gpus: Sequence[int], train_gpus: Sequence[int], manager: Any,
               namespace: str) -> CoordinatorPlacement:
        """Ask the coordinator's manager for its groups (as ROLL's proxy does) and plan."""
        groups = read_groups(manager)
        plan = plan_pinned(infer_gpus, train_gpus, groups.node_ids, groups.gpus_per_node)
        logger.info(
            "rlix: coordinator's shared placement groups (namespace %r): inference GPUs %s, "
            "training GPUs %s, pinned by CUDA_VISIBLE_DEVICES", namespace, plan.infer.gpus,
            plan.train.gpus,
        )
        return cls(groups.placement_groups, plan, namespace)

    def shutdown(self) -> None:
        """Nothing to remove: the coordinator owns the groups (its stop removes them)."""


def coordinator_groups(model_parallel: int) -> tuple[Any, str] | None:
    """``(rlix:roll_resource_manager handle, namespace)`` when this pipeline places on the
    coordinator's shared groups; None when no manager runs (gate off, or none in the
    control-plane namespace): then it gets a placement group of its own.

    Shared groups are used under ``RLIX_CONTROL_PLANE=rlix`` when the manager runs in the
    control-plane namespace (``RLIX_NAMESPACE``, default ``rlix``). There vLLM must run one GPU
    per engine (tp*pp == 1): NeMo RL's tensor-parallel path places vLLM's own workers on
    per-GPU bundles, which the one-bundle-per-node groups do not have. A tp*pp > 1 pipeline is
    refused (:class:`PlacementError`) before anything is reserved or claimed: a group of its
    own could never be placed next to the coordinator's groups (they hold every GPU of every
    node), and one made first would stop those groups being created for every other pipeline.
    """
    found = find_manager()
    if found is None:
        return None
    if model_parallel != 1:
        refuse_model_parallel(model_parallel, found[1])
    return found


Placement = SharedPlacement | CoordinatorPlacement


def _claim_setup(layout: tuple[tuple[int, ...], tuple[int, ...]], model_parallel: int) -> None:
    """Before either role's workers exist: the pipeline registers and holds its GPUs while
    NeMo RL loads onto them (:func:`rlix_plugins.adapters.nemo_rl.claim_setup`)."""
    from rlix_plugins.adapters.nemo_rl import NemoRlLayout, claim_setup

    claim_setup(NemoRlLayout(*layout, model_parallel))


class _ClusterPair:
    """The train and inference views one ``grpo.setup`` call built (train first)."""

    def __init__(self) -> None:
        self.views: dict[str, RLixPlacementCluster] = {}
        self.lock = threading.Lock()
        self.placement: Placement | None = None
        self.layout: tuple[tuple[int, ...], tuple[int, ...]] | None = None
        #: roles whose view let go of the current placement; cleared when a bind applies it
        #: to every view and when the last release shuts it down (a new round starts afresh)
        self.released: set[str] = set()
        self.allocated_ports: set[int] = set()


_pairs_lock = threading.Lock()
_open_pair: _ClusterPair | None = None


def _join_pair(view: RLixPlacementCluster, role: str) -> _ClusterPair:
    global _open_pair
    with _pairs_lock:
        pair = _open_pair
        if pair is None or role in pair.views:
            pair = _ClusterPair()
        pair.views[role] = view
        _open_pair = None if len(pair.views) == len(GRPO_CLUSTER_ROLES) else pair
        return pair


class RLixPlacementCluster(RayVirtualCluster):  # type: ignore[misc]
    """``grpo.RayVirtualCluster`` under the coordinator (see module docstring).

    Unbound, a role view is NeMo RL's cluster except that it refuses to create placement
    groups of its own (that would place the role where the coordinator does not think it is).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.rlix_role: str | None = GRPO_CLUSTER_ROLES.get(self.name)
        self.rlix_stock_world_size: int = self._world_size
        self.rlix_plan: PlacementPlan | None = None
        self._rlix_pair: _ClusterPair | None = None
        self._rlix_copy = False
        if self.rlix_role is not None:
            self._rlix_pair = _join_pair(self, self.rlix_role)
            if self._rlix_pair.placement is not None:
                self._rlix_apply(self._rlix_pair.placement)
        elif self.name == GRPO_COLOCATED_CLUSTER:
            logger.warning(
                "rlix: colocated inference (policy.generation.colocated.enabled=true) keeps "
                "NeMo RL's own placement: training and inference on every GPU; partial overlap "
                "needs colocated.enabled=false"
            )

    # binding --------------------------------------------------------------------------------
    def rlix_bind(self, generation_cfg: Mapping[str, Any]) -> PlacementPlan:
        """Bind both views of this setup call to the layout (first call creates the group)."""
        pair = self._rlix_pair
        if pair is None or self.rlix_role is None:
            raise PlacementError(f"cluster {self.name!r} is not a role view; nothing to bind")
        with pair.lock:
            infer_view = pair.views.get(ACTOR_INFER)
            stock = (infer_view or self).rlix_stock_world_size
            layout = layout_gpus(generation_cfg, stock, vllm_model_parallel(generation_cfg))
            if pair.placement is None:
                shared = coordinator_groups(vllm_model_parallel(generation_cfg))
                pair.placement = (
                    CoordinatorPlacement.create(*layout, *shared) if shared is not None
                    else SharedPlacement.create(
                        *layout, name=f"rlix_nemo_rl_shared_{id(pair):x}"
                    )
                )
                pair.layout = layout
                try:
                    _claim_setup(layout, vllm_model_parallel(generation_cfg))
                except BaseException:
                    pair.placement.shutdown()
                    pair.placement, pair.layout = None, None
                    raise
            elif layout != pair.layout:
                raise PlacementError(
                    f"{self.rlix_role} was configured with layout infer/train {layout}, but "
                    f"the shared placement was built for {pair.layout}"
                )
            for view in pair.views.values():
                view._rlix_apply(pair.placement)
            # Every view holds the placement again (a released one included): each must
            # release it before it is shut down.
            pair.released.clear()
            return pair.placement.plan

    def _rlix_apply(self, placement: Placement) -> None:
        assert self.rlix_role is not None and self._rlix_pair is not None
        plan = placement.plan
        role = plan.role(self.rlix_role)
        nodes: dict[int, int] = {}
        for n in role.node_indices:
            nodes[n] = nodes.get(n, 0) + 1
        self._bundle_ct_per_node_list = list(nodes.values())
        self._world_size = role.world_size
        self.num_gpus_per_node = plan.gpus_per_node
        # NeMo RL asks 1 / max_colocated_worker_groups GPU per worker.
        self.max_colocated_worker_groups = (
            PINNED_WORKER_GROUPS if plan.pinned else SHARED_WORKER_GROUPS
        )
        self._node_placement_groups: list[Any] | None = list(placement.placement_groups)
        self._sorted_bundle_indices = list(role.bundles)
        self._nvlink_domain_per_bundle_index = None
        self._allocated_master_ports = self._rlix_pair.allocated_ports
        self.rlix_plan = plan

    # NeMo RL's cluster API --------------------------------------------------------------------
    def _init_placement_groups(self, strategy: str | None = None,
                               use_unified_pg: bool = False) -> list[Any]:
        if self.rlix_role is not None and self.rlix_plan is None:
            raise PlacementError(
                f"{self.name} was asked for placement groups before the pipeline layout was "
                "bound; under RLIX_CONTROL_PLANE=rlix the policy must be built by grpo.Policy "
                "(no policy_factory) and generation by the vLLM backend, which bind it to "
                "policy.generation.rlix"
            )
        groups: list[Any] = super()._init_placement_groups(strategy, use_unified_pg)
        return groups

    def get_master_address_and_port(self) -> tuple[str, int]:
        """NeMo RL's master address, on the node of the role's rank 0 for a pinned plan.

        NeMo RL probes group 0, bundle 0: on the coordinator's per-node groups that is node
        rank 0's node, which need not hold any of this role's workers (training on node rank
        1 only would rendezvous at an address where no rank listens).
        """
        plan, role = self.rlix_plan, self.rlix_role
        if plan is None or role is None or not plan.pinned:
            address: tuple[str, int] = super().get_master_address_and_port()
            return address
        node_rank = plan.role(role).node_indices[0]
        for _ in range(10):  # NeMo RL's retries for a port no group of the pair took yet
            addr, port = self.get_available_address_and_port(node_rank, SHARED_NODE_BUNDLE)
            if port not in self._allocated_master_ports:
                self._allocated_master_ports.add(port)
                return str(addr), int(port)
        raise PlacementError(
            f"{role}: no unique master port found on node rank {node_rank} after 10 tries "
            f"(already taken: {sorted(self._allocated_master_ports)})"
        )

    def shutdown(self) -> bool:
        pair = self._rlix_pair
        if self.rlix_plan is None or pair is None:
            if self._rlix_copy:
                self._node_placement_groups = None  # a pickled copy never owns the group
                return True
            return bool(super().shutdown())
        with pair.lock:
            role = str(self.rlix_role)
            if pair.placement is None or role in pair.released:
                # Idempotent: this view already let go (or the round is over); counting it
                # again could shut the placement down under the other view.
                self._node_placement_groups = None
                return True
            if pair.released | {role} >= set(pair.views):
                # Shut down first: if that raises, nothing is marked and a retry tries again.
                pair.placement.shutdown()
                # The round is over: a later bind of this pair starts a new one from scratch.
                pair.placement = None
                pair.layout = None
                pair.released.clear()
                logger.info("rlix: shared placement released by %s, shut down",
                            sorted(pair.views))
            else:
                pair.released.add(role)
            self._node_placement_groups = None
        return True

    def __getstate__(self) -> dict[str, Any]:
        # NeMo RL pickles the generation (and its worker group's cluster) into the collector:
        # the copy carries the plan but never the pair (a lock) nor the group's ownership.
        state = dict(self.__dict__)
        state["_rlix_pair"] = None
        state["_rlix_copy"] = True
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


def bind_cluster(cluster: Any, generation_cfg: Mapping[str, Any] | None) -> PlacementPlan | None:
    """Bind a role view to the layout; None for any other cluster (left as NeMo RL's)."""
    if isinstance(cluster, RLixPlacementCluster) and cluster.rlix_role is not None:
        return cluster.rlix_bind(generation_cfg or {})
    return None


class RLixRayWorkerGroup(RayWorkerGroup):  # type: ignore[misc]
    """``RayWorkerGroup`` that places a bound view's workers on the role's bundles and checks
    where they landed; on any other cluster it is NeMo RL's class unchanged."""

    def __init__(
        self,
        cluster: Any,
        remote_worker_builder: Any,
        workers_per_node: int | list[int] | None = None,
        name_prefix: str = "",
        bundle_indices_list: list[tuple[int, list[int]]] | None = None,
        sharding_annotations: Any = None,
        env_vars: dict[str, str] | None = None,
    ) -> None:
        plan: PlacementPlan | None = getattr(cluster, "rlix_plan", None)
        role: str | None = getattr(cluster, "rlix_role", None)
        placed = plan is not None and role is not None
        self._rlix_pins: Iterator[int] | None = None
        if placed and plan is not None and plan.pinned:
            assert role is not None
            if bundle_indices_list is not None and any(
                len(b) != 1 for _, b in bundle_indices_list
            ):
                raise PlacementError(
                    f"{role}: tied worker groups {bundle_indices_list} cannot be placed on the "
                    "coordinator's shared groups (one bundle per node); only one GPU per "
                    "worker group is supported there"
                )
            # Rank r on node rank n: bundle 0 of group n, pinned to its layout GPU (in the
            # order NeMo RL creates the workers, which is rank order).
            bundle_indices_list = plan.role(role).bundle_groups(1)
            self._rlix_pins = iter([plan.local_gpu(role, r)
                                    for r in range(plan.role(role).world_size)])
            self._rlix_gpus_per_node = plan.gpus_per_node
        elif placed and bundle_indices_list is None:
            assert plan is not None and role is not None
            if workers_per_node is not None:
                logger.warning("rlix: workers_per_node=%s ignored on the shared placement",
                               workers_per_node)
            # NeMo RL would put one worker on each bundle in bundle order (vLLM, tp=1); the
            # layout's order is by GPU id, which Ray's bundle order need not follow.
            bundle_indices_list = plan.role(role).bundle_groups(1)
        super().__init__(
            cluster, remote_worker_builder, workers_per_node=workers_per_node,
            name_prefix=name_prefix, bundle_indices_list=bundle_indices_list,
            sharding_annotations=sharding_annotations,
            env_vars=env_vars if env_vars is not None else {},
        )
        if placed:
            assert plan is not None and role is not None and bundle_indices_list is not None
            verify_worker_group(self, plan, role, bundle_indices_list)

    # NeMo RL's _create_workers_from_bundle_indices fills this pool (one initializer per
    # node) and calls ``pool[pg_idx].create_worker.remote(...)`` once per worker, in rank
    # order. On a pinned plan the pool hands out wrappers that add the pinning env there:
    # NeMo RL drops RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES from ``env_vars``, and every
    # worker needs its own CUDA_VISIBLE_DEVICES.
    @property
    def _initializer_pool(self) -> dict[int, Any]:
        pool: dict[int, Any] | None = self.__dict__.get("_rlix_initializer_pool")
        if pool is None:  # NeMo RL's shutdown tests hasattr() before workers exist
            raise AttributeError("_initializer_pool")
        return pool

    @_initializer_pool.setter
    def _initializer_pool(self, pool: dict[int, Any]) -> None:
        pins = self.__dict__.get("_rlix_pins")
        self.__dict__["_rlix_initializer_pool"] = (
            _PinningPool(pool, pins, self.__dict__["_rlix_gpus_per_node"])
            if pins is not None else pool
        )


class _PinningPool(dict[int, Any]):
    """NeMo RL's initializer pool; items read back by index pin the next worker."""

    def __init__(self, pool: dict[int, Any], pins: Iterator[int], gpus_per_node: int) -> None:
        super().__init__(pool)
        self._pins = pins
        self._gpus_per_node = gpus_per_node

    def __getitem__(self, key: int) -> Any:
        return _PinningInitializer(super().__getitem__(key), self._pins, self._gpus_per_node)


class _PinningInitializer:
    """An ``IsolatedWorkerInitializer`` handle whose ``create_worker.remote`` pins the worker."""

    def __init__(self, handle: Any, pins: Iterator[int], gpus_per_node: int) -> None:
        self._handle = handle
        self._pins = pins
        self._gpus_per_node = gpus_per_node

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handle, name)

    @property
    def create_worker(self) -> _PinnedCreate:
        return _PinnedCreate(self._handle.create_worker, self._pins, self._gpus_per_node)


class _PinnedCreate:
    def __init__(self, method: Any, pins: Iterator[int], gpus_per_node: int) -> None:
        self._method = method
        self._pins = pins
        self._gpus_per_node = gpus_per_node

    def remote(self, placement_group: Any, bundle_index: int, num_gpus: float,
               bundle_indices: tuple[int, list[int]] | None = None, **options: Any) -> Any:
        local = next(self._pins)
        env = options.setdefault("runtime_env", {}).setdefault("env_vars", {})
        env.update(pinned_worker_env(local, self._gpus_per_node))
        # The shared bundles hold GPUs only ({GPU: gpus_per_node}, as ROLL's): a worker that
        # asked Ray's default one CPU would never fit, so it asks for none (as ROLL's).
        options["num_cpus"] = 0
        # NeMo RL names workers {prefix}-{pg_idx}-{bundle}: on one bundle per node those
        # names repeat, so the GPU (and the pipeline, when the process has one) is added.
        if options.get("name"):
            pipeline = os.environ.get("PIPELINE_ID")
            options["name"] = (f"{options['name']}-gpu{local}"
                               + (f"-{pipeline}" if pipeline else ""))
        if bundle_indices is not None:
            # Every worker of a node takes bundle 0; the vLLM worker derives its seed,
            # VLLM_PORT and cache dir from the bundle id, so it is told its GPU instead.
            bundle_indices = (bundle_indices[0], [local])
        return self._method.remote(placement_group, bundle_index, num_gpus, bundle_indices,
                                   **options)


def verify_worker_group(group: Any, plan: PlacementPlan, role: str,
                        bundle_indices_list: Sequence[tuple[int, Sequence[int]]]) -> None:
    """Raise :class:`PlacementError` unless the group sits on the role's planned bundles and
    every single-GPU worker reports its planned GPU (``ray.get_gpu_ids()`` in the worker).

    Workers of a tensor-parallel vLLM group ask Ray for no GPU (vLLM places its own workers
    on the group's bundles), so for them only the bundle list is checked.
    """
    import ray

    used = [b for _, bundles in bundle_indices_list for b in bundles]
    planned = list(plan.role(role).bundles)
    if used != planned:
        raise PlacementError(
            f"{role} worker group was built on bundles {used}; the layout needs bundles "
            f"{planned} (GPUs {list(plan.role(role).gpus)})"
        )
    if any(len(bundles) > 1 for _, bundles in bundle_indices_list):
        return
    reports = ray.get([w.__ray_call__.remote(report_worker_gpu) for w in group.workers])
    observed = [WorkerGpu(r, tuple(g), cvd, node)
                for r, (g, cvd, node) in enumerate(reports)]
    check_worker_gpus(plan, role, observed)
    logger.info("rlix: %s workers on GPUs %s (checked in each worker)", role,
                [list(w.gpu_ids) for w in observed])


def make_placed_policy_class(base: type) -> type:
    """``grpo.Policy`` subclass that binds the training view before NeMo RL's constructor."""

    class RLixPlacedPolicy(base):  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            cluster = kwargs["cluster"] if "cluster" in kwargs else args[0]
            config = kwargs["config"] if "config" in kwargs else args[1]
            bind_cluster(cluster, (config or {}).get("generation"))
            super().__init__(*args, **kwargs)

    RLixPlacedPolicy.__qualname__ = f"Placed{base.__qualname__}"
    return RLixPlacedPolicy


__all__ = [
    "CoordinatorPlacement",
    "PlacementError",
    "RLixPlacementCluster",
    "RLixRayWorkerGroup",
    "SharedPlacement",
    "bind_cluster",
    "coordinator_groups",
    "make_placed_policy_class",
    "verify_worker_group",
]
