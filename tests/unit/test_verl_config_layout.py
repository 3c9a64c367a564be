"""The layout a veRL job claims before veRL builds anything, read from veRL's own config.

``config_layout`` reads veRL's real ``ppo_trainer.yaml`` (composed by Hydra, as veRL's
``main_ppo`` does) with the job's overrides; the layout must be the one veRL then builds:
``LLMServerManager`` makes ``GPUs // (tp x dp x pp)`` replicas of its pool, hybrid ones over
the trainer GPUs (unless ``actor_rollout_ref.hybrid_engine=false``) and, in ``separate_async``
mode only, standalone ones over the rollout's own GPUs.
"""

from __future__ import annotations

from typing import Any

import pytest

from rlix_plugins.protocol.names import ACTOR_INFER, ACTOR_TRAIN

pytestmark = pytest.mark.verl


def _config(*overrides: str) -> Any:
    pytest.importorskip("verl")
    from tests.integration.test_verl_trainer_loop import verl_config

    return verl_config(1, overrides)


def _layout(*overrides: str) -> Any:
    from rlix_plugins.patches.verl_trainer import config_layout

    return config_layout(_config(*overrides))


def test_separate_async_claims_hybrid_replicas_on_the_trainer_gpus_and_standalone_after() -> None:
    layout = _layout("trainer.n_gpus_per_node=4",
                     "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
                     "actor_rollout_ref.rollout.n_gpus_per_node=2")
    assert (layout.train_gpus, layout.tp, layout.hybrid_replicas,
            layout.standalone_replicas) == (4, 2, 2, 1)
    assert layout.device_mappings() == {ACTOR_TRAIN: [0, 1, 2, 3],
                                        ACTOR_INFER: [0, 1, 2, 3, 4, 5]}


def test_a_replica_spans_tensor_data_and_pipeline_parallel_gpus() -> None:
    layout = _layout("trainer.n_gpus_per_node=4",
                     "actor_rollout_ref.rollout.data_parallel_size=2",
                     "actor_rollout_ref.rollout.n_gpus_per_node=2")
    assert (layout.tp, layout.hybrid_replicas, layout.standalone_replicas) == (2, 2, 1)


def test_no_hybrid_replicas_when_the_hybrid_engine_is_off() -> None:
    layout = _layout("actor_rollout_ref.hybrid_engine=false")
    assert (layout.hybrid_replicas, layout.standalone_replicas) == (0, 1)
    assert layout.device_mappings() == {ACTOR_TRAIN: [0], ACTOR_INFER: [1]}


def test_colocated_modes_have_no_standalone_replicas() -> None:
    layout = _layout("trainer.v1.trainer_mode=colocate_async")
    assert (layout.hybrid_replicas, layout.standalone_replicas) == (1, 0)


def test_disaggregated_replicas_are_not_claimed_ahead() -> None:
    assert _layout("actor_rollout_ref.rollout.disaggregation.enabled=true") is None


def test_the_claimed_layout_is_the_one_build_adapter_reads_from_the_built_replicas() -> None:
    """The default job of the trainer-loop test (1 trainer GPU with hybrid replica 0,
    standalone replica 1 on GPU 1): what it claims equals what ``build_adapter`` builds."""
    from rlix_plugins.adapters.verl import VerlLayout

    assert _layout() == VerlLayout(train_gpus=1, tp=1, hybrid_replicas=1, standalone_replicas=1)
