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
    """One row per GPU, one bar per tenure, coloured by job (outlined: training, light: init).

    All bars are drawn as one polygon collection per kind, so a run with 10^5 tenures plots
    in about a second.
    """
    plt = _plt()
    from matplotlib.collections import PolyCollection

    jobs = sorted({t.job for t in result.tenures})
    cmap = plt.get_cmap("tab20")
    colour = {j: cmap(i % 20) for i, j in enumerate(jobs)}
    fig, ax = plt.subplots(figsize=(12, max(3.0, min(result.num_gpus, max_gpus) * 0.08 + 1.5)))
    style = {"gen": (0.75, "none", 0.0), "train": (1.0, "black", 0.4), "init": (0.35, "none", 0.0)}
    for kind, (alpha, edge, width) in style.items():
        verts = []
        colours = []
        for t in result.tenures:
            if t.gpu >= max_gpus or t.kind != kind or t.end <= t.start:
                continue
            y0, y1 = t.gpu - 0.4, t.gpu + 0.4
            verts.append(((t.start, y0), (t.start, y1), (t.end, y1), (t.end, y0)))
            colours.append(colour[t.job])
        if verts:
            ax.add_collection(
                PolyCollection(
                    verts, facecolors=colours, edgecolors=edge, linewidths=width, alpha=alpha
                )
            )
    ax.set_xlabel("virtual time (s)")
    ax.set_ylabel("GPU")
    ax.set_title(f"{title}: GPU ownership (colour = job, outlined = training, pale = init)")
    ax.set_xlim(0, result.makespan)
    ax.set_ylim(-1, min(result.num_gpus, max_gpus))
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


def summary_chart(rows: list[dict[str, Any]], path: Path) -> None:
    """Benchmark summary: each workload's figure per shared deployment vs its target.

    ``rows``: ``{"label", "metric" ("throughput_x" or "saving"), "values": {deployment: x},
    "target": float | None}``.
    """
    plt = _plt()
    panels = [
        ("throughput_x", "rollout throughput x exclusive"),
        ("saving", "GPU-h/step saving vs exclusive"),
    ]
    fig, axes = plt.subplots(1, 2, figsize=(14, 4.8), gridspec_kw={"width_ratios": [1, 3]})
    for ax, (metric, label) in zip(axes, panels, strict=True):
        sel = [r for r in rows if r["metric"] == metric]
        if not sel:
            ax.set_visible(False)
            continue
        deployments = sorted({d for r in sel for d in r["values"]}, key=_order)
        width = 0.8 / max(1, len(deployments))
        for i, d in enumerate(deployments):
            xs = [k + (i - (len(deployments) - 1) / 2) * width for k in range(len(sel))]
            ys = [r["values"].get(d, float("nan")) for r in sel]
            ax.bar(xs, ys, width=width, label=d)
        for k, r in enumerate(sel):
            if r["target"] is not None:
                ax.hlines(r["target"], k - 0.45, k + 0.45, colors="red", linestyles="--")
        ax.axhline(0.0 if metric == "saving" else 1.0, color="black", linewidth=0.6)
        ax.set_xticks(range(len(sel)))
        ax.set_xticklabels([r["label"] for r in sel], rotation=20, ha="right", fontsize=8)
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    fig.suptitle("cluster efficiency vs exclusive allocation (red dashes: targets)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def pool_sweep(
    curves: dict[str, dict[str, list[tuple[float, float]]]],
    target: float,
    published: dict[str, float],
    path: Path,
) -> None:
    """GPU-h/step saving vs exclusive against the training:rollout pool ratio, one panel per
    model, one line per deployment, plus the no-slowdown bound ``T / (2 (T + R))``.

    ``curves``: model -> deployment -> [(T/R, saving)]; ``published``: model -> PlexRL's figure.
    """
    plt = _plt()
    models = list(curves)
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        ratios: list[float] = []
        for deployment, points in sorted(curves[model].items(), key=lambda kv: _order(kv[0])):
            xs = [x for x, _ in points]
            ratios = sorted(set(ratios) | set(xs))
            ax.plot(xs, [y for _, y in points], marker="o", label=deployment)
        ax.plot(ratios, [r / (2 * (r + 1)) for r in ratios], "k:", label="bound T/(2(T+R))")
        ax.axhline(target, color="red", linestyle="--", label=f"target {target:.1%}")
        if model in published:
            ax.axhline(published[model], color="grey", linestyle="-.", label="PlexRL reported")
        ax.axhline(0.0, color="black", linewidth=0.6)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("training : rollout GPUs per job (T/R)")
        ax.set_ylabel("GPU-h/step saving vs exclusive")
        ax.set_ylim(min(-0.1, ax.get_ylim()[0]), 0.5)
        ax.set_title(f"PlexRL {model}")
        ax.legend(fontsize=7)
    fig.suptitle("PlexRL 2-job setups: saving vs pool ratio (same seed per point)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def size_sweep(
    curves: dict[str, dict[str, list[tuple[float, float, float]]]],
    target: float,
    published: dict[str, float],
    path: Path,
) -> None:
    """GPU-h/step saving vs exclusive (left axis) and makespan x exclusive (right axis, dashed)
    against the time-shared cluster's size as a fraction of the exclusive GPUs, one panel per
    model, one colour per deployment.

    ``curves``: model -> deployment -> [(GPUs x exclusive, saving, makespan x exclusive)].
    """
    plt = _plt()
    models = list(curves)
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        right = ax.twinx()
        for deployment, points in sorted(curves[model].items(), key=lambda kv: _order(kv[0])):
            pts = sorted(points)
            xs = [x for x, _, _ in pts]
            (line,) = ax.plot(xs, [y for _, y, _ in pts], marker="o", label=f"{deployment} saving")
            right.plot(
                xs,
                [m for _, _, m in pts],
                linestyle="--",
                marker="x",
                color=line.get_color(),
                label=f"{deployment} makespan x",
            )
        ax.axhline(target, color="red", linestyle=":", label=f"target {target:.1%}")
        if model in published:
            ax.axhline(published[model], color="grey", linestyle="-.", label="PlexRL reported")
        ax.set_xlabel("time-shared GPUs / exclusive GPUs")
        ax.set_ylabel("GPU-h/step saving vs exclusive")
        right.set_ylabel("makespan x exclusive (dashed)")
        ax.set_ylim(0.0, 0.7)
        ax.set_title(f"PlexRL {model}: shared cluster size")
        ax.legend(fontsize=7, loc="upper right")
    fig.suptitle("PlexRL 2-job setups: saving and slowdown vs time-shared cluster size")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def cluster_scale(points: list[dict[str, Any]], deployments: tuple[str, ...], path: Path) -> None:
    """Across cluster sizes (log x): GPU-h/step saving vs exclusive per deployment (left),
    mean slowdown per deployment (middle) and the planner's mean / max cycle time (right).

    ``points``: one per cluster size, with ``gpus``, ``saving`` and ``mean_slowdown``
    (deployment -> value) and ``plan_ms_mean`` / ``plan_ms_max`` (deployment -> ms); a
    deployment missing from a point (not run at that size) leaves a gap in its line.
    """
    plt = _plt()
    fig, (left, mid, right) = plt.subplots(1, 3, figsize=(15, 4))

    def series(key: str, deployment: str) -> tuple[list[int], list[float]]:
        pts = [(pt["gpus"], pt[key][deployment]) for pt in points if deployment in pt[key]]
        return [x for x, _ in pts], [y for _, y in pts]

    for deployment in sorted(deployments, key=_order):
        if deployment != "exclusive":
            left.plot(*series("saving", deployment), marker="o", label=deployment)
        mid.plot(*series("mean_slowdown", deployment), marker="o", label=deployment)
        (line,) = right.plot(
            *series("plan_ms_mean", deployment), marker="o", label=f"{deployment} mean"
        )
        right.plot(
            *series("plan_ms_max", deployment),
            marker="x",
            linestyle="--",
            color=line.get_color(),
            label=f"{deployment} max",
        )
    xs = [pt["gpus"] for pt in points]
    # A collapsed deployment (e.g. -150%) would flatten the others: clip and label it instead.
    floor = -0.3
    for pt in points:
        for deployment, value in pt["saving"].items():
            if value < floor:
                left.annotate(
                    f"{deployment} {value:.0%}",
                    (pt["gpus"], floor),
                    xytext=(0, 8),
                    textcoords="offset points",
                    ha="center",
                    fontsize=7,
                    arrowprops={"arrowstyle": "->"},
                )
    left.set_ylim(bottom=floor)
    left.axhline(0.0, color="grey", linewidth=0.8)
    left.set_ylabel("GPU-h/step saving vs exclusive")
    mid.set_ylabel("mean slowdown (JCT / alone)")
    mid.set_yscale("log")
    right.set_ylabel("planner cycle, ms (wall)")
    right.set_yscale("log")
    for ax in (left, mid, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [f"{x:,}" for x in xs])
        ax.set_xlabel("cluster GPUs")
        ax.legend(fontsize=6, ncol=2 if ax is right else 1)
    fig.suptitle("RollMux-shaped mixed trace across cluster sizes")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _order(deployment: str) -> int:
    known = ("plexrl", "rlix", "rlix_async", "rlix_async_migr", "ours_roll", "ours_nomigr", "ours")
    return known.index(deployment) if deployment in known else len(known)


def run_length(
    curves: dict[str, list[tuple[int, float, float, float]]],
    bound: list[tuple[int, float]],
    drain: list[tuple[int, float]],
    target: float,
    path: Path,
) -> None:
    """Rollout throughput x exclusive against steps per job (left: mean over seeds with the
    min..max range, one line per deployment, the makespan bound dashed), and the share of ours'
    makespan spent in the final drain (right).

    ``curves``: deployment -> [(steps, mean, min, max)]; ``bound``: [(steps, mean bound x
    exclusive)]; ``drain``: [(steps, mean final-drain share of ours' makespan)].
    """
    plt = _plt()
    fig, (ax, right) = plt.subplots(1, 2, figsize=(11, 4))
    for deployment, pts in sorted(curves.items(), key=lambda kv: _order(kv[0])):
        pts = sorted(pts)
        xs = [p[0] for p in pts]
        means = [p[1] for p in pts]
        low = [p[1] - p[2] for p in pts]
        high = [p[3] - p[1] for p in pts]
        ax.errorbar(xs, means, yerr=[low, high], marker="o", capsize=3, label=deployment)
    if bound:
        ax.plot(
            [b[0] for b in bound], [b[1] for b in bound], "k--", label="bound (any schedule)"
        )
    ax.axhline(target, color="red", linestyle=":", label=f"target {target:g}x (RLix RFC)")
    ax.set_xscale("log", base=2)
    ax.set_xticks([p[0] for p in bound] or [])
    ax.set_xticklabels([str(p[0]) for p in bound])
    ax.set_xlabel("training steps per job")
    ax.set_ylabel("rollout throughput x exclusive")
    ax.set_title("long-tail 24 jobs: throughput vs run length (seeds: mean, min..max)")
    ax.legend(fontsize=7, loc="upper right", bbox_to_anchor=(1.0, 0.86))
    right.bar([str(d[0]) for d in drain], [d[1] for d in drain], color="tab:grey")
    right.set_xlabel("training steps per job")
    right.set_ylabel("final drain / makespan (ours)")
    right.set_title("the one-off end of the run")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def relative_changes(
    changes: dict[str, dict[str, tuple[float, float, float]]],
    ylabel: str,
    title: str,
    path: Path,
) -> None:
    """Grouped bars of relative changes (in %), one group per workload, one bar per figure,
    with min..max error bars. ``changes``: figure -> workload -> (mean, min, max) as ratios."""
    plt = _plt()
    names = list(next(iter(changes.values()), {}))
    width = 0.8 / max(1, len(changes))
    fig, ax = plt.subplots(figsize=(11, 4.5))
    for j, (label, per) in enumerate(changes.items()):
        means = [100 * per[n][0] for n in names]
        low = [100 * (per[n][0] - per[n][1]) for n in names]
        high = [100 * (per[n][2] - per[n][0]) for n in names]
        xs = [x + j * width for x in range(len(names))]
        ax.bar(xs, means, width, yerr=[low, high], capsize=2, label=label)
    ax.axhline(0, color="black", lw=0.8)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.set_xticks([x + width * (len(changes) - 1) / 2 for x in range(len(names))])
    ax.set_xticklabels(names, rotation=25, ha="right", fontsize=8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
