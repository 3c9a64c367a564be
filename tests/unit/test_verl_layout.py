"""The coordinator's view of a veRL job's GPUs (pure; no veRL needed)."""

from __future__ import annotations

import pytest

from rlix_plugins.adapters.verl import VerlLayout
from rlix_plugins.coordinator.core.model import Topology
from rlix_plugins.coordinator.core.registration import validate_registration
from rlix_plugins.errors import RegistrationError


def test_hybrid_replicas_overlap_training_and_standalone_follow() -> None:
    layout = VerlLayout(train_gpus=4, tp=2, hybrid_replicas=2, standalone_replicas=2)
    maps = layout.device_mappings()
    assert maps["actor_train"] == [0, 1, 2, 3]
    assert maps["actor_infer"] == [0, 1, 2, 3, 4, 5, 6, 7]
    assert layout.tp_configs() == {"actor_train": 1, "actor_infer": 2}
    assert layout.num_replicas == 4


def test_hybrid_replicas_cannot_exceed_the_trainer_gpus() -> None:
    with pytest.raises(ValueError, match="exceed"):
        VerlLayout(train_gpus=2, tp=2, hybrid_replicas=2, standalone_replicas=0).device_mappings()


def test_separate_async_without_hybrid_is_disjoint() -> None:
    maps = VerlLayout(2, 1, 0, 2).device_mappings()
    assert maps == {"actor_train": [0, 1], "actor_infer": [2, 3]}


def test_the_coordinator_accepts_the_registration() -> None:
    layout = VerlLayout(train_gpus=4, tp=2, hybrid_replicas=2, standalone_replicas=2)
    spec = validate_registration(
        Topology(num_nodes=1, gpus_per_node=8),
        pipeline_id="ft_0123456789ab",
        ray_namespace="pipeline_ft_0123456789ab_NS",
        cluster_tp_configs=layout.tp_configs(),
        cluster_device_mappings=layout.device_mappings(),
    )
    assert spec is not None


def test_the_setup_hold_covers_every_gpu_verl_loads_a_model_on() -> None:
    # hybrid: the inference cluster covers the trainer GPUs
    assert VerlLayout(4, 2, 2, 2).setup_clusters() == ("actor_infer",)
    # hybrid_engine=false: the trainer GPUs host no replica; both clusters, disjoint
    assert VerlLayout(2, 1, 0, 2).setup_clusters() == ("actor_train", "actor_infer")


def test_trainer_gpus_partly_without_a_replica_are_refused_before_registering() -> None:
    # 3 trainer GPUs, replicas of 2: GPU 2 trains but hosts no replica (it would load the
    # training model unheld, and the two clusters share GPUs 0-1: both cannot be held)
    with pytest.raises(RegistrationError, match=r"trainer GPUs \[2\] host no rollout replica"):
        VerlLayout(3, 2, 1, 2).setup_clusters()
