"""Start a tiny dummy-weight vLLM engine on CPU (tests, benchmarks and the CPU gate rehearsals).

The model is a 2-layer Llama written as a ``config.json`` only; ``load_format="dummy"`` fills
the weights, so nothing is downloaded. Dummy weights are drawn from the engine's seed, so two
engines built with the same seed hold identical weights (check with
``AsyncLLM.compute_weight_checksums`` where it matters). Engine args follow
shared/notes/vllm-cpu.md: bfloat16, eager, a fixed 64 MiB KV cache (the default memory
fraction fails on CPU), token-id prompts with no tokenizer.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: Vocabulary of the tiny model; token-id prompts must stay below it.
TINY_VOCAB_SIZE = 1024

_TINY_LLAMA_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,  # head size 32: CPU attention needs >= 32
    "num_key_value_heads": 4,
    "vocab_size": TINY_VOCAB_SIZE,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def write_tiny_llama(directory: Path) -> Path:
    """Write the tiny Llama ``config.json`` into ``directory`` and return the directory."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(_TINY_LLAMA_CONFIG, indent=2))
    return directory


@dataclass(frozen=True, slots=True)
class TinyEngineSpec:
    """Arguments of one tiny engine. ``cpu_bind`` pins its EngineCore (``"0"``, ``"1"``)."""

    model_dir: Path
    cpu_bind: str | None = None
    seed: int = 0
    max_num_seqs: int = 32
    worker_extension_cls: str = ""


def start_tiny_engine(spec: TinyEngineSpec) -> Any:
    """Create a ``vllm.v1.engine.async_llm.AsyncLLM`` for the tiny model.

    Must be called from a running event loop's thread (AsyncLLM starts its output handler
    lazily there). ``VLLM_CPU_OMP_THREADS_BIND`` is read by the spawned EngineCore at start,
    so it is set just for the creation and restored afterwards (left set, a later engine
    without ``cpu_bind`` inherited this one's cores); without it two engines share core 0.
    """
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    args = AsyncEngineArgs(
        model=str(spec.model_dir),
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_model_len=1024,
        max_num_seqs=spec.max_num_seqs,
        enforce_eager=True,
        kv_cache_memory_bytes=64 * 1024 * 1024,
        seed=spec.seed,
        worker_extension_cls=spec.worker_extension_cls,
        disable_log_stats=True,
    )
    key = "VLLM_CPU_OMP_THREADS_BIND"
    before = os.environ.get(key)
    if spec.cpu_bind is not None:
        os.environ[key] = spec.cpu_bind
    try:
        return AsyncLLM.from_engine_args(args)
    finally:
        if before is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = before
