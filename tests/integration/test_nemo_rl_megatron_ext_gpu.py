"""On real NCCL (one GPU): the group NeMo RL builds lazily for itself is destroyed with
Megatron's, and the GPU memory its communicator held comes back every cycle.

The CPU test (``test_nemo_rl_megatron_ext.py``, gloo) shows the group is destroyed and dropped;
what only a GPU shows is that this frees its NCCL buffers. The host is the same FAKE worker
(NeMo RL's ``MegatronPolicyWorkerImpl`` needs megatron-bridge); megatron-core's parallel_state,
torch's NCCL process groups and the extension's lifecycle are real.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.distributed import run_world
from tests.support.megatron_host import FakeMegatronHostWorker

pytestmark = [pytest.mark.gpu, pytest.mark.integration]

CYCLES = 3


def _used() -> int:
    import torch

    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return int(total - free)


def _cycles(rank: int, world_size: int) -> dict[str, Any]:
    import megatron.core
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from benchmarks.gpu.run import machine
    from rlix_plugins.patches.megatron import RLixMegatronWorkerMixin

    class Worker(RLixMegatronWorkerMixin, FakeMegatronHostWorker):
        model: Any  # what MegatronPolicyWorkerImpl keeps (DDP holds its groups)
        _replica_group_cache: Any  # NeMo RL's own group (_get_replica_group)

    ps.initialize_model_parallel(tensor_model_parallel_size=1)  # what the host did at init
    w = Worker()
    w.model = torch.nn.Module()
    w.model.dp_group = ps.get_data_parallel_group()
    out: dict[str, Any] = {
        "machine": {**machine(), "megatron_core": megatron.core.__version__},
        "cycles": [],
    }
    for _ in range(CYCLES):
        # Megatron's groups in use (DDP's all-reduce), then NeMo RL's own, built lazily on
        # first use (_get_replica_group) and used once
        dist.all_reduce(torch.ones(1, device="cuda"), group=w.model.dp_group)
        without_lazy = _used()
        w._replica_group_cache = dist.new_group(ranks=list(range(world_size)))
        t = torch.ones(1 << 10, device="cuda")
        dist.all_reduce(t, group=w._replica_group_cache)
        with_lazy = _used()
        w.rlix_destroy_parallel_state()
        after_destroy = _used()
        out["cycles"].append({
            "lazy_group_bytes": with_lazy - without_lazy,
            "used_with_groups_bytes": with_lazy,
            "used_after_destroy_bytes": after_destroy,
            "lazy_dropped": "_replica_group_cache" not in vars(w),
            "sum": float(t[0]),
        })
        w.rlix_reinit_parallel_state()
        assert w.model.dp_group is ps.get_data_parallel_group()  # rebound to the new group
    return out


def test_the_lazily_built_nemo_rl_group_frees_its_nccl_memory_every_cycle() -> None:
    measured = run_world(_cycles, 1, backend="nccl", timeout_s=300)[0]
    _save(measured)
    cycles = measured["cycles"]
    first = cycles[0]
    # a communicator holds GPU memory of its own (NCCL buffers): the lazy group costs some
    assert first["lazy_group_bytes"] > 0
    for c in cycles:
        assert c["lazy_dropped"] is True and c["sum"] == 1.0
        # every group, the lazy one included, gave its memory back
        assert c["used_with_groups_bytes"] - c["used_after_destroy_bytes"] >= c["lazy_group_bytes"]
        # and nothing accumulates over the cycles (not even half a lazy group's worth)
        drift = c["used_after_destroy_bytes"] - first["used_after_destroy_bytes"]
        assert drift <= first["lazy_group_bytes"] // 2


def _save(measured: dict[str, Any]) -> None:
    """The figures as JSON in ``$RLIX_GPU_RESULTS`` when set (how
    ``benchmarks/gpu/results/nemo_rl_lazy_group_h200.json`` was made)."""
    out_dir = os.environ.get("RLIX_GPU_RESULTS")
    if not out_dir:
        return
    path = Path(out_dir) / "nemo_rl_lazy_group.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        **measured,
        "command": "RLIX_GPU_RESULTS=DIR pytest -m gpu "
        "tests/integration/test_nemo_rl_megatron_ext_gpu.py",
        "layout": "world of one rank (one GPU, NCCL), tensor_model_parallel_size=1; FAKE host "
        "worker (NeMo RL's MegatronPolicyWorkerImpl needs megatron-bridge); real "
        "parallel_state, NCCL groups and the extension's rlix_destroy_parallel_state / "
        "rlix_reinit_parallel_state",
        "method": "device memory in use (cudaMemGetInfo, whole GPU, this process alone) before "
        "and after NeMo RL's lazily built group (new_group + one all_reduce), and after "
        "rlix_destroy_parallel_state()",
    }, indent=2) + "\n")
