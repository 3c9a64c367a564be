"""Topology and placement: ``rlix:resource_manager`` and ``rlix:roll_resource_manager``.

``topology_from_ray`` reads GPUs per node from Ray's cluster resources. The ROLL resource
manager owns the shared placement groups (one per node, one bundle ``{GPU: gpus_per_node}``)
that every pipeline's workers are placed on with fractional GPU requests, so Ray's accounting
never stops two pipelines from sharing a GPU: the scheduler is the only arbiter. Its methods
match ROLL's ``ResourceManager`` (``get_state``, ``nodes_placement_group``,
``allocate_placement_group``, ``destroy_placement_group``) so ROLL's proxy works unchanged.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from collections.abc import Iterable, Mapping
from typing import Any

import ray

from rlix_plugins.adapters.shared_groups import SHARED_NODE_BUNDLE, check_one_group_per_node
from rlix_plugins.coordinator.core.model import Topology
from rlix_plugins.errors import ProtocolError, RlixPluginsError
from rlix_plugins.values import is_int

logger = logging.getLogger(__name__)


def gpu_nodes(nodes: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Alive nodes with at least one GPU, in a stable order (node rank = position)."""
    alive = [n for n in nodes if n.get("Alive", n.get("alive", True))]
    with_gpu = [n for n in alive if int(n.get("Resources", {}).get("GPU", 0)) > 0]
    return sorted(with_gpu, key=lambda n: (str(n.get("NodeManagerAddress")), str(n.get("NodeID"))))


def topology_from_nodes(
    nodes: Iterable[Mapping[str, Any]], required_gpus_per_node: int | None = None
) -> Topology:
    """Topology of the GPU nodes; every node must have the same GPU count (or at least
    ``required_gpus_per_node``, of which that many are used)."""
    if required_gpus_per_node is not None and (
        not is_int(required_gpus_per_node) or required_gpus_per_node < 1
    ):
        raise ProtocolError(
            f"required_gpus_per_node must be an int >= 1 or None (every GPU of a node), got "
            f"{required_gpus_per_node!r}"
        )
    found = gpu_nodes(nodes)
    if not found:
        raise RlixPluginsError("the Ray cluster has no node with GPUs; nothing to schedule")
    counts = sorted({int(n["Resources"]["GPU"]) for n in found})
    if required_gpus_per_node is not None:
        usable = [n for n in found if int(n["Resources"]["GPU"]) >= required_gpus_per_node]
        if not usable:
            raise RlixPluginsError(
                f"no node has {required_gpus_per_node} GPUs (nodes have {counts})"
            )
        return Topology(len(usable), required_gpus_per_node)
    if len(counts) > 1:
        raise RlixPluginsError(
            f"nodes have different GPU counts {counts}; pass gpus_per_node explicitly"
        )
    return Topology(len(found), counts[0])


def topology_from_ray(required_gpus_per_node: int | None = None) -> Topology:
    """Topology of the connected Ray cluster."""
    return topology_from_nodes(ray.nodes(), required_gpus_per_node)  # type: ignore[no-untyped-call]


class ResourceManagerService:
    """``rlix:resource_manager``: the frozen GPU topology of this control plane."""

    def __init__(self, topology: Topology | None = None) -> None:
        self._topology = topology
        #: concurrent first calls: the first freezes the topology, the others check against it
        self._init_lock = asyncio.Lock()

    async def init_topology(self, *, required_gpus_per_node: int | None = None) -> int:
        """Freeze the topology (first call wins); returns GPUs per node."""
        async with self._init_lock:
            if self._topology is None:
                self._topology = await asyncio.to_thread(topology_from_ray, required_gpus_per_node)
                return self._topology.gpus_per_node
        if (
            required_gpus_per_node is not None
            and required_gpus_per_node != self._topology.gpus_per_node
        ):
            raise RlixPluginsError(
                f"topology is frozen at {self._topology.gpus_per_node} GPUs per node; "
                f"{required_gpus_per_node} was asked"
            )
        return self._topology.gpus_per_node

    async def get_topology(self) -> Topology:
        await self.init_topology()
        assert self._topology is not None
        return self._topology

    async def cluster_resources(self) -> dict[str, float]:
        """Live total resources of the Ray cluster."""
        return dict(await asyncio.to_thread(ray.cluster_resources))


#: Ray KV namespace and key prefix (+ control-plane namespace) of the shared groups' ids: a
#: restarted manager adopts them instead of making a second set its GPUs cannot hold.
GROUPS_KV_NAMESPACE = "rlix"
GROUPS_KV_PREFIX = "shared_groups:"

#: Seconds ``_ensure`` waits for the shared groups to be placed before it gives up with
#: :class:`SharedGroupsUnplaceableError` (and removes them) instead of blocking every caller.
READY_TIMEOUT_S = 120.0

#: Name of node rank ``n``'s shared group: ``f"{GROUP_NAME}{n}"``.
GROUP_NAME = "rlix_pg_node"


class SharedGroupsUnplaceableError(RlixPluginsError, TimeoutError):
    """The shared per-node placement groups could not be placed in time: something else holds
    GPUs of a node in Ray's accounting (or the nodes have fewer GPUs than the topology)."""


def _unplaceable_message(topology: Topology, timeout_s: float) -> str:
    """What could not be placed, and which placement groups hold GPUs instead."""
    holders: list[str] = []
    try:
        from ray.util.placement_group import placement_group_table

        for pg_id, entry in placement_group_table().items():
            gpus = sum(float(b.get("GPU", 0)) for b in dict(entry.get("bundles", {})).values())
            name = str(entry.get("name") or "")
            if gpus and entry.get("state") == "CREATED" and not name.startswith(GROUP_NAME):
                holders.append(f"{name or pg_id} ({gpus:g} GPU)")
        available = ray.available_resources().get("GPU", 0.0)  # type: ignore[no-untyped-call]
    except Exception:
        logger.warning("could not read Ray's placement groups", exc_info=True)
        available = float("nan")
    names = ", ".join(f"{GROUP_NAME}{i}" for i in range(topology.num_nodes))
    return (
        f"the shared placement groups ({names}, one bundle {{GPU: {topology.gpus_per_node}}} "
        f"each) were not placed within {timeout_s:g}s: every GPU of each of "
        f"{topology.num_nodes} node(s) must be free in Ray's accounting ({available:g} GPU "
        f"free now); placement groups holding GPUs: {', '.join(holders) or 'none'}"
    )


def _remove_groups(pgs: Iterable[Any], *, strict: bool = False) -> None:
    """Remove ``pgs`` (blocking GCS calls), each attempted even if one fails; ``strict``:
    then raise the first failure (else it is logged)."""
    from ray.util.placement_group import remove_placement_group

    first: Exception | None = None
    for pg in pgs:
        try:
            remove_placement_group(pg)
        except Exception as exc:
            logger.warning("could not remove placement group", exc_info=True)
            first = first or exc
    if strict and first is not None:
        raise first


def _group_nodes(pgs: list[Any]) -> list[str]:
    """The Ray node each shared group's (only) bundle sits on, in node-rank order."""
    from ray.util.placement_group import placement_group_table

    return [str(placement_group_table(pg)["bundles_to_node_id"][SHARED_NODE_BUNDLE])
            for pg in pgs]


class RollResourceManagerService:
    """``rlix:roll_resource_manager``: shared per-node placement groups (ROLL-compatible).

    The placement groups are created on first use, not at start, so a coordinator serving no
    ROLL-style pipeline does not reserve every GPU in Ray's accounting.
    """

    def __init__(
        self,
        topology: Topology | None = None,
        *,
        namespace: str | None = None,
        ready_timeout_s: float = READY_TIMEOUT_S,
    ) -> None:
        """``namespace``: the control plane's, where ``rlix:scheduler`` runs (an actor's
        runtime context only knows its job's namespace) and under which the shared groups'
        ids are remembered for a restarted incarnation; None: this process's namespace, and
        nothing remembered."""
        if isinstance(ready_timeout_s, bool) or not isinstance(ready_timeout_s, (int, float)) or (
            not ready_timeout_s > 0
        ):
            raise ProtocolError(f"ready_timeout_s must be a number > 0, got {ready_timeout_s!r}")
        self._topology = topology
        self._namespace = namespace
        self._ready_timeout_s = float(ready_timeout_s)
        self._pgs: list[Any] | None = None
        self._lock = asyncio.Lock()
        self._topology_lock = asyncio.Lock()

    async def _get_topology(self) -> Topology:
        """The scheduler's topology (the arbiter's GPU ids are what ROLL's device mappings
        name); Ray's cluster resources only when no scheduler runs in this namespace. Read
        once: a node joining or dying later never moves node ranks under placed workers."""
        async with self._topology_lock:
            if self._topology is None:
                self._topology = await self._scheduler_topology()
                if self._topology is None:
                    self._topology = await asyncio.to_thread(topology_from_ray)
            return self._topology

    async def _scheduler_topology(self) -> Topology | None:
        from rlix_plugins.protocol.names import SCHEDULER_ACTOR

        namespace = self._namespace or ray.get_runtime_context().namespace
        try:
            scheduler = await asyncio.to_thread(ray.get_actor, SCHEDULER_ACTOR, namespace)
        except ValueError:
            return None
        status = await scheduler.get_status.remote()
        return Topology(int(status.num_nodes), int(status.gpus_per_node))

    def _kv_key(self) -> bytes:
        return f"{GROUPS_KV_PREFIX}{self._namespace}".encode()

    def _adopt(self, topology: Topology) -> list[Any] | None:
        """The groups an earlier incarnation of this actor made (remembered in Ray's KV),
        when every one is still placed and they match ``topology``; else None (and the
        record is dropped). They are detached: a crash of this actor must not take every
        pipeline's workers placed on them down with it."""
        from ray import PlacementGroupID
        from ray.experimental import internal_kv
        from ray.util.placement_group import PlacementGroup, placement_group_table

        if self._namespace is None:
            return None  # not the control plane's actor: nothing is remembered
        raw = internal_kv._internal_kv_get(self._kv_key(), namespace=GROUPS_KV_NAMESPACE)
        if raw is None:
            return None
        try:
            ids = [str(i) for i in json.loads(raw)]
            pgs = [PlacementGroup(PlacementGroupID.from_hex(i)) for i in ids]
            tables = [placement_group_table(pg) for pg in pgs]
        except (ValueError, TypeError):
            logger.warning("the remembered shared placement groups are unreadable; making "
                           "new ones", exc_info=True)
            tables, pgs = [], []
        gpn = float(topology.gpus_per_node)
        if (len(pgs) == topology.num_nodes and tables
                and all(t.get("state") == "CREATED"
                        and dict(t.get("bundles", {})).get(SHARED_NODE_BUNDLE, {})
                        .get("GPU") == gpn for t in tables)):
            logger.info("adopted the %d shared placement group(s) of an earlier incarnation",
                        len(pgs))
            return pgs
        internal_kv._internal_kv_del(self._kv_key(), namespace=GROUPS_KV_NAMESPACE)
        return None

    def _remember(self, pgs: list[Any] | None) -> None:
        from ray.experimental import internal_kv

        if self._namespace is None:
            return
        if pgs is None:
            internal_kv._internal_kv_del(self._kv_key(), namespace=GROUPS_KV_NAMESPACE)
            return
        internal_kv._internal_kv_put(self._kv_key(), json.dumps([pg.id.hex() for pg in pgs]),
                                     overwrite=True, namespace=GROUPS_KV_NAMESPACE)

    async def _ensure(self) -> list[Any]:
        async with self._lock:
            if self._pgs is None:
                topology = await self._get_topology()
                self._pgs = await asyncio.to_thread(self._adopt, topology)
            if self._pgs is None:
                from ray.util.placement_group import placement_group

                gpn = topology.gpus_per_node
                pgs: list[Any] = []
                try:
                    for i in range(topology.num_nodes):
                        pgs.append(placement_group([{"GPU": float(gpn)}],
                                                   name=f"{GROUP_NAME}{i}", lifetime="detached"))
                    try:
                        await asyncio.wait_for(
                            asyncio.gather(*(pg.ready() for pg in pgs)), self._ready_timeout_s
                        )
                    except asyncio.TimeoutError:
                        # The message reads Ray's placement group table (a blocking GCS
                        # call): off the loop, which serves every other caller meanwhile.
                        message = await asyncio.to_thread(
                            _unplaceable_message, topology, self._ready_timeout_s
                        )
                        raise SharedGroupsUnplaceableError(message) from None
                    # A topology of more nodes than Ray has (or a node with more GPUs than
                    # the topology's) puts two groups on one node: pinned workers of two
                    # global GPUs would share one physical GPU. Refused, and removed below.
                    check_one_group_per_node(await asyncio.to_thread(_group_nodes, pgs))
                except BaseException:
                    # Given up (cancelled) or failed while pending: a pending group still
                    # reserves its GPUs once they free, and the next call would create a
                    # second set that could then never be placed. Removed here, not in a
                    # thread: a cancelled call must not be cancelled out of its clean-up.
                    _remove_groups(pgs)
                    raise
                self._pgs = pgs
                await asyncio.to_thread(self._remember, pgs)
                logger.info("created %d placement group(s) of %d GPUs", len(pgs), gpn)
            return self._pgs

    async def get_state(self) -> dict[str, Any]:
        """What ROLL's ``RollResourceManagerProxy`` reads (the first call makes the groups).

        Raises:
            SharedGroupsUnplaceableError: the groups were not placed within the bound.
            PlacementError: they do not sit one per Ray node (the topology names more nodes,
                or fewer GPUs per node, than Ray has); they are removed again.
        """
        pgs = await self._ensure()
        assert self._topology is not None
        return {
            "num_nodes": self._topology.num_nodes,
            "gpu_per_node": self._topology.gpus_per_node,
            "num_gpus": self._topology.num_gpus,
            "node_ranks": list(range(len(pgs))),
            "gpu_ranks": [0 for _ in pgs],
            "node2pg": dict(enumerate(pgs)),
            "placement_groups": list(pgs),
        }

    async def nodes_placement_group(self, node_rank: int) -> Any:
        """The shared placement group of node ``node_rank`` (0 <= node_rank < num_nodes)."""
        topology = await self._get_topology()
        if not is_int(node_rank) or not 0 <= node_rank < topology.num_nodes:
            raise ProtocolError(
                f"node_rank must be an int in [0, {topology.num_nodes}) (the cluster has "
                f"{topology.num_nodes} GPU node(s)), got {node_rank!r}"
            )
        return (await self._ensure())[node_rank]

    async def allocate_placement_group(
        self, world_size: int, device_mapping: list[int] | None = None
    ) -> list[list[dict[str, Any]]]:
        """Per worker, the placement group (and GPU) of each of its devices (ROLL's layout).

        ``world_size``: an int >= 1. ``device_mapping``: None / empty (CPU workers, spread over
        the nodes) or global GPU ids in ``[0, num_gpus)``, ``world_size`` workers' worth of
        equal shares (its length a multiple of ``world_size``).
        """
        topology = await self._get_topology()
        _check_allocation(topology, world_size, device_mapping)
        pgs = await self._ensure()
        gpn = topology.gpus_per_node
        address = ray.get_runtime_context().gcs_address
        out: list[list[dict[str, Any]]] = []
        if device_mapping:
            per_worker = len(device_mapping) // world_size
            for i in range(0, len(device_mapping), per_worker):
                out.append(
                    [
                        {
                            "node_rank": g // gpn,
                            "gpu_rank": g % gpn,
                            "placement_group": pgs[g // gpn],
                            "ray_address": address,
                        }
                        for g in device_mapping[i : i + per_worker]
                    ]
                )
        else:
            for rank in range(world_size):
                node = rank % len(pgs)
                out.append(
                    [
                        {
                            "node_rank": node,
                            "gpu_rank": None,
                            "placement_group": pgs[node],
                            "ray_address": address,
                        }
                    ]
                )
        return out

    async def destroy_placement_group(self) -> None:
        """Remove the shared placement groups (at coordinator stop)."""
        async with self._lock:
            if self._pgs is None:
                # an earlier incarnation's groups (this one never asked for them)
                self._pgs = await asyncio.to_thread(self._adopt, await self._get_topology())
            # off the loop (every caller waits on it); a failure keeps the groups known
            await asyncio.to_thread(functools.partial(_remove_groups, self._pgs or [],
                                                      strict=True))
            self._pgs = None
            await asyncio.to_thread(self._remember, None)


def _check_allocation(topology: Topology, world_size: object, device_mapping: object) -> None:
    """Refuse an ``allocate_placement_group`` call that cannot be laid out, before any Ray
    call (ROLL's own resource manager only asserts)."""
    if not is_int(world_size) or world_size < 1:
        raise ProtocolError(f"world_size must be an int >= 1, got {world_size!r}")
    if device_mapping is None:
        return
    if not isinstance(device_mapping, (list, tuple)):
        raise ProtocolError(
            f"device_mapping must be a list of GPU ids or None, got {type(device_mapping).__name__}"
        )
    bad = [
        g
        for g in device_mapping
        if not is_int(g) or not 0 <= g < topology.num_gpus
    ]
    if bad:
        raise ProtocolError(
            f"device_mapping has GPU ids {bad} outside the topology; valid ids are ints in "
            f"[0, {topology.num_gpus}) ({topology.num_nodes} node(s) x "
            f"{topology.gpus_per_node} GPUs)"
        )
    if device_mapping and len(device_mapping) % world_size:
        raise ProtocolError(
            f"device mapping of {len(device_mapping)} GPUs does not split into {world_size} "
            f"workers of equal size; its length must be a multiple of world_size"
        )
    twice = sorted({g for g in device_mapping if device_mapping.count(g) > 1})
    if twice:
        raise ProtocolError(
            f"device_mapping names GPU ids {twice} more than once; each GPU may appear once "
            f"(one worker per GPU, each GPU of a worker distinct)"
        )
    gpn = topology.gpus_per_node
    per_worker = len(device_mapping) // world_size
    for w in range(world_size):
        gpus = list(device_mapping[w * per_worker : (w + 1) * per_worker])
        nodes = sorted({g // gpn for g in gpus})
        whole = {n * gpn + i for n in nodes for i in range(gpn)}
        if len(nodes) > 1 and set(gpus) != whole:
            raise ProtocolError(
                f"worker {w} has GPUs {gpus} on node ranks {nodes}: a worker's GPUs must be "
                f"on one node or cover whole nodes (GPUs n*{gpn}..n*{gpn}+{gpn - 1} are node n)"
            )
