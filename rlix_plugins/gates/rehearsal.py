"""CPU rehearsals of gates 1-3: real coordinator, real vLLM engines, real training and sync.

Each rehearsal runs its scenario twice in one invocation:

* **shared**: the pipelines under one coordinator (namespace unique to the run) on 2 logical
  GPUs, partial overlap, time-sharing (what the gate validates);
* **exclusive**: the same pipelines, same steps and batch sizes, with exclusive allocation:
  every stage on a dedicated GPU (training on its training GPU, generation on the other, the
  overlap shard asleep),
  no sharing, pipelines one after another (two need the whole box each). This is the
  baseline of the idle-share criterion.

Scenarios (``infer`` = shard GPUs, ``train`` = training GPUs):

* gate 1: one NeMo RL-like pipeline, infer [0, 1], train [0];
* gate 2: two, A infer [0, 1] train [0]; B infer [0, 1] train [1];
* gate 3: one NeMo RL-like pipeline (infer [0, 1], train [0]) and one ROLL-sequence pipeline
  (SIMULATED GPU work; infer [0, 1], train [1]) on one coordinator.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlix_plugins.coordinator.service.wire_log import PipelineWire
from rlix_plugins.gates.criteria import (
    CriterionResult,
    GateResult,
    IdleShare,
    RequestCount,
    RunCount,
    idle_below_exclusive,
    measure_idle,
    no_double_ownership,
    requests_accounted,
    roll_protocol,
    steps_completed,
    time_sharing,
    weights_current,
)
from rlix_plugins.gates.nemo_rehearsal import PipelineRun, PipelineSpec
from rlix_plugins.gates.observed import (
    observed_criteria,
    overlap_from_records,
    ownership_from_records,
)
from rlix_plugins.gates.outputs import clear_outputs, write_text_atomic
from rlix_plugins.gates.roll_sequence import RollRun, RollSequencePipeline, RollSpec
from rlix_plugins.gates.timeline import Interval, intervals_from_trace

logger = logging.getLogger(__name__)

NUM_GPUS = 2
#: seconds a phase waits for its pipelines' step loops (each pipeline, and the ROLL thread)
PHASE_TIMEOUT_S = 1800.0
#: subdirectory of the output with the observation records (``shared/``, ``exclusive/``)
OBSERVE_SUBDIR = "observe"


@dataclass(frozen=True, slots=True)
class RehearsalConfig:
    """What to run. ``batch``/``max_tokens``: requests per step and tokens per request."""

    gate: int
    steps: int
    out_dir: Path
    batch: int = 32
    max_tokens: int = 192
    exclusive: bool = True

    def __post_init__(self) -> None:
        if self.gate not in (1, 2, 3):
            raise ValueError(f"gate must be 1, 2 or 3, got {self.gate}")
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")


@dataclass(slots=True)
class PhaseResult:
    """One phase (shared or exclusive) of a rehearsal."""

    mode: str
    nemo: list[PipelineRun] = field(default_factory=list)
    roll: list[RollRun] = field(default_factory=list)
    coordinator: list[Interval] = field(default_factory=list)
    #: from ``get_status()`` after the phase: pipelines declared dead (fenced) and still queued
    dead: list[str] = field(default_factory=list)
    waiting: int = 0
    #: the coordinator's wire log of this phase's pipelines (shared phase only)
    wire: dict[str, PipelineWire] = field(default_factory=dict)
    start: float = 0.0
    end: float = 0.0

    @property
    def busy(self) -> list[Interval]:
        return [iv for r in self.nemo for iv in r.busy] + [iv for r in self.roll for iv in r.busy]


@dataclass(frozen=True, slots=True)
class RehearsalOutcome:
    """A finished rehearsal: the verdict and where its files are."""

    result: GateResult
    report_path: Path
    timeline_path: Path
    plot_path: Path | None


def _nemo_specs(gate: int, model_dir: Path, cfg: RehearsalConfig) -> list[PipelineSpec]:
    def spec(label: str, train: int, seed: int) -> PipelineSpec:
        # Shard r lives on GPU r and its EngineCore is pinned to core r.
        return PipelineSpec(label, (0, 1), (train,), ("0", "1"), str(model_dir), seed=seed,
                            batch=cfg.batch, max_tokens=cfg.max_tokens,
                            observe_dir=str(cfg.out_dir / OBSERVE_SUBDIR))

    if gate == 2:
        return [spec("nemo-a", 0, 1), spec("nemo-b", 1, 2)]
    return [spec("nemo-a", 0, 1)]


def _roll_spec(cfg: RehearsalConfig, exclusive: bool) -> RollSpec:
    # Exclusive allocation: dedicated GPUs per stage (train 0, generation 1).
    if exclusive:
        return RollSpec("roll", train_gpus=(0,), infer_gpus=(1,), target=cfg.batch * 2)
    return RollSpec("roll", train_gpus=(1,), infer_gpus=(0, 1), target=cfg.batch * 2)


class _Rehearsal:
    def __init__(self, cfg: RehearsalConfig) -> None:
        import ray

        from rlix_plugins.coordinator.core.model import Topology
        from rlix_plugins.coordinator.service.client import connect
        from rlix_plugins.coordinator.service.config import ServiceConfig

        self.cfg = cfg
        self.out = cfg.out_dir
        self.out.mkdir(parents=True, exist_ok=True)
        self.ray = ray
        self.namespace = f"rlix_gate{cfg.gate}_{uuid.uuid4().hex[:8]}"
        self.service = ServiceConfig(
            namespace=self.namespace, topology=Topology(1, NUM_GPUS),
            trace_dir=str(self.out), request_timeout_s=600.0, resize_timeout_s=180.0,
            lease_s=30.0, tick_s=0.2, liveness_interval_s=1.0, probe_timeout_s=10.0,
        )
        self.plane = connect(namespace=self.namespace, config=self.service)
        self.actors: list[tuple[str, Any]] = []
        #: every ROLL-sequence pipeline started (stopped by close() whatever happened)
        self.rolls: list[RollSequencePipeline] = []
        self.rlix_types: Any = None

    # ------------------------------------------------------------------ pipelines
    def start_nemo(self, specs: Sequence[PipelineSpec]) -> None:
        from rlix_plugins.adapters.pipeline_coordinator import start_pipeline_coordinator
        from rlix_plugins.gates.nemo_rehearsal import RehearsalPipeline, RuntimeFactory

        ray = self.ray
        pending = []
        for spec in specs:
            pid: str = ray.get(self.plane.orchestrator.allocate_pipeline_id.remote("ft"))
            actor = start_pipeline_coordinator(
                pid, RuntimeFactory(spec), control_namespace=self.namespace,
                cls=RehearsalPipeline, max_concurrency=16,
            )
            pending.append((pid, spec, actor))
        for pid, spec, actor in pending:
            ray.get(actor.ready.remote(), timeout=900)  # engines started, v0 cached
            self.actors.append((pid, actor))
            logger.info("%s (%s) ready", spec.label, pid)

    def register_nemo(self, specs: Sequence[PipelineSpec]) -> None:
        from rlix_plugins.protocol.names import ACTOR_INFER, ACTOR_TRAIN, pipeline_namespace

        ray = self.ray
        for (pid, _), spec in zip(self.actors, specs, strict=True):
            ray.get(self.plane.orchestrator.register_pipeline.remote(
                pipeline_id=pid, ray_namespace=pipeline_namespace(pid),
                cluster_tp_configs={ACTOR_TRAIN: 1, ACTOR_INFER: 1},
                cluster_device_mappings={ACTOR_TRAIN: list(spec.train_gpus),
                                         ACTOR_INFER: list(spec.infer_gpus)},
            ))
            ray.get(self.plane.orchestrator.admit_pipeline.remote(pipeline_id=pid))

    def unregister_nemo(self) -> None:
        for pid, actor in self.actors:
            with contextlib.suppress(Exception):
                self.ray.get(self.plane.orchestrator.unregister_pipeline.remote(pid), timeout=60)
            # Unregistered first: a lapsing lease must not fence (kill) the actor.
            self.ray.get(actor.close_hooks.remote(), timeout=60)

    def roll_types(self) -> Any:
        if self.rlix_types is None:
            from rlix_plugins.gates.roll_sequence import provide_rlix_types

            self.rlix_types = provide_rlix_types(self.out / "_rlix_types")
        return self.rlix_types

    # ------------------------------------------------------------------ phases
    def shared_phase(self, specs: Sequence[PipelineSpec]) -> PhaseResult:
        from rlix_plugins.gates.roll_sequence import RollSequencePipeline

        ray = self.ray
        phase = PhaseResult("shared", start=time.time())
        refs = [actor.run_steps.remote(self.cfg.steps, "shared") for _, actor in self.actors]
        roll_runs: list[RollRun] = []
        roll_thread = None
        roll: RollSequencePipeline | None = None
        if self.cfg.gate == 3:
            roll = RollSequencePipeline(self.plane, _roll_spec(self.cfg, False),
                                        self.roll_types())
            self.rolls.append(roll)
            roll.setup()
            roll_thread = threading.Thread(
                target=lambda: roll_runs.append(roll.run(self.cfg.steps, "shared")),
                name="roll-sequence", daemon=True)
            roll_thread.start()
        phase.nemo = list(ray.get(refs, timeout=PHASE_TIMEOUT_S))
        if roll_thread is not None and roll is not None:
            roll_thread.join(timeout=PHASE_TIMEOUT_S)
            if not roll_runs:
                # Still running (or died without a record): a failed run, never a missing one
                # (``steps`` would judge the NeMo RL pipelines alone).
                roll_runs.append(RollRun(
                    roll.pipeline_id, roll.spec.label, "shared", self.cfg.steps,
                    start=phase.start, end=time.time(),
                    error=f"the ROLL run did not finish within {PHASE_TIMEOUT_S:.0f}s"))
            phase.roll = [roll.collect(r) for r in roll_runs]
        phase.end = time.time()
        trace = ray.get(self.plane.scheduler.get_trace.remote())
        intervals, _ = intervals_from_trace(trace)
        phase.coordinator = intervals
        status = ray.get(self.plane.scheduler.get_status.remote())
        phase.dead = [f"{d.pipeline_id}: {d.reason}" for d in status.dead_pipelines]
        # A GENERATION request may legitimately still wait (asked for a step whose batch was
        # already generated, it has no demand left); anything else waiting is a stuck stage.
        phase.waiting = sum(1 for w in status.wait_queue if w.priority != "GENERATION")
        # This run's pipelines only: the coordinator may have served earlier runs.
        ours = {pid for pid, _ in self.actors} | {r.pipeline_id for r in phase.roll}
        wire = ray.get(self.plane.scheduler.get_wire_log.remote())
        phase.wire = {pid: w for pid, w in wire.items() if pid in ours}
        return phase

    def exclusive_phase(self) -> PhaseResult:
        from rlix_plugins.gates.roll_sequence import RollSequencePipeline

        phase = PhaseResult("exclusive", start=time.time())
        for _, actor in self.actors:
            phase.nemo.append(self.ray.get(actor.run_steps.remote(self.cfg.steps, "exclusive"),
                                           timeout=PHASE_TIMEOUT_S))
        if self.cfg.gate == 3:
            # Alone on the coordinator with disjoint stage GPUs: nothing to share.
            roll = RollSequencePipeline(self.plane, _roll_spec(self.cfg, True),
                                        self.roll_types())
            self.rolls.append(roll)
            phase.roll = [roll.collect(roll.run(self.cfg.steps, "exclusive"))]
        phase.end = time.time()
        return phase

    def close(self) -> None:
        from rlix_plugins.coordinator.service.client import stop_coordinator

        for _, actor in self.actors:
            try:
                self.ray.get(actor.shutdown.remote(), timeout=120)
            except Exception:
                logger.exception("pipeline shutdown failed")
            with contextlib.suppress(Exception):
                self.ray.kill(actor, no_restart=True)
        for roll in self.rolls:  # a failed phase never collected its ROLL pipeline
            try:
                roll.close()
            except Exception:
                logger.exception("ROLL pipeline %s: stopping it failed", roll.pipeline_id)
        with contextlib.suppress(Exception):
            self.ray.get(self.plane.scheduler.flush_trace.remote(), timeout=30)
        stop_coordinator(self.namespace)


# ---------------------------------------------------------------------------- criteria


def _gate_specific(gate: int, shared: PhaseResult, steps: int) -> list[CriterionResult]:
    out: list[CriterionResult] = []
    a = shared.nemo[0]
    if gate == 1:
        # The overlap shard goes down for a train step when it is active then; it comes back
        # (wake + sync + activate) after a step whose next batch still had demand. Whether it
        # is active again before the next train step depends on timing (the next batch may
        # complete on the other shard first), so the cycle must happen, and every preemption
        # but the last (the run may end before the shard is needed again) must be followed by
        # a wake of that shard. The first wake (at the start) is no re-activation.
        ok = (a.overlap_preemptions >= 1 and a.overlap_reactivations >= 1
              and a.overlap_reactivations >= a.overlap_preemptions - 1
              and a.nccl_cycles == steps)
        out.append(CriterionResult(
            "overlap_cycle",
            "overlap shard preempted (abort/drain/sleep) for a train step and woken+synced+"
            "activated again after it (>= 1 cycle; every preemption but the last followed by "
            "a wake); NCCL groups destroyed and re-initialised once per step",
            f"overlap shard: {a.overlap_preemptions} preemptions, "
            f"{a.overlap_reactivations} of them followed by wake+sync+activate "
            f"({a.overlap_expands} wakes in all); {a.nccl_cycles} NCCL destroy/re-init "
            f"cycles; {a.forced_sleeps} forced sleeps; over {steps} steps", ok))
    else:
        out.append(time_sharing(shared.coordinator, gate))
    if gate == 3:
        # What the coordinator received from the ROLL stand-in (its priorities come straight
        # in RLix's classes; its reports through our pipeline coordinator, so the class they
        # were built from is the sender's word).
        roll = shared.roll[0] if shared.roll else None
        out.append(roll_protocol(shared.wire, steps=steps,
                                 sender_module=roll.report_module if roll else ""))
    return out


def evaluate(gate: int, steps: int, shared: PhaseResult,
             exclusive: PhaseResult | None,
             observe_dir: Path | None = None) -> tuple[GateResult, dict[str, Any]]:
    """The gate's criteria from the two phases; also the figures for the report.

    With ``observe_dir``, the NeMo RL-like pipelines' observation records are judged too,
    by the GPU mode's code (``weights_observed``, ``requests_observed``).
    """
    criteria = [
        no_double_ownership("ownership_coordinator", shared.coordinator,
                            source="the coordinator's GPU trace"),
        no_double_ownership("ownership_busy_log", shared.busy,
                            source="the rehearsal's own busy log"),
    ]
    criteria.append(CriterionResult(
        "coordinator_status",
        "no pipeline fenced or declared dead; no training request left waiting",
        f"dead: {shared.dead or 'none'}; non-generation requests waiting after the run: "
        f"{shared.waiting}",
        not shared.dead and shared.waiting == 0))
    phases = [shared] + ([exclusive] if exclusive else [])
    every: list[tuple[str, PipelineRun | RollRun]] = [
        (p.mode, r) for p in phases for r in _runs(p)]
    runs = [RunCount(f"{mode}/{r.label}", r.steps_done, r.steps_target, r.error)
            for mode, r in every]
    criteria.append(steps_completed(runs))
    checks = [dataclasses.replace(c, label=f"{p.mode}/{r.label}")
              for p in phases for r in p.nemo for c in r.sync_checks]
    criteria.append(weights_current(checks))
    counts = [RequestCount(f"{p.mode}/{r.label}", a.submitted, a.completed, a.duplicates,
                           a.lost, a.aborted_returned, a.short_samples, a.redispatched,
                           a.router_requests, a.router_completed)
              for p in phases for r in p.nemo if (a := r.audit) is not None]
    criteria.append(requests_accounted(counts))
    if observe_dir is not None:
        criteria.extend(observed_criteria(
            [(p.mode, observe_dir / p.mode) for p in phases],
            expected_pipelines=len(shared.nemo),
            names=("weights_observed", "requests_observed")))
        criteria.append(ownership_from_records(observe_dir / shared.mode,
                                               expected_pipelines=len(shared.nemo)))
        if gate == 1:
            # GPU mode's gate-1 check, on this run's records (the same code in CI).
            criteria.append(overlap_from_records(observe_dir / shared.mode, steps=steps,
                                                 expected_pipelines=len(shared.nemo),
                                                 name="overlap_cycle_observed"))
    shared_idle = measure_idle(shared.busy, NUM_GPUS, shared.start, shared.end)
    figures: dict[str, Any] = {"shared": dataclasses.asdict(shared_idle)}
    if exclusive is not None:
        excl_idle = measure_idle(exclusive.busy, NUM_GPUS, exclusive.start, exclusive.end)
        figures["exclusive"] = dataclasses.asdict(excl_idle)
        criteria.append(idle_below_exclusive(shared_idle, excl_idle))
    else:
        criteria.append(idle_below_exclusive(shared_idle, IdleShare(0.0, 0.0, NUM_GPUS)))
    criteria.extend(_gate_specific(gate, shared, steps))
    return GateResult(gate, "cpu", tuple(criteria)), figures


# ---------------------------------------------------------------------------- outputs


def _runs(phase: PhaseResult) -> list[PipelineRun | RollRun]:
    return [*phase.nemo, *phase.roll]


def _run_record(run: PipelineRun | RollRun) -> dict[str, Any]:
    rec = dataclasses.asdict(run)
    rec["busy"] = len(run.busy)
    if isinstance(run, PipelineRun):
        rec["sync_checks"] = len(run.sync_checks)
    return rec


def write_outputs(cfg: RehearsalConfig, result: GateResult, figures: dict[str, Any],
                  shared: PhaseResult, exclusive: PhaseResult | None) -> RehearsalOutcome:
    from rlix_plugins.gates.plots import plot_ownership
    from rlix_plugins.gates.timeline import to_chrome_trace

    out = cfg.out_dir
    t0 = min([shared.start] + [iv.start for iv in shared.coordinator])
    tracks: dict[str, Sequence[Interval]] = {
        "coordinator GPU ownership": shared.coordinator,
        "rehearsal busy (shared)": shared.busy,
    }
    if exclusive is not None:
        tracks["rehearsal busy (exclusive)"] = exclusive.busy
    timeline = to_chrome_trace(tracks, t0=t0, num_gpus=NUM_GPUS)
    timeline_path = out / f"gate{cfg.gate}_timeline.json"
    write_text_atomic(timeline_path, json.dumps(timeline))
    plot_path: Path | None = out / f"gate{cfg.gate}_gpu_ownership.png"
    try:
        assert plot_path is not None
        plot_ownership(plot_path, shared, exclusive, num_gpus=NUM_GPUS,
                       title=f"gate {cfg.gate} (cpu rehearsal)")
    except ImportError:
        logger.warning("matplotlib not installed; no PNG written")
        plot_path = None
    report = {
        "gate": cfg.gate,
        "mode": "cpu",
        "passed": result.passed,
        "steps": cfg.steps,
        "criteria": [dataclasses.asdict(c) for c in result.criteria],
        "figures": figures,
        "phases": {
            p.mode: {"start": p.start, "end": p.end, "duration_s": p.end - p.start,
                     "pipelines": [_run_record(r) for r in _runs(p)],
                     "wire": {pid: dataclasses.asdict(w) for pid, w in p.wire.items()}}
            for p in ([shared] + ([exclusive] if exclusive else []))
        },
        "files": {"timeline": timeline_path.name,
                  "plot": plot_path.name if plot_path else None,
                  "coordinator_trace": "rlix_gpu_timeline_*.json"},
    }
    report_path = out / f"gate{cfg.gate}_report.json"
    write_text_atomic(report_path, json.dumps(report, indent=2, default=str))
    return RehearsalOutcome(result, report_path, timeline_path, plot_path)


def run_cpu_gate(cfg: RehearsalConfig) -> RehearsalOutcome:
    """Run one rehearsal end to end (Ray must be initialised with >= 2 logical GPUs)."""
    from rlix_plugins.generation.tiny_engine import write_tiny_llama

    model_dir = write_tiny_llama(cfg.out_dir / "tiny_llama")
    # An earlier run's report must not stand for this run should it crash before writing its own.
    clear_outputs(cfg.out_dir, cfg.gate)
    observe = cfg.out_dir / OBSERVE_SUBDIR
    if observe.exists():
        import shutil

        shutil.rmtree(observe)  # an earlier run's records must not be judged as this one's
    specs = _nemo_specs(cfg.gate, model_dir, cfg)
    reh = _Rehearsal(cfg)
    try:
        reh.start_nemo(specs)
        reh.register_nemo(specs)
        shared = reh.shared_phase(specs)
        reh.unregister_nemo()
        exclusive = reh.exclusive_phase() if cfg.exclusive else None
    finally:
        reh.close()
    result, figures = evaluate(cfg.gate, cfg.steps, shared, exclusive,
                               observe_dir=cfg.out_dir / OBSERVE_SUBDIR)
    return write_outputs(cfg, result, figures, shared, exclusive)
