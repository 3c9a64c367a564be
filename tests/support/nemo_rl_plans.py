"""A one-node RLix placement plan for NeMo RL adapter tests (training GPUs among the
inference GPUs, one bundle per inference GPU)."""

from __future__ import annotations

from rlix_plugins.adapters.nemo_rl_placement_plan import BundleGpu, PlacementPlan, RolePlacement
from rlix_plugins.protocol.names import ACTOR_INFER, ACTOR_TRAIN


def one_node_plan(infer: tuple[int, ...], train: tuple[int, ...]) -> PlacementPlan:
    """Inference on ``infer`` (bundle i on GPU infer[i]), training on ``train`` (a subset)."""
    return PlacementPlan(
        gpus_per_node=8, node_ranks={"n0": 0},
        bundle_gpus=tuple(BundleGpu(i, "n0", g) for i, g in enumerate(infer)),
        infer=RolePlacement(ACTOR_INFER, infer, tuple(range(len(infer))), (0,) * len(infer)),
        train=RolePlacement(ACTOR_TRAIN, train, tuple(infer.index(g) for g in train),
                            (0,) * len(train)),
    )
