"""The pipeline-side coordinator actor, served as ``rlix:coordinator:{pipeline_id}``.

The scheduler calls ``resize_infer`` on it; it delegates to a :class:`ShardController` (the
generation module's shard router: shrink = preempt/abort/drain/sleep, expand = wake + sync +
activate). It also aggregates the progress streams of the pipeline's rollout schedulers into
one report for the scheduler.

Concurrency: resizes are serialised by their own lock, and progress calls never wait for a
resize (the actor runs with several threads), so a long weight sync during an expand does not
stall demand reporting (RLix holds one lock across the whole sync).

Ordering of progress: Ray does not run a threaded actor's calls in submission order (with
``max_concurrency > 1`` Ray 2.60 forces ``allow_out_of_order_execution``), and ROLL's reports
carry no sequence number, so an older report could be applied after a newer one. Two layers
keep the newest report: the progress calls run in their own concurrency group of one thread
(:data:`PROGRESS_GROUP`; they never overlap and, in the usual case, run in arrival order, but
Ray promises no order), and a report that its own fields show to be older than the one already
applied for its stream (:func:`is_stale`: ``fifo_timestamp``, which ROLL sets to each report's
send time; without distinct stamps ``current_train_step``, then ``completed``) is dropped, as is
a late report of a batch whose stream was already cleared. A stamp more than ``clock_step_s``
before the applied one is the sender's clock stepping back (NTP), not a late delivery: that
report is taken as the newer one and the stream is ordered from it on (logged as a warning).

Delivery of progress: ROLL sends its reports and clears fire-and-forget, so a forward that
fails (the scheduler gave no answer within ``call_timeout_s``, or is being re-created) raises
into nothing, and the stream is already closed here. A lost clear left the scheduler planning
GPUs for the ended batch's demand until the next batch opened. So after such a failure the
pipeline's progress as it stands now (the streams' sum, or a clear) is sent again, after
:data:`RESYNC_S` and then doubling up to :data:`RESYNC_MAX_S`, until delivered or superseded by
a delivered forward; a typed refusal from the scheduler is an answer and is not sent again.

Keep :class:`PipelineCoordinator` undecorated; :func:`start_pipeline_coordinator` serves it (or a
subclass) through ``ray.remote`` (Ray freezes decorated classes).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol, TypeVar, runtime_checkable

import ray

from rlix_plugins.errors import CoordinatorUnavailableError, ProtocolError
from rlix_plugins.protocol.names import (
    SCHEDULER_ACTOR,
    pipeline_coordinator_actor,
    pipeline_namespace,
    validate_pipeline_id,
)
from rlix_plugins.protocol.types import ActionResponse, ProgressReport, coerce_progress_report
from rlix_plugins.values import as_index, is_finite

logger = logging.getLogger(__name__)

StreamKey = tuple[str, str | None]

#: Ray concurrency group (one thread) of the progress calls, so they never overlap.
PROGRESS_GROUP = "progress"
#: The calls a rollout scheduler makes; overrides in subclasses join the group too.
PROGRESS_METHODS = ("report_progress_from_scheduler", "clear_progress_stream")
#: A report stamped more than this many seconds before the stream's applied one is taken to
#: come from a sender whose clock stepped back (an NTP step), not from a late delivery. Ray
#: reorders calls of one sender by far less (their arguments are inline; nothing retries
#: them), and a clock step smaller than this freezes the stream's demand for at most as long
#: as the step (until the sender's clock passes the applied stamp again).
CLOCK_STEP_S = 10.0

#: Seconds after a failed progress forward before the pipeline's progress is sent again; each
#: further failure doubles the wait, up to :data:`RESYNC_MAX_S`.
RESYNC_S = 1.0
RESYNC_MAX_S = 30.0
#: Failures of a forward that mean it may not have been applied (no answer, no scheduler);
#: anything else is the scheduler's answer (e.g. the pipeline was fenced).
_LOST = (CoordinatorUnavailableError, ray.exceptions.RayActorError)

_F = TypeVar("_F", bound=Callable[..., Any])


def _in_progress_group(fn: _F) -> _F:
    """Tag ``fn`` with :data:`PROGRESS_GROUP` for Ray, keeping its own type (``ray.method``'s
    typing would make it a remote method, which a plain instance or subclass cannot call)."""
    tagged: _F = ray.method(concurrency_group=PROGRESS_GROUP)(fn)
    return tagged


@dataclasses.dataclass(frozen=True, slots=True)
class StreamMark:
    """Where a progress stream stands, read from the fields ROLL sends (it sends no seq).

    ``step`` is ``metrics["current_train_step"]`` (None when absent; ROLL sends the batch's
    step only when opening it, otherwise the reporting episode's start step), ``fifo`` the
    report's ``fifo_timestamp`` (ROLL: its send time), ``completed`` the raw completed count,
    ``new_batch`` the report opens a batch (ROLL's ``begin_progress_batch``); ``cleared``: the
    stream was cleared after this report.
    """

    step: int | None
    fifo: float | None
    completed: int
    cleared: bool = False
    new_batch: bool = False


def stream_mark(report: ProgressReport) -> StreamMark:
    """The ordering fields of a coerced report; ProtocolError for a malformed step."""
    metrics = report.metrics or {}
    raw_step = metrics.get("current_train_step")
    step = None if raw_step is None else as_index(raw_step)
    if raw_step is not None and (step is None or step < 0):
        raise ProtocolError(
            f"metrics['current_train_step'] must be an int >= 0 or None, got {raw_step!r}"
        )
    # coerce_progress_report checked it is an int >= 0
    completed = int(metrics.get("completed", metrics.get("collected", 0)))
    return StreamMark(step, report.fifo_timestamp, completed,
                      new_batch=bool(metrics.get("new_batch", False)))


def clock_stepped_back(
    new: StreamMark, last: StreamMark | None, clock_step_s: float = CLOCK_STEP_S
) -> bool:
    """Whether ``new`` is stamped more than ``clock_step_s`` before ``last``: its sender's
    clock stepped back (the reports of one ROLL stream are sent in order, and Ray's
    reordering of them spans far less), so the stamps no longer order the two."""
    return (
        last is not None
        and new.fifo is not None
        and last.fifo is not None
        and last.fifo - new.fifo > clock_step_s
    )


def is_stale(
    new: StreamMark, last: StreamMark | None, clock_step_s: float = CLOCK_STEP_S
) -> bool:
    """True if ``new`` is provably older than ``last`` (the stream's applied state).

    Checked against ROLL's source (commit 4989ec48, rlix's external/ROLL pin;
    roll/distributed/scheduler/rollout_scheduler.py, ``GroupQueueManager``):

    * The send time decides first: ROLL stamps ``fifo_timestamp`` with each report's own
      ``time.time()`` (line 624) and one asyncio actor sends all of a stream's reports in turn,
      so a later stamp is a later report.
    * The step orders nothing inside a batch: only the report opening it carries the batch's
      step (lines 1044-1046); a report sent on a trajectory's put carries that episode's START
      step (line 770), below the batch's step under async generation. Nor does the count: a
      filtered group (or an exited env) takes its trajectories back (lines 761-764).
    * After a clear only a report opening a batch (``new_batch``) reopens the stream: ROLL
      sends nothing between ``end_progress_batch`` and the next ``begin_progress_batch``
      (lines 590, 682-698), so any other report is a late one of the cleared batch, whatever
      its step or stamp (the clear carries neither).
    * A stamp more than ``clock_step_s`` earlier (:func:`clock_stepped_back`) is a sender
      whose wall clock stepped back, not a report sent earlier: it is taken as the later one
      (after a clear only a ``new_batch`` still reopens), so the stream is ordered from it
      on instead of dropping every report until the clock passes the applied stamp again.

    Without two distinct stamps (another sender, or none) the fields order as before: a later
    step is newer; after a clear only a later step or a new batch of the same step reopens;
    within a step a report opening a batch restarts the count, otherwise a higher
    ``completed`` is newer. Without a step on either side nothing orders them (the new one is
    taken).
    """
    if last is None:
        return False
    if new.fifo is not None and last.fifo is not None and new.fifo != last.fifo:
        if new.fifo < last.fifo and not clock_stepped_back(new, last, clock_step_s):
            return True
        return last.cleared and not new.new_batch
    if new.step is None or last.step is None:
        return False
    if new.step != last.step:
        return new.step < last.step
    if last.cleared:
        return not new.new_batch
    if new.new_batch:
        return False
    return new.completed < last.completed


@runtime_checkable
class ShardController(Protocol):
    """What the coordinator actor drives; both calls must be idempotent per rank.

    ``shrink`` returns once the ranks run nothing and hold no GPU memory (asleep); ``expand``
    returns once the ranks are awake, synced to the current weights and routable. A rank that is
    already in the asked state is left alone (after a coordinator restart the scheduler may
    repeat a move it cannot prove happened).
    """

    def shrink(self, dp_ranks: Sequence[int]) -> None: ...

    def expand(self, dp_ranks: Sequence[int]) -> None: ...


class PendingController:
    """The controller of a pipeline that registered before its shard controller could be
    built (its replicas, or the policy that owns its weight cache, do not exist yet; it holds
    its GPUs for setup meanwhile, so the scheduler has nothing of it to resize): a resize
    fails with the reason until :func:`set_shard_controller` hands over the real one."""

    def shrink(self, dp_ranks: Sequence[int]) -> None:
        raise RuntimeError(f"pipeline not ready (its shard controller is not built yet); cannot "
                           f"shrink {list(dp_ranks)}")

    def expand(self, dp_ranks: Sequence[int]) -> None:
        raise RuntimeError(f"pipeline not ready (its shard controller is not built yet); cannot "
                           f"expand {list(dp_ranks)}")


def _install_controller(actor_self: Any, controller: ShardController) -> None:
    actor_self.shards = controller


def set_shard_controller(coordinator: Any, controller: ShardController) -> None:
    """Hand ``controller`` to a running coordinator actor (started with a
    :class:`PendingController`); blocks until installed.

    Raises:
        ProtocolError: ``controller`` is not a shard controller instance (e.g. the factory
            or class the constructor accepts); nothing is sent.
    """
    # Installed as is, a factory failed the next resize_infer with an AttributeError and
    # the scheduler fenced the pipeline for it.
    if not isinstance(controller, ShardController) or isinstance(controller, type):
        raise ProtocolError(
            f"set_shard_controller needs a shard controller instance (with shrink(dp_ranks) "
            f"and expand(dp_ranks) methods), got {controller!r}; build it before handing it over"
        )
    ray.get(coordinator.__ray_call__.remote(_install_controller, controller))


def aggregate_reports(pipeline_id: str, streams: dict[StreamKey, ProgressReport]) -> ProgressReport:
    """One report for the scheduler from a pipeline's streams: targets and completions add up."""
    target = sum(r.step_target_trajectories for r in streams.values())
    completed = sum(r.completed for r in streams.values())
    fifo = [r.fifo_timestamp for r in streams.values() if r.fifo_timestamp is not None]
    new_batch = any(bool((r.metrics or {}).get("new_batch")) for r in streams.values())
    steps = [
        int(m["current_train_step"])
        for r in streams.values()
        if (m := r.metrics) and isinstance(m.get("current_train_step"), int)
    ]
    from rlix_plugins.protocol.types import progress_bucket

    return ProgressReport(
        pipeline_id=pipeline_id,
        step_target_trajectories=target,
        fifo_timestamp=min(fifo) if fifo else None,
        metrics={
            "mode": "train",
            "completed": completed,
            "bucket": progress_bucket(completed, target),
            "new_batch": new_batch,
            "current_train_step": max(steps) if steps else None,
            "adapter_id": None,
            "streams": len(streams),
        },
    )


def _rank_list(name: str, value: Iterable[int] | None) -> list[int]:
    """``value`` as a list of DP ranks (ints >= 0); ProtocolError naming the bad entry.

    ``int()`` would accept ``"1"``, ``True`` and ``2.7`` (as 2) and raise untyped errors for
    the rest."""
    if value is None:
        return []
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise ProtocolError(f"{name} must be a list of DP ranks (ints >= 0), got {value!r}")
    given = list(value)
    out: list[int] = []
    for r in given:
        rank = as_index(r)  # ints and numpy ints; not floats, strings or bools
        if rank is None or rank < 0:
            raise ProtocolError(
                f"{name} must hold DP ranks (ints >= 0); got {r!r} in {given!r}"
            )
        out.append(rank)
    return out


class PipelineCoordinator:
    """Undecorated implementation of ``rlix:coordinator:{pipeline_id}``.

    Serve it (or a subclass) with :func:`start_pipeline_coordinator`, which declares
    :data:`PROGRESS_GROUP`; the progress methods are tagged with it.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # An override of a progress call must stay in the one-thread group, or its calls
        # would overlap again and apply out of order.
        for name in PROGRESS_METHODS:
            fn = cls.__dict__.get(name)
            if callable(fn) and not hasattr(fn, "__ray_concurrency_group__"):
                setattr(cls, name, _in_progress_group(fn))

    def __init__(
        self,
        pipeline_id: str,
        shard_controller: ShardController | Callable[[str], ShardController],
        *,
        control_namespace: str = "rlix",
        scheduler: Any = None,
        call_timeout_s: float = 60.0,
        clock_step_s: float = CLOCK_STEP_S,
    ) -> None:
        self.pipeline_id = validate_pipeline_id(pipeline_id)
        if not is_finite(call_timeout_s) or call_timeout_s <= 0:
            raise ProtocolError(
                f"call_timeout_s must be finite seconds > 0, got {call_timeout_s!r}"
            )
        if not is_finite(clock_step_s) or clock_step_s <= 0:
            raise ProtocolError(f"clock_step_s must be finite seconds > 0, got {clock_step_s!r}")
        #: a report stamped this much before the applied one: the sender's clock stepped back
        self.clock_step_s = float(clock_step_s)
        #: bound on each progress call to the scheduler (it answers at once when healthy): a
        #: hung scheduler must not block the rollout scheduler, which waits for the call,
        #: with the progress lock held
        self.call_timeout_s = float(call_timeout_s)
        # A factory is accepted so the controller is built inside the actor process (the
        # router and its engine handles do not need to pickle). A class is a factory too: it
        # has ``shrink``/``expand`` attributes, so the Protocol check alone would take it for
        # a controller.
        self.shards: ShardController = (
            shard_controller
            if isinstance(shard_controller, ShardController)
            and not isinstance(shard_controller, type)
            else shard_controller(pipeline_id)
        )
        self.control_namespace = control_namespace
        from rlix_plugins.coordinator.service import rlix_compat

        # Rollout schedulers of a ROLL pipeline send RLix's classes pickled by reference.
        rlix_compat.install()
        self._scheduler = scheduler
        self._resize_lock = threading.Lock()
        self._progress_lock = threading.Lock()
        self._streams: dict[StreamKey, ProgressReport] = {}
        #: per stream, the ordering fields of the last report applied (kept after a clear)
        self._marks: dict[StreamKey, StreamMark] = {}
        #: the last progress forward was lost (under the progress lock): the scheduler may
        #: hold an older state than ``_streams`` says until :meth:`resync_progress` sends it
        self._unsynced = False
        self._resync_timer: threading.Timer | None = None
        self._resync_delay = RESYNC_S
        self._active: set[int] = set()

    # ---------------------------------------------------------------- scheduler -> pipeline
    def resize_infer(
        self, dp_ranks_to_remove: Sequence[int], dp_ranks_to_add: Sequence[int]
    ) -> ActionResponse:
        """Shrink or expand generation DP ranks (exactly one list non-empty)."""
        try:
            remove = _rank_list("dp_ranks_to_remove", dp_ranks_to_remove)
            add = _rank_list("dp_ranks_to_add", dp_ranks_to_add)
        except ProtocolError as exc:
            # an answer, not an exception: the scheduler reads ActionResponse.message
            return ActionResponse(False, str(exc))
        if bool(remove) == bool(add):
            return ActionResponse(
                False,
                f"exactly one of dp_ranks_to_remove={remove} / dp_ranks_to_add={add} "
                "must be non-empty",
            )
        with self._resize_lock:
            try:
                if remove:
                    self.shards.shrink(remove)
                    self._active.difference_update(remove)
                else:
                    self.shards.expand(add)
                    self._active.update(add)
            except Exception as exc:
                # The scheduler fences the pipeline on a failed resize; say what went wrong.
                logger.exception("resize_infer(remove=%s, add=%s) failed", remove, add)
                return ActionResponse(False, f"{type(exc).__name__}: {exc}")
        return ActionResponse(True)

    def active_ranks(self) -> list[int]:
        """DP ranks the scheduler has expanded and not shrunk since."""
        return sorted(self._active)

    # ---------------------------------------------------------------- progress aggregation
    @_in_progress_group
    def report_progress_from_scheduler(self, report: Any) -> None:
        """A rollout scheduler's progress for one stream (mode, adapter): forward the sum.

        A report older than the stream's applied one (:func:`is_stale`) is dropped: Ray may
        deliver ROLL's reports out of order.
        """
        rep = coerce_progress_report(report)
        if rep.pipeline_id != self.pipeline_id:
            raise ProtocolError(
                f"report for pipeline {rep.pipeline_id!r} sent to the coordinator of "
                f"{self.pipeline_id!r}"
            )
        mark = stream_mark(rep)
        key = rep.stream_key
        with self._progress_lock:
            # checked and applied under one lock: no report can slip in between
            last = self._marks.get(key)
            if clock_stepped_back(mark, last, self.clock_step_s):
                assert last is not None and last.fifo is not None and mark.fifo is not None
                logger.warning(
                    "pipeline %s stream %s: a report is stamped %.1fs before the applied one; "
                    "the sender's clock stepped back (NTP?): ordering the stream from this "
                    "report on", self.pipeline_id, key, last.fifo - mark.fifo,
                )
            if is_stale(mark, last, self.clock_step_s):
                logger.info(
                    "pipeline %s stream %s: dropped a progress report older than the one "
                    "applied (%s < %s)", self.pipeline_id, key, mark, last,
                )
                return
            self._marks[key] = mark
            self._streams[key] = rep
            self._forward_locked()

    @_in_progress_group
    def clear_progress_stream(self, *, mode: str = "train", adapter_id: str | None = None) -> None:
        """One stream ended; forward the remaining sum (or clear the pipeline's progress)."""
        key = (str(mode), None if adapter_id is None else str(adapter_id))
        with self._progress_lock:
            self._streams.pop(key, None)
            last = self._marks.get(key)
            if last is not None:
                # a report of this batch that arrives after the clear is stale (is_stale)
                self._marks[key] = dataclasses.replace(last, cleared=True)
            self._forward_locked()

    def resync_progress(self) -> bool:
        """Send the pipeline's progress as it stands again if the last forward was lost (what
        the re-send scheduled after a failure runs). True when nothing is left to send."""
        with self._progress_lock:
            self._resync_timer = None
            if not self._unsynced:
                return True
            try:
                self._forward_locked()
            except _LOST:
                return False  # _forward_locked scheduled the next try
            except Exception:
                logger.exception(
                    "pipeline %s: the scheduler refused the progress sent again after a lost "
                    "forward; not sent again (the next progress call sends it)", self.pipeline_id,
                )
                return False
            logger.info("pipeline %s: progress sent again after a lost forward was delivered",
                        self.pipeline_id)
            return True

    def _forward_locked(self) -> None:
        """Send the pipeline's progress as it stands: the streams' sum, or a clear when none
        is left (the caller holds the progress lock). A lost forward (:data:`_LOST`) is
        re-raised and sent again later; the scheduler's refusals are re-raised only."""
        try:
            if self._streams:
                self._call("report_progress", aggregate_reports(self.pipeline_id, self._streams))
            else:
                self._call("clear_progress", pipeline_id=self.pipeline_id)
        except _LOST as exc:
            self._unsynced = True
            self._schedule_resync_locked(exc)
            raise
        self._unsynced = False
        self._resync_delay = RESYNC_S

    def _schedule_resync_locked(self, exc: BaseException) -> None:
        if self._resync_timer is not None:
            return  # one re-send pending: it sends the state as it is then
        delay = self._resync_delay
        self._resync_delay = min(delay * 2, RESYNC_MAX_S)
        logger.warning(
            "pipeline %s: progress not delivered to %s (%s: %s); sending it again in %gs",
            self.pipeline_id, SCHEDULER_ACTOR, type(exc).__name__, exc, delay,
        )
        timer = threading.Timer(delay, self.resync_progress)
        timer.daemon = True
        self._resync_timer = timer
        timer.start()

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        for attempt in (0, 1):
            if self._scheduler is None:
                try:
                    self._scheduler = ray.get_actor(
                        SCHEDULER_ACTOR, namespace=self.control_namespace
                    )
                except ValueError:
                    raise CoordinatorUnavailableError(
                        f"no {SCHEDULER_ACTOR} in namespace {self.control_namespace!r}"
                    ) from None
            ref = getattr(self._scheduler, method).remote(*args, **kwargs)
            try:
                return ray.get(ref, timeout=self.call_timeout_s)
            except ray.exceptions.GetTimeoutError:
                ray.cancel(ref)
                raise CoordinatorUnavailableError(
                    f"{method} to {SCHEDULER_ACTOR} (namespace {self.control_namespace!r}) "
                    f"got no answer within {self.call_timeout_s:g}s"
                ) from None
            except ray.exceptions.RayActorError:
                # The scheduler was re-created (new actor id): look it up again once.
                self._scheduler = None
                if attempt:
                    raise
        return None


def start_pipeline_coordinator(
    pipeline_id: str,
    shard_controller: ShardController | Callable[[str], ShardController],
    *,
    control_namespace: str = "rlix",
    cls: type[PipelineCoordinator] = PipelineCoordinator,
    ray_namespace: str | None = None,
    max_concurrency: int = 8,
    detached: bool = False,
) -> Any:
    """Create the pipeline's coordinator actor under RLix's name and namespace.

    ``cls`` may be a subclass (e.g. adding host-specific methods); it is decorated here.
    ``max_concurrency`` is the thread count of the default group (resizes and the rest); the
    progress calls run on the one thread of :data:`PROGRESS_GROUP`.
    """
    # ray.remote's typed overloads leave out ``concurrency_groups``, a documented option
    remote: Any = ray.remote
    actor_cls = remote(concurrency_groups={PROGRESS_GROUP: 1})(cls)
    options: dict[str, Any] = {
        "name": pipeline_coordinator_actor(pipeline_id),
        "namespace": ray_namespace or pipeline_namespace(pipeline_id),
        "num_cpus": 0,
        "max_concurrency": max_concurrency,
    }
    if detached:
        options["lifetime"] = "detached"
    return actor_cls.options(**options).remote(
        pipeline_id, shard_controller, control_namespace=control_namespace
    )
