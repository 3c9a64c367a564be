"""RLixHooks backed by the coordinator: one pipeline's training loop talks to ``rlix:scheduler``.

``before_training`` blocks until the pipeline's training GPUs are granted (retrying across a
coordinator restart), ``after_training`` releases them, progress is sent in 2% buckets, and a
heartbeat thread keeps the pipeline's lease. Beyond the four hook methods, ``hold_for_setup`` /
``release_setup_hold`` hold the pipeline's GPUs at INITIALIZATION while its host loads models.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlix_plugins.adapters.gpu_memory import (
    GpuMemoryReader,
    MemoryReadError,
    memory_reader_from_env,
)
from rlix_plugins.adapters.observability import (
    BusyObserved,
    MemoryObserved,
    ObservationError,
    ObservationWriter,
)
from rlix_plugins.errors import CoordinatorUnavailableError, PipelineFailedError, ProtocolError
from rlix_plugins.protocol.names import ACTOR_INFER, ACTOR_TRAIN, SCHEDULER_ACTOR, cluster_id
from rlix_plugins.protocol.types import (
    OUTSTANDING_METRIC,
    Priority,
    ProgressReport,
    progress_bucket,
)
from rlix_plugins.settings import MIN_SECONDS, Settings
from rlix_plugins.values import as_index

logger = logging.getLogger(__name__)

#: how long past its own deadline a client waits for request_gpus's answer (the scheduler
#: bounds the wait by the same RLIX_REQUEST_TIMEOUT_S and then answers with an error)
_REQUEST_GRACE_S = 30.0


def _count(name: str, value: object, minimum: int | None = None) -> int:
    """``value`` as a plain int (numpy ints too; not bools, floats or strings), else
    :class:`ProtocolError` naming the argument and what is valid."""
    out = as_index(value)
    if out is None or (minimum is not None and out < minimum):
        valid = "an int" if minimum is None else f"an int >= {minimum}"
        raise ProtocolError(f"report_progress: {name}={value!r} is not valid; valid: {valid}")
    return out


@dataclass(slots=True)
class ProgressThrottle:
    """Decides which progress updates are worth a message (pure; one per stream).

    Sent when the 2% bucket changes, when nothing remains, or on a new batch; identical
    repeats of the last sent state are dropped. The caller asks :meth:`wants` and records the
    state with :meth:`mark_sent` only once it was delivered, so a failed send is retried by the
    next identical update instead of being throttled.
    """

    last: tuple[int, int, int] | None = None  # (target, bucket, remaining)

    @staticmethod
    def state_of(*, target: int, completed: int) -> tuple[int, int, int]:
        bucket = progress_bucket(completed, target)
        remaining = target - min(max(completed, 0), target)
        return (target, bucket, remaining if remaining == 0 else -1)

    def wants(self, state: tuple[int, int, int], *, new_batch: bool) -> bool:
        """Whether ``state`` differs from the last delivered one (or starts a batch)."""
        return new_batch or self.last is None or state != self.last

    def mark_sent(self, state: tuple[int, int, int]) -> None:
        self.last = state


class CoordinatorHooks:
    """:class:`~rlix_plugins.hooks.protocol.RLixHooks` for one pipeline under the coordinator."""

    def __init__(
        self,
        pipeline_id: str,
        settings: Settings,
        *,
        scheduler: Any = None,
        train_cluster: str = ACTOR_TRAIN,
        heartbeat: bool = True,
        clock: Callable[[], float] = time.monotonic,
        observer: ObservationWriter | None = None,
        memory_reader: GpuMemoryReader | None = None,
    ) -> None:
        self.pipeline_id = pipeline_id
        self.settings = settings
        self.train_cluster_id = cluster_id(pipeline_id, train_cluster)
        self._scheduler = scheduler
        self._clock = clock
        self._throttles: dict[tuple[str, str | None], ProgressThrottle] = {}
        self._stop = threading.Event()
        self._heartbeat_thread: threading.Thread | None = None
        self.heartbeat_error: BaseException | None = None
        #: where train busy records go (``RLIX_OBSERVE_DIR`` unless given); off when unset
        self.observer = observer if observer is not None else ObservationWriter.from_env(
            pipeline_id)
        #: reads the training GPUs' memory before each release (``RLIX_OBSERVE_GPU_MEMORY=1``
        #: unless given); only used while :attr:`observer` writes records
        self.memory_reader = (memory_reader if memory_reader is not None
                              else memory_reader_from_env())
        #: the training GPUs and when they were granted, until after_training
        self._training: tuple[tuple[int, ...], float] | None = None
        #: (cluster, GPUs) held at INITIALIZATION by hold_for_setup, until release_setup_hold
        self._setup_hold: list[tuple[str, tuple[int, ...]]] = []
        if heartbeat:
            self.start_heartbeat()

    # ------------------------------------------------------------------ scheduler access
    def _sched(self) -> Any:
        import ray

        if self._scheduler is None:
            try:
                self._scheduler = ray.get_actor(SCHEDULER_ACTOR, namespace=self.settings.namespace)
            except ValueError:
                raise CoordinatorUnavailableError(
                    f"no {SCHEDULER_ACTOR} in namespace {self.settings.namespace!r}"
                ) from None
        return self._scheduler

    def _call(self, method: str, *args: Any, deadline_s: float | None = None, **kwargs: Any) -> Any:
        """Call the scheduler; ride through a coordinator restart until ``deadline_s``.

        A restarted actor keeps its id and Ray retries the call itself; a re-created one
        (stopped and started, or created by another ``connect``) has a new id, so the name is
        looked up again. Typed errors (bad call, pipeline failed) are never retried.
        """
        import ray

        limit = self.settings.request_timeout_s if deadline_s is None else deadline_s
        deadline = self._clock() + limit
        delay = 0.05
        while True:
            # Every attempt is bounded: a hung scheduler must not block the training loop
            # forever. request_gpus may legitimately wait up to the scheduler's own request
            # timeout (the same setting), so it gets a grace beyond it to hear that answer.
            wait = max(deadline - self._clock(), MIN_SECONDS)
            if method == "request_gpus":
                wait += _REQUEST_GRACE_S
            ref: Any = None
            try:
                ref = getattr(self._sched(), method).remote(*args, **kwargs)
                return ray.get(ref, timeout=wait)
            except ray.exceptions.GetTimeoutError:
                if method == "request_gpus":
                    # Stop the request where it waits: the scheduler then withdraws a request
                    # whose caller stopped waiting (and gives back a grant it was never told
                    # of). Left running, it stayed queued, was granted later to nobody (GPUs
                    # taken from other pipelines' shards, held by a pipeline not training)
                    # and a retry was refused as "already has a pending request". Other
                    # calls (a release) are better applied late than never: not cancelled.
                    with contextlib.suppress(Exception):
                        ray.cancel(ref)
                raise CoordinatorUnavailableError(
                    f"scheduler did not answer {method} within {wait:g}s "
                    f"({'RLIX_REQUEST_TIMEOUT_S' if deadline_s is None else 'deadline'} "
                    f"{limit:g}s); not retried: the call may still be applied"
                ) from None
            except (ray.exceptions.RayActorError, CoordinatorUnavailableError) as exc:
                if self._clock() >= deadline:
                    raise CoordinatorUnavailableError(
                        f"scheduler unreachable for {limit:g}s calling {method}: {exc}"
                    ) from exc
                logger.warning(
                    "scheduler unavailable (%s); retrying %s", type(exc).__name__, method
                )
                self._scheduler = None
                # Backoff between lookups of a name that is being re-created (nothing to wait on).
                time.sleep(delay)
                delay = min(delay * 2, 2.0)

    # ------------------------------------------------------------------ RLixHooks
    def before_training(self, step: int) -> None:
        """Block until this pipeline's training cluster is granted (overlapping shards shrunk)."""
        gpus = self._call(
            "request_gpus",
            cluster_id=self.train_cluster_id,
            priority=Priority.ACTOR_TRAINING,
            global_step=step,
            pipeline_id=self.pipeline_id,
        )
        logger.info("step %d: training GPUs granted %s", step, gpus)
        if isinstance(gpus, (list, tuple)) and gpus:
            self._training = (tuple(int(g) for g in gpus), time.time())

    def after_training(self, step: int) -> None:
        """Release the training GPUs (weights cached, training state offloaded)."""
        if self._training is not None:
            gpus, since = self._training
            self._training = None
            # Written before the release: once released, the GPUs may be woken for others.
            # Wall-clock times (records of several processes are compared); a clock stepped
            # back since the grant is clamped, and a record that cannot be built never stops
            # the release (it is evidence only: a missing one fails the gate as unobserved).
            try:
                self.observer.write(BusyObserved(self.pipeline_id, "train", gpus, since,
                                                 max(time.time(), since)))
            except ObservationError:
                logger.warning("step %d: train busy record not written", step, exc_info=True)
            self._observe_memory(step, gpus)
        self._call(
            "notify_release_gpus",
            cluster_id=self.train_cluster_id,
            global_step=step,
            pipeline_id=self.pipeline_id,
        )

    def _observe_memory(self, step: int, gpus: tuple[int, ...]) -> None:
        """Record the training GPUs' memory in use (the host has offloaded its training state
        and destroyed its NCCL groups, the overlapping shards sleep). A failed read is
        recorded with its reason, never raised: the release must go out."""
        reader = self.memory_reader
        if reader is None or not self.observer.enabled:
            return
        used: list[int | None] = []
        errors: list[str] = []
        for g in gpus:
            try:
                used.append(reader.used_bytes(g))
            except Exception as exc:  # whatever a reader raises, the release must go out
                used.append(None)
                errors.append(str(exc) if isinstance(exc, MemoryReadError)
                              else f"GPU {g}: {type(exc).__name__}: {exc}")
        try:
            self.observer.write(MemoryObserved(self.pipeline_id, step, gpus, tuple(used),
                                               error="; ".join(errors)))
        except Exception:  # evidence only: the release must go out
            logger.warning("step %s: memory record not written", step, exc_info=True)

    def report_progress(
        self,
        *,
        step_target_trajectories: int,
        collected: int,
        current_train_step: int,
        new_batch: bool = False,
        mode: str = "train",
        adapter_id: str | None = None,
        outstanding: int | None = None,
    ) -> None:
        """Send demand when the 2% bucket changes, at 0 remaining, or on a new batch.

        ``outstanding`` (optional): requests admitted and not finished over every step the
        staleness bound allows; sent as the ``outstanding`` metric with the report (it never
        triggers a report by itself), so our planner sizes an async job by all its work.
        """
        # Checked before anything is sent or throttled: a bool would count as 1, a float or a
        # string would reach the coordinator (refused there, or read as another number).
        step_target_trajectories = _count("step_target_trajectories", step_target_trajectories,
                                          0)
        collected = _count("collected", collected)
        current_train_step = _count("current_train_step", current_train_step)
        if outstanding is not None:
            outstanding = _count("outstanding", outstanding)
        throttle = self._throttles.setdefault((mode, adapter_id), ProgressThrottle())
        state = throttle.state_of(target=step_target_trajectories, completed=collected)
        if not throttle.wants(state, new_batch=new_batch):
            return
        completed = min(max(collected, 0), step_target_trajectories)
        metrics: dict[str, object] = {
            "mode": mode,
            "completed": completed,
            "bucket": progress_bucket(completed, step_target_trajectories),
            "new_batch": new_batch,
            "current_train_step": current_train_step,
            "adapter_id": adapter_id,
        }
        if outstanding is not None:
            metrics[OUTSTANDING_METRIC] = max(0, int(outstanding))
        report = ProgressReport(
            pipeline_id=self.pipeline_id,
            step_target_trajectories=step_target_trajectories,
            fifo_timestamp=time.time(),
            metrics=metrics,
        )
        self._call("report_progress", report)
        # only now: if the call raised, the same state must not be throttled on the retry
        throttle.mark_sent(state)

    def clear_progress(self) -> None:
        """The step's generation is over: forget this pipeline's demand."""
        self._throttles.clear()
        self._call("clear_progress", pipeline_id=self.pipeline_id)

    def end_run(self) -> None:
        """The training run is over (the pipeline stays registered to save and shut down):
        the coordinator forgets its demand for good, ignores its later progress reports (a
        collector still running) and cancels its waiting GENERATION request
        (``SchedulerActor.end_run``). Not one of the four hook methods: only a host whose
        run can end before it unregisters calls it."""
        self._throttles.clear()
        self._call("end_run", pipeline_id=self.pipeline_id)

    # ------------------------------------------------------------------ setup
    # Not among the four hook methods (hooks.protocol.SetupHold): only a host that registers
    # before it loads its models can hold its GPUs for that.
    def hold_for_setup(self, cluster: str = ACTOR_INFER, *others: str) -> tuple[int, ...]:
        """Block until every GPU of ``cluster`` (and of ``others``, in order) is held at
        INITIALIZATION, as ROLL's init holds each cluster while it loads: other pipelines'
        generation shards on those GPUs are shrunk, and training on them finishes first.
        With partial overlap the inference cluster covers the training GPUs, so a pipeline
        joining a busy cluster loads its models on GPUs nobody else is using; a layout whose
        training GPUs lie outside it holds both clusters (they must not share a GPU: the
        second request would wait for this pipeline's own hold). Returns the GPUs held;
        idempotent while the same clusters are held. If a later cluster's request fails, the
        ones held by this call are given back first (nothing changes)."""
        cids = tuple(cluster_id(self.pipeline_id, c) for c in (cluster, *others))
        if self._setup_hold:
            held = tuple(cid for cid, _ in self._setup_hold)
            if held == cids:
                return tuple(sorted({g for _, gpus in self._setup_hold for g in gpus}))
            raise ProtocolError(
                f"hold_for_setup{tuple((cluster, *others))!r}: {', '.join(held)} "
                f"{'is' if len(held) == 1 else 'are'} already held for setup; valid: "
                "release_setup_hold() first"
            )
        taken: list[tuple[str, tuple[int, ...]]] = []
        try:
            for cid in cids:
                gpus = self._call(
                    "request_gpus",
                    cluster_id=cid,
                    priority=Priority.INITIALIZATION,
                    global_step=None,
                    pipeline_id=self.pipeline_id,
                )
                taken.append((cid, tuple(int(g) for g in gpus)))
        except BaseException:
            self._setup_hold = taken
            try:
                self.release_setup_hold()
            except Exception:
                logger.warning("pipeline %s: giving back a partial setup hold failed",
                               self.pipeline_id, exc_info=True)
            raise
        self._setup_hold = taken
        held_gpus = tuple(sorted({g for _, gpus in taken for g in gpus}))
        logger.info("pipeline %s: GPUs %s held for setup", self.pipeline_id, list(held_gpus))
        return held_gpus

    @property
    def holding_for_setup(self) -> bool:
        """Whether :meth:`hold_for_setup`'s GPUs are still held."""
        return bool(self._setup_hold)

    def release_setup_hold(self) -> None:
        """Give back the GPUs :meth:`hold_for_setup` took (the pipeline's models are asleep or
        offloaded by now), last cluster first. No-op when nothing is held; a failed call
        keeps what it did not give back, for a retry."""
        if not self._setup_hold:
            return
        while self._setup_hold:
            cid, _ = self._setup_hold[-1]
            self._call("notify_release_gpus", cluster_id=cid, global_step=None,
                       pipeline_id=self.pipeline_id)
            self._setup_hold.pop()
        logger.info("pipeline %s: setup hold released", self.pipeline_id)

    # ------------------------------------------------------------------ lease
    def start_heartbeat(self) -> None:
        """Beat every lease/3 from a daemon thread (from the first beat the lease applies)."""
        if self._heartbeat_thread is not None:
            return
        self._heartbeat_thread = threading.Thread(
            target=self._beat, name=f"rlix-heartbeat-{self.pipeline_id}", daemon=True
        )
        self._heartbeat_thread.start()

    def _beat(self) -> None:
        import ray

        interval = self.settings.lease_s / 3
        while not self._stop.is_set():
            try:
                lease = ray.get(
                    self._sched().heartbeat.remote(self.pipeline_id), timeout=interval * 2
                )
                # The coordinator's lease is the one that counts: a pipeline started with a
                # longer RLIX_LEASE_S than the coordinator's must not let it lapse.
                if isinstance(lease, (int, float)) and math.isfinite(lease) and lease > 0:
                    interval = min(self.settings.lease_s, float(lease)) / 3
            except PipelineFailedError as exc:
                self.heartbeat_error = exc
                logger.error("coordinator declared this pipeline dead: %s", exc)
                return
            except Exception as exc:  # restart in progress: keep trying, the lease decides
                logger.warning("heartbeat failed: %s", exc)
                self._scheduler = None
            self._stop.wait(interval)

    def close(self) -> None:
        """Stop the heartbeat thread (the lease then lapses unless the pipeline unregisters)."""
        self._stop.set()
        if self._heartbeat_thread is not None:
            self._heartbeat_thread.join(timeout=5)
            self._heartbeat_thread = None
