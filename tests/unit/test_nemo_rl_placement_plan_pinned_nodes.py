"""Pinned plans on the coordinator's shared per-node groups: two node ranks whose groups Ray
put on one node would alias global GPU ids (pure planning, no Ray, no NeMo RL)."""

from __future__ import annotations

import pytest

from rlix_plugins.adapters.nemo_rl_placement_plan import PlacementError, plan_pinned
from rlix_plugins.protocol.names import ACTOR_TRAIN


def test_pinned_plan_refuses_two_node_ranks_on_one_ray_node() -> None:
    # A coordinator started with --nodes 2 --gpus-per-node 4 on one 8-GPU machine: both
    # {GPU: 4} groups sit on node "nA". Global GPU 4 (node rank 1, local 0) would be pinned to
    # CUDA_VISIBLE_DEVICES=0 on nA, the same physical GPU as global GPU 0, which the
    # coordinator may grant to another pipeline at the same time.
    with pytest.raises(PlacementError, match=r"node ranks \[0, 1\].*nA"):
        plan_pinned([0, 4], [0], ["nA", "nA"], 4)


def test_pinned_plan_on_distinct_nodes_is_accepted() -> None:
    plan = plan_pinned([0, 4], [4], ["nA", "nB"], 4)
    assert plan.infer.node_indices == (0, 1) and plan.local_gpu(ACTOR_TRAIN, 0) == 0
