"""On the coordinator's per-node groups, a role's torch.distributed master address is on the
node of the role's rank 0 (NeMo RL's own choice, group 0 / bundle 0, is node rank 0's group).

Needs NeMo RL's source (``nemo_rl_src``: its real ``RayVirtualCluster``); no Ray is started:
the port probe, which NeMo RL runs as a Ray task on the chosen group, is replaced by a FAKE
that records which group it was asked about."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


class _FakeGroup:
    """FAKE Ray placement group: one bundle, as the coordinator's per-node groups."""

    bundle_specs = [{"GPU": 2.0}]


@pytest.fixture
def placement(nemo_rl_src: Path) -> Iterator[Any]:
    from rlix_plugins.adapters import nemo_rl_placement

    yield nemo_rl_placement


def test_pinned_training_master_address_is_on_its_rank_0_node(
    placement: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rlix_plugins.adapters.nemo_rl_placement_plan import plan_pinned

    groups = [_FakeGroup(), _FakeGroup()]  # node rank 0 on "n0", node rank 1 on "n1"
    # Inference on both nodes, training (two Megatron ranks) only on node rank 1.
    plan = plan_pinned([0, 1, 2, 3], [2, 3], ["n0", "n1"], 2)
    monkeypatch.setattr(placement, "coordinator_groups", lambda mp: (object(), "rlix"))
    monkeypatch.setattr(
        placement.CoordinatorPlacement, "create",
        classmethod(lambda cls, infer, train, manager, ns: cls(groups, plan, ns)),
    )
    monkeypatch.setattr(placement, "_claim_setup", lambda layout, mp: None)
    cluster = placement.RLixPlacementCluster
    train = cluster([2], num_gpus_per_node=2, name="grpo_train_cluster")
    infer = cluster([2, 2], num_gpus_per_node=2, name="grpo_inference_cluster")
    train.rlix_bind({"rlix": {"infer_gpus": [0, 1, 2, 3], "train_gpus": [2, 3]}})
    assert train.rlix_plan is plan and infer.rlix_plan is plan

    asked: list[tuple[int, int]] = []

    def probe(pg_idx: int, bundle_idx: int) -> tuple[str, int]:  # FAKE Ray port probe
        asked.append((pg_idx, bundle_idx))
        return (f"ip-of-group-{pg_idx}", 29500 + len(asked))

    monkeypatch.setattr(train, "get_available_address_and_port", probe)
    monkeypatch.setattr(infer, "get_available_address_and_port", probe)
    # Rank 0 of training is GPU 2 = node rank 1: its rendezvous must be on group 1's node.
    addr, port = train.get_master_address_and_port()
    assert (addr, asked) == ("ip-of-group-1", [(1, 0)])
    # Inference rank 0 is GPU 0 = node rank 0; ports stay unique across the pair's roles.
    addr2, port2 = infer.get_master_address_and_port()
    assert addr2 == "ip-of-group-0" and port2 != port
