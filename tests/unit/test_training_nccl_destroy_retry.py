"""A repeated destroy() keeps the old-to-new group pairing that reinitialize(roots) needs.

Real megatron-core ``parallel_state`` on one real gloo rank (a spawned process, so this test
process never initialises torch.distributed).
"""

from __future__ import annotations

from typing import Any

from tests.fixtures.distributed import run_world


def _destroy_twice_then_reinitialize(rank: int, world_size: int) -> dict[str, Any]:
    from megatron.core import parallel_state as ps
    from torch.distributed import distributed_c10d

    from rlix_plugins.training.nccl_lifecycle import MegatronParallelLifecycle, ParallelConfig

    lc = MegatronParallelLifecycle(ParallelConfig.of())
    lc.initialize()
    holder = {"dp": ps.get_data_parallel_group(), "tp": ps.get_tensor_model_parallel_group()}
    old = dict(holder)
    lc.destroy()
    lc.destroy()  # a retry: the globals are already reset, nothing is left to find
    report = lc.reinitialize([holder])
    out = {
        "replaced": None if report is None else report.replaced,
        "dp_is_new": holder["dp"] is ps.get_data_parallel_group() and holder["dp"] is not old["dp"],
        "tp_is_new": holder["tp"] is ps.get_tensor_model_parallel_group()
        and holder["tp"] is not old["tp"],
        "alive": all(g in distributed_c10d._world.pg_map for g in holder.values()),
    }
    lc.destroy()
    return out


def test_destroy_twice_then_reinitialize_rebinds_held_groups() -> None:
    (result,) = run_world(_destroy_twice_then_reinitialize, 1, timeout_s=300)
    assert result == {"replaced": 2, "dp_is_new": True, "tp_is_new": True, "alive": True}
