"""The coordinator's shared per-node placement groups, as any pipeline places on them.

``rlix:roll_resource_manager`` (the coordinator's ROLL-compatible resource manager) owns one
placement group per GPU node with one bundle ``{GPU: gpus_per_node}``. ROLL places its workers
there; NeMo RL (:mod:`.nemo_rl_placement`) and veRL (:mod:`rlix_plugins.patches.verl_placement`)
pipelines do too when the manager runs, so Ray's accounting never stops two pipelines from
sharing a GPU: each worker asks for a sliver of GPU (:data:`PINNED_WORKER_GROUPS`) and no CPU,
and is pinned to its layout GPU by ``CUDA_VISIBLE_DEVICES``; the coordinator decides who
computes there.

Global GPU id ``g`` is local GPU ``g % gpus_per_node`` of node rank ``g // gpus_per_node``,
node ranks in the order of the manager's groups.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rlix_plugins.errors import RegistrationError
from rlix_plugins.protocol.names import ROLL_RESOURCE_MANAGER_ACTOR

logger = logging.getLogger(__name__)

#: On the shared groups every worker asks for ``1 / PINNED_WORKER_GROUPS`` GPU (0.01, as
#: ROLL's workers): Ray's accounting never stops two pipelines from sharing a GPU.
PINNED_WORKER_GROUPS = 100
#: The only bundle of each shared per-node group (``{GPU: gpus_per_node}``).
SHARED_NODE_BUNDLE = 0


class PlacementError(RegistrationError):
    """The pipeline's GPU layout and where Ray put (or would put) its workers disagree."""


def check_one_group_per_node(node_ids: Sequence[str]) -> None:
    """Raise :class:`PlacementError` when two node ranks' groups sit on one Ray node:
    workers pinned there to distinct global GPUs (``n * gpus_per_node + g``) would get the
    same ``CUDA_VISIBLE_DEVICES=g``, one physical GPU the coordinator counts twice."""
    ranks_of: dict[str, list[int]] = {}
    for rank, nid in enumerate(node_ids):
        ranks_of.setdefault(str(nid), []).append(rank)
    shared = {nid: ranks for nid, ranks in ranks_of.items() if len(ranks) > 1}
    if shared:
        where = "; ".join(f"node ranks {ranks} on Ray node {nid}"
                          for nid, ranks in sorted(shared.items()))
        raise PlacementError(
            f"the coordinator's shared placement groups do not sit one per node ({where}); "
            "workers pinned by CUDA_VISIBLE_DEVICES would share a physical GPU that the "
            "coordinator counts as two (its gpus_per_node / node count exceed what the Ray "
            "nodes hold)"
        )


@dataclass(frozen=True, slots=True)
class SharedGroups:
    """The shared groups as the manager reports them, node rank ``n`` at position ``n``."""

    placement_groups: tuple[Any, ...]
    #: the Ray node each group's bundle sits on
    node_ids: tuple[str, ...]
    gpus_per_node: int

    @property
    def num_gpus(self) -> int:
        return len(self.placement_groups) * self.gpus_per_node

    def locate(self, gpu: int) -> tuple[int, int]:
        """``(node rank, local GPU)`` of global GPU ``gpu`` (raises for one that does not
        exist here)."""
        if not 0 <= gpu < self.num_gpus:
            raise PlacementError(
                f"GPU {gpu} does not exist: the coordinator's shared placement groups cover "
                f"{len(self.placement_groups)} node(s) of {self.gpus_per_node} GPUs (global GPU "
                f"ids 0..{self.num_gpus - 1})"
            )
        return divmod(gpu, self.gpus_per_node)


def find_manager() -> tuple[Any, str] | None:
    """``(rlix:roll_resource_manager handle, namespace)`` when the coordinator's manager runs
    in the control-plane namespace (``RLIX_NAMESPACE``, default ``rlix``) of a process under
    ``RLIX_CONTROL_PLANE=rlix``; None otherwise (a warning names the consequence: the
    pipeline reserves GPUs of its own, which no other pipeline can share)."""
    import ray

    from rlix_plugins.settings import settings_if_enabled

    settings = settings_if_enabled()
    if settings is None:
        return None
    try:
        manager = ray.get_actor(ROLL_RESOURCE_MANAGER_ACTOR, namespace=settings.namespace)
    except ValueError:
        logger.warning(
            "rlix: no %s in namespace %r: this pipeline reserves a placement group of its "
            "own, so no other pipeline can share its GPUs", ROLL_RESOURCE_MANAGER_ACTOR,
            settings.namespace,
        )
        return None
    return manager, settings.namespace


def read_groups(manager: Any) -> SharedGroups:
    """Ask the manager for its groups (as ROLL's proxy does; the first ask creates them) and
    Ray where each one's bundle sits. Raises :class:`PlacementError` when two share a
    node (:func:`check_one_group_per_node`)."""
    import ray
    from ray.util.placement_group import placement_group_table

    state = ray.get(manager.get_state.remote())
    pgs = tuple(state["placement_groups"])
    node_ids = tuple(str(placement_group_table(pg)["bundles_to_node_id"][SHARED_NODE_BUNDLE])
                     for pg in pgs)
    check_one_group_per_node(node_ids)
    return SharedGroups(pgs, node_ids, int(state["gpu_per_node"]))


__all__ = [
    "PINNED_WORKER_GROUPS",
    "SHARED_NODE_BUNDLE",
    "PlacementError",
    "SharedGroups",
    "check_one_group_per_node",
    "find_manager",
    "read_groups",
]
