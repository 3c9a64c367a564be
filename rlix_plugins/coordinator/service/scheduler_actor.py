"""The scheduler actor, ``rlix:scheduler``: RLix's scheduler calls on top of the pure core.

Concurrency model (one asyncio event loop, never blocked by ``ray.get``):

* Event handlers (``request_gpus``, releases, progress, registration) validate and mutate the
  core state synchronously, with no ``await`` between check and mutation, so each is atomic on
  the loop. The core allows such events between a plan and its commit (they only free GPUs).
* One cycle task runs scheduling cycles one at a time: plan under ``_lock`` -> persist the
  in-flight intent -> ``resize_infer`` RPCs to pipeline coordinators OUTSIDE the lock, shrinks
  (all) before expands, each bounded by ``resize_timeout_s`` -> commit under ``_lock`` ->
  persist -> wake waiters. Cycles are triggered by events and by a periodic tick (aging).
* With ``background_expands`` a cycle commits once its shrinks are done: its expanded ranks are
  owned at once (``warming`` in the core) and each cluster's expand RPC runs in a background
  task, one at a time per cluster (a later shrink of that cluster waits for it), so one slow
  wake + sync does not hold every other pipeline's grants. A generation request answered by
  such an expand is answered when the cluster has a rank that serves.
* One liveness task probes pipeline coordinator actors and checks heartbeat leases.

Failure handling (unlike RLix, nothing here ever shuts Ray down): a pipeline whose actor died,
whose lease expired or whose resize failed is fenced (its waiters get
:class:`PipelineFailedError`, its actors are killed) and, once Ray confirms it dead, unregistered
so its GPUs return to the pool. A GPU whose shrink failed is never handed on before that.

The ``resize_infer`` calls to pipeline coordinator actors are :mod:`.resizer`'s, the GPU
timeline and metrics are :mod:`.observer`'s, the waiting callers are kept by :mod:`.waiters`, and
saving the state (holding back answers a restart would not restore) is :mod:`.durability`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import logging
import time
from collections import OrderedDict
from collections.abc import Collection, Iterable
from pathlib import Path
from typing import Any

from rlix_plugins.coordinator.core import (
    CommitResult,
    DemandSharePlanner,
    ImmediateGrant,
    InvariantViolation,
    Plan,
    RankMove,
    SchedulerState,
    Topology,
    check_plan,
    check_state,
    validate_registration,
)
from rlix_plugins.coordinator.core.snapshot import restore, settle_inflight, snapshot
from rlix_plugins.coordinator.core.status import CoordinatorStatus, DeadPipeline, build_status
from rlix_plugins.coordinator.service import rlix_compat
from rlix_plugins.coordinator.service.config import ServiceConfig
from rlix_plugins.coordinator.service.durability import Durability
from rlix_plugins.coordinator.service.liveness import Liveness, kill_pipeline_actors, probe
from rlix_plugins.coordinator.service.observer import Observer
from rlix_plugins.coordinator.service.persistence import FileStateStore, KvStateStore, StateStore
from rlix_plugins.coordinator.service.resizer import Resizer
from rlix_plugins.coordinator.service.resource_manager import topology_from_ray
from rlix_plugins.coordinator.service.saved_record import (
    InflightIntent,
    SavedRecord,
    write_record,
)
from rlix_plugins.coordinator.service.waiters import Waiters
from rlix_plugins.coordinator.service.wire_log import PipelineWire, WireLog, on_wire
from rlix_plugins.errors import (
    CoordinatorUnavailableError,
    CorruptStateError,
    PipelineFailedError,
    ProtocolError,
    RegistrationError,
    RequestTimeoutError,
    RunOverError,
    UnknownPipelineError,
)
from rlix_plugins.protocol.names import (
    GENERATION_CLUSTER,
    cluster_id,
    parse_cluster_id,
    validate_pipeline_id,
)
from rlix_plugins.protocol.types import Priority, coerce_priority, coerce_progress_report
from rlix_plugins.values import is_finite

logger = logging.getLogger(__name__)

#: Dead (and unregistered) pipelines remembered for status and for answering late calls.
_DEAD_KEPT = 256


class SchedulerService:
    """Undecorated implementation; :mod:`.client` serves it as a detached async Ray actor."""

    def __init__(self, config: ServiceConfig | None = None) -> None:
        self.cfg = config or ServiceConfig()
        # ROLL sends RLix's classes pickled by reference; make them loadable here.
        rlix_compat.install()
        self._planner = DemandSharePlanner(self.cfg.policy)
        self._store: StateStore = (
            FileStateStore(Path(self.cfg.state_file))
            if self.cfg.state_file
            else KvStateStore(self.cfg.namespace)
        )
        self._durable = Durability(
            self._store,
            self._record,
            namespace=self.cfg.namespace,
            timeout_s=self.cfg.request_timeout_s,
        )
        self._lock = asyncio.Lock()
        #: what each pipeline sent over the protocol (gate 3 judges ROLL's calls from it);
        #: failed calls also go to the metrics (the observer exists by the first call)
        self.wire_log = WireLog(on_failure=lambda m, e: self._observer.call_failed(m, e))
        self._waiters = Waiters()
        self._handles: dict[str, Any] = {}
        self._seen: set[str] = set()
        self._beats: dict[str, float] = {}
        self._fencing: dict[str, str] = {}
        self._dead: OrderedDict[str, DeadPipeline] = OrderedDict()
        #: GPUs each recent unregistration freed, so a retried ``unregister_pipeline`` (its
        #: caller told the save failed, or its reply lost) gets the first call's answer
        self._unregistered: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._inflight: InflightIntent | None = None
        self._side_tasks: set[asyncio.Task[None]] = set()
        #: background expands: the last expand task of each cluster (they run in order)
        self._expand_tails: dict[str, asyncio.Task[None]] = {}
        self._stopping = False
        self._wake = asyncio.Event()
        self._liveness_wake = asyncio.Event()
        self._state = self._load()
        # Built after _load, which replaces the fencing map and the seen set it shares.
        self._resizer = Resizer(
            self._state,
            fencing=self._fencing,
            handles=self._handles,
            seen=self._seen,
            expand_tails=self._expand_tails,
            fence=self._fence,
            persist=self._durable.save,
            resize_timeout_s=self.cfg.resize_timeout_s,
        )
        self._observer = Observer(
            self._state.topology.num_gpus,
            namespace=self.cfg.namespace,
            t0=time.time(),
            trace_dir=self.cfg.trace_dir,
            metrics=self.cfg.metrics,
            keep_task=self._keep_task,
        )
        self._observer.observe(self._state, time.time())
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._cycle_loop()),
            loop.create_task(self._liveness_loop()),
        ]
        self._wake.set()
        for cid, ranks in _by_cluster(self._state.warming).items():
            # Background expands in flight at a crash: their answers are lost, so send them
            # again (idempotent per rank; the pipeline runs one resize at a time).
            self._start_expand(cid, ranks)
        for pid, _reason in list(self._fencing.items()):
            # Fenced before a crash: the kill may not have happened; make sure it does.
            spec = self._state.pipelines[pid]
            self._keep_task(loop.create_task(self._kill_then_probe(pid, spec.ray_namespace)))

    # ================================================================== recovery
    def _load(self) -> SchedulerState:
        """Restore the last persisted state, settling a plan that was in flight."""
        record = self._store.load()
        now = time.time()
        if record is None:
            topo = self.cfg.topology or topology_from_ray()
            logger.info("scheduler %s: fresh state, topology %s", self.cfg.namespace, topo)
            return SchedulerState(topo)
        try:
            saved = SavedRecord.read(record)
            state = restore(saved.state, self.cfg.topology)
            if saved.inflight is not None:
                settle_inflight(
                    state,
                    confirmed_shrinks=saved.inflight.confirmed_shrinks,
                    possible_expands=saved.inflight.expands,
                    now=now,
                )
        except CorruptStateError as exc:
            raise CorruptStateError(
                f"scheduler {self.cfg.namespace}: {exc}; start afresh with "
                "`rlix-plugins coordinator stop` (clears the saved state)"
            ) from None
        for d in saved.dead:
            self._dead[d.pipeline_id] = d
        # Unregistrations stay answerable across a restart (Ray retries a call whose answer
        # the crash lost); an id registered again was forgotten before it was saved.
        self._unregistered.update(
            (p, g) for p, g in saved.unregistered.items() if p not in state.pipelines
        )
        self._seen = set(saved.seen) & set(state.pipelines)
        # A lease restarts at recovery: the pipeline had no scheduler to beat against meanwhile.
        self._beats = {p: now for p in saved.leased if p in state.pipelines}
        self._fencing = {p: r for p, r in saved.fencing.items() if p in state.pipelines}
        for pid in self._fencing:
            state.fence(pid)
        logger.warning(
            "scheduler %s: recovered %d pipeline(s), %d GPU(s) owned, revision %d",
            self.cfg.namespace,
            len(state.pipelines),
            sum(o is not None for o in state.owner),
            state.revision,
        )
        # Reconcile with the pipelines at once: dead ones are dropped by the first probe.
        self._liveness_wake.set()
        return state

    def _record(self) -> dict[str, Any]:
        """What a restarted scheduler restores: state, in-flight intent and registry."""
        # After stop() (which may have cleared the store) a late save would bring back a
        # state that no scheduler serves any more.
        self._check_running()
        return write_record(
            state=snapshot(self._state),
            inflight=self._inflight,
            dead=self._dead.values(),
            seen=self._seen,
            leased=self._beats,
            fencing=self._fencing,
            unregistered=self._unregistered,
        )

    # ================================================================== helpers
    def _now(self) -> float:
        return time.time()

    def _check_running(self) -> None:
        if self._stopping:
            raise CoordinatorUnavailableError(
                f"the coordinator in namespace {self.cfg.namespace!r} is stopping or stopped; "
                "connect to a running coordinator (rlix-plugins coordinator start)"
            )

    def _check_alive(self, pipeline_id: str) -> None:
        validate_pipeline_id(pipeline_id)  # a list or dict id is a ProtocolError, not a TypeError
        dead = self._dead.get(pipeline_id)
        if dead is not None:
            raise PipelineFailedError(
                f"pipeline {pipeline_id!r} was declared dead ({dead.reason}); register again "
                "under a new pipeline id"
            )
        reason = self._fencing.get(pipeline_id)
        if reason is not None:
            raise PipelineFailedError(f"pipeline {pipeline_id!r} has failed ({reason})")

    def _resolve_caller(self, cluster: object, pipeline_id: object) -> str:
        """Validate a cluster id and the caller's identity; return the cluster id."""
        if pipeline_id is not None and not isinstance(pipeline_id, str):
            raise ProtocolError(f"pipeline_id must be a str or None, got {pipeline_id!r}")
        owner_pid, _ = parse_cluster_id(cluster)
        assert isinstance(cluster, str)
        self._check_alive(owner_pid)
        self._state.check_owner(cluster, pipeline_id)
        return cluster

    def _kick(self) -> None:
        self._wake.set()

    def _keep_task(self, task: asyncio.Task[None]) -> None:
        """Hold a side task until it ends (the loop holds tasks weakly); stop() cancels it."""
        self._side_tasks.add(task)
        task.add_done_callback(self._side_tasks.discard)

    def _still_releasing(self, cid: str) -> bool:
        """A planned release of ``cid`` still has ranks to shrink (its waiters keep waiting)."""
        return cid in self._state.planned_releases and bool(self._state.active_ranks.get(cid))

    # ================================================================== registry
    @on_wire("register_pipeline")
    async def register_pipeline(
        self,
        *,
        pipeline_id: str,
        ray_namespace: str,
        cluster_tp_configs: dict[str, int],
        cluster_device_mappings: dict[str, list[int]],
        weight: float = 1.0,
    ) -> None:
        """Validate and register a pipeline (RLix keyword signature, plus our ``weight``)."""
        self._check_running()
        spec = validate_registration(
            self._state.topology,
            pipeline_id=pipeline_id,
            ray_namespace=ray_namespace,
            cluster_tp_configs=cluster_tp_configs,
            cluster_device_mappings=cluster_device_mappings,
            weight=weight,
        )
        if self._state.pipelines.get(spec.pipeline_id) == spec:
            # A retry (by Ray after a restart, or by a caller told the save failed): answered
            # once the registration is saved, like the first call.
            await self._durable.until_saved(f"register_pipeline({spec.pipeline_id})")
            return
        if spec.pipeline_id in self._dead:
            raise RegistrationError(
                f"pipeline {spec.pipeline_id!r} was declared dead "
                f"({self._dead[spec.pipeline_id].reason}); register under a new pipeline id"
            )
        self._state.register(spec)
        self._unregistered.pop(spec.pipeline_id, None)
        self._durable.save()
        logger.info("registered %s: %s", spec.pipeline_id, [c.cluster_id for c in spec.clusters])
        await self._durable.until_saved(f"register_pipeline({spec.pipeline_id})")

    @on_wire("admit_pipeline")
    async def admit_pipeline(self, *, pipeline_id: str) -> None:
        """Check the pipeline is registered and alive (the orchestrator hands out our handle)."""
        self._check_running()
        self._check_alive(pipeline_id)
        self._state.pipeline(pipeline_id)

    @on_wire("unregister_pipeline")
    async def unregister_pipeline(self, pipeline_id: str) -> tuple[int, ...]:
        """Forget a pipeline and free its GPUs (the pipeline stopped using them)."""
        self._check_running()
        # A list or dict id is a ProtocolError, not a TypeError from the lookups below.
        validate_pipeline_id(pipeline_id)
        if pipeline_id not in self._state.pipelines and pipeline_id in self._unregistered:
            # A retry: answered like the first call, once the unregistration is saved.
            freed = self._unregistered[pipeline_id]
        else:
            freed = self._drop(
                pipeline_id,
                PipelineFailedError(f"pipeline {pipeline_id!r} was unregistered"),
                remember=True,
            )
            self._kick()
        await self._durable.until_saved(f"unregister_pipeline({pipeline_id})")
        return freed

    async def kill_pipeline(self, pipeline_id: str) -> None:
        """Fence a pipeline: kill its actors; its GPUs return once Ray confirms it dead."""
        self._check_running()
        self._state.pipeline(pipeline_id)
        self._fence(pipeline_id, "killed by request")

    def _drop(
        self, pipeline_id: str, error: Exception, *, remember: bool = False
    ) -> tuple[int, ...]:
        """Unregister ``pipeline_id`` and save; ``remember``: keep the GPUs it freed as the
        answer to a retried ``unregister_pipeline``, in the same save (a retry Ray sends to
        a restarted scheduler reads it back)."""
        freed, _cancelled = self._state.unregister(pipeline_id)
        if remember:
            self._unregistered[pipeline_id] = freed
            while len(self._unregistered) > _DEAD_KEPT:
                self._unregistered.popitem(last=False)
        self._waiters.fail_pipeline(pipeline_id, error)
        self._handles.pop(pipeline_id, None)
        self._seen.discard(pipeline_id)
        self._beats.pop(pipeline_id, None)
        self._fencing.pop(pipeline_id, None)
        self._durable.save()
        self._observer.observe(self._state, self._now())
        logger.info("unregistered %s, freed GPUs %s", pipeline_id, list(freed))
        return freed

    def _fence(self, pipeline_id: str, reason: str) -> None:
        """Stop a failing pipeline: error its waiters, drop its requests, kill its actors."""
        if pipeline_id in self._fencing or pipeline_id not in self._state.pipelines:
            return
        logger.warning("pipeline %s failed: %s; fencing it", pipeline_id, reason)
        self._fencing[pipeline_id] = reason
        spec = self._state.pipelines[pipeline_id]
        # Frozen in the core too (P7): nothing is planned for it, nobody's rank moves for it.
        self._state.fence(pipeline_id)
        self._waiters.fail_pipeline(
            pipeline_id, PipelineFailedError(f"pipeline {pipeline_id!r} failed: {reason}")
        )
        self._durable.save()
        self._keep_task(
            asyncio.get_running_loop().create_task(
                self._kill_then_probe(pipeline_id, spec.ray_namespace)
            )
        )

    async def _kill_then_probe(self, pipeline_id: str, ray_namespace: str) -> None:
        try:
            await kill_pipeline_actors(pipeline_id, ray_namespace)
        finally:
            self._liveness_wake.set()

    def _declare_dead(self, pipeline_id: str, reason: str, cause: str) -> None:
        if pipeline_id not in self._state.pipelines:
            return
        self._dead[pipeline_id] = DeadPipeline(pipeline_id, reason, self._now())
        while len(self._dead) > _DEAD_KEPT:
            self._dead.popitem(last=False)
        self._observer.failed(cause)
        logger.warning("pipeline %s declared dead: %s", pipeline_id, reason)
        self._drop(pipeline_id, PipelineFailedError(f"pipeline {pipeline_id!r} is dead: {reason}"))
        self._kick()

    # ================================================================== requests
    @on_wire("request_gpus")
    async def request_gpus(
        self,
        *,
        cluster_id: str,
        priority: Any,
        global_step: int | None = None,
        step_target_estimate: int | None = None,
        lora_name: str | None = None,
        pipeline_id: str | None = None,
    ) -> list[int]:
        """Block until the cluster is granted; return its GPUs (generation: >= 1 active rank)."""
        self._check_running()
        prio = coerce_priority(priority)
        cid = self._resolve_caller(cluster_id, pipeline_id)
        return await self._submit_and_wait(cid, prio, global_step, step_target_estimate, lora_name)

    async def _submit_and_wait(
        self,
        cid: str,
        prio: Priority,
        global_step: int | None,
        step_target_estimate: int | None,
        lora_name: str | None,
    ) -> list[int]:
        got = self._submit(cid, prio, global_step, step_target_estimate, lora_name)
        if isinstance(got, list):
            # Answered from GPUs the cluster holds already; the commit that gave them may not
            # be saved yet (its own answer waits for a save): a restart would take them back
            # while the caller uses them. Nothing to undo on failure: it held them before.
            await self._durable.until_saved(f"request_gpus({cid}, {prio.name})")
            return got
        return await self._wait(cid, prio, got)

    def _submit(
        self,
        cid: str,
        prio: Priority,
        global_step: int | None,
        step_target_estimate: int | None,
        lora_name: str | None,
    ) -> list[int] | asyncio.Future[list[int]]:
        """Queue a request (raises, state unchanged, if refused): GPUs now, or a future."""
        now = self._now()
        res = self._state.submit_request(
            cid,
            prio,
            now=now,
            global_step=global_step,
            step_target_estimate=step_target_estimate,
            lora_name=lora_name,
        )
        if isinstance(res, ImmediateGrant):
            if not (prio is Priority.GENERATION and self._all_warming(cid)):
                self._durable.save()
                self._observer.observe(self._state, now)
                self._observer.answered_at_once(prio.name)
                return list(res.gpus)
            # Every rank still wakes (background expands): answered by _settle_deferred once
            # one serves; the same request again (retried after a restart) shares the wait.
            waiting = self._waiters.get(cid)
            if waiting is not None and not waiting.done():
                return waiting
        fut = self._waiters.open(cid, now)
        self._kick()
        return fut

    async def _wait(self, cid: str, prio: Priority, fut: asyncio.Future[list[int]]) -> list[int]:
        try:
            gpus = await asyncio.wait_for(asyncio.shield(fut), self.cfg.request_timeout_s)
        except (asyncio.TimeoutError, asyncio.CancelledError) as exc:
            granted = fut.done() and not fut.cancelled() and fut.exception() is None
            if granted and isinstance(exc, asyncio.TimeoutError):
                return fut.result()  # granted in the same instant: the caller still waits
            if granted:
                self._give_back_cancelled(cid, fut)
                raise
            self._withdraw(cid, fut)
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise RequestTimeoutError(
                f"request_gpus({cid}, {prio.name}) not granted within "
                f"{self.cfg.request_timeout_s:g}s; the request was withdrawn"
            ) from None
        # Python 3.11's wait_for returns the answer instead of raising when the caller was
        # cancelled in the step the answer was set (3.12's raises: the branch above).
        task = asyncio.current_task()
        cancelling = getattr(task, "cancelling", None)
        if cancelling is not None and cancelling():
            self._give_back_cancelled(cid, fut)
            raise asyncio.CancelledError
        return gpus

    def _give_back_cancelled(self, cid: str, fut: asyncio.Future[list[int]]) -> None:
        """The caller was cancelled in the step its answer was set (the hooks cancel a call
        they gave up on): nobody reads the answer, so a whole-cluster grant is given back like
        one granted after its caller left. Kept, it held the GPUs for a pipeline that went on
        believing it had none."""
        self._waiters.withdraw(cid, fut)
        if cid in self._state.holdings:
            self._give_back_unanswered(cid)

    def _withdraw(self, cid: str, fut: asyncio.Future[list[int]]) -> None:
        """Drop a request whose caller stopped waiting (``fut`` is its answer): its waiter
        and, while still queued, the request itself; a whole-cluster grant it was never told
        of is given back (:meth:`_give_back_unanswered`)."""
        if not self._waiters.withdraw(cid, fut):
            return
        if self._state.cancel_request(cid) or fut.done():
            return
        if cid in self._state.holdings:
            self._give_back_unanswered(cid)

    def _give_back_unanswered(self, cid: str) -> None:
        """Release a whole-cluster grant whose caller stopped waiting before it was told.

        A held cluster whose waiter is still unanswered was granted by a commit whose save
        failed (its answer is held by ``Durability.hold``). Nobody will ever be told of it: kept, it
        would hold its GPUs until the pipeline unregisters. It is released in the core like any
        release (invariants S1-S7 hold, no other state is touched), with no hold time recorded
        (it never served), and saved with the next successful save, which the deferred answer
        also waits for: that answer then finds another (or no) waiter for ``cid`` and skips it
        (:meth:`_after_commit`). Generation grants are not given back: their ranks were sent
        their expand (or will be, with the answer), the pipeline's coordinator knows them, the
        planner may still shrink them for others, and a retried request is answered from them.
        """
        pid = parse_cluster_id(cid)[0]
        if pid in self._fencing:
            return  # frozen until it is unregistered (P7); its waiters were failed already
        now = self._now()
        freed = self._state.release(cid)
        logger.warning(
            "request for %s was granted (GPUs %s) but its caller stopped waiting before the "
            "grant was saved and answered; the grant is given back",
            cid,
            list(freed),
        )
        self._durable.save()
        self._observer.observe(self._state, now)
        self._kick()

    @on_wire("notify_release_gpus")
    async def notify_release_gpus(
        self, *, cluster_id: str, global_step: int | None = None, pipeline_id: str | None = None
    ) -> None:
        """The pipeline stopped using the cluster's GPUs (its shards are asleep): free them."""
        del global_step
        self._check_running()
        cid = self._resolve_caller(cluster_id, pipeline_id)
        self._release(cid)
        self._kick()
        await self._durable.until_saved(f"notify_release_gpus({cid})")

    def _release(self, cid: str) -> None:
        now = self._now()
        freed = self._state.release(cid, now=now)
        self._durable.save()
        self._waiters.settle_releases(self._still_releasing)
        self._observer.observe(self._state, now)
        logger.debug("released %s: GPUs %s", cid, list(freed))

    @on_wire("notify_release_then_request_gpus")
    async def notify_release_then_request_gpus(
        self,
        *,
        release_cluster_id: str,
        release_global_step: int | None,
        request_cluster_id: str,
        request_priority: Any,
        request_global_step: int | None = None,
        request_step_target_estimate: int | None = None,
        request_lora_name: str | None = None,
        pipeline_id: str | None = None,
    ) -> list[int]:
        """Release one cluster and request another atomically (no cycle runs in between).

        A refused request (bad priority or estimate, a request already pending, ...) raises
        with nothing released.
        """
        del release_global_step
        self._check_running()
        prio = coerce_priority(request_priority)
        rel = self._resolve_caller(release_cluster_id, pipeline_id)
        req = self._resolve_caller(request_cluster_id, pipeline_id)
        if parse_cluster_id(rel)[0] != parse_cluster_id(req)[0]:
            raise ProtocolError(
                f"release {rel!r} and request {req!r} belong to different pipelines"
            )
        if rel == req:
            # The release must come first (the request is for what the release frees), so try
            # both on a copy: a refusal then raises before the real release. A copy, not a
            # re-check of the core's rules here, so the two can never disagree.
            now = self._now()
            trial = copy.deepcopy(self._state)
            trial.release(rel, now=now)
            trial.submit_request(
                req,
                prio,
                now=now,
                global_step=request_global_step,
                step_target_estimate=request_step_target_estimate,
                lora_name=request_lora_name,
            )
            self._release(rel)
            await self._durable.until_saved(f"notify_release_then_request_gpus({rel})")
            return await self._submit_and_wait(
                req, prio, request_global_step, request_step_target_estimate, request_lora_name
            )
        # Submit first (the only half that can be refused: a refusal then leaves the release
        # undone), then release; both run with no await in between, so no cycle can see one
        # without the other.
        got = self._submit(
            req, prio, request_global_step, request_step_target_estimate, request_lora_name
        )
        self._release(rel)
        self._kick()
        try:
            await self._durable.until_saved(f"notify_release_then_request_gpus({rel})")
        except BaseException:
            # The caller is told the call failed (or gave up): its request must not stay
            # queued with nobody waiting (granted to nobody, and the retry refused as a
            # duplicate). A generation grant made meanwhile stays (the retry is answered from
            # it); a whole-cluster one the caller was never told of is given back.
            if not isinstance(got, list):
                self._withdraw(req, got)
            raise
        if isinstance(got, list):
            return got
        return await self._wait(req, prio, got)

    @on_wire("await_release_gpus")
    async def await_release_gpus(
        self,
        *,
        pipeline_id: str | None = None,
        cluster_id: str | None = None,
        global_step: int | None = None,
        timeout_s: float | None = None,
    ) -> None:
        """Shrink every active rank of a generation cluster; return when all are asleep.

        ``timeout_s``: a finite number of seconds > 0, or None for the configured
        ``request_timeout_s``.
        """
        del global_step
        self._check_running()
        limit = _release_timeout(timeout_s, self.cfg.request_timeout_s)
        if cluster_id is None:
            if pipeline_id is None:
                raise ProtocolError("await_release_gpus needs pipeline_id or cluster_id")
            cluster = cluster_id_of(pipeline_id)
        else:
            cluster = cluster_id
        cid = self._resolve_caller(cluster, pipeline_id)
        if self._state.plan_release(cid, now=self._now()):
            return
        fut = self._waiters.open_release(cid)
        self._kick()
        try:
            await asyncio.wait_for(asyncio.shield(fut), limit)
        except asyncio.TimeoutError:
            self._waiters.drop_release(cid, fut)
            # The shrink may still be running; RLix shuts Ray down here. We only tell the caller.
            raise RequestTimeoutError(
                f"await_release_gpus({cid}) not done within {limit:g}s"
            ) from None

    # ================================================================== demand
    @on_wire("report_progress")
    async def report_progress(self, report: Any) -> None:
        """Record a progress report (any object with RLix's ProgressReport fields)."""
        self._check_running()
        rep = coerce_progress_report(report)
        self._check_alive(rep.pipeline_id)
        if not self._state.report_progress(rep):
            # A collector still running after its driver ended the run: nothing to plan for.
            logger.debug("progress of %s ignored: its run is over", rep.pipeline_id)
            return
        self._kick()

    @on_wire("clear_progress")
    async def clear_progress(self, *, pipeline_id: str) -> None:
        """Forget every progress stream of a pipeline (its step's generation is over)."""
        self._check_running()
        self._check_alive(pipeline_id)
        self._state.clear_progress(pipeline_id)
        self._kick()

    @on_wire("end_run")
    async def end_run(self, *, pipeline_id: str) -> None:
        """The pipeline's training run is over while it stays registered (saving, shutting
        down): its demand is forgotten, a waiting GENERATION request fails with
        :class:`RunOverError`, later progress reports are ignored and later GENERATION
        requests refused (``SchedulerState.end_run``). Idempotent."""
        self._check_running()
        self._check_alive(pipeline_id)
        cancelled = self._state.end_run(pipeline_id)
        for cid in cancelled:
            self._waiters.fail(cid, RunOverError(
                f"pipeline {pipeline_id!r} ended its training run; its GENERATION "
                f"request for {cid!r} was cancelled"
            ))
        self._durable.save()
        logger.info("pipeline %s: run over, demand forgotten%s", pipeline_id,
                    f", cancelled {list(cancelled)}" if cancelled else "")
        self._kick()

    async def heartbeat(self, pipeline_id: str) -> float:
        """Keep the pipeline's lease; from the first beat on it must beat within ``lease_s``.

        Returns the lease length so a client can pace itself.
        """
        self._check_running()
        self._check_alive(pipeline_id)
        if pipeline_id not in self._state.pipelines:
            raise UnknownPipelineError(f"pipeline {pipeline_id!r} is not registered")
        first = pipeline_id not in self._beats
        self._beats[pipeline_id] = self._now()
        if first:
            self._durable.save()
        return self.cfg.lease_s

    # ================================================================== visibility
    async def get_status(self) -> CoordinatorStatus:
        """Pipelines, clusters, GPU owners and stages, demand and the wait queue."""
        self._check_running()
        return build_status(self._state, self._now(), dead=tuple(self._dead.values()))

    async def ping(self) -> int:
        """Cheap liveness check for clients; returns the state revision."""
        self._check_running()
        return self._state.revision

    async def get_wire_log(self) -> dict[str, PipelineWire]:
        """Per pipeline: the protocol calls received, their failures, and the classes of the
        progress reports and priorities sent (:mod:`.wire_log`)."""
        return self.wire_log.snapshot()

    async def get_trace(self) -> dict[str, Any]:
        """The GPU-ownership timeline so far (Chrome trace-event JSON)."""
        return self._observer.to_json(self._now())

    async def flush_trace(self) -> str | None:
        """Write the timeline file now; returns its path (None without a trace dir)."""
        path = await self._observer.write(self._now())
        return str(path) if path else None

    async def stop(self, *, clear_state: bool = True) -> None:
        """Stop cycles, probes and background work, fail every waiting call, write the trace,
        and (by default) forget the saved state. Every later call but the trace's raises
        :class:`CoordinatorUnavailableError`."""
        self._stopping = True
        # Not the pipelines' fault: clients retry these against the next coordinator.
        error = CoordinatorUnavailableError(
            f"the coordinator in namespace {self.cfg.namespace!r} is stopping"
        )
        self._waiters.fail_all(error)
        self._durable.held.clear()  # their waiters were failed above
        tasks = [*self._tasks, *self._expand_tails.values(), *self._side_tasks]
        for t in tasks:
            t.cancel()
        # Wait for them to end, so none of them touches the state or the store afterwards.
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._observer.write(self._now())
        if clear_state:
            self._store.clear()

    # ================================================================== cycle
    async def _cycle_loop(self) -> None:
        while not self._stopping:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.cfg.tick_s)
            self._wake.clear()
            try:
                again = await self._cycle()
            except asyncio.CancelledError:
                raise
            except Exception:
                # Never take anything else down for a cycle error (RLix shuts Ray down here).
                logger.exception("scheduling cycle failed; state kept, retrying on next event")
                again = False
            if again:
                self._wake.set()

    async def _cycle(self) -> bool:
        t0 = time.perf_counter()
        async with self._lock:
            # Every cycle (each event and tick), not only when GPUs move: registrations,
            # requests queued or withdrawn and fencing change the pipeline and pending counts.
            self._observer.gauges(self._state)
            if self._durable.held and not self._durable.retry():
                return False  # retried next tick; nothing new is decided meanwhile
            now = self._now()
            plan = self._planner.plan(self._state, now)
            if plan.empty:
                # Nothing to commit, but how long a pipeline has waited for a rank still counts
                # (the planner's starvation guard): a restart must neither restart that clock
                # nor restore one that had stopped.
                if self._state.note_starving(now):
                    self._durable.save()
                return False
            if not plan.registrations:
                # A planner that does not stamp its plans (any Planner may be configured): the
                # registrations are the current ones, under the same lock it planned under.
                plan = self._state.stamp(plan)
            try:
                check_plan(self._state, plan)
            except InvariantViolation:
                logger.exception("planner produced an invalid plan; not applied")
                return False
            self._inflight = InflightIntent()
            if plan.shrinks:
                self._durable.save()
            planned = self._planned_for(plan)
        failed_shrinks = await self._resizer.resize_all(
            plan.shrinks_by_cluster(), remove=True, planned=planned
        )
        if plan.shrinks:
            # The shrinks are done: a crash from here on must restore those ranks as asleep,
            # whatever comes next (expands to send, a background commit, or only a commit).
            async with self._lock:
                self._record_inflight(plan, failed_shrinks, ())
        # An expand on a GPU whose shrink failed must not be sent (two shards on one GPU).
        blocked = {g for m in plan.shrinks if m.cluster_id in failed_shrinks for g in m.gpus}
        sendable = tuple(
            m
            for m in plan.expands
            if parse_cluster_id(m.cluster_id)[0] not in self._fencing
            and not self._replaced(m.cluster_id, planned)
            and not any(g in blocked for g in m.gpus)
        )
        if self.cfg.background_expands:
            result = await self._commit_then_expand(plan, failed_shrinks, sendable, planned)
        else:
            result = await self._expand_then_commit(plan, failed_shrinks, sendable, planned)
        self._observer.cycle(time.perf_counter() - t0)
        return bool(result.granted or result.shrunk or result.expanded or result.released)

    @staticmethod
    def _planned_for(plan: Plan) -> dict[str, int]:
        """The registration token each pipeline in ``plan`` had when it was planned (the
        planner stamps them, :attr:`Plan.registrations`): a pipeline unregistered while the
        plan's resizes run may be registered again under the same id, and nothing planned for
        the old one may reach the new one (no RPC here; the core's commit skips it too)."""
        return dict(plan.registrations)

    def _replaced(self, cid: str, planned: dict[str, int]) -> bool:
        """Whether ``cid``'s pipeline is no longer the registration it was planned for."""
        pid = parse_cluster_id(cid)[0]
        return self._state.registrations.get(pid) != planned.get(pid)

    def _record_inflight(
        self, plan: Plan, failed_shrinks: set[str], expands: tuple[RankMove, ...]
    ) -> bool:
        """Save the shrinks that are done and the expands about to be sent (under ``_lock``):
        what a restart settles (:func:`settle_inflight`) if the cycle dies before its commit.
        False when the save failed."""
        self._inflight = InflightIntent(
            confirmed_shrinks=tuple(
                (m.cluster_id, m.dp_rank)
                for m in plan.shrinks
                if m.cluster_id not in failed_shrinks
            ),
            expands=tuple((m.cluster_id, m.dp_rank) for m in expands),
        )
        return self._durable.save()

    async def _expand_then_commit(
        self,
        plan: Plan,
        failed_shrinks: set[str],
        sendable: tuple[RankMove, ...],
        planned: dict[str, int],
    ) -> CommitResult:
        """The default cycle (as RLix's): send the expands, wait for them, then commit."""
        to_send = Plan(plan.revision, expands=sendable).expands_by_cluster()
        if to_send:
            async with self._lock:
                if not self._record_inflight(plan, failed_shrinks, sendable):
                    # Unsaved, a restart would not know these expands went out: their GPUs
                    # would come back idle under awake shards. Not sent, so not committed;
                    # planned again once saving works.
                    logger.warning("expands of %s not sent: their intent could not be saved",
                                   sorted(to_send))
                    sendable, to_send = (), {}
        # A failed expand leaves the shard's state unknown: the pipeline is fenced and the rank
        # is committed as active, so its GPUs stay with it until it is confirmed dead.
        unsent = await self._resizer.resize_all(to_send, remove=False, planned=planned)
        unsent -= {c for c in unsent if parse_cluster_id(c)[0] in self._fencing}
        async with self._lock:
            # What belongs to a registration that ended meanwhile is skipped by the core.
            applied = dataclasses.replace(
                plan, expands=tuple(m for m in sendable if m.cluster_id not in unsent)
            )
            return self._commit(plan, applied, failed_shrinks, background=False)

    def _commit(
        self, plan: Plan, applied: Plan, failed_shrinks: set[str], *, background: bool
    ) -> CommitResult:
        """Commit ``applied`` (``plan`` less what was not sent), check, persist, answer
        waiters; with ``background`` start the expands (under ``_lock``)."""
        now = self._now()
        result = self._state.commit(
            applied, now=now, failed_shrinks=failed_shrinks, expands_pending=background
        )
        self._inflight = None
        try:
            check_state(self._state)
        except InvariantViolation:
            logger.exception("state invariant broken after commit")
        durable = self._durable.save()
        expanding = _by_cluster(result.expanded) if background else {}
        # The waiters these grants answer: an answer that waits for a save must not reach a
        # later request of the same cluster (its caller gave up and asked again meanwhile).
        asked = {cid: self._waiters.get(cid) for cid in result.granted}

        def answer() -> None:
            self._after_commit(
                plan,
                result.granted,
                result.shrunk,
                result.expanded,
                now,
                defer=set(expanding),
                asked=asked,
            )
            self._waiters.settle_releases(self._still_releasing)
            for cid, ranks in expanding.items():
                self._start_expand(cid, ranks)

        # Unsaved, a restart would restore the state before this commit: a grant answered now
        # could be handed to someone else after it. Held until a save succeeds.
        self._durable.hold(answer, durable=durable)
        return result

    async def _commit_then_expand(
        self,
        plan: Plan,
        failed_shrinks: set[str],
        sendable: tuple[RankMove, ...],
        planned: dict[str, int],
    ) -> CommitResult:
        """Background expands: commit the cycle now (its shrinks are done), then start each
        cluster's expand RPC in its own task (:meth:`_expand`)."""
        reachable = {
            cid for cid in {m.cluster_id for m in sendable} if await self._resizer.reachable(cid)
        }
        async with self._lock:
            # What belongs to a registration that ended meanwhile is skipped by the core.
            applied = dataclasses.replace(
                plan,
                expands=tuple(
                    m
                    for m in sendable
                    if m.cluster_id in reachable
                    and parse_cluster_id(m.cluster_id)[0] not in self._fencing
                ),
            )
            return self._commit(plan, applied, failed_shrinks, background=True)

    def _start_expand(self, cid: str, ranks: list[int]) -> None:
        # Only ranks still warming: a commit answered late (its save failed first) may find
        # them given back meanwhile (released, unregistered), and an expand sent then would
        # wake shards on GPUs counted as free.
        ranks = [r for r in ranks if (cid, r) in self._state.warming]
        if not ranks:
            return
        # The ranks are owned now: the registration they belong to.
        expected = self._state.registrations.get(parse_cluster_id(cid)[0])
        task = asyncio.get_running_loop().create_task(
            self._expand(cid, ranks, self._expand_tails.get(cid), expected)
        )
        self._expand_tails[cid] = task

        def done(t: asyncio.Task[None]) -> None:
            if self._expand_tails.get(cid) is t:
                del self._expand_tails[cid]

        task.add_done_callback(done)

    async def _expand(
        self,
        cid: str,
        ranks: list[int],
        after: asyncio.Task[None] | None,
        expected: int | None,
    ) -> None:
        """One background ``resize_infer(add)``; the ranks stop warming when it returns.

        A call that failed, timed out or could not be sent fences the pipeline, and its ranks
        stay owned until it is confirmed dead (the shard's state is unknown), as a failed
        expand of a blocking cycle does. A call not sent because Ray's lookup of the
        coordinator actor failed is sent again, up to ``resize_timeout_s``, before that.
        """
        if after is not None:
            await asyncio.wait([after])  # one resize at a time per cluster, in plan order
        pid = parse_cluster_id(cid)[0]
        deadline = time.monotonic() + self.cfg.resize_timeout_s
        delay = 0.05
        while True:
            ok = await self._resizer.resize_one(cid, ranks, remove=False, expected=expected)
            # Not sent, yet neither fenced nor gone, for a pipeline whose actor was found
            # before: Ray's lookup failed (a GCS hiccup, likely right after a restart, when no
            # handle is cached). That is no verdict on the pipeline: try again, within the
            # resize timeout, while the ranks still wake (fenced before, a healthy pipeline
            # was killed for it).
            if (
                ok
                or self._state.registrations.get(pid) != expected
                or pid in self._fencing
                or pid not in self._seen
                or time.monotonic() + delay > deadline
            ):
                break
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)
            ranks = [r for r in ranks if (cid, r) in self._state.warming]
            if not ranks:
                break  # released or unregistered meanwhile: nothing left to wake
        async with self._lock:
            now = self._now()
            if self._state.registrations.get(pid) != expected or not ranks:
                # Unregistered meanwhile (its warming ranks went with it); a pipeline registered
                # since under the same id is not the one this expand was for.
                pass
            elif not ok:
                # resize_one fenced it already unless the call was never sent (the handle
                # was resolved before the commit, so that is not expected): fence it too.
                self._fence(pid, f"resize_infer(add={ranks}) on {cid} was not sent")
            elif cid in self._state.clusters:
                for r in ranks:
                    self._state.expand_done(cid, r, now=now)
                self._durable.save()
                self._observer.observe(self._state, now)
                self._settle_deferred(cid, now)
        self._kick()

    def _settle_deferred(self, cid: str, now: float) -> None:
        """Answer a generation request whose grant waited for an expand of ``cid`` once one
        of the cluster's ranks serves (a fenced or dropped pipeline's waiter failed already)."""
        fut = self._waiters.get(cid)
        if fut is None or fut.done() or cid in self._state.pending:
            return
        if self._state.active_ranks.get(cid) and not self._all_warming(cid):
            self._resolve_waiter(cid, self._state.held_gpus(cid), now)

    def _all_warming(self, cid: str) -> bool:
        """The cluster has active ranks and every one of them still wakes."""
        ranks = self._state.active_ranks.get(cid) or {}
        return bool(ranks) and all((cid, r) in self._state.warming for r in ranks)

    def _resolve_waiter(self, cid: str, gpus: tuple[int, ...], now: float) -> None:
        started = self._waiters.resolve(cid, gpus)
        self._observer.granted(
            self._state.holdings.get(cid, Priority.GENERATION).name,
            None if started is None else now - started,
        )

    def _after_commit(
        self,
        plan: Plan,
        granted: dict[str, tuple[int, ...]],
        shrunk: tuple[tuple[str, int], ...],
        expanded: tuple[tuple[str, int], ...],
        now: float,
        defer: Collection[str] = (),
        asked: dict[str, asyncio.Future[list[int]] | None] | None = None,
    ) -> None:
        """Trace, metrics and waiters of a commit. ``defer``: clusters whose expands still run
        (background expands); a generation grant of such a cluster is answered by
        :meth:`_settle_deferred` unless one of its ranks already serves. ``asked``: the waiter
        each grant answers, as at commit; a grant whose waiter has gone (withdrawn, and a
        whole-cluster grant given back, :meth:`_withdraw`) answers nobody else."""
        reasons = {(m.cluster_id, m.dp_rank): m for m in plan.shrinks}
        for key in shrunk:
            move = reasons.get(key)
            if move is not None and move.reason is not None:
                self._observer.shrunk(move, now)
        self._observer.expanded(len(expanded))
        self._observer.observe(self._state, now)
        for cid, gpus in granted.items():
            if asked is not None and self._waiters.get(cid) is not asked.get(cid):
                continue  # its caller stopped waiting; a later request is not answered by it
            if cid in defer and cid not in self._state.holdings and self._all_warming(cid):
                continue  # no rank serves yet: answered when one does
            self._resolve_waiter(cid, gpus, now)

    # ================================================================== liveness
    async def _liveness_loop(self) -> None:
        while not self._stopping:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._liveness_wake.wait(), self.cfg.liveness_interval_s)
            self._liveness_wake.clear()
            try:
                await self._check_liveness()
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("liveness check failed; retrying")

    async def _check_liveness(self) -> None:
        now = self._now()
        for pid, beat in list(self._beats.items()):
            if pid in self._state.pipelines and now - beat > self.cfg.lease_s:
                self._fence(pid, f"lease expired (no heartbeat for {now - beat:.1f}s)")
        pids = [p for p in self._state.pipelines]
        # The registration each verdict is about: a pipeline unregistered and registered
        # again under its id while the probes ran is a new registration with a new actor.
        probed = {p: self._state.registrations.get(p) for p in pids}
        # One probe failing in a way probe() does not classify (a Ray system error, say) is
        # no verdict on that pipeline; it must not cost every other pipeline its check.
        verdicts = await asyncio.gather(*(self._probe(p) for p in pids), return_exceptions=True)
        for pid, verdict in zip(pids, verdicts, strict=True):
            if isinstance(verdict, BaseException):
                logger.warning("liveness probe of %s failed (%r): no verdict this round",
                               pid, verdict)
                continue
            if pid not in self._state.pipelines:
                continue
            if self._state.registrations.get(pid) != probed[pid]:
                continue  # a verdict on the registration before this one
            fenced = self._fencing.get(pid)
            if verdict is Liveness.DEAD:
                reason = fenced or "its coordinator actor died"
                cause = "fenced" if fenced else "actor_died"
                self._declare_dead(pid, reason, cause)
            elif fenced is not None and verdict is Liveness.UNKNOWN and pid not in self._seen:
                # Fenced and no actor was ever there to kill: nothing can still be running
                # on its behalf that the coordinator knows how to stop.
                self._declare_dead(pid, fenced, "fenced")

    async def _probe(self, pipeline_id: str) -> Liveness:
        handle = await self._resizer.coordinator(pipeline_id)
        if handle is None:
            return Liveness.DEAD if pipeline_id in self._seen else Liveness.UNKNOWN
        verdict = await probe(handle, self.cfg.probe_timeout_s)
        if verdict is Liveness.DEAD:
            self._handles.pop(pipeline_id, None)
        return verdict


def _release_timeout(timeout_s: object, default: float) -> float:
    """``await_release_gpus``'s ``timeout_s`` checked before anything is planned."""
    if timeout_s is None:
        return default
    if not is_finite(timeout_s) or timeout_s <= 0:
        raise ProtocolError(
            f"timeout_s must be a finite number of seconds > 0, or None for the configured "
            f"request timeout ({default:g}s); got {timeout_s!r}"
        )
    return float(timeout_s)


def _by_cluster(ranks: Iterable[tuple[str, int]]) -> dict[str, list[int]]:
    """``(cluster, rank)`` pairs as sorted ranks per cluster (one resize call per cluster)."""
    out: dict[str, list[int]] = {}
    for cid, rank in ranks:
        out.setdefault(cid, []).append(rank)
    return {cid: sorted(r) for cid, r in out.items()}


def cluster_id_of(pipeline_id: str, name: str = GENERATION_CLUSTER) -> str:
    """``{pipeline_id}_{name}`` (generation cluster by default)."""
    return cluster_id(pipeline_id, name)


def default_topology() -> Topology:
    """The topology a scheduler started now would use (Ray's cluster resources)."""
    return topology_from_ray()
