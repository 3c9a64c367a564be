"""Switch-cost sensitivity: do the cluster-efficiency targets hold if the assumed costs are off?

The simulator charges every shared deployment the same per-step switch costs (``SwitchCosts``:
shard sleep and wake, training onload and offload, Megatron NCCL re-init). Only PlexRL's
onload time is published; the NCCL re-init (5 s) is an assumption, and one GPU can measure it
only for a world of one rank (``benchmarks/gpu``: Megatron's 17 groups destroyed in 0.49-0.99 s
and re-created and first used in 0.27-0.6 s on an H200, so about 1 s). This script re-runs
``run.py``'s workloads, the 16-step long-tail run included (seed 7, same builders, engine
settings and deployments) with the costs
changed for every job and evaluates every target of ``run.py`` under each setting:

* ``assumed``: the workloads' own costs (what ``run.py`` measures);
* ``nccl_1s`` / ``nccl_15s``: NCCL re-init 1 s (the one-GPU measurement) / 15 s (3x assumed:
  many ranks across nodes);
* ``switch_x0.5`` / ``switch_x2``: every per-step switch cost halved / doubled (the first
  model load and exclusive allocation, whose shards and trainers stay resident, unchanged).

    python benchmarks/cluster_efficiency/switch_costs.py     # results/switch_costs.json / .png
    python benchmarks/cluster_efficiency/switch_costs.py --settings assumed,nccl_1s --only plexrl_7B
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.cluster_efficiency.run import (  # noqa: E402
    RESULTS,
    SEED,
    _steady,
    _workloads,
    evaluate,
    save_results,
)
from benchmarks.cluster_efficiency.seeds import _spread  # noqa: E402
from rlix_plugins.sim.bounds import MakespanBound, makespan_lower_bound  # noqa: E402
from rlix_plugins.sim.report import Comparison, compare  # noqa: E402
from rlix_plugins.sim.runner import run_policy  # noqa: E402
from rlix_plugins.sim.workloads import PER_STEP_COSTS, Workload, with_switch_costs  # noqa: E402

#: seeds of the spread run for every line a setting misses at seed 7 (seeds.py's)
SPREAD_SEEDS = tuple(range(1, 9))
#: ours against these in the spread (exclusive: the PlexRL saving target)
SPREAD_BASES = ("exclusive", "rlix_async", "rlix_async_migr")

#: name -> (scale of every per-step cost, costs set afterwards): see the module docstring
SETTINGS: dict[str, tuple[float, dict[str, float]]] = {
    "assumed": (1.0, {}),
    "nccl_1s": (1.0, {"nccl_reinit_s": 1.0}),
    "nccl_15s": (1.0, {"nccl_reinit_s": 15.0}),
    "switch_x0.5": (0.5, {}),
    "switch_x2": (2.0, {}),
}


def with_setting(wl: Workload, name: str) -> Workload:
    """``wl`` under setting ``name`` (:func:`~rlix_plugins.sim.workloads.with_switch_costs`)."""
    scale, overrides = SETTINGS[name]
    return with_switch_costs(wl, scale=scale, overrides=overrides)


def _families(only: set[str] | None) -> list[tuple[str, Workload, Any, tuple[str, ...]]]:
    args = argparse.Namespace(quick=False, full=False, scale=False)
    families = [*_workloads(args), *_steady(args)]
    return [f for f in families if only is None or f[1].name in only]


def run_setting(name: str, only: set[str] | None) -> dict[str, Any]:
    """Every family of ``run.py`` under setting ``name``: the targets and ours' margins."""
    started = time.perf_counter()
    comparisons: list[tuple[str, Comparison]] = []
    bounds: dict[str, MakespanBound] = {}
    for kind, wl, config, policies in _families(only):
        changed = with_setting(wl, name)
        comp = compare(changed, seed=SEED, out_dir=None, policies=policies,
                       config=replace(config, record_tenures=False), plot=False)
        comparisons.append((kind, comp))
        if kind.startswith("long_tail") or kind == "rollmux":
            bounds[wl.name] = makespan_lower_bound(changed, SEED)
    targets = evaluate(comparisons, bounds)
    margins: dict[str, dict[str, float]] = {}
    for _, c in comparisons:
        r = c.ratios()
        margins[c.workload] = {
            k: round(v, 4) for k, v in r.items()
            if k.startswith("ours_gpu_hours_saving_vs_") or k == "ours_throughput_x_exclusive"
        }
    met = sum(1 for t in targets if t["status"] == "MET")
    print(f"{name}: {met}/{len(targets)} targets met "
          f"({time.perf_counter() - started:.0f} s)", flush=True)
    return {
        "targets_met": met,
        "targets": len(targets),
        "missed": [{"target": t["target"], "measured": t["measured"]}
                   for t in targets if t["status"] != "MET"],
        "margins": margins,
        "wall_s": round(time.perf_counter() - started, 1),
    }


def missed_workloads(setting: dict[str, Any]) -> list[str]:
    """Workloads with a missed target in a :func:`run_setting` result (a target's text starts
    with its workload's name)."""
    return sorted({str(m["target"]).split(":", 1)[0] for m in setting["missed"]})


def _gpu_seconds(wl: Workload, policy: str, seed: int, cfg: Any) -> float:
    r = run_policy(wl, policy, seed=seed, config=cfg)
    return float(r.num_gpus * r.makespan)


def spread(name: str, workload: str) -> dict[str, Any]:
    """Ours' GPU-h/step saving against each of :data:`SPREAD_BASES` on ``workload`` under
    setting ``name``, over :data:`SPREAD_SEEDS`: is a miss at seed 7 the setting's or the
    seed's?"""
    (_, wl, config, _), = _families({workload})
    changed = with_setting(wl, name)
    cfg = replace(config, record_tenures=False)
    gpu_seconds = [{p: _gpu_seconds(changed, p, seed, cfg) for p in ("ours", *SPREAD_BASES)}
                   for seed in SPREAD_SEEDS]
    out: dict[str, Any] = {}
    for base in SPREAD_BASES:
        # same workload and steps under every deployment: GPU-h/step ratios are these
        out[f"ours_gpu_hours_saving_vs_{base}"] = _spread(
            [1 - g["ours"] / g[base] for g in gpu_seconds]
        )
    return out


def plot(out: dict[str, Any], path: Path) -> None:
    """Ours' GPU-h/step saving vs ``rlix_async_migr`` and vs exclusive, per workload and
    setting, with each setting's count of targets met in the legend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = out["settings"]
    names = list(next(iter(settings.values()))["margins"])
    fig, axes = plt.subplots(2, 1, figsize=(13, 8), sharex=True)
    width = 0.8 / len(settings)
    for ax, key, title in (
        (axes[0], "ours_gpu_hours_saving_vs_rlix_async_migr", "vs rlix_async_migr (policy only)"),
        (axes[1], "ours_gpu_hours_saving_vs_exclusive", "vs exclusive allocation"),
    ):
        for i, (setting, s) in enumerate(settings.items()):
            ys = [100 * s["margins"][n].get(key, float("nan")) for n in names]
            xs = [x + (i - (len(settings) - 1) / 2) * width for x in range(len(names))]
            ax.bar(xs, ys, width, label=f"{setting} ({s['targets_met']}/{s['targets']} met)")
        ax.axhline(0, color="black", lw=0.8)
        ax.set_ylabel("ours' GPU-h/step saving, %")
        ax.set_title(title)
    axes[1].set_xticks(range(len(names)), names, rotation=35, ha="right", fontsize=8)
    axes[0].legend(fontsize=8, ncol=len(settings))
    fig.suptitle(f"Switch-cost sensitivity (seed {out['seed']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--settings", default=",".join(SETTINGS),
                    help=f"comma-separated, of {', '.join(SETTINGS)}")
    ap.add_argument("--only", default=None, help="comma-separated workload names")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", type=Path, default=RESULTS / "switch_costs.json")
    args = ap.parse_args(argv)
    chosen = args.settings.split(",")
    unknown = [s for s in chosen if s not in SETTINGS]
    if unknown:
        ap.error(f"unknown setting(s) {unknown}; valid: {', '.join(SETTINGS)}")
    only = set(args.only.split(",")) if args.only else None
    started = time.perf_counter()
    with ProcessPoolExecutor(max(1, args.workers)) as pool:
        futures = {s: pool.submit(run_setting, s, only) for s in chosen}
        settings = {s: f.result() for s, f in futures.items()}
        # a line missed at seed 7: the same line over seeds 1-8
        spreads = {(s, w): pool.submit(spread, s, w)
                   for s, r in settings.items() for w in missed_workloads(r)}
        for (s, w), f in spreads.items():
            settings[s].setdefault("seed_spread_of_missed", {})[w] = f.result()
    out = {
        "seed": SEED,
        "settings": settings,
        "definitions": {
            "assumed": "each workload's own SwitchCosts (run.py)",
            "nccl_1s": "nccl_reinit_s = 1 s (one-GPU H200 measurement, benchmarks/gpu)",
            "nccl_15s": "nccl_reinit_s = 15 s (3x assumed)",
            "switch_x0.5": f"{', '.join(PER_STEP_COSTS)} x 0.5",
            "switch_x2": f"{', '.join(PER_STEP_COSTS)} x 2",
        },
        "note": "targets are run.py's (evaluate) on its workloads at seed 7 (the PlexRL "
        "sweeps are not targets and are not run); seed_spread_of_missed: every workload with "
        "a missed target, the same setting over seeds 1-8 (mean/min/max, above_par = seeds "
        "where ours is ahead); margins: 1 - ours' GPU-h/step / "
        "baseline's (positive: ours ahead); exclusive allocation pays no per-step switch cost",
        "wall_s": round(time.perf_counter() - started, 1),
    }
    save_results(out, args.out)
    plot(out, args.out.with_suffix(".png"))
    print(f"wrote {args.out} ({out['wall_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
