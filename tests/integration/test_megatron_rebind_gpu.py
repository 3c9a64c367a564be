"""Megatron's real DDP and distributed optimizer keep training, on a GPU with NCCL, after every
process group is destroyed, re-created and rebound between steps.

The CPU tests drive the same lifecycle with DDP / optimizer-shaped holders (megatron-core's
own need CUDA). Here they are megatron-core's real ``DistributedDataParallel`` (grad buffers,
bucket groups) and distributed optimizer, on a world of one NCCL rank (one GPU): the run with
a destroy / re-init / rebind after every step must produce bit-identical losses and weights to
the run without, and no destroyed group may stay reachable from the model or the optimizer.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.fixtures.distributed import run_world

pytestmark = [pytest.mark.gpu, pytest.mark.integration]

STEPS = 4


def _train(rank: int, world_size: int, cycle_groups: bool) -> dict[str, Any]:
    import torch
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import MegatronModule

    from rlix_plugins.training.nccl_lifecycle import MegatronParallelLifecycle, ParallelConfig

    lc = MegatronParallelLifecycle(ParallelConfig.of(tensor_model_parallel_size=1))
    lc.initialize()
    model_parallel_cuda_manual_seed(0)
    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4)

    class Tiny(MegatronModule):
        def __init__(self) -> None:
            super().__init__(config)
            self.hidden = torch.nn.Linear(64, 64)
            self.out = torch.nn.Linear(64, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(torch.relu(self.hidden(x)))  # type: ignore[no-any-return]

    torch.manual_seed(0)
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_grad_reduce=False, grad_reduce_in_fp32=True
    )
    model = DistributedDataParallel(config, ddp_config, Tiny().cuda())
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-2, use_distributed_optimizer=True), [model]
    )
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(1)).cuda()
    losses: list[float] = []
    rebinds: list[tuple[int, int]] = []
    destroyed: list[dict[str, int]] = []
    for _ in range(STEPS):
        model.zero_grad_buffer()
        optimizer.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        model.finish_grad_sync()  # the data-parallel reduce, on the (re-created) NCCL group
        ok, _, _ = optimizer.step()
        assert ok
        losses.append(float(loss.item()))
        if cycle_groups:
            report = lc.destroy()
            destroyed.append(dict(report.by_backend))
            rebind = lc.reinitialize(roots={"model": [model], "optimizer": optimizer})
            assert rebind is not None and not rebind.dead_reachable, rebind
            rebinds.append((rebind.replaced, len(rebind.unreplaceable)))
    # numpy: pickled by value through the result queue (a CPU tensor would travel as a
    # shared-memory handle of a process that is about to exit)
    weights = {n: p.detach().cpu().numpy() for n, p in model.module.named_parameters()}
    lc.destroy()
    return {"losses": losses, "weights": weights, "rebinds": rebinds, "destroyed": destroyed}


def test_real_ddp_and_distributed_optimizer_train_identically_across_group_cycles() -> None:
    import numpy as np

    plain = run_world(_train, 1, False, backend="nccl", timeout_s=300)[0]
    cycled = run_world(_train, 1, True, backend="nccl", timeout_s=300)[0]
    assert len(cycled["destroyed"]) == STEPS
    assert all(d.get("nccl", 0) > 0 for d in cycled["destroyed"]), cycled["destroyed"]
    # every cycle found group references in DDP / the optimizer and replaced them (a destroyed
    # group still reachable fails inside the rank: dead_reachable)
    assert all(replaced > 0 for replaced, _ in cycled["rebinds"]), cycled["rebinds"]
    assert cycled["losses"] == plain["losses"]
    assert plain["losses"][-1] < plain["losses"][0]  # it trains
    for name, w in plain["weights"].items():
        assert np.array_equal(cycled["weights"][name], w), name
