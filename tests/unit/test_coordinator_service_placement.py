"""ROLL's placement calls on ``rlix:roll_resource_manager`` refuse impossible layouts with a
typed error, before any placement group exists."""

from __future__ import annotations

import asyncio
import importlib
from types import SimpleNamespace
from typing import Any

import pytest

from rlix_plugins.coordinator.core import Topology
from rlix_plugins.coordinator.service import resource_manager
from rlix_plugins.coordinator.service.resource_manager import RollResourceManagerService
from rlix_plugins.errors import ProtocolError


class FakePlacementGroup:
    """FAKE Ray placement group. The topology here is two nodes of 4 GPUs; a real two-node
    Ray runs here only as ``ray.cluster_utils.Cluster`` in a child process (as in
    ``tests/integration/test_roll_resource_manager.py``), and on the session's one-node Ray
    the manager refuses groups that share a node. The refusals under test happen before any
    Ray call (``created`` stays empty); the fake only lets the valid call after them build
    its layout, whose node and GPU ranks do not depend on Ray."""

    def __init__(self, name: str) -> None:
        self.name = name

    async def ready(self) -> None:
        return None


@pytest.fixture
def created(monkeypatch: pytest.MonkeyPatch) -> list[FakePlacementGroup]:
    """Route placement-group creation to fakes; the list of those created."""
    # The module, not ray.util's function of the same name (what the service imports from).
    pg_module = importlib.import_module("ray.util.placement_group")
    made: list[FakePlacementGroup] = []

    def placement_group(bundles: list[dict[str, float]], name: str,
                        **_: Any) -> FakePlacementGroup:
        made.append(FakePlacementGroup(name))
        return made[-1]

    monkeypatch.setattr(pg_module, "placement_group", placement_group)
    # Where Ray put each group (read from its placement-group table): one node each.
    monkeypatch.setattr(resource_manager, "_group_nodes",
                        lambda pgs: [f"FAKE-node-{i}" for i in range(len(pgs))])
    monkeypatch.setattr(
        resource_manager.ray,  # type: ignore[attr-defined]
        "get_runtime_context",
        lambda: SimpleNamespace(gcs_address="FAKE:6379"),
    )
    return made


@pytest.mark.parametrize(
    ("world_size", "mapping", "match"),
    [
        (0, [0, 1], "world_size must be an int >= 1"),
        (True, [0], "world_size must be an int >= 1"),
        (3, [0, 1], "multiple of world_size"),
        (2, [0, 1, 2], "multiple of world_size"),
        (1, [8], r"outside the topology; valid ids are ints in \[0, 8\)"),
        (1, [-1], "outside the topology"),
        (2, [1, 1], r"GPU ids \[1\] more than once"),
        (2, [0, 1, 0, 2], r"GPU ids \[0\] more than once"),
        (1, [3, 4], r"worker 0 has GPUs \[3, 4\] on node ranks \[0, 1\].*cover whole nodes"),
        (2, [0, 1, 3, 4], r"worker 1 has GPUs \[3, 4\]"),
    ],
    ids=[
        "zero-workers", "bool-workers", "more-workers-than-gpus", "uneven", "gpu-8", "gpu-neg",
        "duplicate-across-workers", "duplicate-in-worker", "worker-across-nodes",
        "second-worker-across-nodes",
    ],
)
def test_allocate_placement_group_refuses_impossible_layouts(
    created: list[FakePlacementGroup], world_size: Any, mapping: list[int], match: str
) -> None:
    rm = RollResourceManagerService(Topology(2, 4))
    with pytest.raises(ProtocolError, match=match):
        asyncio.run(rm.allocate_placement_group(world_size, mapping))
    assert created == []  # refused before any placement group was made
    layout = asyncio.run(rm.allocate_placement_group(2, [4, 5, 6, 7]))
    assert [[(d["node_rank"], d["gpu_rank"]) for d in w] for w in layout] == [
        [(1, 0), (1, 1)],
        [(1, 2), (1, 3)],
    ]


@pytest.mark.parametrize("node_rank", [-1, 2, True, "0"])
def test_nodes_placement_group_refuses_a_node_outside_the_topology(
    created: list[FakePlacementGroup], node_rank: Any
) -> None:
    rm = RollResourceManagerService(Topology(2, 4))
    with pytest.raises(ProtocolError, match=r"node_rank must be an int in \[0, 2\)"):
        asyncio.run(rm.nodes_placement_group(node_rank))
    assert created == []
    assert asyncio.run(rm.nodes_placement_group(1)).name == "rlix_pg_node1"


def test_allocate_placement_group_places_a_node_aligned_worker_over_whole_nodes(
    created: list[FakePlacementGroup],
) -> None:
    """A worker of ``tp`` a multiple of gpus_per_node (protocol: node-aligned) covers whole
    nodes; only a worker over part of two nodes is refused."""
    rm = RollResourceManagerService(Topology(2, 4))
    layout = asyncio.run(rm.allocate_placement_group(1, list(range(8))))
    assert [(d["node_rank"], d["gpu_rank"]) for d in layout[0]] == [
        (n, g) for n in range(2) for g in range(4)
    ]
