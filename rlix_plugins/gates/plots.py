"""PNG of GPU ownership over time for a gate run (matplotlib, imported lazily)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from rlix_plugins.gates.timeline import Interval, pipeline_of

_STAGE_HATCH = {"train": "//", "sync": "..", "generation": ""}


def _hatch(stage: str) -> str:
    """Hatch by stage keyword (coordinator stages are priority names, e.g. ACTOR_TRAINING)."""
    s = stage.lower()
    if "train" in s or "log_probs" in s or "init" in s:
        return "//"
    if "sync" in s:
        return ".."
    return ""


class _Phase(Protocol):
    mode: str
    start: float
    end: float
    coordinator: list[Interval]

    @property
    def busy(self) -> list[Interval]: ...


def _panel(ax: Any, intervals: Sequence[Interval], t0: float, num_gpus: int,
           colors: dict[str, Any], title: str) -> None:
    for iv in intervals:
        color = colors[pipeline_of(iv.owner)]
        ax.broken_barh([(iv.start - t0, max(iv.end - iv.start, 1e-3))], (iv.gpu - 0.4, 0.8),
                       facecolors=color, edgecolor="black", linewidth=0.2,
                       hatch=_hatch(iv.stage))
    ax.set_yticks(range(num_gpus))
    ax.set_yticklabels([f"GPU {g}" for g in range(num_gpus)])
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("seconds")


def plot_ownership(path: Path, shared: _Phase, exclusive: _Phase | None, *, num_gpus: int,
                   title: str) -> None:
    """Rows per GPU; colour = pipeline, hatch = stage (// train, .. sync, plain generation).

    Panels: the coordinator's ownership and the rehearsal's busy intervals of the shared run,
    and the busy intervals of the exclusive-allocation run.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    panels: list[tuple[str, Sequence[Interval], float]] = [
        ("shared: coordinator ownership (GENERATION / ACTOR_TRAINING / ...)",
         shared.coordinator, shared.start),
        ("shared: busy intervals (rehearsal log)", shared.busy, shared.start),
    ]
    if exclusive is not None:
        panels.append(("exclusive allocation: busy intervals", exclusive.busy, exclusive.start))
    owners = sorted({pipeline_of(iv.owner) for _, ivs, _ in panels for iv in ivs})
    cmap = plt.get_cmap("tab10")
    colors = {o: cmap(i % 10) for i, o in enumerate(owners)}
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 2.0 * len(panels) + 0.8),
                             squeeze=False)
    for ax, (label, ivs, t0) in zip(axes[:, 0], panels, strict=True):
        _panel(ax, ivs, t0, num_gpus, colors, label)
    handles = [Patch(facecolor=colors[o], label=o) for o in owners]
    handles += [Patch(facecolor="white", edgecolor="black", hatch=h, label=s)
                for s, h in _STAGE_HATCH.items()]
    fig.legend(handles=handles, loc="upper right", fontsize=7, ncol=2)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0, 0.8, 0.95))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
