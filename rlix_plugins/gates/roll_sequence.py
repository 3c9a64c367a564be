"""A pipeline that makes exactly ROLL's call sequence (``shared/protocol.md``), for gate 3.

ROLL itself is not installable here, so its GPU work is SIMULATED: the generation shards are
:class:`SimulatedRollShards` (a rank "generates" while active, at a fixed rate of trajectories
per tick; its busy time is the time it is active) and "training" sleeps. Everything it says to
the coordinator is real and in ROLL's order: ``allocate_pipeline_id`` -> start
``rlix:coordinator:{id}`` -> ``register_pipeline`` -> ``admit_pipeline``; init per cluster
(``request_gpus(INITIALIZATION)`` -> release); per step ``await_release_gpus(actor_infer)`` ->
``notify_release_then_request_gpus(release actor_train, request actor_infer GENERATION)`` ->
progress through its own coordinator's ``report_progress_from_scheduler`` -> ``request_gpus``
OLD_LOG_PROBS then ACTOR_TRAINING -> keep actor_train until the next step's release.

The progress reports and priorities it sends are RLix's OWN classes from the module path
``rlix.protocol.types`` (:func:`provide_rlix_types` writes a stand-in of that module into a
directory the gate puts on ``sys.path``; it is never part of the package's import path).
"""

from __future__ import annotations

import importlib
import sys
import textwrap
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlix_plugins.adapters.pipeline_coordinator import PipelineCoordinator
from rlix_plugins.gates.timeline import Interval, RunRecord
from rlix_plugins.protocol.names import ACTOR_INFER, ACTOR_TRAIN, cluster_id, pipeline_namespace

#: Source of RLix's ``rlix/protocol/types.py`` wire classes (same names, fields and values as
#: protocol.md). RLix is not installable from an index, so the gate writes this stand-in.
RLIX_TYPES_SOURCE = textwrap.dedent('''
    """Stand-in for RLix's rlix.protocol.types (written by the rlix-plugins gate)."""
    import enum
    from dataclasses import dataclass
    from typing import Any, Dict, Optional


    class Priority(enum.IntEnum):
        INITIALIZATION = 0
        ACTOR_TRAINING = 1
        CRITIC_TRAINING = 2
        OLD_LOG_PROBS = 3
        REF_LOG_PROBS = 4
        VALUE_COMPUTE = 5
        GENERATION = 6


    @dataclass(frozen=True)
    class ProgressReport:
        pipeline_id: str
        step_target_trajectories: int
        fifo_timestamp: Optional[float] = None
        metrics: Optional[Dict[str, Any]] = None


    @dataclass(frozen=True)
    class ActionResponse:
        success: bool
        error: Optional[str] = None
''')


def provide_rlix_types(directory: Path) -> Any:
    """Write ``rlix/protocol/types.py`` under ``directory``, put it first on ``sys.path`` and
    return the imported module (its classes pickle by reference as ``rlix.protocol.types``)."""
    pkg = directory / "rlix" / "protocol"
    pkg.mkdir(parents=True, exist_ok=True)
    (directory / "rlix" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "types.py").write_text(RLIX_TYPES_SOURCE)
    # A stand-in installed earlier by rlix_compat (or another gate) must not shadow this one.
    for name in [m for m in sys.modules if m == "rlix" or m.startswith("rlix.")]:
        del sys.modules[name]
    if str(directory) not in sys.path:
        sys.path.insert(0, str(directory))
    importlib.invalidate_caches()
    return importlib.import_module("rlix.protocol.types")


class SimulatedRollShards:
    """ShardController of the ROLL pipeline's generation ranks (SIMULATED, see module doc).

    A rank is busy from its expand to its shrink; both are idempotent per rank.
    """

    def __init__(self, pipeline_id: str, infer_gpus: Sequence[int]) -> None:
        self.owner = cluster_id(pipeline_id, ACTOR_INFER)
        self.gpus = list(infer_gpus)
        self.active: dict[int, float] = {}
        self.busy: list[Interval] = []
        self._lock = threading.Lock()

    def shrink(self, dp_ranks: Sequence[int]) -> None:
        with self._lock:
            now = time.time()
            for r in dp_ranks:
                since = self.active.pop(r, None)
                if since is not None:
                    self.busy.append(Interval(self.gpus[r], self.owner, "generation", since, now))

    def expand(self, dp_ranks: Sequence[int]) -> None:
        with self._lock:
            now = time.time()
            for r in dp_ranks:
                self.active.setdefault(r, now)

    def close_open(self) -> None:
        self.shrink(list(self.active))


@dataclass(frozen=True, slots=True)
class RollShardFactory:
    """Builds the simulated shards in the coordinator actor's process."""

    infer_gpus: tuple[int, ...]

    def __call__(self, pipeline_id: str) -> SimulatedRollShards:
        return SimulatedRollShards(pipeline_id, self.infer_gpus)


class RollRehearsalCoordinator(PipelineCoordinator):
    """The ROLL pipeline's ``rlix:coordinator:{id}`` with a read-out of its shards' busy log."""

    def busy(self) -> list[Interval]:
        assert isinstance(self.shards, SimulatedRollShards)
        self.shards.close_open()
        return list(self.shards.busy)


@dataclass(frozen=True, slots=True)
class RollSpec:
    """Timing of the simulated ROLL pipeline."""

    label: str
    train_gpus: tuple[int, ...]
    infer_gpus: tuple[int, ...]
    target: int = 48
    per_rank_per_tick: int = 2
    tick_s: float = 0.05
    train_s: float = 0.6


@dataclass(slots=True)
class RollRun(RunRecord):
    """What the ROLL-sequence pipeline did."""
    reports_sent: int = 0
    report_module: str = ""


class RollSequencePipeline:
    """Registers a pipeline and runs ROLL's per-step call sequence against the coordinator."""

    def __init__(self, plane: Any, spec: RollSpec, rlix_types: Any, *,
                 timeout_s: float = 300.0) -> None:
        import ray

        self.plane = plane
        self.spec = spec
        self.types = rlix_types
        self.timeout_s = timeout_s
        self.pipeline_id: str = ray.get(plane.orchestrator.allocate_pipeline_id.remote("ft"))
        self.train_cluster = cluster_id(self.pipeline_id, ACTOR_TRAIN)
        self.infer_cluster = cluster_id(self.pipeline_id, ACTOR_INFER)
        self.coordinator: Any = None
        self.scheduler: Any = None
        self._train_busy: list[Interval] = []
        self._gen_windows: list[tuple[float, float]] = []

    def _get(self, ref: Any) -> Any:
        import ray

        return ray.get(ref, timeout=self.timeout_s)

    def setup(self) -> None:
        from rlix_plugins.adapters.pipeline_coordinator import start_pipeline_coordinator

        self.coordinator = start_pipeline_coordinator(
            self.pipeline_id, RollShardFactory(self.spec.infer_gpus),
            control_namespace=self.plane.namespace, cls=RollRehearsalCoordinator,
        )
        self._get(self.coordinator.__ray_ready__.remote())
        self._get(self.plane.orchestrator.register_pipeline.remote(
            pipeline_id=self.pipeline_id,
            ray_namespace=pipeline_namespace(self.pipeline_id),
            cluster_tp_configs={ACTOR_TRAIN: 1, ACTOR_INFER: 1},
            cluster_device_mappings={ACTOR_TRAIN: list(self.spec.train_gpus),
                                     ACTOR_INFER: list(self.spec.infer_gpus)},
        ))
        admitted = self._get(
            self.plane.orchestrator.admit_pipeline.remote(pipeline_id=self.pipeline_id))
        self.scheduler = admitted.scheduler

    def _work(self, seconds: float) -> None:
        t0 = time.time()
        time.sleep(seconds)  # simulated GPU work on the training GPUs
        for g in self.spec.train_gpus:
            self._train_busy.append(Interval(g, self.train_cluster, "train", t0, time.time()))

    def _report(self, completed: int, step: int, new_batch: bool, run: RollRun) -> None:
        target = self.spec.target
        report = self.types.ProgressReport(
            pipeline_id=self.pipeline_id, step_target_trajectories=target,
            fifo_timestamp=time.time(),
            metrics={"mode": "train", "completed": min(completed, target),
                     "bucket": min(50, completed * 50 // target), "new_batch": new_batch,
                     "current_train_step": step, "adapter_id": None},
        )
        run.report_module = type(report).__module__
        self._get(self.coordinator.report_progress_from_scheduler.remote(report))
        run.reports_sent += 1

    def _generate(self, step: int, run: RollRun) -> None:
        t0 = time.time()
        try:
            self._generate_batch(step, run)
        finally:
            self._gen_windows.append((t0, time.time()))

    def _generate_batch(self, step: int, run: RollRun) -> None:
        completed = 0
        self._report(0, step, True, run)
        deadline = time.monotonic() + self.timeout_s
        while completed < self.spec.target:
            active = self._get(self.coordinator.active_ranks.remote())
            completed += len(active) * self.spec.per_rank_per_tick
            self._report(completed, step, False, run)
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.pipeline_id}: generation of step {step} stalled")
            time.sleep(self.spec.tick_s)  # simulated decode time
        self._get(self.coordinator.clear_progress_stream.remote(mode="train", adapter_id=None))

    def run(self, steps: int, mode: str = "shared") -> RollRun:
        """Init, ``steps`` steps, release everything, unregister. Errors end the run."""
        prio = self.types.Priority
        run = RollRun(self.pipeline_id, self.spec.label, mode, steps, start=time.time())
        try:
            if self.scheduler is None:
                self.setup()
            sched = self.scheduler
            for cid in (self.train_cluster, self.infer_cluster):
                self._get(sched.request_gpus.remote(cluster_id=cid,
                                                    priority=prio.INITIALIZATION,
                                                    global_step=None))
                if cid == self.train_cluster:
                    self._work(self.spec.train_s / 4)  # load + build the CPU cache
                self._get(sched.notify_release_gpus.remote(cluster_id=cid, global_step=None))
            for step in range(steps):
                if step > 0:
                    self._get(sched.await_release_gpus.remote(cluster_id=self.infer_cluster,
                                                              global_step=step))
                gpus = self._get(sched.notify_release_then_request_gpus.remote(
                    release_cluster_id=self.train_cluster, release_global_step=step,
                    request_cluster_id=self.infer_cluster, request_priority=prio.GENERATION,
                    request_global_step=step, request_step_target_estimate=self.spec.target,
                ))
                if not gpus:
                    raise RuntimeError("a GENERATION grant must carry at least one rank's GPUs")
                self._generate(step, run)
                self._get(sched.request_gpus.remote(cluster_id=self.train_cluster,
                                                    priority=prio.OLD_LOG_PROBS,
                                                    global_step=step))
                self._work(self.spec.train_s / 3)
                self._get(sched.request_gpus.remote(cluster_id=self.train_cluster,
                                                    priority=prio.ACTOR_TRAINING,
                                                    global_step=step))
                self._work(self.spec.train_s)  # train, then cache version `step`
                run.steps_done = step + 1
            self._get(sched.notify_release_gpus.remote(cluster_id=self.train_cluster,
                                                       global_step=None))
            self._get(sched.await_release_gpus.remote(cluster_id=self.infer_cluster))
        except Exception as exc:
            run.error = f"{type(exc).__name__}: {exc}"
        run.end = time.time()
        return run

    def collect(self, run: RollRun) -> RollRun:
        """Fetch the shards' busy log, unregister, and stop the coordinator actor."""
        if self.coordinator is not None:
            # A rank counts as busy while active AND its pipeline is generating (an active rank
            # of a pipeline that is training or waiting does no simulated work).
            held: list[Interval] = list(self._get(self.coordinator.busy.remote()))
            gen = [Interval(iv.gpu, iv.owner, iv.stage, max(iv.start, s), min(iv.end, e))
                   for iv in held for s, e in self._gen_windows
                   if min(iv.end, e) > max(iv.start, s)]
            run.busy = list(self._train_busy) + gen
            self.close()
        return run

    def close(self) -> None:
        """Unregister the pipeline and kill its coordinator actor (idempotent; also after a
        failed or unfinished run, whose actor must not outlive the gate)."""
        import ray

        actor, self.coordinator = self.coordinator, None
        if actor is None:
            return
        try:
            self._get(self.plane.orchestrator.unregister_pipeline.remote(self.pipeline_id))
        finally:
            ray.kill(actor, no_restart=True)
