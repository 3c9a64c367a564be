"""Our mechanism per host, as built: the default workloads with each host's re-dispatch.

``ours`` in ``run.py`` models the generation module's router (continue from partial tokens +
migration), which veRL (eb17d83) and NeMo RL (d5844fd) also do by default. The options differ
(docs/simulator.md, "What is built vs what ours models"): ``ours_nomigr`` = veRL with
``RLIX_VERL_MIGRATION=off`` (continue, no migration), ``ours_nemo_rl`` = NeMo RL with
``RLIX_NEMO_RL_REDISPATCH=restart`` (an aborted request is generated again from the prompt; no
migration). This runs them
beside exclusive allocation and RLix's policy on the same workloads (``run.py``'s builders and
engine settings) and seed (7), and writes results/hosts.json + hosts.png.

    python benchmarks/cluster_efficiency/hosts.py
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
from benchmarks.cluster_efficiency.seeds import run_figures  # noqa: E402

POLICIES = ("exclusive", "rlix_async", "ours", "ours_nomigr", "ours_nemo_rl")
HOSTS = {
    "ours": "router (gates), veRL and NeMo RL as built",
    "ours_nomigr": "veRL, migration off",
    "ours_nemo_rl": "NeMo RL, RESTART selected",
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--out", type=Path, default=RESULTS / "hosts.json")
    args = ap.parse_args(argv)
    started = time.perf_counter()
    rows: dict[str, dict[str, dict[str, float]]] = {}
    for _, wl, config, _ in _workloads(argparse.Namespace(quick=False, full=False, scale=False)):
        cfg = replace(config, record_tenures=False)
        row: dict[str, dict[str, float]] = {}
        for policy in POLICIES:
            row[policy] = run_figures(wl, policy, SEED, cfg)
        ex = row["exclusive"]
        for policy in POLICIES[1:]:
            v = row[policy]
            v["gpu_hours_saving_vs_exclusive"] = (
                1 - v["gpu_hours_per_step"] / ex["gpu_hours_per_step"]
            )
            v["throughput_x_exclusive"] = v["throughput_per_h"] / ex["throughput_per_h"]
            v["gpu_hours_saving_vs_rlix_async"] = (
                1 - v["gpu_hours_per_step"] / row["rlix_async"]["gpu_hours_per_step"]
            )
        rows[wl.name] = row
        print(
            f"{wl.name}: "
            + ", ".join(
                f"{p} {row[p]['gpu_hours_saving_vs_exclusive']:+.1%} "
                f"(x{row[p]['throughput_x_exclusive']:.2f})"
                for p in POLICIES[1:]
            ),
            flush=True,
        )
    out: dict[str, Any] = {
        "seed": SEED,
        "policies": list(POLICIES),
        "hosts": HOSTS,
        "note": "savings = 1 - policy / baseline GPU-h per step; throughput = trajectories per "
        "hour of makespan; same workloads and engine settings as run.py",
        "wall_s": round(time.perf_counter() - started, 1),
        "workloads": rows,
    }
    save_results(out, args.out)
    _plot(rows, args.out.with_suffix(".png"))
    return 0


def _plot(rows: dict[str, dict[str, dict[str, float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(rows)
    shown = POLICIES[1:]
    fig, ax = plt.subplots(figsize=(11, 4.5))
    width = 0.8 / len(shown)
    for i, p in enumerate(shown):
        vals = [100 * rows[n][p]["gpu_hours_saving_vs_exclusive"] for n in names]
        ax.bar([x + i * width for x in range(len(names))], vals, width,
               label=f"{p} ({HOSTS.get(p, 'RLix policy')})")
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(names))])
    ax.set_xticklabels(names, rotation=25, ha="right", fontsize=8)
    ax.set_ylabel("GPU-h/step saving vs exclusive (%)")
    ax.axhline(0, color="black", lw=0.8)
    ax.legend(fontsize=8)
    ax.set_title(f"Our mechanism per host as built (seed {SEED})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
