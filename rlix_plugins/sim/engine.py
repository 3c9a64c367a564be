"""The simulated cluster: the production scheduling core driven on virtual time.

Every event a pipeline causes goes through the same :class:`SchedulerState` methods the Ray
service calls; scheduling cycles run ``planner.plan(state, now)`` -> ``check_plan`` ->
``state.commit`` -> ``check_state``, exactly the service's cycle, and the plan's shrinks are
applied (abort + sleep) before its grants and expands, whose GPUs become usable only once the
previous tenant has physically left (plus wake / sync / onload costs).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from functools import partial

from rlix_plugins.coordinator.core import (
    ImmediateGrant,
    InvariantViolation,
    Plan,
    Planner,
    SchedulerState,
    ShrinkReason,
    Topology,
    check_plan,
    check_state,
    validate_registration,
)
from rlix_plugins.protocol.names import ACTOR_INFER, ACTOR_TRAIN, pipeline_namespace
from rlix_plugins.protocol.types import Priority, ProgressReport
from rlix_plugins.sim.async_pipeline import AsyncOverlapPipeline
from rlix_plugins.sim.clock_queue import ClockQueue, Timer
from rlix_plugins.sim.physics import GpuLedger, PhysicsViolation, TrajectoryCounter
from rlix_plugins.sim.pipeline_model import SimPipeline
from rlix_plugins.sim.placement import Placer
from rlix_plugins.sim.records import CycleStats, JobRecord, StepRecord, TenureRecord
from rlix_plugins.sim.workloads import RESIDENT_COSTS, JobSpec, SwitchCosts, job_rng

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Knobs of the simulated service (not of the policy)."""

    #: events within this window share one scheduling cycle (the service batches them)
    cycle_interval_s: float = 0.2
    #: a cycle also runs this often while anything is registered (time-based policy rules)
    tick_s: float = 10.0
    #: shards stay resident (exclusive deployment): no sleep/wake/offload costs, no aborts
    resident: bool = False
    #: planner may shrink ranks for requests it cannot satisfy yet (RLix's eager preemption)
    allows_idle_preemption: bool = False
    #: record every GPU tenure (for the ownership plot); off for huge clusters
    record_tenures: bool = True
    #: utilisation series bin width (virtual seconds)
    util_bin_s: float = 60.0
    #: give up (error) after this much virtual time
    horizon_s: float = 3.0e7
    #: pipeline model for every job ("roll" / "async"); None = each job's ``JobSpec.kind``.
    #: Resident (exclusive) deployments always use the ROLL model with in-place broadcast.
    pipeline_kind: str | None = None
    #: async kind: when a shard becomes ACTIVE (after wake + selective sync), the router moves
    #: running requests from shards above the mean load onto it (each pays a re-prefill,
    #: ``JobSpec.redispatch_prefill_s``); our router's feature, RLix's router has none
    migrate_on_activate: bool = False
    #: async kind: an aborted request is re-dispatched from its prompt (the router's RESTART,
    #: as NeMo RL's adapter runs it): its generated work is lost and regenerated, no re-prefill
    #: of partial tokens; False = CONTINUE from the partial tokens (veRL, the gate rehearsals)
    restart_on_abort: bool = False
    #: the next cycle plans only once the previous cycle's resizes are done (shrunk shards
    #: asleep, expanded shards serving). RLix's scheduler awaits every ``resize_infer`` of a
    #: cycle before committing it (rlops/rlix ``_execute_resize_calls``) and our service does
    #: the same (scheduler_actor.py; ``resize_infer`` returns once the shard slept, or woke,
    #: synced and serves). False: a cycle may follow ``cycle_interval_s`` later while shards
    #: still wake (results before 2026-11-24, benchmarks/cluster_efficiency/blocking.py).
    #: Modelled as the max over the cycle's resizes, not shrinks-then-expands: a slight
    #: underestimate of a real cycle's length.
    blocking_cycles: bool = True
    #: with blocking cycles, a cycle waits only for its shrinks; its expands finish in the
    #: background and a later shrink of a rank still waking waits for its wake: our service
    #: with ``RLIX_BACKGROUND_EXPANDS=1`` (``ServiceConfig.background_expands``). RLix's
    #: scheduler always awaits its expands, so ``runner.run_policy`` applies this to our
    #: deployments only.
    background_expands: bool = False


@dataclass(frozen=True, slots=True)
class RunResult:
    """Everything one simulated run produced."""

    num_gpus: int
    makespan: float
    jobs: tuple[JobRecord, ...]
    steps: tuple[StepRecord, ...]
    tenures: tuple[TenureRecord, ...]
    util_bins: tuple[float, ...]
    util_bin_s: float
    useful_gpu_s: float
    cycles: CycleStats
    trajectories: int
    aborted: int
    events: int
    #: generation work lost to aborts, solo-seconds (regenerated tokens + re-prefills)
    lost_work_s: float = 0.0
    #: running requests moved to a newly active shard (not aborts: nothing is lost)
    migrated: int = 0
    #: solo-seconds of re-prefill the migrations cost on their new shards
    migration_prefill_s: float = 0.0
    #: GPU-seconds credited to ``useful_gpu_s`` for lost work and migration re-prefills
    #: (busy, not useful: :func:`metrics.summarize` takes them out of the utilisation)
    wasted_gpu_s: float = 0.0


@dataclass(slots=True)
class _CycleCounters:
    """The running counters behind :class:`CycleStats` (same fields, mutable)."""

    cycles: int = 0
    preempt_shrinks: int = 0
    rebalance_shrinks: int = 0
    planned_shrinks: int = 0
    idle_preemptions: int = 0
    expands: int = 0
    grants: int = 0
    plan_wall_s_total: float = 0.0
    plan_wall_s_max: float = 0.0
    starvation_shrinks: int = 0


class _Series:
    """Useful GPU-seconds per time bin (utilisation over time)."""

    def __init__(self, bin_s: float) -> None:
        self.bin_s = bin_s
        self.bins: list[float] = []

    def add(self, t0: float, t1: float, rate: float) -> None:
        """Spread ``rate`` GPUs busy over [t0, t1) into bins."""
        if t1 <= t0 or rate <= 0:
            return
        b = int(t0 // self.bin_s)
        last = int(t1 // self.bin_s)
        if len(self.bins) <= last:
            self.bins.extend([0.0] * (last + 1 - len(self.bins)))
        while b <= last:
            lo = max(t0, b * self.bin_s)
            hi = min(t1, (b + 1) * self.bin_s)
            if hi > lo:
                self.bins[b] += (hi - lo) * rate
            b += 1


class SimCluster:
    """Coordinator core + pipelines + physics on one virtual clock."""

    def __init__(
        self,
        topology: Topology,
        planner: Planner,
        placer: Placer,
        jobs: tuple[JobSpec, ...],
        *,
        seed: int,
        config: EngineConfig | None = None,
    ) -> None:
        self.config = config or EngineConfig()
        self.topology = topology
        self.planner = planner
        self.placer = placer
        self.jobs = jobs
        self.clock = ClockQueue()
        self.state = SchedulerState(topology)
        self.ledger = GpuLedger(topology.num_gpus)
        self.counter = TrajectoryCounter()
        self.series = _Series(self.config.util_bin_s)
        self.seed = seed
        self.pipelines: dict[str, SimPipeline] = {}
        self.waiting: deque[int] = deque()
        self.job_records: list[JobRecord] = []
        self.step_records: list[StepRecord] = []
        self.tenures: list[TenureRecord] = []
        self._tenure_meta: dict[str, tuple[str, str]] = {}
        self._cycle_timer: Timer | None = None
        self._last_cycle = -1.0
        #: blocking cycles: when the last cycle's resize calls have all returned
        self._resizing_until = 0.0
        self._dirty = False
        self._tick_timer: Timer | None = None
        self._stats = _CycleCounters()
        self._finished = 0
        self.useful_gpu_s = 0.0

    # ------------------------------------------------------------------ costs
    def costs_for(self, job: JobSpec) -> SwitchCosts:
        if self.config.resident:
            return replace(RESIDENT_COSTS, init_load_s=job.costs.init_load_s)
        return job.costs

    # ------------------------------------------------------------------ physics hooks
    def tenure_begin(
        self, gpus: tuple[int, ...], who: str, start: float, job: str, kind: str
    ) -> None:
        self.ledger.begin(gpus, who, start)
        self._tenure_meta[who] = (job, kind)

    def tenure_end(self, gpus: tuple[int, ...], who: str, end: float) -> None:
        starts = [self.ledger.current[g] for g in gpus]
        self.ledger.end(gpus, who, end)
        if self.config.record_tenures:
            job, kind = self._tenure_meta.get(who, ("?", "?"))
            for g, ten in zip(gpus, starts, strict=True):
                assert ten is not None
                self.tenures.append(TenureRecord(g, job, kind, ten.start, end))

    def credit(
        self,
        gpus: tuple[int, ...],
        who: str,
        t0: float,
        t1: float,
        job: str,
        util: float = 1.0,
    ) -> None:
        """``gpus`` compute usefully for ``who`` over [t0, t1) at ``util`` (0..1)."""
        if not 0.0 <= util <= 1.0 + 1e-9:
            raise PhysicsViolation(f"{who}: utilisation {util} outside 0..1")
        seconds = (t1 - t0) * util
        self.ledger.add_useful(gpus, who, seconds, t0, t1)
        self.series.add(t0, t1, util * len(gpus))
        self.useful_gpu_s += seconds * len(gpus)

    def on_step(self, rec: StepRecord) -> None:
        self.step_records.append(rec)
        # Physics, every step: utilisation of every GPU within 100% of elapsed time.
        self.ledger.check_bounds(self.clock.now + self._future_credit_slack())

    def _future_credit_slack(self) -> float:
        # Training phases are credited when they start, so a GPU may hold up to one phase
        # of credit ahead of the clock.
        return max(
            (j.phases.update_actor_s + j.phases.old_log_probs_s + j.phases.ref_log_probs_s)
            for j in self.jobs
        )

    # ------------------------------------------------------------------ core calls
    def request(
        self,
        cid: str,
        priority: Priority,
        *,
        global_step: int | None = None,
        step_target_estimate: int | None = None,
    ) -> None:
        res = self.state.submit_request(
            cid,
            priority,
            now=self.clock.now,
            global_step=global_step,
            step_target_estimate=step_target_estimate,
        )
        if isinstance(res, ImmediateGrant):
            pipe = self.pipelines[self.state.clusters[cid].pipeline_id]
            if priority is not Priority.GENERATION:
                gpus = res.gpus
                self.clock.after(0.0, lambda: pipe.on_grant(cid, gpus))
        self._mark_dirty()

    def release(self, cid: str) -> None:
        self.state.release(cid, now=self.clock.now)
        self._mark_dirty()

    def release_then_request(
        self, *, release_cid: str | None, request_cid: str, step_target_estimate: int
    ) -> None:
        """``notify_release_then_request_gpus`` (atomic: both before the next cycle)."""
        if release_cid is not None:
            self.state.release(release_cid, now=self.clock.now)
        self.state.cancel_request(request_cid)
        self.request(request_cid, Priority.GENERATION, step_target_estimate=step_target_estimate)

    def plan_release(self, cid: str) -> bool:
        done = self.state.plan_release(cid, now=self.clock.now)
        self._mark_dirty()
        return done

    def report(self, report: ProgressReport) -> None:
        self.state.report_progress(report)
        self._mark_dirty()

    def clear_progress(self, pid: str) -> None:
        self.state.clear_progress(pid)

    # ------------------------------------------------------------------ cycles
    def _mark_dirty(self) -> None:
        self._dirty = True
        if self._cycle_timer is None:
            at = max(
                self.clock.now,
                self._last_cycle + self.config.cycle_interval_s,
                self._resizing_until,
            )
            self._cycle_timer = self.clock.at(at, self._cycle)

    def _tick(self) -> None:
        self._tick_timer = None
        if self.pipelines:
            self._dirty = True
            if self._cycle_timer is None:
                at = max(self.clock.now, self._resizing_until)
                self._cycle_timer = self.clock.at(at, self._cycle)
            self._tick_timer = self.clock.after(self.config.tick_s, self._tick)

    def _check(self, plan: Plan) -> int:
        """The core's invariants on the plan; returns how many shrinks freed GPUs for no one."""
        if not self.config.allows_idle_preemption:
            check_plan(self.state, plan)
            return 0
        taken = {g for gr in plan.grants for g in gr.gpus} | {
            g for m in plan.expands for g in m.gpus
        }
        idle = [
            m
            for m in plan.shrinks
            if m.reason is ShrinkReason.PREEMPT and not any(g in taken for g in m.gpus)
        ]
        if not idle:
            check_plan(self.state, plan)
            return 0
        # RLix's eager preemption frees GPUs nobody takes (our P5 forbids it): check the rest
        # of the plan against every invariant, and the eager shrinks for P1 only.
        ids = {id(m) for m in idle}
        check_plan(
            self.state, replace(plan, shrinks=tuple(m for m in plan.shrinks if id(m) not in ids))
        )
        seen = {(m.cluster_id, m.dp_rank) for m in plan.shrinks if id(m) not in ids}
        for m in idle:
            key = (m.cluster_id, m.dp_rank)
            if key in seen or m.dp_rank not in self.state.active_ranks.get(m.cluster_id, {}):
                raise InvariantViolation("P1", f"eager shrink of {key}: not active or moved twice")
            seen.add(key)
        return len(idle)

    def _cycle(self) -> None:
        self._cycle_timer = None
        if not self._dirty:
            return
        if self.clock.now < self._resizing_until:
            # set while this cycle's timer was pending (an event during the last apply)
            self._cycle_timer = self.clock.at(self._resizing_until, self._cycle)
            return
        self._dirty = False
        now = self.clock.now
        self._last_cycle = now
        wall = time.perf_counter()
        plan = self.planner.plan(self.state, now)
        wall = time.perf_counter() - wall
        stats = self._stats
        stats.plan_wall_s_total += wall
        stats.plan_wall_s_max = max(stats.plan_wall_s_max, wall)
        stats.cycles += 1
        idle = self._check(plan)
        background = self.config.blocking_cycles and self.config.background_expands
        result = self.state.commit(plan, now=now, expands_pending=background)
        check_state(self.state)
        stats.idle_preemptions += idle
        for m in plan.shrinks:
            if m.reason is ShrinkReason.REBALANCE:
                stats.rebalance_shrinks += 1
            elif m.reason is ShrinkReason.STARVATION:
                stats.starvation_shrinks += 1
            elif m.reason is ShrinkReason.PLANNED_RELEASE:
                stats.planned_shrinks += 1
            else:
                stats.preempt_shrinks += 1
        stats.expands += len(result.expanded)
        stats.grants += len(result.granted)
        # Apply: shrinks (abort + sleep) first, then grants and expands.
        touched: set[str] = set()
        release_ready: dict[str, float] = {}
        resized = now
        for cid, rank in result.shrunk:
            pid = self.state.clusters[cid].pipeline_id
            end = self.pipelines[pid].on_shrink(rank)
            release_ready[cid] = max(release_ready.get(cid, now), end)
            resized = max(resized, end)
            touched.add(pid)
        for cid in result.released:
            pid = self.state.clusters[cid].pipeline_id
            self.pipelines[pid].on_release_done(release_ready.get(cid, now))
        for cid, gpus in result.granted.items():
            spec = self.state.clusters[cid]
            pipe = self.pipelines[spec.pipeline_id]
            if cid not in self.state.holdings:  # a GENERATION grant (ranks come as expands)
                pipe.on_generation_granted()
            else:
                pipe.on_grant(cid, gpus)
        for cid, rank in result.expanded:
            pid = self.state.clusters[cid].pipeline_id
            serves = self.pipelines[pid].on_expand(rank)
            if background:
                # the expand RPC returns: the service tells the core the rank serves
                self.clock.at(serves, partial(self._expand_done, cid, rank))
            else:
                resized = max(resized, serves)
        if self.config.blocking_cycles:
            self._resizing_until = resized
        for pid in touched:
            self.pipelines[pid].redispatch()
        # Planned releases whose ranks were already all gone complete without a shrink.
        if self._dirty and self._cycle_timer is None:
            self._mark_dirty()

    def _expand_done(self, cid: str, rank: int) -> None:
        if cid in self.state.clusters and self.state.expand_done(cid, rank, now=self.clock.now):
            self._mark_dirty()

    # ------------------------------------------------------------------ jobs
    def _arrive(self, index: int) -> None:
        self.waiting.append(index)
        self._admit()

    def _admit(self) -> None:
        while self.waiting:
            index = self.waiting[0]
            job = self.jobs[index]
            placement = self.placer.place(index, job)
            if placement is None:
                return  # FIFO: later jobs wait behind the head
            self.waiting.popleft()
            spec = validate_registration(
                self.topology,
                pipeline_id=job.name,
                ray_namespace=pipeline_namespace(job.name),
                cluster_tp_configs={ACTOR_TRAIN: 1, ACTOR_INFER: job.infer_tp},
                cluster_device_mappings={
                    ACTOR_TRAIN: list(placement.train),
                    ACTOR_INFER: list(placement.infer),
                },
                weight=job.weight,
            )
            self.state.register(spec)
            rng = job_rng(self.seed, job.name)
            kind = "roll" if self.config.resident else (self.config.pipeline_kind or job.kind)
            cls = AsyncOverlapPipeline if kind == "async" else SimPipeline
            pipe = cls(
                job,
                placement,
                self,
                rng,
                resident=self.config.resident,
                on_finished=self._make_finish(index),
            )
            self.pipelines[job.name] = pipe
            pipe.start()
            if self._tick_timer is None:
                self._tick_timer = self.clock.after(self.config.tick_s, self._tick)

    def _make_finish(self, index: int) -> Callable[[SimPipeline], None]:
        def finished(pipe: SimPipeline) -> None:
            self.job_records.append(pipe.record())
            self.state.unregister(pipe.pid)
            check_state(self.state)
            del self.pipelines[pipe.pid]
            self.placer.release(index)
            self._finished += 1
            self._mark_dirty()
            self._admit()

        return finished

    def run(self) -> RunResult:
        """Run every job to completion and return the records."""
        for i, job in enumerate(self.jobs):
            self.clock.at(job.arrival_s, lambda i=i: self._arrive(i))  # type: ignore[misc]
        self.clock.run(until=self.config.horizon_s)
        if self._finished != len(self.jobs):
            stuck = {p.pid: (p.phase, p.step) for p in self.pipelines.values()}
            raise PhysicsViolation(
                f"simulation stopped at t={self.clock.now:.0f} with "
                f"{len(self.jobs) - self._finished} jobs unfinished: {stuck}; "
                f"waiting {list(self.waiting)}"
            )
        makespan = max(r.finished for r in self.job_records)
        self.ledger.check_bounds(makespan)
        expected = sum(j.steps * j.batch for j in self.jobs)
        self.counter.check_final(expected)
        for b, v in enumerate(self.series.bins):
            if v > self.topology.num_gpus * self.series.bin_s * (1 + 1e-6):
                raise PhysicsViolation(f"utilisation above 100% in bin {b}: {v}")
        return RunResult(
            num_gpus=self.topology.num_gpus,
            makespan=makespan,
            jobs=tuple(sorted(self.job_records, key=lambda r: r.job)),
            steps=tuple(self.step_records),
            tenures=tuple(self.tenures),
            util_bins=tuple(self.series.bins),
            util_bin_s=self.series.bin_s,
            useful_gpu_s=self.useful_gpu_s,
            cycles=CycleStats(**asdict(self._stats)),
            trajectories=self.counter.consumed,
            aborted=self.counter.aborted,
            events=self.clock.processed,
            lost_work_s=self.counter.lost_s,
            migrated=self.counter.migrated,
            migration_prefill_s=self.counter.migration_s,
            wasted_gpu_s=self.counter.wasted_gpu_s,
        )
