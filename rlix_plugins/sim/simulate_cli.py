"""``rlix-plugins simulate``: compare exclusive allocation, RLix's policy and ours."""

from __future__ import annotations

import argparse
import logging
import tempfile
from pathlib import Path

from rlix_plugins.cli import report_error
from rlix_plugins.sim.calibrate import CALIBRATION_STEPS, calibrate_lengths
from rlix_plugins.sim.engine import EngineConfig
from rlix_plugins.sim.report import compare, format_table
from rlix_plugins.sim.runner import DEPLOYMENTS, POLICIES
from rlix_plugins.sim.scenario import load_scenario
from rlix_plugins.sim.workloads import (
    PLEXRL_TABLE2,
    ROLLMUX_RANGES,
    ROLLMUX_SIZES,
    SWITCH_COSTS,
    Workload,
    long_tail_agentic,
    plexrl_two_jobs,
    rollmux_trace,
    shared_on,
    with_switch_costs,
)

log = logging.getLogger(__name__)

WORKLOADS = (
    "long-tail",
    *(f"plexrl-{r.model}" for r in PLEXRL_TABLE2),
    *(f"rollmux-{p}" for p in (*ROLLMUX_RANGES, "mixed")),
)


def build_workload(
    name: str,
    *,
    jobs: int | None,
    steps: int | None,
    nodes: int | None,
    seed: int,
    shared_gpus: int | None = None,
    job_sizes: tuple[str, ...] | None = None,
) -> Workload:
    """A named workload from :mod:`rlix_plugins.sim.workloads` (PlexRL ones calibrated).

    ``shared_gpus`` sizes the time-shared cluster (exclusive allocation keeps its own): for
    PlexRL e.g. ``T + R`` runs both jobs on one job's exclusive GPUs (the default is PlexRL's
    ``T + 2R``); for the other workloads a whole number of nodes that holds the largest job.
    ``job_sizes`` (RollMux only): the sizes drawn, out of S, M, L.
    """
    if job_sizes is not None and not name.startswith("rollmux-"):
        raise ValueError(f"job sizes apply to the RollMux workloads, not {name!r}")
    for option, value in (("--jobs", jobs), ("--steps", steps), ("--nodes", nodes)):
        if value is not None and value < 1:
            raise ValueError(f"{option} must be >= 1 (leave it out for the default), got {value}")
    if name.startswith("plexrl-"):
        for option, value in (("--jobs", jobs), ("--nodes", nodes)):
            if value is not None:
                raise ValueError(
                    f"{option} does not apply to {name} (PlexRL's setup: two jobs on its own "
                    "pools); size its shared cluster with --shared-gpus"
                )
        row = next(r for r in PLEXRL_TABLE2 if r.model == name.removeprefix("plexrl-"))
        run_steps = 8 if steps is None else steps
        # Calibrated on a run long enough for a steady cycle, whatever the run's own length.
        probe = plexrl_two_jobs(row, steps=max(run_steps, CALIBRATION_STEPS))
        scale = calibrate_lengths(probe, row.cycle_s, seed=seed)
        return plexrl_two_jobs(row, steps=run_steps, length_scale=scale, shared_gpus=shared_gpus)
    if name == "long-tail":
        wl = long_tail_agentic(
            num_jobs=16 if jobs is None else jobs,
            nodes=8 if nodes is None else nodes,
            steps=4 if steps is None else steps,
        )
    elif name.startswith("rollmux-"):
        wl = rollmux_trace(
            name.removeprefix("rollmux-"),
            num_jobs=16 if jobs is None else jobs,
            nodes=8 if nodes is None else nodes,
            steps=10 if steps is None else steps,
            seed=seed,
            sizes=ROLLMUX_SIZES if job_sizes is None else job_sizes,
        )
    else:
        raise ValueError(f"unknown workload {name!r}; expected one of {WORKLOADS}")
    return wl if shared_gpus is None else shared_on(wl, shared_gpus)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``rlix-plugins simulate``."""
    src = parser.add_mutually_exclusive_group()
    src.add_argument(
        "--workload", choices=WORKLOADS, default="long-tail", help="built-in workload (docs)"
    )
    src.add_argument("--scenario", type=Path, help="scenario file (.json/.toml), see docs")
    parser.add_argument(
        "--policies",
        default=",".join(POLICIES),
        help=f"comma-separated deployments out of {tuple(DEPLOYMENTS)}",
    )
    parser.add_argument(
        "--seed", type=int, default=1, help="random seed: trace, lengths (same for every policy)"
    )
    parser.add_argument("--jobs", type=int, help="number of jobs (long-tail, rollmux)")
    parser.add_argument("--steps", type=int, help="training steps per job")
    parser.add_argument("--nodes", type=int, help="nodes of 8 GPUs (long-tail, rollmux)")
    parser.add_argument(
        "--shared-gpus",
        type=int,
        help="GPUs of the time-shared cluster (exclusive keeps its own). PlexRL: default T + 2R, "
        "PlexRL's; T + R runs both jobs on one job's exclusive GPUs; the plexrl deployment needs "
        "T + 2R. long-tail / rollmux: whole nodes holding the largest job, e.g. half the cluster",
    )
    parser.add_argument(
        "--job-sizes", help="rollmux: comma-separated job sizes out of S,M,L (default all)"
    )
    parser.add_argument(
        "--out", type=Path, default=Path("sim-results"), help="directory for JSON + PNG results"
    )
    parser.add_argument("--no-plots", action="store_true", help="JSON only, no PNG plots")
    parser.add_argument(
        "--background-expands",
        action="store_true",
        help="our deployments' service commits a cycle once its shrinks are done and lets "
        "expands finish in the background (RLIX_BACKGROUND_EXPANDS=1); RLix's always waits",
    )
    parser.add_argument(
        "--switch-scale",
        type=float,
        default=1.0,
        help="multiply every job's per-step switch costs (shard sleep/wake, training "
        "onload/offload, NCCL re-init) by this; exclusive allocation pays none of them",
    )
    parser.add_argument(
        "--switch-cost",
        action="append",
        metavar="NAME=SECONDS",
        help="set one switch cost of every job, after --switch-scale (repeatable), e.g. "
        "nccl_reinit_s=1.0 with your cluster's measured figure; names: "
        + ", ".join(SWITCH_COSTS),
    )


def parse_switch_costs(items: list[str] | None) -> dict[str, float]:
    """``--switch-cost NAME=SECONDS`` values as a dict; ValueError naming the bad item and
    the valid names (a repeated name: the last one counts, as argparse does for options)."""
    out: dict[str, float] = {}
    for item in items or []:
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or name not in SWITCH_COSTS:
            raise ValueError(
                f"--switch-cost expects NAME=SECONDS with NAME one of {', '.join(SWITCH_COSTS)}; "
                f"got {item!r}"
            )
        try:
            out[name] = float(value)
        except ValueError:
            raise ValueError(
                f"--switch-cost {name}: {value!r} is not a number of seconds"
            ) from None
    return out


def _unwritable(out: Path) -> str | None:
    """Why results cannot be written into directory ``out`` (created if missing), or None."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def _error(message: str) -> int:
    """A usage error of this command: one line on stderr; the exit status to return."""
    return report_error("simulate", message)


def run(args: argparse.Namespace) -> int:
    """Run the comparison, print the table, save JSON and plots."""
    policies = tuple(p.strip() for p in str(args.policies).split(",") if p.strip())
    bad = [p for p in policies if p not in DEPLOYMENTS]
    if not policies:
        return _error(f"--policies names no deployment; expected a subset of {tuple(DEPLOYMENTS)}")
    if bad:
        return _error(f"unknown deployments {bad}; expected a subset of {tuple(DEPLOYMENTS)}")
    if args.seed < 0:
        return _error(f"--seed must be >= 0, got {args.seed}")
    if args.out.exists() and not args.out.is_dir():
        return _error(f"--out {args.out} exists and is not a directory; name a directory")
    if args.scenario is not None:
        # The scenario file sets the jobs, steps and cluster: these options would be ignored.
        given = [
            option
            for option, value in (
                ("--jobs", args.jobs),
                ("--steps", args.steps),
                ("--nodes", args.nodes),
                ("--shared-gpus", args.shared_gpus),
                ("--job-sizes", args.job_sizes),
            )
            if value is not None
        ]
        if given:
            return _error(
                f"{', '.join(given)} apply to --workload only; a --scenario file sets "
                "its own pipelines, steps and cluster (edit the file instead)"
            )
        try:
            workload = load_scenario(args.scenario)
        except (OSError, ValueError) as exc:  # ScenarioError and JSON/TOML syntax errors
            return _error(f"scenario {args.scenario}: {exc}")
    else:
        try:
            workload = build_workload(
                args.workload,
                jobs=args.jobs,
                steps=args.steps,
                nodes=args.nodes,
                seed=args.seed,
                shared_gpus=args.shared_gpus,
                job_sizes=None
                if args.job_sizes is None
                else tuple(z.strip() for z in str(args.job_sizes).split(",") if z.strip()),
            )
        except ValueError as exc:
            return _error(str(exc))
    if "plexrl" in policies and workload.pool_placements is None:
        # Checked before running: the runner refuses it only after simulating every
        # deployment listed before it, and then nothing is written.
        if args.shared_gpus is not None:
            why = "needs PlexRL's T + 2R GPUs; drop it from --policies or leave --shared-gpus out"
        else:
            why = (f"applies only to the plexrl-* workloads, not {workload.name!r}; drop it "
                   "from --policies")
        return _error(f"the plexrl deployment keeps a rollout pool per job and {why}")
    try:
        overrides = parse_switch_costs(args.switch_cost)
        if args.switch_scale != 1.0 or overrides:
            workload = with_switch_costs(workload, scale=args.switch_scale, overrides=overrides)
    except ValueError as exc:
        return _error(str(exc))
    # Checked before running: a run of minutes whose results cannot be written is lost.
    problem = _unwritable(args.out)
    if problem is not None:
        return _error(f"--out {args.out}: cannot write results there ({problem})")
    config = EngineConfig(
        record_tenures=not args.no_plots, background_expands=args.background_expands
    )
    comparison = compare(
        workload,
        seed=args.seed,
        out_dir=args.out,
        policies=policies,
        config=config,
        plot=not args.no_plots,
    )
    print(format_table(comparison))
    for s in workload.sources:
        print(f"  source: {s}")
    for a in workload.assumptions:
        print(f"  assumption: {a}")
    print(f"results written to {args.out}/")
    return 0
