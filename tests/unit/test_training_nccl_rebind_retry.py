"""A re-init whose rebind failed is retried, never reported as "nothing to do".

The groups are re-created, then rebinding the references the engine holds raises (here a
``functools.partial`` argument, which cannot be written back). The parallel state is then
initialised while the engine still holds destroyed groups: the retry (the next
``before_training``) must rebind again, and raise again while a destroyed group is still
reachable. A destroy after the failed re-init must leave only the default group.

Real megatron-core ``parallel_state`` on 2 real gloo ranks (spawned processes, so this test
process never initialises torch.distributed); the NeMo RL host worker is the FAKE of
``tests/support/megatron_host.py`` (megatron-bridge cannot be installed here).
"""

from __future__ import annotations

import functools
from typing import Any

from tests.fixtures.distributed import run_world
from tests.support.megatron_host import FakeMegatronHostWorker


def _sync_params(group: Any) -> None:
    """Stands for the parameter sync hook NeMo RL keeps for the first train step."""


def _worker_retries_failed_rebind(rank: int, world_size: int) -> dict[str, Any]:
    import pytest
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from torch.distributed import distributed_c10d

    from rlix_plugins.patches.megatron import RLixMegatronWorkerMixin
    from rlix_plugins.training.nccl_lifecycle import StaleProcessGroupError

    class Worker(RLixMegatronWorkerMixin, FakeMegatronHostWorker):
        # what MegatronPolicyWorkerImpl keeps (two of rlix_rebind_roots)
        model: Any
        _first_train_step_param_sync_func: Any

    ps.initialize_model_parallel(tensor_model_parallel_size=2)  # what the host did at init
    w = Worker()
    w.model = torch.nn.Module()
    w.model.tp_group = ps.get_tensor_model_parallel_group()
    # a positional partial argument cannot be rebound: the re-init's rebind raises
    w._first_train_step_param_sync_func = functools.partial(
        _sync_params, ps.get_data_parallel_group()
    )
    out: dict[str, Any] = {}
    w.rlix_destroy_parallel_state()
    with pytest.raises(StaleProcessGroupError):
        w.rlix_reinit_parallel_state()
    out["initialized_after_failure"] = bool(ps.model_parallel_is_initialized())
    # the retry with the destroyed group still reachable: the same error, not "nothing to do"
    try:
        retry = w.rlix_reinit_parallel_state()
        out["retry_while_stale"] = "returned" if retry is None else "report"
    except StaleProcessGroupError:
        out["retry_while_stale"] = "raised"
    # the host rebuilds its hook on the live group (what the error advises): the retry finishes
    w._first_train_step_param_sync_func = functools.partial(
        _sync_params, ps.get_data_parallel_group()
    )
    report = w.rlix_reinit_parallel_state()
    out["retry_report"] = report is not None and not report.unreplaceable
    out["again"] = w.rlix_reinit_parallel_state()  # rebound now: nothing to do
    held = w.model.tp_group
    out["held_current"] = held is ps.get_tensor_model_parallel_group()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t, group=held)
    out["tp_sum"] = t.item()
    w.rlix_destroy_parallel_state()
    out["live_after_destroy"] = len(distributed_c10d._world.pg_map)
    return out


def test_worker_retries_a_reinit_whose_rebind_failed() -> None:
    for result in run_world(_worker_retries_failed_rebind, 2, timeout_s=300):
        assert result == {
            "initialized_after_failure": True,
            "retry_while_stale": "raised",
            "retry_report": True,
            "again": None,
            "held_current": True,
            "tp_sum": 3.0,
            "live_after_destroy": 1,  # only the default group
        }


def _destroy_after_failed_rebind(rank: int, world_size: int) -> dict[str, Any]:
    import pytest
    from megatron.core import parallel_state as ps
    from torch.distributed import distributed_c10d

    from rlix_plugins.training.nccl_lifecycle import (
        MegatronParallelLifecycle,
        ParallelConfig,
        StaleProcessGroupError,
        groups_in_module,
    )

    lc = MegatronParallelLifecycle(ParallelConfig.of(tensor_model_parallel_size=2))
    lc.initialize()
    holder = {"tp": ps.get_tensor_model_parallel_group()}
    roots: dict[str, Any] = {
        "holder": holder,
        "hook": functools.partial(_sync_params, ps.get_data_parallel_group()),
    }
    lc.destroy()
    with pytest.raises(StaleProcessGroupError):
        lc.reinitialize(roots)
    out: dict[str, Any] = {"pending_after_failure": lc.rebind_pending}
    # the step is abandoned: the groups go back to inference, the next step re-inits
    lc.destroy()
    out["live_after_destroy"] = len(distributed_c10d._world.pg_map)
    out["referenced_after_destroy"] = len(groups_in_module(ps))
    out["pending_after_destroy"] = lc.rebind_pending
    roots["hook"] = functools.partial(_sync_params, None)  # rebuilt by the host
    report = lc.reinitialize(roots)
    out["rebound"] = report is not None and not report.unreplaceable and (
        holder["tp"] is ps.get_tensor_model_parallel_group()
    )
    out["pending_after_success"] = lc.rebind_pending
    lc.destroy()
    return out


def test_destroy_after_failed_rebind_leaves_nothing_and_next_reinit_rebinds() -> None:
    for result in run_world(_destroy_after_failed_rebind, 2, timeout_s=300):
        assert result == {
            "pending_after_failure": True,
            "live_after_destroy": 1,
            "referenced_after_destroy": 0,
            "pending_after_destroy": False,
            "rebound": True,
            "pending_after_success": False,
        }
