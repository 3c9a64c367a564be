"""The pipeline-side coordinator actor, served as ``rlix:coordinator:{pipeline_id}``.

The scheduler calls ``resize_infer`` on it; it delegates to a :class:`ShardController` (the
generation module's shard router: shrink = preempt/abort/drain/sleep, expand = wake + sync +
activate). It also aggregates the progress streams of the pipeline's rollout schedulers into
one report for the scheduler.

Concurrency: resizes are serialised by their own lock, and progress calls never wait for a
resize (the actor runs with several threads), so a long weight sync during an expand does not
stall demand reporting (RLix holds one lock across the whole sync).

Keep :class:`PipelineCoordinator` undecorated; :func:`start_pipeline_coordinator` serves it (or a
subclass) through ``ray.remote`` (Ray freezes decorated classes).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol, runtime_checkable

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
    """Undecorated implementation of ``rlix:coordinator:{pipeline_id}``."""

    def __init__(
        self,
        pipeline_id: str,
        shard_controller: ShardController | Callable[[str], ShardController],
        *,
        control_namespace: str = "rlix",
        scheduler: Any = None,
        call_timeout_s: float = 60.0,
    ) -> None:
        self.pipeline_id = validate_pipeline_id(pipeline_id)
        if not is_finite(call_timeout_s) or call_timeout_s <= 0:
            raise ProtocolError(
                f"call_timeout_s must be finite seconds > 0, got {call_timeout_s!r}"
            )
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
    def report_progress_from_scheduler(self, report: Any) -> None:
        """A rollout scheduler's progress for one stream (mode, adapter): forward the sum."""
        rep = coerce_progress_report(report)
        if rep.pipeline_id != self.pipeline_id:
            raise ProtocolError(
                f"report for pipeline {rep.pipeline_id!r} sent to the coordinator of "
                f"{self.pipeline_id!r}"
            )
        with self._progress_lock:
            self._streams[rep.stream_key] = rep
            aggregated = aggregate_reports(self.pipeline_id, self._streams)
            self._call("report_progress", aggregated)

    def clear_progress_stream(self, *, mode: str = "train", adapter_id: str | None = None) -> None:
        """One stream ended; forward the remaining sum (or clear the pipeline's progress)."""
        with self._progress_lock:
            self._streams.pop((str(mode), None if adapter_id is None else str(adapter_id)), None)
            if self._streams:
                self._call("report_progress", aggregate_reports(self.pipeline_id, self._streams))
            else:
                self._call("clear_progress", pipeline_id=self.pipeline_id)

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        import ray

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
    """
    import ray

    actor_cls = ray.remote(cls)
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
