"""Planner variants measured and not kept: ours' margins with each, over seeds.

docs/simulator.md lists policy changes tried against the RLix baselines and why none became
the default. This script reproduces three of them on ``run.py``'s RollMux traces (64 GPUs and
the same traces on 32) and the long-tail 24-job workload, seeds 1..N: ours' GPU-h/step saving
against ``rlix_async`` and ``rlix_async_migr`` with the default planner and with

* ``tp_weighted``: GPU shares by remaining demand x TP (RLix's weighting: ranks, not GPUs,
  follow requests), the idle fill unchanged;
* ``no_hysteresis``: ``PolicyConfig(rebalance_threshold=0, min_hold_s=0)`` (RLix has neither);
* ``exact_shares``: targets capped at what each cluster reaches and split GPU by GPU where
  spans overlap (:mod:`benchmarks.cluster_efficiency.exact_shares`: no starvation in a chain
  of spans).

    python benchmarks/cluster_efficiency/policy_variants.py      # results/policy_variants.*
    python benchmarks/cluster_efficiency/policy_variants.py --seeds 1 --only rollmux_mixed
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.cluster_efficiency.exact_shares import ExactSharePlanner  # noqa: E402
from benchmarks.cluster_efficiency.run import RESULTS, _workloads, save_results  # noqa: E402
from rlix_plugins.coordinator.core import DemandSharePlanner, Planner  # noqa: E402
from rlix_plugins.coordinator.core.model import PolicyConfig  # noqa: E402
from rlix_plugins.coordinator.core.planner import _Cycle, _Gen  # noqa: E402
from rlix_plugins.sim.runner import run_policy  # noqa: E402

BASES = ("rlix_async", "rlix_async_migr")
KINDS = ("rollmux", "rollmux_half", "long_tail")


class _TpWeightedCycle(_Cycle):
    def _set_targets(self, gens: dict[str, _Gen]) -> None:
        # weight x tp in the apportioning only: quotas (in ranks) become proportional to
        # weight x demand; the idle fill already counts ranks per request
        weights = {cid: g.weight for cid, g in gens.items()}
        for g in gens.values():
            g.weight *= g.tp
        try:
            super()._set_targets(gens)
        finally:
            for cid, g in gens.items():
                g.weight = weights[cid]


class TpWeightedPlanner(DemandSharePlanner):
    """Ours with RLix's ``remaining x tp`` GPU shares (a variant, not the default)."""

    cycle_class = _TpWeightedCycle


VARIANTS: dict[str, Callable[[], Planner | None]] = {
    "default": lambda: None,
    "tp_weighted": TpWeightedPlanner,
    "no_hysteresis": lambda: DemandSharePlanner(
        PolicyConfig(rebalance_threshold=0.0, min_hold_s=0.0)
    ),
    "exact_shares": ExactSharePlanner,
}


def _gpu_hours(job: tuple[str, str, str, int]) -> tuple[tuple[str, str, str, int], float]:
    """One run: (workload, policy, variant, seed) -> GPU-h per step."""
    name, policy, variant, seed = job
    fam = next(f for f in _workloads(_args()) if f[1].name == name)
    _, wl, cfg, _ = fam
    r = run_policy(wl, policy, seed=seed, config=cfg, planner=VARIANTS[variant]())
    return job, r.num_gpus * r.makespan / 3600.0 / max(1, len(r.steps))


def _args() -> argparse.Namespace:
    return argparse.Namespace(quick=False, full=False, scale=False)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--seeds", type=int, default=8, help="seeds 1..N")
    ap.add_argument("--only", default=None, help="comma-separated workload names")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", type=Path, default=RESULTS / "policy_variants.json")
    args = ap.parse_args(argv)
    only = set(args.only.split(",")) if args.only else None
    names = [
        wl.name
        for kind, wl, _, _ in _workloads(_args())
        if kind in KINDS
        and (kind != "long_tail" or wl.name.endswith("24jobs"))
        and (only is None or wl.name in only)
    ]
    if not names:
        ap.error(f"--only {args.only!r} names none of the workloads this script runs")
    seeds = range(1, args.seeds + 1)
    jobs = [(n, b, "default", s) for n in names for s in seeds for b in BASES]
    jobs += [(n, "ours", v, s) for n in names for s in seeds for v in VARIANTS]
    t0 = time.perf_counter()
    with ProcessPoolExecutor(args.workers) as pool:
        gh = dict(pool.map(_gpu_hours, jobs))
    out: dict[str, Any] = {"seeds": list(seeds), "variants": list(VARIANTS), "workloads": {}}
    for n in names:
        row: dict[str, Any] = {}
        for v in VARIANTS:
            for b in BASES:
                margins = [1 - gh[(n, "ours", v, s)] / gh[(n, b, "default", s)] for s in seeds]
                row[f"{v}_vs_{b}"] = {
                    "mean": round(statistics.mean(margins), 5),
                    "per_seed": [round(m, 5) for m in margins],
                    "seeds_ahead": sum(m > 0 for m in margins),
                }
        out["workloads"][n] = row
        print(n, "  ".join(
            f"{v}: {row[f'{v}_vs_rlix_async']['mean']:+.2%} / "
            f"{row[f'{v}_vs_rlix_async_migr']['mean']:+.2%}" for v in VARIANTS
        ), flush=True)
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    save_results(out, args.out)
    _plot(out, args.out.with_suffix(".png"))
    print(f"mean margins (vs rlix_async / rlix_async_migr) in {args.out} ({out['wall_s']} s)")
    return 0


def _plot(out: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(out["workloads"])
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.8 / len(out["variants"])
    for i, v in enumerate(out["variants"]):
        means = [100 * out["workloads"][n][f"{v}_vs_rlix_async_migr"]["mean"] for n in names]
        ax.bar([x + i * width for x in range(len(names))], means, width, label=v)
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(names))])
    ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("ours' GPU-h/step saving vs rlix_async_migr (%)")
    ax.set_title(f"Planner variants, mean over seeds {out['seeds'][0]}-{out['seeds'][-1]}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
