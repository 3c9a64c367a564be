"""Run one workload under each policy on the same seeds (and isolated runs for slowdown)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from rlix_plugins.coordinator.core import DemandSharePlanner, Planner, Topology
from rlix_plugins.sim.engine import EngineConfig, RunResult, SimCluster
from rlix_plugins.sim.exclusive import ExclusivePlanner
from rlix_plugins.sim.placement import ExclusivePlacer, Placer, SpanPlacer, StaticPlacer
from rlix_plugins.sim.rlix_policy import RlixPlanner
from rlix_plugins.sim.workloads import JobSpec, Workload

log = logging.getLogger(__name__)

#: deployment -> (scheduling policy, pipeline model for every job or None = each job's kind)
DEPLOYMENTS: dict[str, tuple[str, str | None]] = {
    # dedicated GPUs per job, resident shards (split-async with in-place weight broadcast)
    "exclusive": ("exclusive", None),
    # RLix as deployed: RLix's policy driving ROLL-sequence pipelines
    "rlix": ("rlix", "roll"),
    # RLix's policy driving our pipelines (isolates the policy from the mechanism)
    "rlix_async": ("rlix", None),
    # ours: DemandSharePlanner driving our pipelines (each job's own kind)
    "ours": ("ours", None),
    # our policy driving ROLL-sequence pipelines (not in the default comparison)
    "ours_roll": ("ours", "roll"),
    # PlexRL as published: the jobs time-slice one training pool (FIFO, offload/onload per
    # turn), each keeps its dedicated rollout pool; needs ``Workload.pool_placements``
    "plexrl": ("exclusive", None),
    # RLix's policy on our pipelines WITH our router's migration (not in the default set):
    # separates the policy's share of ours-vs-rlix_async from the router's
    "rlix_async_migr": ("rlix", None),
    # ours without migration (not in the default set): the router feature's own effect
    "ours_nomigr": ("ours", None),
    # ours with the NeMo RL adapter's RESTART option (RLIX_NEMO_RL_REDISPATCH=restart): an
    # aborted request runs again from the prompt (partial tokens discarded) and nothing
    # migrates (not in the default set; the adapter's default is CONTINUE + migration = ours)
    "ours_nemo_rl": ("ours", None),
}
#: deployments whose router migrates running requests onto a newly active shard
#: (``EngineConfig.migrate_on_activate``). Ours only: RLix's router has no migration (RLix's
#: scheduler re-queues the requests of a shrunk shard; an added shard takes new requests only).
MIGRATING = frozenset({"ours", "rlix_async_migr"})
#: deployments whose router re-runs an aborted request from the prompt
#: (``EngineConfig.restart_on_abort``): NeMo RL's adapter with
#: ``RLIX_NEMO_RL_REDISPATCH=restart`` (RESTART, migration off)
RESTARTING = frozenset({"ours_nemo_rl"})
#: deployments scheduled by our service, the only ones ``EngineConfig.background_expands``
#: applies to (RLix's scheduler awaits every expand of a cycle)
OUR_SERVICE = frozenset(d for d, (scheduler, _) in DEPLOYMENTS.items() if scheduler == "ours")
POLICIES = ("exclusive", "rlix", "rlix_async", "ours")


@dataclass(frozen=True, slots=True)
class PolicyRun:
    """One policy's run of a workload."""

    policy: str
    result: RunResult


def make_planner(policy: str) -> Planner:
    """The scheduling policy of a deployment (see :data:`DEPLOYMENTS`)."""
    if policy not in DEPLOYMENTS:
        raise ValueError(f"unknown deployment {policy!r}; expected one of {tuple(DEPLOYMENTS)}")
    name = DEPLOYMENTS[policy][0]
    if name == "exclusive":
        return ExclusivePlanner()
    if name == "rlix":
        return RlixPlanner()
    return DemandSharePlanner()


def run_policy(
    workload: Workload,
    policy: str,
    *,
    seed: int,
    config: EngineConfig | None = None,
    planner: Planner | None = None,
) -> RunResult:
    """Simulate ``workload`` under ``policy`` (its own deployment: dedicated or shared)."""
    base = config or EngineConfig()
    base = replace(base, background_expands=base.background_expands and policy in OUR_SERVICE)
    gpn = workload.gpus_per_node
    placer: Placer
    if policy == "exclusive":
        topo = Topology(workload.exclusive_nodes, gpn)
        placer = ExclusivePlacer(topo.num_gpus, gpn)
        cfg = replace(base, resident=True, allows_idle_preemption=False)
    elif policy == "plexrl":
        if workload.pool_placements is None:
            raise ValueError(
                f"workload {workload.name!r} has no pool_placements: the plexrl deployment "
                "applies to workloads with one shared training pool (plexrl_two_jobs)"
            )
        topo = Topology(workload.shared_nodes, gpn)
        placer = StaticPlacer(workload.pool_placements)
        # Not resident: the pool changes hands, so training state is offloaded/onloaded each
        # turn; rollout shards are never shrunk (disjoint pools) and take new weights in place.
        cfg = replace(base, resident=False, allows_idle_preemption=False)
    else:
        topo = Topology(workload.shared_nodes, gpn)
        if workload.shared_placements is not None:
            placer = StaticPlacer(workload.shared_placements)
        else:
            placer = SpanPlacer(topo.num_gpus, gpn, workload.span_factor)
        scheduler, kind = DEPLOYMENTS.get(policy, ("ours", None))
        cfg = replace(
            base,
            resident=False,
            allows_idle_preemption=scheduler == "rlix",
            pipeline_kind=kind if kind is not None else base.pipeline_kind,
            migrate_on_activate=policy in MIGRATING,
            restart_on_abort=policy in RESTARTING,
        )
    sim = SimCluster(
        topo, planner or make_planner(policy), placer, workload.jobs, seed=seed, config=cfg
    )
    result = sim.run()
    log.info(
        "%s/%s: makespan %.0f s, %d cycles, %d events",
        workload.name,
        policy,
        result.makespan,
        result.cycles.cycles,
        result.events,
    )
    return result


def isolated_jct(
    job: JobSpec, gpus_per_node: int, *, seed: int, config: EngineConfig | None = None
) -> float:
    """JCT of ``job`` alone on its dedicated GPUs (the slowdown denominator), under the same
    engine settings (cycle interval, tick, blocking cycles) as the runs it divides."""
    alone = replace(job, arrival_s=0.0)
    nodes = -(-job.footprint // gpus_per_node)
    wl = Workload(
        name=f"isolated_{job.name}",
        description="one job alone",
        jobs=(alone,),
        gpus_per_node=gpus_per_node,
        exclusive_nodes=nodes,
        shared_nodes=nodes,
    )
    cfg = replace(config or EngineConfig(), record_tenures=False)
    return run_policy(wl, "exclusive", seed=seed, config=cfg).makespan


def run_all(
    workload: Workload,
    *,
    seed: int,
    policies: tuple[str, ...] = POLICIES,
    config: EngineConfig | None = None,
) -> tuple[tuple[PolicyRun, ...], dict[str, float]]:
    """Every policy on the same workload and seed, plus each job's isolated JCT."""
    runs = tuple(PolicyRun(p, run_policy(workload, p, seed=seed, config=config)) for p in policies)
    # A job's random stream is keyed by (seed, job name): alone it draws the same lengths.
    isolated = {
        job.name: isolated_jct(job, workload.gpus_per_node, seed=seed, config=config)
        for job in workload.jobs
    }
    return runs, isolated
