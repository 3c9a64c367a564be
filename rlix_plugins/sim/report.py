"""Compare policies on one workload and write JSON + PNG results (shared by CLI and benchmark)."""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

from rlix_plugins.sim import plots
from rlix_plugins.sim.engine import EngineConfig, RunResult
from rlix_plugins.sim.metrics import Summary, slowdowns, summarize
from rlix_plugins.sim.runner import POLICIES, run_all
from rlix_plugins.sim.workloads import Workload

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Comparison:
    """Every policy's summary of one workload, plus the ratios between them."""

    workload: str
    description: str
    seed: int
    summaries: tuple[Summary, ...]
    sources: tuple[str, ...]
    assumptions: tuple[str, ...]

    def get(self, policy: str) -> Summary:
        for s in self.summaries:
            if s.policy == policy:
                return s
        raise KeyError(policy)

    def ratios(self) -> dict[str, float]:
        """Throughput gain and GPU-hour saving of each shared deployment vs exclusive, and ours
        vs RLix as deployed (``rlix``), vs RLix's policy on our pipelines (``rlix_async``: its
        router has no migration; ``rlix_async_migr``: with ours, the policy alone differs) and
        vs PlexRL-style pool time-slicing (``plexrl``) where run, all from the same run."""
        out: dict[str, float] = {}
        names = {s.policy for s in self.summaries}
        if "exclusive" in names:
            ex = self.get("exclusive")
            for s in self.summaries:
                if s.policy == "exclusive":
                    continue
                p = s.policy
                out[f"{p}_throughput_x_exclusive"] = (
                    s.rollout_throughput_per_h / ex.rollout_throughput_per_h
                )
                out[f"{p}_gpu_hours_saving_vs_exclusive"] = 1.0 - (
                    s.gpu_hours_per_step / ex.gpu_hours_per_step
                )
        for base in ("rlix", "rlix_async", "rlix_async_migr", "plexrl"):
            if {base, "ours"} <= names:
                ours, other = self.get("ours"), self.get(base)
                out[f"ours_throughput_x_{base}"] = (
                    ours.rollout_throughput_per_h / other.rollout_throughput_per_h
                )
                out[f"ours_gpu_hours_saving_vs_{base}"] = 1.0 - (
                    ours.gpu_hours_per_step / other.gpu_hours_per_step
                )
                out[f"ours_mean_jct_vs_{base}"] = ours.mean_jct_s / other.mean_jct_s
        return out

    def to_json(self) -> dict[str, object]:
        return {
            "workload": self.workload,
            "description": self.description,
            "seed": self.seed,
            "sources": list(self.sources),
            "assumptions": list(self.assumptions),
            "summaries": [asdict(s) for s in self.summaries],
            "ratios": self.ratios(),
        }


def compare(
    workload: Workload,
    *,
    seed: int,
    out_dir: Path | None,
    policies: tuple[str, ...] = POLICIES,
    config: EngineConfig | None = None,
    plot: bool = True,
    ownership: tuple[str, ...] | None = None,
) -> Comparison:
    """Run ``policies`` on ``workload`` (same seed), summarise, write JSON and plots.

    ``ownership``: deployments whose GPU ownership timeline is drawn (None = all, when
    ``plot``); they need ``config.record_tenures``.
    """
    runs, isolated = run_all(workload, seed=seed, policies=policies, config=config)
    results: dict[str, RunResult] = {r.policy: r.result for r in runs}
    comparison = Comparison(
        workload=workload.name,
        description=workload.description,
        seed=seed,
        summaries=tuple(summarize(p, r, isolated) for p, r in results.items()),
        sources=workload.sources,
        assumptions=workload.assumptions,
    )
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / f"{workload.name}.json").write_text(
            json.dumps(comparison.to_json(), indent=2, default=str)
        )
        if plot:
            for policy, r in results.items():
                if r.tenures and (ownership is None or policy in ownership):
                    plots.ownership_timeline(
                        r,
                        f"{workload.name}/{policy}",
                        out_dir / f"{workload.name}_{policy}_ownership.png",
                    )
            plots.utilisation(results, workload.name, out_dir / f"{workload.name}_util.png")
            plots.cdfs(
                {p: [j.finished - j.arrival for j in r.jobs] for p, r in results.items()},
                {p: list(slowdowns(r, isolated).values()) for p, r in results.items()},
                workload.name,
                out_dir / f"{workload.name}_cdf.png",
            )
    return comparison


def format_table(comparison: Comparison) -> str:
    """A plain-text table of one comparison (for the CLI and the benchmark log)."""
    cols = (
        ("GPUs", "num_gpus", "{:d}"),
        ("makespan s", "makespan_s", "{:.0f}"),
        ("traj/h", "rollout_throughput_per_h", "{:.0f}"),
        ("GPU-h/step", "gpu_hours_per_step", "{:.3f}"),
        ("util", "gpu_utilisation", "{:.3f}"),
        ("train bubble", "train_bubble", "{:.3f}"),
        ("mean JCT s", "mean_jct_s", "{:.0f}"),
        ("mean slowdown", "mean_slowdown", "{:.2f}"),
        ("Jain", "jain_fairness", "{:.3f}"),
        ("preempt", "preemptions", "{:d}"),
        ("rebalance", "rebalances", "{:d}"),
        ("idle-preempt", "idle_preemptions", "{:d}"),
        ("aborted", "aborted_trajectories", "{:d}"),
        ("lost s", "lost_work_s", "{:.0f}"),
        ("migrated", "migrated_requests", "{:d}"),
        ("migr s", "migration_prefill_s", "{:.0f}"),
        ("plan ms", "plan_ms_mean", "{:.2f}"),
    )
    lines = [f"== {comparison.workload}: {comparison.description}"]
    header = f"{'policy':<11}" + "".join(f"{c[0]:>13}" for c in cols)
    lines.append(header)
    for s in comparison.summaries:
        row = f"{s.policy:<11}" + "".join(f"{c[2].format(getattr(s, c[1])):>13}" for c in cols)
        lines.append(row)
    for k, v in comparison.ratios().items():
        lines.append(f"  {k}: {v:.3f}")
    return "\n".join(lines)
