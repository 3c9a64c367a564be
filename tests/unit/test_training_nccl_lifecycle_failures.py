"""Failure paths of the Megatron NCCL lifecycle and the NeMo RL worker's saved configuration.

Real megatron-core ``parallel_state`` on 2 real gloo ranks (spawned processes, so this test
process never initialises torch.distributed).
"""

from __future__ import annotations

from typing import Any

from tests.fixtures.distributed import run_world


def _failed_initialize_leaves_state_unchanged(rank: int, world_size: int) -> dict[str, Any]:
    import pytest
    from megatron.core import parallel_state as ps
    from torch.distributed import distributed_c10d

    from rlix_plugins.errors import ParallelStateError
    from rlix_plugins.training.nccl_lifecycle import MegatronParallelLifecycle, ParallelConfig

    live_before = len(distributed_c10d._world.pg_map)
    # megatron creates the DP and CP groups, then asserts on the hierarchical CP sizes
    bad = MegatronParallelLifecycle(
        ParallelConfig.of(context_parallel_size=2, hierarchical_context_parallel_sizes=[3])
    )
    with pytest.raises(ParallelStateError, match="hierarchical_context_parallel_sizes"):
        bad.initialize()
    out: dict[str, Any] = {
        "new_groups_after_failure": len(distributed_c10d._world.pg_map) - live_before,
        "dp_global_after_failure": ps._DATA_PARALLEL_GROUP is not None,
        "process_group_list": ps._global_process_group_list,
    }
    # a layout megatron refuses before creating anything is a typed error too
    with pytest.raises(ParallelStateError, match="tensor_model_parallel_size"):
        MegatronParallelLifecycle(ParallelConfig.of(tensor_model_parallel_size=3)).initialize()
    # the worker is still usable: a valid configuration initialises
    good = MegatronParallelLifecycle(ParallelConfig.of(tensor_model_parallel_size=2))
    good.initialize()
    out["tp_after_good_init"] = ps.get_tensor_model_parallel_world_size()
    good.destroy()
    return out


def test_failed_initialize_raises_typed_error_and_leaves_no_groups() -> None:
    for result in run_world(_failed_initialize_leaves_state_unchanged, 2, timeout_s=300):
        assert result == {
            "new_groups_after_failure": 0,
            "dp_global_after_failure": False,
            "process_group_list": None,
            "tp_after_good_init": 2,
        }


def _failed_pairing_keeps_state_destroyed(rank: int, world_size: int) -> dict[str, Any]:
    import pytest
    from megatron.core import parallel_state as ps
    from torch.distributed import distributed_c10d

    from rlix_plugins.errors import ParallelStateError
    from rlix_plugins.training.nccl_lifecycle import MegatronParallelLifecycle, ParallelConfig

    config = ParallelConfig.of(tensor_model_parallel_size=2)
    lc = MegatronParallelLifecycle(config)
    lc.initialize()
    holder = {"tp": ps.get_tensor_model_parallel_group()}
    old_tp = holder["tp"]
    lc.destroy()
    # a re-init whose layout differs (no gloo groups now) cannot pair old groups with new ones
    lc.config = ParallelConfig.of(tensor_model_parallel_size=2, create_gloo_process_groups=False)
    with pytest.raises(ParallelStateError, match="layout differs"):
        lc.reinitialize([holder])
    out: dict[str, Any] = {
        # still destroyed: a caller that retries must not find an "initialised" state whose
        # held groups were never rebound
        "initialized_after_failure": lc.initialized,
        "live_groups_after_failure": len(distributed_c10d._world.pg_map),
    }
    lc.config = config
    report = lc.reinitialize([holder])
    out["replaced"] = None if report is None else report.replaced
    out["rebound"] = holder["tp"] is ps.get_tensor_model_parallel_group() and (
        holder["tp"] is not old_tp
    )
    lc.destroy()
    return out


def test_failed_group_pairing_rolls_the_reinit_back() -> None:
    for result in run_world(_failed_pairing_keeps_state_destroyed, 2, timeout_s=300):
        assert result == {
            "initialized_after_failure": False,
            "live_groups_after_failure": 1,  # only the default group
            "replaced": 1,
            "rebound": True,
        }


def _config_round_trip(rank: int, world_size: int) -> dict[str, Any]:
    from megatron.core import parallel_state as ps

    from rlix_plugins.patches.megatron import parallel_config_from_state
    from rlix_plugins.training.nccl_lifecycle import MegatronParallelLifecycle

    def after_reinit(**init: Any) -> dict[str, Any]:
        """Initialise as a host would, destroy and re-create from the config read back."""
        ps.initialize_model_parallel(**init)
        lc = MegatronParallelLifecycle.adopt(parallel_config_from_state(ps), ps)
        lc.destroy()
        lc.reinitialize()
        seen = {
            "vpp": ps.get_virtual_pipeline_model_parallel_world_size(),
            "etp": ps.get_expert_tensor_parallel_world_size(),
            "gloo": ps._DATA_PARALLEL_GROUP_GLOO is not None,
        }
        lc.destroy()
        return seen

    return {
        # interleaved pipeline, no gloo groups
        "vpp_no_gloo": after_reinit(
            pipeline_model_parallel_size=2,
            virtual_pipeline_model_parallel_size=2,
            create_gloo_process_groups=False,
        ),
        # experts with a tensor-parallel size of their own (gloo groups by default)
        "own_expert_tp": after_reinit(tensor_model_parallel_size=2, expert_tensor_parallel_size=1),
    }


def test_worker_config_from_state_reproduces_vpp_expert_tp_and_gloo() -> None:
    for result in run_world(_config_round_trip, 2, timeout_s=300):
        assert result["vpp_no_gloo"]["vpp"] == 2 and result["vpp_no_gloo"]["gloo"] is False
        assert result["own_expert_tp"]["etp"] == 1 and result["own_expert_tp"]["gloo"] is True
