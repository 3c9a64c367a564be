"""FAKE host worker for the Megatron worker extension's tests (CPU on gloo, GPU on NCCL).

NeMo RL's ``MegatronPolicyWorkerImpl`` needs megatron-bridge, which is not installable here;
this provides only what the extension uses from its host.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


class FakeMegatronHostWorker:
    """Stands in for MegatronPolicyWorkerImpl (megatron-bridge cannot be installed here)."""

    def _iter_params_with_optional_kv_scales(
        self, kv_scales: dict[str, float] | None = None
    ) -> Iterator[tuple[str, Any]]:
        import torch
        import torch.distributed as dist

        for i in range(3):
            t = torch.full((64, 32), float(dist.get_rank() + i), dtype=torch.bfloat16)
            dist.all_reduce(t)  # collective: every rank must iterate
            yield f"model.layers.{i}.weight", t
