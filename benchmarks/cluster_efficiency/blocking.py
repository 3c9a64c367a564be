"""Sensitivity to blocking scheduling cycles: every result with and without them.

RLix's scheduler awaits every ``resize_infer`` of a cycle (shrinks, then expands, each a
blocking call into the pipeline) before it commits the cycle and plans the next one (rlops/rlix
at 6664b0e, ``scheduler.py`` ``_execute_resize_calls``); our service does the same
(``scheduler_actor.py``: resize RPCs outside the lock, then commit). The simulator models
that by default (``EngineConfig.blocking_cycles``, since 2026-11-24); before, it planned the
next cycle 0.2 s later even while shards were still waking ("overlapping" here), so RLix's
eager preemption could hit a rank again before it served. This script runs ``run.py``'s
workloads (same builders, engine settings and seed) and the 512-GPU point of ``scale.py``
under both engines and reports, per deployment, GPU-h/step saving vs exclusive, preemptions
and cycles, and ours' margin over each RLix baseline, so the conclusions can be checked
against the engine choice.

    python benchmarks/cluster_efficiency/blocking.py            # results/blocking.{json,png}
    python benchmarks/cluster_efficiency/blocking.py --no-512   # skip the 512-GPU point
    python benchmarks/cluster_efficiency/blocking.py --no-512 --only long_tail_agentic_8jobs
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.cluster_efficiency.run import RESULTS, SEED, _workloads, save_results  # noqa: E402
from benchmarks.cluster_efficiency.scale import POINTS, point_trace  # noqa: E402
from rlix_plugins.sim.engine import EngineConfig  # noqa: E402
from rlix_plugins.sim.runner import run_policy  # noqa: E402
from rlix_plugins.sim.workloads import Workload  # noqa: E402

POLICIES = ("exclusive", "rlix", "rlix_async", "rlix_async_migr", "ours")
BASES = ("rlix", "rlix_async", "rlix_async_migr")
#: engine -> ``blocking_cycles``; "blocking" is the default every other result uses
ENGINES = {"blocking": True, "overlapping": False}


def _figures(wl: Workload, policy: str, cfg: EngineConfig) -> dict[str, float]:
    r = run_policy(wl, policy, seed=SEED, config=cfg)
    return {
        "makespan_s": round(r.makespan, 1),
        "gpu_hours_per_step": r.num_gpus * r.makespan / 3600.0 / max(1, len(r.steps)),
        "preemptions": r.cycles.preempt_shrinks,
        "idle_preemptions": r.cycles.idle_preemptions,
        "rebalances": r.cycles.rebalance_shrinks,
        "cycles": r.cycles.cycles,
    }


def run_workload(wl: Workload, config: EngineConfig) -> dict[str, Any]:
    """Every deployment on ``wl`` under both engines, with savings and ours' margins."""
    out: dict[str, Any] = {}
    for engine, blocking in ENGINES.items():
        # Exclusive allocation never resizes: one run serves as the baseline of both engines.
        cfg = replace(config, record_tenures=False, blocking_cycles=blocking)
        row = {p: _figures(wl, p, cfg) for p in POLICIES if p != "exclusive" or blocking}
        row.setdefault("exclusive", out.get("blocking", {}).get("exclusive"))
        ex = row["exclusive"]["gpu_hours_per_step"]
        for p in POLICIES[1:]:
            row[p]["saving_vs_exclusive"] = round(1 - row[p]["gpu_hours_per_step"] / ex, 4)
        row["ours_margin_vs"] = {
            b: round(1 - row["ours"]["gpu_hours_per_step"] / row[b]["gpu_hours_per_step"], 4)
            for b in BASES
        }
        out[engine] = row
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--out", type=Path, default=RESULTS / "blocking.json")
    ap.add_argument("--no-512", action="store_true", help="skip scale.py's 512-GPU point")
    ap.add_argument("--only", default=None, help="comma-separated run.py workload names")
    args = ap.parse_args(argv)
    only = set(args.only.split(",")) if args.only else None
    started = time.perf_counter()
    rows: dict[str, dict[str, Any]] = {}
    cases: list[tuple[Workload, EngineConfig]] = [
        (wl, config)
        for _, wl, config, _ in _workloads(argparse.Namespace(quick=False, full=False, scale=False))
        if only is None or wl.name in only
    ]
    if not cases and only is not None:
        ap.error(f"--only matches no workload of run.py: {sorted(only)}")
    if not args.no_512:
        point = next(p for p in POINTS if p.gpus == 512)
        cases.append((point_trace(point), EngineConfig()))
    for wl, config in cases:
        t0 = time.perf_counter()
        rows[wl.name] = run_workload(wl, config)
        line = ", ".join(
            f"{e}: ours vs rlix_async {rows[wl.name][e]['ours_margin_vs']['rlix_async']:+.1%}, "
            f"rlix {rows[wl.name][e]['rlix']['preemptions']} preemptions"
            for e in ENGINES
        )
        print(f"{wl.name}: {line} ({time.perf_counter() - t0:.0f} s)", flush=True)
    out: dict[str, Any] = {
        "seed": SEED,
        "policies": list(POLICIES),
        "engines": {
            "blocking": "next cycle once the last cycle's shrinks sleep and expands serve "
            "(EngineConfig.blocking_cycles, the default: RLix's scheduler and our service "
            "await them)",
            "overlapping": "next cycle 0.2 s after the last, resizes still in flight (the "
            "engine before 2026-11-24)",
        },
        "note": "saving = 1 - deployment / exclusive GPU-h per step (exclusive never resizes: "
        "one run); ours_margin_vs = 1 - ours / baseline GPU-h per step (positive: ours ahead)",
        "wall_s": round(time.perf_counter() - started, 1),
        "workloads": rows,
    }
    save_results(out, args.out)
    _plot(rows, args.out.with_suffix(".png"))
    return 0


def _plot(rows: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(rows)
    fig, axes = plt.subplots(2, 1, figsize=(11, 7.5), sharex=True)
    width = 0.8 / (2 * len(BASES))
    axes[0].set_ylabel("ours' GPU-h/step margin (%)")
    i = 0
    for base in BASES:
        for engine in ENGINES:
            vals = [100 * rows[n][engine]["ours_margin_vs"][base] for n in names]
            axes[0].bar(
                [x + i * width for x in range(len(names))],
                vals,
                width,
                label=f"vs {base}, {engine}",
                hatch="//" if engine == "blocking" else "",
            )
            i += 1
    axes[0].axhline(0, color="black", lw=0.8)
    axes[0].legend(fontsize=7, ncol=3)
    axes[0].set_title(f"Ours vs RLix's policy, blocking vs overlapping cycles (seed {SEED})")
    for j, engine in enumerate(ENGINES):
        vals = [max(1, rows[n][engine]["rlix"]["preemptions"]) for n in names]
        axes[1].bar([x + j * 0.4 for x in range(len(names))], vals, 0.4, label=f"rlix, {engine}")
    axes[1].set_yscale("log")
    axes[1].set_ylabel("rlix preemption shrinks")
    axes[1].legend(fontsize=8)
    axes[1].set_xticks([x + 0.2 for x in range(len(names))])
    axes[1].set_xticklabels(names, rotation=25, ha="right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
