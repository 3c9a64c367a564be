"""The ``rlix_cache`` checkpoint-engine backend against veRL 0.9.1's real rollout workers.

Receivers are veRL's own ``CheckpointEngineWorker`` actors, built the veRL way (RayWorkerGroup on
a CPU RayResourcePool), each creating its engine from ``CheckpointEngineRegistry`` - which only
knows ``rlix_cache`` because the worker process activated rlix-plugins through
``VERL_USE_EXTERNAL_MODULES`` + ``RLIX_CONTROL_PLANE=rlix`` in the job's runtime_env env_vars
(the existing-cluster path). Only the vLLM server adapter (CUDA IPC
into a vLLM worker) is replaced, by ``FakeServerAdapter``. The sender is the backend in this
process, caching real tensors, then serving one version to a SUBSET of the replicas.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from tests.fixtures.verl_env import VerlEnv

# slow: three veRL worker processes importing veRL take ~90 s on a 2-core box.
pytestmark = [pytest.mark.verl, pytest.mark.integration, pytest.mark.slow]


def _weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        ("model.embed_tokens.weight", torch.randn(64, 32, generator=g, dtype=torch.bfloat16)),
        ("model.layers.0.mlp.up_proj.weight", torch.randn(48, 32, generator=g)),
        ("lm_head.weight", torch.randn(64, 32, generator=g, dtype=torch.bfloat16)),
    ]


def _reporting_adapter_cls() -> type:
    from tests.support.verl_cpu_server import FakeServerAdapter

    class FakeReportingServerAdapter(FakeServerAdapter):  # type: ignore[misc]
        """FakeServerAdapter that, like veRL's vLLM ``ServerAdapter.update_weights``, tells its
        server ``set_global_steps(v)`` once the load returned (the server's version record)."""

        def __init__(self, server: Any) -> None:
            super().__init__()
            self.server = server

        async def update_weights(
            self, weights: Any, global_steps: int | None = None, **kwargs: Any
        ) -> None:
            await super().update_weights(weights, global_steps=global_steps, **kwargs)
            if global_steps is not None:
                await self.server.set_global_steps.remote(global_steps)

    return FakeReportingServerAdapter


def _rollout_worker_group(ray: Any, server: Any = None) -> Any:
    """One veRL rollout ``CheckpointEngineWorker``; with ``server`` (a vLLM server actor) its
    adapter reports each loaded version to that server as veRL's ServerAdapter does."""
    from verl.checkpoint_engine.base import CheckpointEngineWorker
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from verl.workers.config import CheckpointEngineConfig, RolloutConfig

    from tests.support.verl_cpu_server import FakeServerAdapter

    cfg = RolloutConfig(
        name="vllm",
        mode="async",
        checkpoint_engine=CheckpointEngineConfig(
            backend="rlix_cache", update_weights_bucket_megabytes=1
        ),
    )
    cls = RayClassWithInitArgs(
        cls=ray.remote(CheckpointEngineWorker),
        rollout_config=cfg,
        model_config=None,
        server_adapter=FakeServerAdapter() if server is None else _reporting_adapter_cls()(server),
    )
    # max_colocate_count=1: the default (10) reserves 10 CPUs per worker bundle.
    pool = RayResourcePool([1], use_gpu=False, max_colocate_count=1)
    group = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=cls, device_name="cpu")
    # Wait until every worker finished its __init__ (veRL imports): on a loaded 2-core box
    # that alone can eat most of the sync's ack timeout (one CI run timed out that way).
    ray.get([w.__ray_ready__.remote() for w in group.workers], timeout=600)
    return group


def test_cache_backend_syncs_exactly_the_selected_replicas(
    verl_env: VerlEnv, verl_ray: Any
) -> None:
    from verl.checkpoint_engine.base import CheckpointEngineRegistry

    from rlix_plugins.patches.verl import VerlPatch
    from rlix_plugins.patches.verl_checkpoint import BACKEND

    patch = VerlPatch()
    patch.apply()
    try:
        sender = CheckpointEngineRegistry.new(BACKEND, bucket_size=1 << 20)
        groups = [_rollout_worker_group(verl_ray) for _ in range(3)]
        workers = [g.workers[0] for g in groups]
        weights = _weights(7)
        metrics = asyncio.run(sender.send_weights(iter(weights), global_steps=5))
        assert metrics["rlix/cache_version"] == 5

        report = sender.rlix_serve(5, [("replica0", workers[0]), ("replica2", workers[2])])
        assert sorted(report["succeeded"]) == ["replica0", "replica2"] and not report["failed"]

        got = verl_ray.get(
            [w.__ray_call__.remote(lambda self: self.server_adapter.summary()) for w in workers]
        )
        for idx in (0, 2):
            assert list(got[idx]) == [5]
            loaded = got[idx][5]
            assert set(loaded) == {n for n, _ in weights}
            for name, tensor in weights:
                assert loaded[name].dtype == tensor.dtype
                assert torch.equal(loaded[name], tensor)
        assert got[1] == {}, "a replica that was not selected must not be contacted"
    finally:
        patch.revert()
