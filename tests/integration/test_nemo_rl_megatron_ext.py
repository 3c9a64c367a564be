"""The Megatron worker extension's cache build and NCCL lifecycle, in 2 real gloo ranks.

NeMo RL's ``MegatronPolicyWorkerImpl`` needs megatron-bridge (not installable here), so the
host is a Fake worker that provides only what the extension uses: a collective
``_iter_params_with_optional_kv_scales`` (it all-reduces each tensor, as the real HF export
all-gathers) and ``model`` / ``optimizer`` attributes holding process groups the way megatron's
DDP and distributed optimizer do (those need CUDA to build). Everything else is real:
torch.distributed on gloo, megatron-core's parallel_state, the training module's BucketCache
and MegatronParallelLifecycle.
"""

from __future__ import annotations

import types
from typing import Any

import pytest

from tests.fixtures.distributed import run_world
from tests.support.megatron_host import FakeMegatronHostWorker

pytestmark = pytest.mark.integration


def _rank(rank: int, world_size: int) -> dict[str, Any]:
    import torch
    from megatron.core import parallel_state as ps

    from rlix_plugins.patches.megatron import RLixMegatronWorkerMixin

    class Worker(RLixMegatronWorkerMixin, FakeMegatronHostWorker):  # type: ignore[misc]
        rlix_bucket_bytes = 1 << 16

    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    ps.initialize_model_parallel(tensor_model_parallel_size=2)  # what the host did at init
    w = Worker()
    # what MegatronPolicyWorkerImpl keeps: model (DDP holds its groups) and optimizer
    w.model = torch.nn.Module()
    w.model.tp_group = ps.get_tensor_model_parallel_group()
    w.optimizer = types.SimpleNamespace(data_parallel_group=[ps.get_data_parallel_group()])
    # NeMo RL's _get_replica_group: a group of its own, built lazily with new_group
    w._replica_group_cache = dist.new_group(ranks=[0, 1])
    lazy = w._replica_group_cache
    info = w.rlix_build_cache(1)
    out: dict[str, Any] = {"info": info, "latest": w.rlix_latest_version()}
    if info is not None:
        tensors = dict(w._rlix_cache().named_tensors(1))
        out["sums"] = {k: float(v.float().sum()) for k, v in tensors.items()}
        out["dtype"] = str(next(iter(tensors.values())).dtype)
    report = w.rlix_destroy_parallel_state()
    out["destroyed"] = report.destroyed
    out["initialized_after_destroy"] = bool(ps.model_parallel_is_initialized())
    # dropped (NeMo RL rebuilds it when absent) and destroyed (its NCCL buffers freed)
    out["lazy_dropped"] = "_replica_group_cache" not in vars(w)
    out["lazy_destroyed"] = lazy not in distributed_c10d._world.pg_map
    rebind = w.rlix_reinit_parallel_state()
    out["tp_after_reinit"] = ps.get_tensor_model_parallel_world_size()
    out["rebound"] = rebind.replaced if rebind is not None else None
    out["again"] = w.rlix_reinit_parallel_state()  # already initialised: nothing to do
    held = [w.model.tp_group, w.optimizer.data_parallel_group[0]]
    out["held_live"] = [g in distributed_c10d._world.pg_map for g in held]
    out["held_current"] = [held[0] is ps.get_tensor_model_parallel_group(),
                           held[1] is ps.get_data_parallel_group()]
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t, group=held[0])
    out["tp_sum"] = t.item()
    # a cached group that is already gone (destroyed elsewhere): dropped, the destroy goes on
    stale = dist.new_group(ranks=[0, 1])
    w._replica_group_cache = stale
    dist.destroy_process_group(stale)
    out["stale_destroyed"] = w.rlix_destroy_parallel_state().destroyed
    out["stale_dropped"] = "_replica_group_cache" not in vars(w)
    del torch
    return out


def test_cache_on_owner_rank_and_nccl_destroy_reinit_in_the_worker() -> None:
    r0, r1 = run_world(_rank, 2)
    assert r0["info"] is not None and r0["latest"] == 1
    assert r1["info"] is None and r1["latest"] is None  # only the owner keeps the cache
    # all-reduced full tensors: rank0 (0+i) + rank1 (1+i) per element, 64*32 elements
    assert r0["sums"] == {f"model.layers.{i}.weight": float((1 + 2 * i) * 64 * 32)
                          for i in range(3)}
    assert r0["dtype"] == "torch.bfloat16"
    for r in (r0, r1):
        assert r["destroyed"] > 10 and r["initialized_after_destroy"] is False
        assert r["lazy_dropped"] is True and r["lazy_destroyed"] is True
        assert r["tp_after_reinit"] == 2
        # the worker's model/optimizer references were rebound to the live new groups
        assert r["rebound"] == 2 and r["again"] is None
        assert r["held_live"] == [True, True] and r["held_current"] == [True, True]
        assert r["tp_sum"] == 3.0
        assert r["stale_destroyed"] > 10 and r["stale_dropped"] is True
