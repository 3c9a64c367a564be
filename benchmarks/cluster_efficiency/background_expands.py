"""Background expands: our service's cycle with and without waiting for its expands.

Both RLix's scheduler and our service (by default) await every ``resize_infer`` of a cycle,
expands included, before the next cycle plans (docs/simulator.md, "Blocking cycles"). With
``RLIX_BACKGROUND_EXPANDS=1`` our service commits a cycle once its shrinks are done and lets
each expand (wake + selective sync, up to a first model load) finish in the background, so one
slow wake does not hold every other pipeline's grants (``ServiceConfig.background_expands``).
This script runs ``ours`` both ways (``EngineConfig.background_expands``; RLix's deployments
always wait) on ``run.py``'s workloads over seeds 1..N and on ``scale.py``'s 512- and
4,096-GPU traces (seed 7), and reports GPU-h/step and mean JCT of background vs blocking
expands, and ours' margin over RLix's policy under each.

    python benchmarks/cluster_efficiency/background_expands.py   # results/background_expands.*
    python benchmarks/cluster_efficiency/background_expands.py --seeds 2 --no-scale \\
        --only long_tail_agentic_8jobs
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

from benchmarks.cluster_efficiency.run import (  # noqa: E402
    RESULTS,
    SEED,
    _workloads,
    save_results,
    saved_results,
)
from benchmarks.cluster_efficiency.scale import POINTS, point_trace  # noqa: E402
from benchmarks.cluster_efficiency.seeds import _spread, run_figures  # noqa: E402
from rlix_plugins.sim import plots  # noqa: E402
from rlix_plugins.sim.engine import EngineConfig  # noqa: E402
from rlix_plugins.sim.workloads import Workload  # noqa: E402

BASES = ("rlix_async", "rlix_async_migr")
#: the two runs of ours: the service's cycle waits for its expands, or not
MODES = {"blocking": False, "background": True}


def _seed_row(wl: Workload, seed: int, cfg: EngineConfig) -> dict[str, dict[str, float]]:
    row = {b: run_figures(wl, b, seed, cfg) for b in BASES}
    for mode, background in MODES.items():
        row[f"ours_{mode}"] = run_figures(
            wl, "ours", seed, replace(cfg, background_expands=background)
        )
    return row


def _summary(rows: list[dict[str, dict[str, float]]]) -> dict[str, Any]:
    def change(key: str) -> list[float]:
        # negative = background expands need less (better)
        return [r["ours_background"][key] / r["ours_blocking"][key] - 1 for r in rows]

    out: dict[str, Any] = {
        # above_par counts seeds where background expands are WORSE
        "gpu_hours_change": _spread(change("gpu_hours_per_step")),
        "mean_jct_change": _spread(change("mean_jct_s")),
    }
    for mode in MODES:
        for b in BASES:
            out[f"ours_{mode}_margin_vs_{b}"] = _spread(
                [
                    1 - r[f"ours_{mode}"]["gpu_hours_per_step"] / r[b]["gpu_hours_per_step"]
                    for r in rows
                ]
            )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--seeds", type=int, default=8, help="seeds 1..N for run.py's workloads")
    ap.add_argument("--only", default=None, help="comma-separated run.py workload names")
    ap.add_argument("--no-scale", action="store_true", help="skip the 512 / 4,096-GPU traces")
    ap.add_argument("--out", type=Path, default=RESULTS / "background_expands.json")
    ap.add_argument("--plot-only", action="store_true", help="redraw the PNG from --out")
    args = ap.parse_args(argv)
    if args.seeds < 1:
        ap.error(f"--seeds must be >= 1, got {args.seeds}")
    if args.plot_only:
        _plot(saved_results(ap, args.out), args.out.with_suffix(".png"))
        return 0
    only = set(args.only.split(",")) if args.only else None
    families = _workloads(argparse.Namespace(quick=False, full=False, scale=False))
    cases = [(wl, cfg) for _, wl, cfg, _ in families if only is None or wl.name in only]
    if only is not None and not cases:
        ap.error(f"--only matches no workload of run.py: {sorted(only)}")
    started = time.perf_counter()
    workloads: dict[str, Any] = {}
    for wl, config in cases:
        cfg = replace(config, record_tenures=False)
        rows = [_seed_row(wl, seed, cfg) for seed in range(1, args.seeds + 1)]
        workloads[wl.name] = {"summary": _summary(rows), "runs": rows}
        s = workloads[wl.name]["summary"]["gpu_hours_change"]
        print(f"{wl.name}: GPU-h/step {s['mean']:+.2%} ({s['min']:+.2%}..{s['max']:+.2%})")
    scale: dict[str, Any] = {}
    if not args.no_scale:
        for point in (p for p in POINTS if p.gpus >= 512):
            wl = point_trace(point)
            cfg = EngineConfig(record_tenures=False)
            row = _seed_row(wl, SEED, cfg)
            row["exclusive"] = run_figures(wl, "exclusive", SEED, cfg)
            scale[wl.name] = {"summary": _summary([row]), "run": row}
            print(f"{point.gpus} GPUs: {_summary([row])['gpu_hours_change']['mean']:+.2%}")
    out = {
        "seeds": list(range(1, args.seeds + 1)),
        "note": "gpu_hours_change / mean_jct_change = ours with background expands / ours "
        "with blocking expands - 1 (negative: background better; above_par counts seeds where "
        "it is worse); margins = 1 - ours / baseline GPU-h/step (positive: ours ahead); RLix's "
        "deployments always wait for their expands; scale traces at seed 7",
        "wall_s": round(time.perf_counter() - started, 1),
        "workloads": workloads,
        "scale": scale,
    }
    save_results(out, args.out)
    _plot(out, args.out.with_suffix(".png"))
    return 0


def _plot(out: dict[str, Any], path: Path) -> None:
    """Mean (min..max) change per workload; the scale traces are one seed each."""
    rows = {n: w["summary"] for n, w in out["workloads"].items()}
    rows.update({f"{n} (seed {SEED})": w["summary"] for n, w in out["scale"].items()})
    changes = {
        label: {
            n: (s[key]["mean"], s[key]["min"], s[key]["max"]) for n, s in rows.items()
        }
        for label, key in (("GPU-h/step", "gpu_hours_change"), ("mean JCT", "mean_jct_change"))
    }
    plots.relative_changes(
        changes,
        "background / blocking expands - 1 (%)",
        "Ours with background expands vs waiting for them (mean, min..max over seeds)",
        path,
    )


if __name__ == "__main__":
    sys.exit(main())
