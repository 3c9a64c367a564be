"""PNG plots of runs: GPU ownership timeline, utilisation over time, JCT/slowdown CDFs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlix_plugins.sim.engine import RunResult


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only, never a display
    import matplotlib.pyplot as plt

    return plt


def ownership_timeline(result: RunResult, title: str, path: Path, max_gpus: int = 128) -> None:
    """One row per GPU, one bar per tenure, coloured by job (hatched: init, dark: training)."""
    plt = _plt()
    jobs = sorted({t.job for t in result.tenures})
    cmap = plt.get_cmap("tab20")
    colour = {j: cmap(i % 20) for i, j in enumerate(jobs)}
    fig, ax = plt.subplots(figsize=(12, max(3.0, min(result.num_gpus, max_gpus) * 0.08 + 1.5)))
    for t in result.tenures:
        if t.gpu >= max_gpus:
            continue
        ax.broken_barh(
            [(t.start, t.end - t.start)],
            (t.gpu - 0.4, 0.8),
            facecolors=colour[t.job],
            edgecolor="black" if t.kind == "train" else "none",
            linewidth=0.4,
            hatch="//" if t.kind == "init" else None,
            alpha=1.0 if t.kind == "train" else 0.75,
        )
    ax.set_xlabel("virtual time (s)")
    ax.set_ylabel("GPU")
    ax.set_title(f"{title}: GPU ownership (colour = job, outlined = training, // = init)")
    ax.set_xlim(0, result.makespan)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def utilisation(results: dict[str, RunResult], title: str, path: Path) -> None:
    """Useful-GPU fraction per time bin, one line per policy."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(10, 3.5))
    for policy, r in results.items():
        xs = [(i + 0.5) * r.util_bin_s for i in range(len(r.util_bins))]
        ys = [v / (r.num_gpus * r.util_bin_s) for v in r.util_bins]
        ax.plot(xs, ys, label=f"{policy} ({r.num_gpus} GPUs)", linewidth=1)
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("virtual time (s)")
    ax.set_ylabel("GPU utilisation")
    ax.set_title(f"{title}: utilisation over time")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def cdfs(
    jct: dict[str, list[float]], slowdown: dict[str, list[float]], title: str, path: Path
) -> None:
    """CDFs of job completion time and slowdown, one line per policy."""
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for ax, data, label in ((axes[0], jct, "JCT (s)"), (axes[1], slowdown, "slowdown")):
        for policy, values in data.items():
            xs = sorted(values)
            ys = [(i + 1) / len(xs) for i in range(len(xs))]
            ax.step(xs, ys, where="post", label=policy)
        ax.set_xlabel(label)
        ax.set_ylabel("CDF")
        ax.legend()
    fig.suptitle(f"{title}: job completion time and slowdown")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
