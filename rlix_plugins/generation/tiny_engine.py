"""Start a tiny dummy-weight vLLM engine on CPU (tests, benchmarks and the CPU gate rehearsals).

The model is a 2-layer Llama written as a ``config.json`` only; ``load_format="dummy"`` fills
the weights, so nothing is downloaded. Dummy weights are drawn from the engine's seed, so two
engines built with the same seed hold identical weights (check with
``AsyncLLM.compute_weight_checksums`` where it matters). Engine args follow
shared/notes/vllm-cpu.md: bfloat16, eager, a fixed 64 MiB KV cache (the default memory
fraction fails on CPU), token-id prompts with no tokenizer.

The model worker runs inside the EngineCore process (``UniProcExecutor``): one spawned process
and one vLLM import per engine instead of two: 17.6 s against 29-42 s per start on this 2-core
box (``python -m benchmarks.engine_start``, docs/generation.md). vLLM's CPU platform only
offers its own multiprocess executor because that is where it sets a worker's OpenMP binding
from ``VLLM_CPU_OMP_THREADS_BIND``; a tiny engine pins its EngineCore to ``cpu_bind`` instead,
once it runs (:func:`pin_engine_core`). The EngineCore inherits ``OMP_NUM_THREADS``: keep it
at the bound core count (1 in the tests and the rehearsals), or its OpenMP threads share the
bound core.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Sequence
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
    """Arguments of one tiny engine. ``cpu_bind`` pins its EngineCore (``"0"``, ``"1"``).

    ``tensor_parallel_size`` * ``pipeline_parallel_size`` > 1 runs vLLM's multiprocess
    executor (one worker process per rank, over gloo); vLLM binds worker ``r``'s OpenMP
    threads to the ``r``-th entry of ``VLLM_CPU_OMP_THREADS_BIND`` (``"0|1"``), which the
    caller sets (``cpu_bind`` is for a one-worker engine only). A pipeline-parallel engine
    starts and loads weights on vllm-cpu 0.32 but cannot generate there (its second stage
    fails on the intermediate tensors, measured 2026-11-28): use it for weight-path checks.
    """

    model_dir: Path
    cpu_bind: str | None = None
    seed: int = 0
    max_num_seqs: int = 32
    worker_extension_cls: str = ""
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.cpu_bind is not None:
            _parse_cores(self.cpu_bind)  # a typed error before any process is spawned
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            size = getattr(self, name)
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"{name}={size!r} must be an int >= 1")
        if self.workers > 1 and self.cpu_bind is not None:
            raise ValueError(
                f"cpu_bind={self.cpu_bind!r} pins a one-worker engine; an engine of "
                f"{self.workers} workers (tensor_parallel_size={self.tensor_parallel_size}, "
                f"pipeline_parallel_size={self.pipeline_parallel_size}) is bound by "
                "VLLM_CPU_OMP_THREADS_BIND (e.g. '0|1', threads_bind_per_rank)"
            )

    @property
    def workers(self) -> int:
        """The engine's worker processes: tensor * pipeline parallel size."""
        return self.tensor_parallel_size * self.pipeline_parallel_size


def threads_bind_per_rank(workers: int) -> str:
    """A ``VLLM_CPU_OMP_THREADS_BIND`` value for an engine of ``workers`` worker processes
    (tensor * pipeline parallel size): worker ``r`` on the ``r``-th core this process may run
    on (wrapping around), e.g. ``"0|1"``."""
    cores = sorted(os.sched_getaffinity(0))
    return "|".join(str(cores[r % len(cores)]) for r in range(workers))


def tiny_engine_args(spec: TinyEngineSpec) -> Any:
    """The ``vllm.engine.arg_utils.AsyncEngineArgs`` of ``spec``'s engine."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.executor.uniproc_executor import UniProcExecutor

    return AsyncEngineArgs(
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
        # The class, not "uni": the CPU platform turns the string into "mp".
        distributed_executor_backend=UniProcExecutor if spec.workers == 1 else "mp",
        tensor_parallel_size=spec.tensor_parallel_size,
        pipeline_parallel_size=spec.pipeline_parallel_size,
    )


def start_tiny_engine(spec: TinyEngineSpec) -> Any:
    """Create a ``vllm.v1.engine.async_llm.AsyncLLM`` for the tiny model.

    Called from a running event loop's thread, the engine's output handler starts there;
    from a thread without one, it starts on the loop that first uses the engine. With
    ``spec.cpu_bind`` its EngineCore process is pinned to those cores; without it two
    engines compete for whichever core the scheduler picks.
    """
    from vllm.v1.engine.async_llm import AsyncLLM

    engine = AsyncLLM.from_engine_args(tiny_engine_args(spec))
    if spec.cpu_bind is not None:
        try:
            pin_engine_core(engine, spec.cpu_bind)
        except BaseException:
            engine.shutdown()
            raise
    return engine


def start_tiny_engines(specs: Sequence[TinyEngineSpec], timeout_s: float = 900.0) -> list[Any]:
    """Start one tiny engine per spec at once; returns them in ``specs``' order.

    Most of an engine's start is its EngineCore process importing vLLM, so EngineCores
    starting side by side take about half the time of one after the other on a 2-core
    box (``benchmarks/engine_start``). Each engine is created on a thread of its own, without
    an event loop, so it binds to the loop that first uses it; call this from any thread but
    that loop's. If any engine fails to start (or ``timeout_s`` passes), the others are shut
    down, those still starting as soon as they are up, and the first error is raised.
    """
    engines: list[Any] = [None] * len(specs)
    errors: list[BaseException] = []
    lock = threading.Lock()
    gave_up = False

    def create(i: int, spec: TinyEngineSpec) -> None:
        try:
            engine = start_tiny_engine(spec)
        except BaseException as exc:  # re-raised on the caller's thread below
            errors.append(exc)
            return
        with lock:
            if not gave_up:
                engines[i] = engine
                return
        engine.shutdown()  # started after the caller gave up: nobody else would stop it

    threads = [threading.Thread(target=create, args=(i, spec), name=f"tiny-engine-{i}",
                                daemon=True) for i, spec in enumerate(specs)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout_s
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    with lock:
        if any(t.is_alive() for t in threads):
            errors.append(TimeoutError(f"tiny engines not started within {timeout_s:.0f}s"))
        gave_up = bool(errors)
    if gave_up:
        for engine in engines:
            if engine is not None:
                engine.shutdown()
        raise errors[0]
    return engines


def pin_engine_core(engine: Any, cpu_bind: str) -> None:
    """Pin every thread of ``engine``'s EngineCore process(es) to the cores of ``cpu_bind``.

    ``engine`` is an ``AsyncLLM`` or an ``LLM``. Threads the EngineCore starts later inherit
    the affinity of the thread that starts them, so pinning the running process covers them
    (with the worker inside the EngineCore, its model runs on the main thread).
    """
    cores = _parse_cores(cpu_bind)
    for pid in engine_core_pids(engine):
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                os.sched_setaffinity(int(tid), cores)
            except ProcessLookupError:  # a thread that ended meanwhile
                continue


def engine_core_pids(engine: Any) -> list[int]:
    """Process ids of the EngineCore process(es) of an ``AsyncLLM`` or ``LLM`` (vLLM 0.32's
    ``engine_core.resources.engine_manager.processes``); a ``TypeError`` naming the missing
    attribute where a vLLM keeps them elsewhere or the engine runs in-process."""
    client = getattr(engine, "llm_engine", engine).engine_core
    manager = getattr(getattr(client, "resources", None), "engine_manager", None)
    processes = getattr(manager, "processes", None)
    if not processes:
        raise TypeError(
            f"{type(engine).__name__} has no EngineCore processes at "
            "engine_core.resources.engine_manager.processes (an in-process engine, or a vLLM "
            "other than 0.32); cannot pin it"
        )
    return [p.pid for p in processes if p.pid is not None]


def _parse_cores(cpu_bind: str) -> list[int]:
    """Core ids of a ``VLLM_CPU_OMP_THREADS_BIND``-style list for one engine (``"0"``,
    ``"0,2"``, ``"0-3"``); anything else is a ``ValueError`` naming the valid forms."""
    cores: list[int] = []
    try:
        for part in cpu_bind.split(","):
            lo, sep, hi = part.strip().partition("-")
            first, last = int(lo), int(hi) if sep else int(lo)
            if first < 0 or last < first:
                raise ValueError(part)
            cores.extend(range(first, last + 1))
    except ValueError:
        raise ValueError(
            f"cpu_bind {cpu_bind!r} is not a list of core ids; valid: '0', '0,2', '0-3'"
        ) from None
    return cores
