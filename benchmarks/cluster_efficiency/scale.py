"""Cluster-size sweep: one RollMux-shaped mixed trace on 8, 64, 512 and 4,096 GPUs.

The issue asks for clusters from 8 to 4,096 GPUs. ``run.py`` measures the targets on 16 to 256
GPUs; this script runs the same trace builder (``rollmux_trace``, profile ``mixed``, offered
load 1.0, 10 steps per job, seed 7) at four sizes under every deployment ``run.py`` compares,
with the default engine settings, so its 64-GPU point is ``run.py``'s ``rollmux_mixed``:

=========  =====  ======================================================================
GPUs       jobs   why
=========  =====  ======================================================================
8          8      one node: only size-S jobs fit (4 train + 4 rollout GPUs); 8 GPUs can
                  never host M or L under exclusive allocation
64         16     ``run.py``'s RollMux traces (S / M / L)
512        64
4,096      300    RollMux's trace has 300 jobs (compressed in time, Poisson shape kept)
=========  =====  ======================================================================

Reported per size and deployment: GPU-h/step saving vs exclusive, makespan, utilisation, mean
JCT and slowdown, Jain fairness, preemptions, aborts, migrations, the planner's cycle time
(wall ms, mean and max) and the simulation's own wall time. The physics checks (one tenant per
GPU, utilisation <= 100%, every trajectory generated and consumed once) run in every run.

    python benchmarks/cluster_efficiency/scale.py                  # results/scale.{json,png}
    python benchmarks/cluster_efficiency/scale.py --max-gpus 512   # skip the 4,096-GPU point
    python benchmarks/cluster_efficiency/scale.py --plot-only      # redraw from scale.json
    python benchmarks/cluster_efficiency/scale.py --half           # shared on half the GPUs
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.cluster_efficiency.run import BENCH_POLICIES, RESULTS, SEED  # noqa: E402
from rlix_plugins.sim import plots  # noqa: E402
from rlix_plugins.sim.engine import EngineConfig  # noqa: E402
from rlix_plugins.sim.report import compare, format_table  # noqa: E402
from rlix_plugins.sim.workloads import Workload, rollmux_trace, shared_on  # noqa: E402

STEPS = 10
BASES = ("rlix", "rlix_async", "rlix_async_migr")


@dataclass(frozen=True, slots=True)
class ScalePoint:
    """One cluster size of the sweep."""

    nodes: int
    jobs: int
    sizes: tuple[str, ...]
    #: deployments not run at this size, and why
    skipped: tuple[str, ...] = ()
    skip_reason: str = ""
    #: nodes of the time-shared deployments (None: the same cluster as exclusive allocation)
    shared_nodes: int | None = None

    @property
    def gpus(self) -> int:
        return self.nodes * 8

    @property
    def shared_gpus(self) -> int:
        return (self.shared_nodes or self.nodes) * 8

    @property
    def deployments(self) -> tuple[str, ...]:
        return tuple(p for p in BENCH_POLICIES if p not in self.skipped)


POINTS = (
    ScalePoint(1, 8, ("S",)),
    ScalePoint(8, 16, ("S", "M", "L")),
    ScalePoint(64, 64, ("S", "M", "L")),
    ScalePoint(512, 300, ("S", "M", "L")),
)
#: ``--half``: the two large traces again, the time-shared deployments on half the GPUs that
#: exclusive allocation has (where sharing pays at scale: fewer GPUs for the same trace)
HALF_POINTS = (
    ScalePoint(64, 64, ("S", "M", "L"), shared_nodes=32),
    ScalePoint(512, 300, ("S", "M", "L"), shared_nodes=256),
)


def point_trace(point: ScalePoint) -> Workload:
    """The RollMux-shaped mixed trace of one cluster size (also used by ``blocking.py`` and
    ``background_expands.py``)."""
    wl = rollmux_trace(
        "mixed", num_jobs=point.jobs, nodes=point.nodes, steps=STEPS, seed=SEED, sizes=point.sizes
    )
    return replace(wl, name=f"rollmux_mixed_{point.gpus}gpus")


def run_point(point: ScalePoint, out: Path) -> dict[str, Any]:
    """Every deployment on one cluster size; per-size JSON and PNGs go under ``out``."""
    wl = point_trace(point)
    if point.shared_nodes is not None:
        wl = shared_on(wl, point.shared_gpus)
    t0 = time.perf_counter()
    comp = compare(
        wl,
        seed=SEED,
        out_dir=out,
        policies=point.deployments,
        config=EngineConfig(record_tenures=False),
    )
    wall = time.perf_counter() - t0
    print(format_table(comp))
    print(f"  ({wall:.1f} s wall)\n", flush=True)
    ratios = comp.ratios()
    summaries = {s.policy: s for s in comp.summaries}
    shared = [p for p in point.deployments if p != "exclusive"]
    bases = [b for b in BASES if b in point.deployments]
    ex = summaries["exclusive"].makespan_s
    return {
        "gpus": point.gpus,
        "shared_gpus": point.shared_gpus,
        "jobs": point.jobs,
        "job_sizes": list(point.sizes),
        "steps_per_job": STEPS,
        "not_run": {p: point.skip_reason for p in point.skipped},
        "wall_s": round(wall, 1),
        "saving": {p: round(ratios[f"{p}_gpu_hours_saving_vs_exclusive"], 4) for p in shared},
        "ours_saving_vs": {b: round(ratios[f"ours_gpu_hours_saving_vs_{b}"], 4) for b in bases},
        "makespan_s": {p: round(s.makespan_s, 1) for p, s in summaries.items()},
        "makespan_x_exclusive": {p: round(s.makespan_s / ex, 4) for p, s in summaries.items()},
        "gpu_utilisation": {p: round(s.gpu_utilisation, 4) for p, s in summaries.items()},
        "mean_jct_s": {p: round(s.mean_jct_s, 1) for p, s in summaries.items()},
        "mean_slowdown": {p: round(s.mean_slowdown, 3) for p, s in summaries.items()},
        "jain_fairness": {p: round(s.jain_fairness, 4) for p, s in summaries.items()},
        "preemptions": {p: s.preemptions for p, s in summaries.items()},
        "aborted": {p: s.aborted_trajectories for p, s in summaries.items()},
        "migrated": {p: s.migrated_requests for p, s in summaries.items()},
        "plan_ms_mean": {p: round(s.plan_ms_mean, 3) for p, s in summaries.items()},
        "plan_ms_max": {p: round(s.plan_ms_max, 2) for p, s in summaries.items()},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--max-gpus", type=int, default=4096, help="largest cluster to run")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--plot-only", action="store_true", help="redraw scale.png from an existing scale.json"
    )
    parser.add_argument(
        "--half",
        action="store_true",
        help="the 512- and 4,096-GPU traces with the shared deployments on half the GPUs "
        "(results/scale_half.json)",
    )
    args = parser.parse_args(argv)
    if args.plot_only:
        saved = json.loads((args.out / "scale.json").read_text())
        plots.cluster_scale(saved["points"], tuple(saved["deployments"]), args.out / "scale.png")
        return 0
    candidates = HALF_POINTS if args.half else POINTS
    points = [p for p in candidates if p.gpus <= args.max_gpus]
    if not points:
        valid = ", ".join(str(p.gpus) for p in candidates)
        parser.error(f"--max-gpus {args.max_gpus} leaves no cluster size; sizes are {valid}")
    started = time.perf_counter()
    rows = [run_point(p, args.out / "scale") for p in points]
    result = {
        "seed": SEED,
        "workload": "rollmux_trace('mixed', load 1.0), per-size jobs and sizes as listed",
        "deployments": list(BENCH_POLICIES),
        "engine": "EngineConfig defaults (cycle batching 0.2 s, tick 10 s), as run.py",
        "shared_cluster": "half of exclusive's GPUs (shared_gpus)" if args.half else "the same",
        "note": "saving = 1 - GPU-h/step / exclusive's (cluster GPUs x makespan / steps); "
        "ours_saving_vs = the same against each RLix baseline (positive: ours ahead); "
        "plan_ms = wall time of one planner cycle on this shared 2-core box",
        "wall_s": round(time.perf_counter() - started, 1),
        "points": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    name = "scale_half" if args.half else "scale"
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=2))
    if not args.half:
        plots.cluster_scale(rows, BENCH_POLICIES, args.out / "scale.png")
    for row in rows:
        margins = ", ".join(f"vs {b} {v:+.1%}" for b, v in row["ours_saving_vs"].items())
        print(
            f"{row['gpus']:>5} GPUs (shared on {row['shared_gpus']}): ours saving "
            f"{row['saving']['ours']:+.1%}, makespan x{row['makespan_x_exclusive']['ours']:.2f} "
            f"({margins})"
        )
    print(f"results in {args.out}/{name}.json ({result['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
