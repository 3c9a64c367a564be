"""Training-request reservation: when a blocked request holds GPUs back from others.

A non-generation request (training, log-probs) needs its whole mapping; when part of it is
held by another cluster's training it waits. Until 2026-11-25 it reserved its GPUs at once
against every lower-ranked request (no backfill). Now (``PolicyConfig``) it reserves only
after waiting ``reserve_after_s`` (600 s), and a lower-ranked request may still take reserved
GPUs when its expected holding (its cluster's last grant-to-release time) ends before the
reserving request may start (``backfill``, EASY backfilling). This script runs ``ours`` with
each rule on the RollMux traces (16 jobs, 10 steps: ``run.py``'s) on the full 64-GPU cluster
and time-shared on 32 and 24 GPUs, seeds 1..N, beside ``rlix_async_migr`` (RLix's policy with
our router: only the policy differs), and reports GPU-h/step, mean JCT and the largest
slowdown (JCT over the job's JCT alone on its own GPUs).

    python benchmarks/cluster_efficiency/reservation.py   # results/reservation.{json,png}
    python benchmarks/cluster_efficiency/reservation.py --seeds 2 --gpus 32 --profiles mixed
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.cluster_efficiency.run import RESULTS, save_results, saved_results  # noqa: E402
from benchmarks.cluster_efficiency.seeds import _spread  # noqa: E402
from rlix_plugins.coordinator.core import DemandSharePlanner, Planner, PolicyConfig  # noqa: E402
from rlix_plugins.sim import plots  # noqa: E402
from rlix_plugins.sim.engine import EngineConfig  # noqa: E402
from rlix_plugins.sim.metrics import summarize  # noqa: E402
from rlix_plugins.sim.runner import isolated_jct, run_policy  # noqa: E402
from rlix_plugins.sim.workloads import ROLLMUX_RANGES, Workload, rollmux_trace  # noqa: E402

PROFILES = (*ROLLMUX_RANGES, "mixed")
BASE = "rlix_async_migr"
#: ours' reservation rules: the default, the rule before it, and the two ends
VARIANTS = {
    "default": PolicyConfig(),
    "reserve_at_once": PolicyConfig(reserve_after_s=0.0, backfill=False),
    "reserve_at_once_backfill": PolicyConfig(reserve_after_s=0.0),
    "never_reserve": PolicyConfig(reserve_after_s=math.inf),
}


def _figures(
    wl: Workload,
    policy: str,
    seed: int,
    cfg: EngineConfig,
    planner: Planner | None,
    alone: dict[str, float],
) -> dict[str, float]:
    s = summarize(policy, run_policy(wl, policy, seed=seed, config=cfg, planner=planner), alone)
    return {
        "gpu_hours_per_step": s.gpu_hours_per_step,
        "mean_jct_s": s.mean_jct_s,
        "max_slowdown": s.max_slowdown,
        "aborted": s.aborted_trajectories,
    }


def _seed_row(wl: Workload, seed: int, cfg: EngineConfig) -> dict[str, dict[str, float]]:
    alone = {j.name: isolated_jct(j, wl.gpus_per_node, seed=seed) for j in wl.jobs}
    row = {BASE: _figures(wl, BASE, seed, cfg, None, alone)}
    for v, pc in VARIANTS.items():
        row[f"ours_{v}"] = _figures(wl, "ours", seed, cfg, DemandSharePlanner(pc), alone)
    return row


def _saving(rows: list[dict[str, dict[str, float]]], name: str, key: str) -> dict[str, Any]:
    return _spread([1 - r[name][key] / r[BASE][key] for r in rows])


def _slowdown(rows: list[dict[str, dict[str, float]]], name: str) -> dict[str, float]:
    values = [r[name]["max_slowdown"] for r in rows]
    return {"mean": round(statistics.mean(values), 3), "max": round(max(values), 3)}


def _summary(rows: list[dict[str, dict[str, float]]]) -> dict[str, Any]:
    out: dict[str, Any] = {
        v: {
            # positive: ours ahead of RLix's policy (same pipelines and router)
            "gpu_hours_saving_vs_base": _saving(rows, f"ours_{v}", "gpu_hours_per_step"),
            "mean_jct_saving_vs_base": _saving(rows, f"ours_{v}", "mean_jct_s"),
            "max_slowdown": _slowdown(rows, f"ours_{v}"),
        }
        for v in VARIANTS
    }
    out[BASE] = {"max_slowdown": _slowdown(rows, BASE)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--seeds", type=int, default=8, help="seeds 1..N")
    ap.add_argument("--gpus", default="64,32,24", help="time-shared cluster sizes (x8)")
    ap.add_argument("--profiles", default=",".join(PROFILES), help="RollMux profiles")
    ap.add_argument("--out", type=Path, default=RESULTS / "reservation.json")
    ap.add_argument("--plot-only", action="store_true", help="redraw the PNG from --out")
    args = ap.parse_args(argv)
    if args.plot_only:
        _plot(saved_results(ap, args.out), args.out.with_suffix(".png"))
        return 0
    try:
        sizes = [int(x) for x in args.gpus.split(",")]
    except ValueError:
        ap.error(f"--gpus must be comma-separated multiples of 8, got {args.gpus!r}")
    if args.seeds < 1 or any(g <= 0 or g % 8 for g in sizes):
        ap.error(f"--seeds must be >= 1 and --gpus multiples of 8, got {args.seeds}, {sizes}")
    profiles = args.profiles.split(",")
    if not profiles or any(p not in PROFILES for p in profiles):
        ap.error(f"--profiles {args.profiles!r}: valid are {', '.join(PROFILES)}")
    started = time.perf_counter()
    cfg = EngineConfig(record_tenures=False)
    workloads: dict[str, Any] = {}
    for profile in profiles:
        seeds = range(1, args.seeds + 1)
        traces = [rollmux_trace(profile, num_jobs=16, steps=10, seed=s) for s in seeds]
        for gpus in sizes:
            rows = [
                _seed_row(replace(wl, shared_nodes=gpus // wl.gpus_per_node), seed, cfg)
                for seed, wl in enumerate(traces, start=1)
            ]
            name = f"{traces[0].name}_S{gpus}"
            workloads[name] = {"summary": _summary(rows), "runs": rows}
            s = workloads[name]["summary"]
            print(name, "  ".join(
                f"{v}: JCT {s[v]['mean_jct_saving_vs_base']['mean']:+.1%} "
                f"GPU-h {s[v]['gpu_hours_saving_vs_base']['mean']:+.1%} "
                f"max slowdown {s[v]['max_slowdown']['mean']:.2f}"
                for v in VARIANTS
            ), f"({BASE}: {s[BASE]['max_slowdown']['mean']:.2f})")
    out = {
        "seeds": list(range(1, args.seeds + 1)),
        "variants": {
            # null: never reserves (JSON has no infinity)
            v: {
                "reserve_after_s": None if math.isinf(pc.reserve_after_s) else pc.reserve_after_s,
                "backfill": pc.backfill,
            }
            for v, pc in VARIANTS.items()
        },
        "note": "savings = 1 - ours / rlix_async_migr (positive: ours ahead; above_par "
        "counts seeds > 0); max_slowdown = the largest JCT / JCT alone over the trace's jobs "
        "(mean and max over seeds); "
        "RollMux traces of run.py (16 jobs, 10 steps), time-shared on S<gpus> GPUs",
        "wall_s": round(time.perf_counter() - started, 1),
        "workloads": workloads,
    }
    save_results(out, args.out)
    _plot(out, args.out.with_suffix(".png"))
    return 0


def _plot(out: dict[str, Any], path: Path) -> None:
    """Mean JCT saving over RLix's policy per rule (mean, min..max over seeds)."""
    changes = {
        v: {
            n: tuple(w["summary"][v]["mean_jct_saving_vs_base"][k] for k in ("mean", "min", "max"))
            for n, w in out["workloads"].items()
        }
        for v in out["variants"]
    }
    plots.relative_changes(
        changes,
        "mean JCT saving vs rlix_async_migr (%)",
        "Ours' training-request reservation rules vs RLix's policy (mean, min..max over seeds)",
        path,
    )


if __name__ == "__main__":
    sys.exit(main())
