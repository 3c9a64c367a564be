"""Which job sets a RollMux trace's makespan, and in what order it and the job sharing its
training GPUs took turns (the analysis behind docs/simulator.md's training-heavy miss).

For each deployment: the makespan, the job that ends last, and the job whose training GPUs
overlap its own the most; then every training tenure of those two jobs on the shared GPUs in
time order, each with the moment its job asked for it (the end of that job's last generation
tenure before it: an async job asks for training when its rollout completes).

    python benchmarks/cluster_efficiency/job_trace.py          # training-heavy, seed 7
    python benchmarks/cluster_efficiency/job_trace.py --profile mixed \
        --deployments ours,rlix_async_migr
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from rlix_plugins.sim.engine import EngineConfig, RunResult  # noqa: E402
from rlix_plugins.sim.records import TenureRecord  # noqa: E402
from rlix_plugins.sim.runner import run_policy  # noqa: E402
from rlix_plugins.sim.workloads import Workload, rollmux_trace  # noqa: E402


@dataclass(frozen=True, slots=True)
class Turn:
    """One training tenure of a job on the GPUs it shares with the other job."""

    job: str
    asked: float
    start: float
    end: float


@dataclass(frozen=True, slots=True)
class JobTrace:
    deployment: str
    makespan: float
    last_job: str
    neighbour: str | None
    shared_gpus: tuple[int, ...]
    turns: tuple[Turn, ...]


def _train_gpus(tenures: list[TenureRecord], job: str) -> set[int]:
    return {t.gpu for t in tenures if t.job == job and t.kind == "train"}


def trace(result: RunResult, deployment: str) -> JobTrace:
    """The makespan job, its most-overlapping training neighbour and their turns."""
    tenures = list(result.tenures)
    last = max(result.jobs, key=lambda j: j.finished).job
    mine = _train_gpus(tenures, last)
    others = {j.job: len(mine & _train_gpus(tenures, j.job)) for j in result.jobs if j.job != last}
    neighbour = max(others, key=lambda j: others[j]) if others and max(others.values()) else None
    # alone on its GPUs: its own trainings, in order
    shared = tuple(sorted(mine & _train_gpus(tenures, neighbour) if neighbour else mine))
    turns: list[Turn] = []
    for job in (last, neighbour) if neighbour else (last,):
        gens = sorted(t.end for t in tenures if t.job == job and t.kind != "train")
        starts = sorted({(t.start, t.end) for t in tenures
                         if t.job == job and t.kind == "train" and t.gpu in shared})
        for start, end in starts:
            asked = max((g for g in gens if g <= start + 1e-9), default=start)
            turns.append(Turn(job, asked, start, end))
    return JobTrace(deployment, result.makespan, last, neighbour, shared,
                    tuple(sorted(turns, key=lambda t: t.start)))


def run(workload: Workload, deployments: list[str], seed: int) -> list[JobTrace]:
    config = EngineConfig(record_tenures=True)
    return [trace(run_policy(workload, d, seed=seed, config=config), d) for d in deployments]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="training_heavy",
                        choices=["balanced", "rollout_heavy", "training_heavy", "mixed"])
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--jobs", type=int, default=16)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--deployments", default="ours,rlix_async")
    args = parser.parse_args()
    wl = rollmux_trace(args.profile, num_jobs=args.jobs, steps=args.steps, seed=args.seed)
    for t in run(wl, args.deployments.split(","), args.seed):
        print(f"{t.deployment}: makespan {t.makespan:,.1f} s; last job {t.last_job}, training "
              f"GPUs shared with {t.neighbour} {list(t.shared_gpus)}")
        for turn in t.turns:
            print(f"  {turn.job}  asked {turn.asked:10.1f}  trained {turn.start:10.1f} "
                  f"-> {turn.end:10.1f}")


if __name__ == "__main__":
    main()
