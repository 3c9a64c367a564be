"""Long-tail throughput against run length: the one-off final drain amortised over more steps.

RLix's ~3x (its RFC, shared/calibration.md) is a rollout-throughput figure of SWE-agent RL
training runs, which run many steps. ``run.py``'s long-tail workload runs 4 steps per job, and
its makespan ends with a drain in which the last steps' capped 3,600 s trajectories run with
little else to do (docs/simulator.md, ``metrics.final_drain``). A drain happens once per run,
so its share of the makespan, and the distance to a steady state, depends on the number of
steps. This script runs the 24-job long-tail workload at several steps per job (same builder,
engine settings and deployments as ``run.py``) on seeds 1..N and reports, per length, the
rollout throughput x exclusive of every deployment (mean, min, max, seeds above 3x), ours'
margin over each RLix baseline, the makespan bound (``sim.bounds``) and the final drain's
share of ours' makespan.

    python benchmarks/cluster_efficiency/run_length.py     # -> results/run_length.{json,png}
    python benchmarks/cluster_efficiency/run_length.py --steps 4,8 --seeds 2
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.cluster_efficiency.run import (  # noqa: E402
    LONG_TAIL_X,
    RESULTS,
    bound_figures,
    save_results,
    saved_results,
)
from benchmarks.cluster_efficiency.seeds import _spread, run_figures  # noqa: E402
from rlix_plugins.sim import plots  # noqa: E402
from rlix_plugins.sim.bounds import makespan_lower_bound  # noqa: E402
from rlix_plugins.sim.engine import EngineConfig  # noqa: E402
from rlix_plugins.sim.workloads import long_tail_agentic  # noqa: E402

POLICIES = ("exclusive", "rlix", "rlix_async", "rlix_async_migr", "ours")
SHARED = POLICIES[1:]
BASES = ("rlix", "rlix_async", "rlix_async_migr")
JOBS = 24
DEFAULT_STEPS = (4, 8, 16)


def _steps(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(s) for s in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--steps takes comma-separated integers >= 1, got {text!r}"
        ) from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"--steps takes integers >= 1, got {text!r}")
    return values


def run_length(steps: int, seeds: int) -> dict[str, Any]:
    """Every deployment on the long-tail workload with ``steps`` per job, seeds 1..``seeds``."""
    wl = long_tail_agentic(num_jobs=JOBS, steps=steps)
    cfg = EngineConfig(record_tenures=False)
    runs: dict[str, dict[str, dict[str, float]]] = {}
    bounds: dict[str, dict[str, float]] = {}
    for seed in range(1, seeds + 1):
        row = {p: run_figures(wl, p, seed, cfg) for p in POLICIES}
        runs[str(seed)] = row
        bounds[str(seed)] = bound_figures(
            makespan_lower_bound(wl, seed),
            row["exclusive"]["makespan_s"],
            row["ours"]["makespan_s"],
        )
        x = row["ours"]["throughput_per_h"] / row["exclusive"]["throughput_per_h"]
        print(f"{steps} steps, seed {seed}: ours {x:.3f}x exclusive", flush=True)
    rows = list(runs.values())
    summary: dict[str, Any] = {}
    for p in SHARED:
        summary[f"{p}_throughput_x_exclusive"] = _spread(
            [r[p]["throughput_per_h"] / r["exclusive"]["throughput_per_h"] for r in rows],
            LONG_TAIL_X,
        )
    for b in BASES:
        summary[f"ours_throughput_x_{b}"] = _spread(
            [r["ours"]["throughput_per_h"] / r[b]["throughput_per_h"] for r in rows], 1.0
        )
    for key in ("bound_throughput_x_exclusive", "ours_fraction_of_bound"):
        summary[key] = _spread([b[key] for b in bounds.values()])
    summary["ours_final_drain_share"] = _spread(
        [r["ours"]["final_drain_s"] / r["ours"]["makespan_s"] for r in rows]
    )
    return {"steps": steps, "summary": summary, "runs": runs, "bounds": bounds}


def _plot(lengths: list[dict[str, Any]], path: Path) -> None:
    curves = {
        p: [
            (
                ln["steps"],
                ln["summary"][f"{p}_throughput_x_exclusive"]["mean"],
                ln["summary"][f"{p}_throughput_x_exclusive"]["min"],
                ln["summary"][f"{p}_throughput_x_exclusive"]["max"],
            )
            for ln in lengths
        ]
        for p in SHARED
    }
    plots.run_length(
        curves,
        [(ln["steps"], ln["summary"]["bound_throughput_x_exclusive"]["mean"]) for ln in lengths],
        [(ln["steps"], ln["summary"]["ours_final_drain_share"]["mean"]) for ln in lengths],
        LONG_TAIL_X,
        path,
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--steps", type=_steps, default=DEFAULT_STEPS, help="e.g. 4,8,16")
    ap.add_argument("--seeds", type=int, default=8, help="seeds 1..N")
    ap.add_argument("--out", type=Path, default=RESULTS / "run_length.json")
    ap.add_argument("--plot-only", action="store_true", help="redraw the PNG from --out")
    args = ap.parse_args(argv)
    if args.seeds < 1:
        ap.error(f"--seeds must be >= 1, got {args.seeds}")
    if args.plot_only:
        _plot(saved_results(ap, args.out)["lengths"], args.out.with_suffix(".png"))
        return 0
    started = time.perf_counter()
    lengths = [run_length(s, args.seeds) for s in args.steps]
    out = {
        "workload": f"long_tail_agentic, {JOBS} jobs, 64 GPUs (run.py's headline workload)",
        "seeds": list(range(1, args.seeds + 1)),
        "policies": list(POLICIES),
        "note": f"above_par counts seeds above {LONG_TAIL_X:g}x (throughput x exclusive) or "
        "above 1 (ours / baseline); bound: the "
        "makespan no schedule can beat (sim.bounds) as throughput x exclusive; final drain: "
        "the end of ours' run below 50% utilisation (metrics.final_drain) over its makespan",
        "wall_s": round(time.perf_counter() - started, 1),
        "lengths": lengths,
    }
    save_results(out, args.out)
    _plot(lengths, args.out.with_suffix(".png"))
    for ln in lengths:
        s = ln["summary"]
        print(
            f"{ln['steps']:>3} steps: "
            + ", ".join(
                f"{p} {s[f'{p}_throughput_x_exclusive']['mean']:.2f}x" for p in SHARED
            )
            + f"; ours above {LONG_TAIL_X:g}x in {s['ours_throughput_x_exclusive']['above_par']} "
            f"seeds; bound {s['bound_throughput_x_exclusive']['mean']:.2f}x"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
