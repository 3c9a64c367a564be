"""Seed spread of the cluster-efficiency margins: the default workloads over several seeds.

``run.py`` evaluates every target on one seed (7). Margins of a few percent between two
policies on the same cluster move with the random trajectory lengths, so this script runs the
same workloads (same builders, same engine settings) on seeds 1..N and reports, per workload,
the GPU-h/step saving of ``ours`` against each baseline (mean, min, max, how many seeds it is
ahead) and the long-tail rollout throughput x exclusive per seed. The targets' status stays the
one ``run.py`` measures; this is the spread around it.

    python benchmarks/cluster_efficiency/seeds.py              # seeds 1-8 -> results/seeds.json
    python benchmarks/cluster_efficiency/seeds.py --seeds 4 --only long_tail_agentic_8jobs
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.cluster_efficiency.run import RESULTS, _workloads, bound_figures, save_results  # noqa: E402
from rlix_plugins.sim.bounds import makespan_lower_bound  # noqa: E402
from rlix_plugins.sim.engine import EngineConfig  # noqa: E402
from rlix_plugins.sim.metrics import final_drain  # noqa: E402
from rlix_plugins.sim.runner import run_policy  # noqa: E402
from rlix_plugins.sim.workloads import Workload  # noqa: E402

#: exclusive for the throughput ratio; the baselines and ours with/without migration
POLICIES = ("exclusive", "rlix_async", "rlix_async_migr", "ours_nomigr", "ours")
BASES = ("rlix_async", "rlix_async_migr", "ours_nomigr")


def _spread(values: list[float], par: float = 0.0) -> dict[str, Any]:
    """Mean, min, max and in how many seeds the value is above ``par``."""
    return {
        "mean": round(statistics.mean(values), 4),
        "min": round(min(values), 4),
        "max": round(max(values), 4),
        "above_par": f"{sum(1 for v in values if v > par)}/{len(values)}",
    }


def run_figures(wl: Workload, policy: str, seed: int, cfg: EngineConfig) -> dict[str, float]:
    """One deployment's run on ``wl``: GPU-h per step, trajectories per hour of makespan, and
    its abort / migration counts (shared by this script and ``hosts.py``)."""
    r = run_policy(wl, policy, seed=seed, config=cfg)
    drain = final_drain(r)
    return {
        "makespan_s": r.makespan,
        # the end of the run below 50% utilisation, and idle cluster-seconds in it / before it
        "final_drain_s": round(drain.length_s, 1),
        "idle_in_drain_s": round(drain.idle_in_s, 1),
        "idle_before_drain_s": round(drain.idle_before_s, 1),
        "gpu_hours_per_step": r.num_gpus * r.makespan / 3600.0 / max(1, len(r.steps)),
        # arrival to finish, mean over jobs: what a user of an arrival trace waits for
        "mean_jct_s": statistics.mean(j.finished - j.arrival for j in r.jobs),
        "throughput_per_h": r.trajectories / r.makespan * 3600.0,
        "migrated": r.migrated,
        "aborted": r.aborted,
        "lost_work_s": r.lost_work_s,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--seeds", type=int, default=8, help="seeds 1..N")
    ap.add_argument("--only", default=None, help="comma-separated workload names")
    ap.add_argument("--out", type=Path, default=RESULTS / "seeds.json")
    args = ap.parse_args(argv)
    families = _workloads(argparse.Namespace(quick=False, full=False, scale=False))
    only = set(args.only.split(",")) if args.only else None
    started = time.perf_counter()
    per: dict[str, dict[str, dict[str, dict[str, float]]]] = {}
    #: long-tail workloads: the makespan lower bound (sim.bounds) per seed
    bounds: dict[str, dict[str, dict[str, float]]] = {}
    for _, wl, config, _ in families:
        if only is not None and wl.name not in only:
            continue
        cfg = replace(config, record_tenures=False)
        for seed in range(1, args.seeds + 1):
            row: dict[str, dict[str, float]] = {}
            for policy in POLICIES:
                row[policy] = run_figures(wl, policy, seed, cfg)
            per.setdefault(wl.name, {})[str(seed)] = row
            if wl.name.startswith("long_tail"):
                bounds.setdefault(wl.name, {})[str(seed)] = bound_figures(
                    makespan_lower_bound(wl, seed),
                    row["exclusive"]["makespan_s"],
                    row["ours"]["makespan_s"],
                )
            ours = row["ours"]["gpu_hours_per_step"]
            print(
                f"{wl.name} seed {seed}: "
                + ", ".join(
                    f"vs {b} {1 - ours / row[b]['gpu_hours_per_step']:+.2%}" for b in BASES
                ),
                flush=True,
            )
    summary: dict[str, Any] = {}
    for name, seeds in per.items():
        rows = list(seeds.values())
        entry: dict[str, Any] = {
            f"ours_gpu_hours_saving_vs_{b}": _spread(
                [1 - r["ours"]["gpu_hours_per_step"] / r[b]["gpu_hours_per_step"] for r in rows]
            )
            for b in BASES
        }
        for b in BASES:
            entry[f"ours_mean_jct_saving_vs_{b}"] = _spread(
                [1 - r["ours"]["mean_jct_s"] / r[b]["mean_jct_s"] for r in rows]
            )
        par = 3.0 if name.startswith("long_tail") else 1.0
        for p in ("ours", "rlix_async"):
            entry[f"{p}_throughput_x_exclusive"] = _spread(
                [r[p]["throughput_per_h"] / r["exclusive"]["throughput_per_h"] for r in rows], par
            )
        if name in bounds:
            for key in ("bound_throughput_x_exclusive", "ours_fraction_of_bound"):
                entry[key] = _spread([b[key] for b in bounds[name].values()], 0.0)
            for key in ("final_drain_s", "idle_in_drain_s", "idle_before_drain_s"):
                entry[f"ours_{key}"] = _spread([r["ours"][key] for r in rows], 0.0)
        summary[name] = entry
    out = {
        "seeds": list(range(1, args.seeds + 1)),
        "policies": list(POLICIES),
        "note": "GPU-h/step saving = 1 - ours / baseline (positive: ours ahead; above_par counts "
        "seeds > 0); mean JCT saving = 1 - ours' mean JCT / baseline's (same sign); "
        "throughput x exclusive: above_par counts seeds above 3 (long tail) or 1; "
        "bounds (long tail): the makespan no schedule can beat (sim.bounds), the throughput x "
        "exclusive it allows and bound / ours' makespan; same workload builders and engine "
        "settings as run.py; seed 7 is run.py's",
        "wall_s": round(time.perf_counter() - started, 1),
        "summary": summary,
        "runs": per,
        "bounds": bounds,
    }
    save_results(out, args.out)
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
