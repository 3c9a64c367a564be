"""Observation records a gate reads from outside a job: engine weight versions, router counters.

A job under the coordinator runs its shard controller and routers in several processes (the
driver, the pipeline's coordinator actor, NeMo RL's collector actor). What the validation
gates must judge (``after each sync every active shard serves the trainer's current weight
version``, ``zero lost or duplicated requests``) is known only inside those processes, so each
one appends typed records, one JSON object per line, to ``{RLIX_OBSERVE_DIR}/{pipeline_id}.jsonl``
and the gate reads them back (:func:`read_observations`).

* :class:`ShardVersionsObserved`: after every expand (wake + sync + activate), every active
  refresh and the exclusive run's initial sync, the version each ACTIVE shard reports from its
  engine (the receiver's record of the last version applied completely), next to the version
  the trainer had just cached and synced. Never the version the sender intended.
* :class:`RouterCountersObserved`: one router copy's bookkeeping (requests submitted, completed,
  lost, duplicated, cancelled, still in flight, re-dispatched), written when the copy drains, when
  it loses a request, and at most once a second otherwise.
* :class:`BusyObserved`: when a stage computed on which GPUs: a generation shard from its
  first running request to the end of its last (:class:`BusyRecordingEngine`), a train step
  from the grant of its GPUs to their release (the coordinator hooks). The gate checks that
  no GPU was used by two stages at once from these, independently of the coordinator.
* :class:`LifecycleObserved`: a shard preempted (which rank, on which GPUs), the Megatron
  NCCL groups destroyed or re-initialised: with the expand and train busy records, what gate
  1's overlap cycle is judged from.
* :class:`MemoryObserved`: device memory in use on the training GPUs right before the hooks
  release them (only with ``RLIX_OBSERVE_GPU_MEMORY=1``; :mod:`rlix_plugins.adapters.gpu_memory`).

Unset ``RLIX_OBSERVE_DIR``: nothing is probed or written. Lines are appended with one
``write(2)`` on an ``O_APPEND`` descriptor, so concurrent writers of one file never interleave
inside a line. The directory must be reachable by every process of the job (one node, or a
shared filesystem).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeAlias

from rlix_plugins.coordinator.core.model import ClusterSpec
from rlix_plugins.errors import RlixPluginsError
from rlix_plugins.generation.router import RouterCounters
from rlix_plugins.protocol.names import ACTOR_INFER
from rlix_plugins.settings import ENV_PIPELINE_ID
from rlix_plugins.values import is_finite, is_int

logger = logging.getLogger(__name__)

#: Directory the records go to (one ``{pipeline_id}.jsonl`` per pipeline); unset = off.
ENV_OBSERVE_DIR = "RLIX_OBSERVE_DIR"

#: Events after which shard versions are recorded.
SYNC_EVENTS = ("expand", "refresh", "initial")


class ObservationError(RlixPluginsError, ValueError):
    """An observation record or setting is malformed (names the file/line or variable)."""


def _int(value: Any, field: str, minimum: int | None = None) -> int:
    """``value`` if it is a JSON integer (not a bool, float or string) >= ``minimum``.

    ``int(...)`` would read ``0.9`` lost requests as 0, ``true`` as 1 and ``"12"`` as 12, and
    fail untyped (OverflowError) on ``Infinity``.
    """
    if not is_int(value):
        raise ObservationError(f"{field}={value!r} is not valid; expected an integer")
    if minimum is not None and value < minimum:
        raise ObservationError(f"{field}={value!r} is not valid; expected an integer >= "
                               f"{minimum}")
    return value


def _opt_int(value: Any, field: str, minimum: int | None = None) -> int | None:
    return None if value is None else _int(value, field, minimum)


def _ints(value: Any, field: str) -> tuple[int, ...]:
    """A JSON list of integers >= 0 (a string is not read as a list of digits)."""
    if not isinstance(value, list):
        raise ObservationError(f"{field}={value!r} is not valid; expected a list of integers")
    return tuple(_int(v, f"{field}[{i}]", 0) for i, v in enumerate(value))


def _check_gpus(what: str, gpus: tuple[int, ...], *, empty_ok: bool = False) -> None:
    """GPU ids (integers >= 0), at least one unless ``empty_ok``."""
    if (not gpus and not empty_ok) or any(not is_int(g) or g < 0 for g in gpus):
        raise ObservationError(
            f"{what}: gpus must be a {'' if empty_ok else 'non-empty '}list of GPU ids, got "
            f"{gpus!r}"
        )


def _seconds(value: Any, field: str) -> float:
    """A finite JSON number (wall-clock seconds)."""
    if not is_finite(value):
        raise ObservationError(f"{field}={value!r} is not valid; expected a finite number")
    return float(value)


@dataclass(frozen=True, slots=True)
class ShardVersionsObserved:
    """Weight versions the active shards serve right after a sync event.

    Attributes:
        pipeline_id: the pipeline.
        event: ``"expand"`` (woken shards synced and activated), ``"refresh"`` (active shards
            given a new version without draining) or ``"initial"`` (first sync of a shard that
            never slept).
        trainer_version: the version the trainer had cached and this event synced.
        synced: the dp ranks this event synced.
        shard_versions: every shard ACTIVE after the event -> the version its engine reports
            (``None``: the engine holds no complete version, or it cannot be asked).
        step: the trainer step, when the caller knows it.
        time: unix seconds when the versions were read.
    """

    KIND: ClassVar[str] = "shard_versions"

    pipeline_id: str
    event: str
    trainer_version: int
    synced: tuple[int, ...]
    shard_versions: Mapping[int, int | None]
    step: int | None = None
    time: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        if self.event not in SYNC_EVENTS:
            raise ObservationError(
                f"event {self.event!r} is not valid; expected one of {', '.join(SYNC_EVENTS)}"
            )

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.KIND, "pipeline_id": self.pipeline_id, "event": self.event,
            "trainer_version": self.trainer_version, "synced": list(self.synced),
            # JSON object keys are strings; the reader turns them back into ranks.
            "shard_versions": {str(r): v for r, v in sorted(self.shard_versions.items())},
            "step": self.step, "time": self.time,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> ShardVersionsObserved:
        raw_versions = d["shard_versions"]
        if not isinstance(raw_versions, dict):
            raise ObservationError(f"shard_versions={raw_versions!r} is not valid; expected "
                                   "an object of rank -> version")
        versions: dict[int, int | None] = {}
        for key, v in raw_versions.items():
            if not (isinstance(key, str) and key.isdigit() and str(int(key)) == key):
                raise ObservationError(f"shard_versions: rank {key!r} is not valid; expected "
                                       "a decimal rank such as \"0\"")
            versions[int(key)] = _opt_int(v, f"shard_versions[{key}]")
        return cls(
            pipeline_id=str(d["pipeline_id"]), event=str(d["event"]),
            trainer_version=_int(d["trainer_version"], "trainer_version"),
            synced=_ints(d["synced"], "synced"),
            shard_versions=versions,
            step=_opt_int(d.get("step"), "step"), time=_seconds(d["time"], "time"),
        )


@dataclass(frozen=True, slots=True)
class RouterCountersObserved:
    """One router copy's request bookkeeping at ``time`` (see :class:`RouterCounters`).

    ``submitted == completed + lost + cancelled + in_flight`` always holds (checked on read).
    ``lost``: requests that left the router with an error and no sample; ``duplicated``:
    submissions of a request id already in flight or already completed.
    """

    KIND: ClassVar[str] = "router_counters"

    pipeline_id: str
    copy_id: str
    submitted: int
    completed: int
    redispatched: int
    lost: int
    duplicated: int
    cancelled: int
    in_flight: int
    #: attempts moved to another shard by migration (the request still completes once);
    #: records written before the field existed read as 0
    migrated: int = 0
    time: float = field(default_factory=time.time)

    #: the counts, each >= 0 (a negative one would cancel another copy's loss in a sum)
    COUNTS: ClassVar[tuple[str, ...]] = ("submitted", "completed", "redispatched", "lost",
                                         "duplicated", "cancelled", "in_flight", "migrated")

    def __post_init__(self) -> None:
        for name in self.COUNTS:
            value = getattr(self, name)
            if value < 0:
                raise ObservationError(
                    f"router copy {self.copy_id} of {self.pipeline_id}: {name}={value} < 0; "
                    "every count must be >= 0"
                )
        if self.submitted != self.completed + self.lost + self.cancelled + self.in_flight:
            raise ObservationError(
                f"router copy {self.copy_id} of {self.pipeline_id}: submitted={self.submitted} "
                f"!= completed {self.completed} + lost {self.lost} + cancelled "
                f"{self.cancelled} + in flight {self.in_flight}"
            )

    @classmethod
    def from_counters(cls, pipeline_id: str, c: RouterCounters) -> RouterCountersObserved:
        return cls(pipeline_id, c.copy_id, c.submitted, c.completed, c.redispatched, c.lost,
                   c.duplicated, c.cancelled, c.in_flight, c.migrated)

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.KIND, "pipeline_id": self.pipeline_id, "copy_id": self.copy_id,
            "submitted": self.submitted, "completed": self.completed,
            "redispatched": self.redispatched, "lost": self.lost,
            "duplicated": self.duplicated, "cancelled": self.cancelled,
            "in_flight": self.in_flight, "migrated": self.migrated, "time": self.time,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> RouterCountersObserved:
        # "migrated" is absent from records written before request migration existed
        raw = {"migrated": 0, **d}
        counts = {name: _int(raw[name], name, 0) for name in cls.COUNTS}
        return cls(pipeline_id=str(d["pipeline_id"]), copy_id=str(d["copy_id"]),
                   time=_seconds(d["time"], "time"), **counts)


#: stages a busy record names (a generation shard, or the training cluster)
BUSY_STAGES = ("generation", "train")


@dataclass(frozen=True, slots=True)
class BusyObserved:
    """A stretch of time in which one stage of a pipeline computed on ``gpus``.

    ``generation``: shard ``shard`` had at least one request running, from its first
    request's start to its last one's end, as seen by the :class:`BusyRecordingEngine`
    wrapping the shard's engine. ``train``: the training GPUs were in use, from the grant
    of ``request_gpus`` to the ``notify_release_gpus`` call (the hooks write it). Wall-clock
    times (``time.time()``) of the writing process: the processes of a job on one node share
    the clock; across nodes the gate's check relies on their clocks agreeing.
    """

    KIND: ClassVar[str] = "busy"

    pipeline_id: str
    stage: str
    gpus: tuple[int, ...]
    start: float
    end: float
    shard: int | None = None

    def __post_init__(self) -> None:
        if self.stage not in BUSY_STAGES:
            raise ObservationError(
                f"busy record of {self.pipeline_id}: stage {self.stage!r} is not one of "
                f"{BUSY_STAGES}"
            )
        _check_gpus(f"busy record of {self.pipeline_id}", self.gpus)
        if not self.end >= self.start:
            raise ObservationError(
                f"busy record of {self.pipeline_id}: ends at {self.end} before it starts "
                f"({self.start})"
            )

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.KIND, "pipeline_id": self.pipeline_id, "stage": self.stage,
                "gpus": list(self.gpus), "start": self.start, "end": self.end,
                "shard": self.shard}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> BusyObserved:
        return cls(
            pipeline_id=str(d["pipeline_id"]), stage=str(d["stage"]),
            gpus=_ints(d["gpus"], "gpus"), start=_seconds(d["start"], "start"),
            end=_seconds(d["end"], "end"), shard=_opt_int(d.get("shard"), "shard", 0),
        )


@dataclass(frozen=True, slots=True)
class MemoryObserved:
    """Device memory in use on a pipeline's training GPUs right before it released them.

    Written by the hooks' ``after_training`` when ``RLIX_OBSERVE_GPU_MEMORY=1`` (GPU-mode
    gates), after the host offloaded its training state, destroyed its NCCL groups and put
    the overlapping shards to sleep, and before the release lets other shards wake there: the
    moment gate 1's "< 2 GiB after sleep(2) + NCCL destroy" is about. ``used_bytes[i]`` is
    GPU ``gpus[i]``'s memory in use as the driver reports it (every process), or None when it
    could not be read (``error`` says why; the gate fails such a record, never skips it).
    """

    KIND: ClassVar[str] = "memory"

    pipeline_id: str
    step: int
    gpus: tuple[int, ...]
    used_bytes: tuple[int | None, ...]
    time: float = field(default_factory=time.time)
    error: str = ""

    def __post_init__(self) -> None:
        _int(self.step, f"memory record of {self.pipeline_id}: step", 0)
        _seconds(self.time, f"memory record of {self.pipeline_id}: time")
        _check_gpus(f"memory record of {self.pipeline_id}", self.gpus)
        if len(self.used_bytes) != len(self.gpus):
            raise ObservationError(
                f"memory record of {self.pipeline_id}: {len(self.used_bytes)} readings for "
                f"{len(self.gpus)} GPUs; expected one per GPU"
            )
        if any(u is not None and (not is_int(u) or u < 0) for u in self.used_bytes):
            raise ObservationError(
                f"memory record of {self.pipeline_id}: used_bytes must be integers >= 0 or "
                f"null, got {self.used_bytes!r}"
            )
        if any(u is None for u in self.used_bytes) and not self.error:
            raise ObservationError(
                f"memory record of {self.pipeline_id}: a GPU without a reading needs the "
                "error that prevented it"
            )

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.KIND, "pipeline_id": self.pipeline_id, "step": self.step,
                "gpus": list(self.gpus), "used_bytes": list(self.used_bytes),
                "time": self.time, "error": self.error}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> MemoryObserved:
        raw = d["used_bytes"]
        if not isinstance(raw, list):
            raise ObservationError(f"used_bytes={raw!r} is not valid; expected a list of "
                                   "integers or nulls")
        return cls(
            pipeline_id=str(d["pipeline_id"]), step=_int(d["step"], "step"),
            gpus=_ints(d["gpus"], "gpus"),
            used_bytes=tuple(_opt_int(v, f"used_bytes[{i}]", 0) for i, v in enumerate(raw)),
            time=_seconds(d["time"], "time"), error=str(d.get("error") or ""),
        )


#: lifecycle events a record names: a shard preempted (abort, drain, sleep), the training
#: side's Megatron NCCL groups destroyed or re-initialised
LIFECYCLE_EVENTS = ("shrink", "nccl_destroy", "nccl_reinit")


@dataclass(frozen=True, slots=True)
class LifecycleObserved:
    """One step of the time-sharing cycle, as the process that did it saw it end.

    ``shrink``: shard ``rank`` (on ``gpus``) was preempted: aborted, drained, put to sleep
    (the shard controller, once per rank it took down; a rank already asleep is not taken
    down again and writes nothing). ``nccl_destroy`` / ``nccl_reinit``: the pipeline's
    Megatron groups were destroyed after a step / re-made before one (the host adapter, after
    the workers returned). The gate judges gate 1's overlap cycle from these, the expand
    records and the train busy records (:func:`rlix_plugins.gates.observed.overlap_from_records`).
    """

    KIND: ClassVar[str] = "lifecycle"

    pipeline_id: str
    event: str
    time: float = field(default_factory=time.time)
    step: int | None = None
    rank: int | None = None
    gpus: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.event not in LIFECYCLE_EVENTS:
            raise ObservationError(
                f"lifecycle record of {self.pipeline_id}: event {self.event!r} is not one of "
                f"{LIFECYCLE_EVENTS}"
            )
        what = f"lifecycle record of {self.pipeline_id}"
        _check_gpus(what, self.gpus, empty_ok=True)
        _opt_int(self.step, f"{what}: step", 0)
        _opt_int(self.rank, f"{what}: rank", 0)
        _seconds(self.time, f"{what}: time")
        shrink = self.event == "shrink"
        if shrink != (self.rank is not None):
            raise ObservationError(
                f"lifecycle record of {self.pipeline_id}: a shrink names its rank and only a "
                f"shrink does (event {self.event!r}, rank {self.rank!r})"
            )

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.KIND, "pipeline_id": self.pipeline_id, "event": self.event,
                "time": self.time, "step": self.step, "rank": self.rank,
                "gpus": list(self.gpus)}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> LifecycleObserved:
        return cls(
            pipeline_id=str(d["pipeline_id"]), event=str(d["event"]),
            time=_seconds(d["time"], "time"), step=_opt_int(d.get("step"), "step"),
            rank=_opt_int(d.get("rank"), "rank", 0), gpus=_ints(d.get("gpus", []), "gpus"),
        )


class BusyRecordingEngine:
    """:class:`~rlix_plugins.generation.engine.ShardEngine` wrapper that records when its
    shard computes: one :class:`BusyObserved` per stretch with >= 1 request running, handed
    to ``record`` when the last request's call returns. Wrap the engines the preemption
    controller drains (the same objects), so a drain that saw the shard idle saw every
    interval closed. Every other attribute (optional capabilities such as
    ``abort_requests``) is the inner engine's.
    """

    def __init__(self, inner: Any, *, pipeline_id: str, shard: int, gpus: Sequence[int],
                 record: Callable[[BusyObserved], None]) -> None:
        self.inner = inner
        self.pipeline_id = pipeline_id
        self.shard = shard
        self.gpus = tuple(int(g) for g in gpus)
        self._record = record
        self._running = 0
        self._since = 0.0

    def __getattr__(self, name: str) -> Any:
        # Only reached for names the wrapper lacks; dunders (pickle's probes on a
        # half-built object) must not recurse into a missing ``inner``.
        if name.startswith("__") or "inner" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.__dict__["inner"], name)

    async def generate(self, request: Any) -> Any:
        if self._running == 0:
            self._since = time.time()
        self._running += 1
        try:
            return await self.inner.generate(request)
        finally:
            self._running -= 1
            if self._running == 0:
                try:
                    # a wall clock stepped back (NTP) since the start is clamped: a record
                    # refused for ending before it starts would hide the stretch from the gate
                    self._record(BusyObserved(self.pipeline_id, "generation", self.gpus,
                                              self._since, max(time.time(), self._since),
                                              self.shard))
                except Exception:  # a lost record fails the gate; it must not fail a request
                    logger.exception("busy record of shard %d not written", self.shard)

    async def abort_all(self) -> int:
        return int(await self.inner.abort_all())

    async def num_running(self) -> int:
        return int(await self.inner.num_running())

    async def sleep(self, level: int | None = None) -> None:
        await self.inner.sleep(level)

    async def wake_up(self) -> None:
        await self.inner.wake_up()

    async def resume(self) -> None:
        await self.inner.resume()


def shard_gpus(gpus: Sequence[int], tp: int) -> list[tuple[int, ...]]:
    """GPU ids of each dp rank of an inference cluster registered on ``gpus`` with ``tp``
    (the coordinator's own rule, :meth:`ClusterSpec.rank_gpus`)."""
    if tp < 1 or len(gpus) % tp:
        raise ObservationError(f"{len(gpus)} inference GPUs do not split into ranks of tp={tp}")
    spec = ClusterSpec("", "", ACTOR_INFER, tp, tuple(int(g) for g in gpus))
    return [spec.rank_gpus(r) for r in range(spec.dp_size)]


def recording_engines(engines: Sequence[Any], pipeline_id: str | None,
                      gpus: Sequence[int] | None, tp: int = 1,
                      writer: ObservationWriter | None = None) -> list[Any]:
    """``engines`` wrapped in :class:`BusyRecordingEngine` writing to ``writer`` (default:
    ``RLIX_OBSERVE_DIR``); unchanged when records are off or the GPUs are unknown."""
    writer = writer if writer is not None else ObservationWriter.from_env(pipeline_id)
    if not writer.enabled or gpus is None or writer.pipeline_id is None:
        return list(engines)
    per_rank = shard_gpus(gpus, tp)
    if len(per_rank) != len(engines):
        raise ObservationError(f"{len(engines)} shard engines but {len(per_rank)} ranks on "
                               f"GPUs {list(gpus)} (tp={tp})")
    return [BusyRecordingEngine(e, pipeline_id=writer.pipeline_id, shard=r, gpus=g,
                                record=writer.write)
            for r, (e, g) in enumerate(zip(engines, per_rank, strict=True))]


Observation: TypeAlias = (
    ShardVersionsObserved | RouterCountersObserved | BusyObserved | MemoryObserved
    | LifecycleObserved
)
_KINDS: dict[str, type[ShardVersionsObserved] | type[RouterCountersObserved]
             | type[BusyObserved] | type[MemoryObserved] | type[LifecycleObserved]] = {
    ShardVersionsObserved.KIND: ShardVersionsObserved,
    RouterCountersObserved.KIND: RouterCountersObserved,
    BusyObserved.KIND: BusyObserved,
    MemoryObserved.KIND: MemoryObserved,
    LifecycleObserved.KIND: LifecycleObserved,
}


def observe_dir_from_env(env: Mapping[str, str] | None = None) -> Path | None:
    """``RLIX_OBSERVE_DIR`` as a path; None when unset. Set but empty is an error."""
    env = os.environ if env is None else env
    raw = env.get(ENV_OBSERVE_DIR)
    if raw is None:
        return None
    if not raw.strip():
        raise ObservationError(
            f"{ENV_OBSERVE_DIR} is set but empty; unset it (no records) or name a directory"
        )
    return Path(raw.strip())


def _check_pipeline_id(pipeline_id: str) -> str:
    # The id becomes a file name: no separators, no hidden or parent names.
    if not pipeline_id or "/" in pipeline_id or os.sep in pipeline_id \
            or "\0" in pipeline_id or pipeline_id.startswith("."):
        raise ObservationError(
            f"pipeline id {pipeline_id!r} cannot name a record file; expected a non-empty id "
            "without path separators, NUL bytes or a leading '.' (e.g. 'ft_0123456789ab')"
        )
    return pipeline_id


class ObservationWriter:
    """Appends records of one pipeline to ``{directory}/{pipeline_id}.jsonl``.

    Picklable (a path and an id), so a controller or router carries it into other processes.
    Disabled (every call a no-op) when ``directory`` or ``pipeline_id`` is None.
    """

    def __init__(self, directory: Path | None, pipeline_id: str | None) -> None:
        self.directory = directory
        self.pipeline_id = None if pipeline_id is None else _check_pipeline_id(pipeline_id)
        self._warned = False

    @classmethod
    def from_env(cls, pipeline_id: str | None = None,
                 env: Mapping[str, str] | None = None) -> ObservationWriter:
        """Directory from ``RLIX_OBSERVE_DIR``; pipeline id given or from ``PIPELINE_ID``."""
        env = os.environ if env is None else env
        directory = observe_dir_from_env(env)
        pid = pipeline_id or (env.get(ENV_PIPELINE_ID) or "").strip() or None
        if directory is not None and pid is None:
            logger.warning("%s is set but no pipeline id is known (%s unset): no records",
                           ENV_OBSERVE_DIR, ENV_PIPELINE_ID)
        return cls(directory, pid)

    @property
    def enabled(self) -> bool:
        return self.directory is not None and self.pipeline_id is not None

    @property
    def path(self) -> Path | None:
        if self.directory is None or self.pipeline_id is None:
            return None
        return self.directory / f"{self.pipeline_id}.jsonl"

    def write(self, record: Observation) -> None:
        """Append ``record`` as one line (one ``write`` call). I/O errors are logged, never
        raised: a missing record makes the gate criterion fail as "not observed" instead."""
        path = self.path
        if path is None:
            return
        if record.pipeline_id != self.pipeline_id:
            raise ObservationError(
                f"record of pipeline {record.pipeline_id!r} given to the writer of "
                f"{self.pipeline_id!r}"
            )
        data = (json.dumps(record.to_json(), separators=(",", ":")) + "\n").encode()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                written = os.write(fd, data)
            finally:
                os.close(fd)
            if written != len(data):
                raise OSError(f"short write: {written} of {len(data)} bytes")
        except OSError:
            if not self._warned:
                self._warned = True
                logger.warning("cannot append observation records to %s", path, exc_info=True)

    def __getstate__(self) -> dict[str, Any]:
        return {"directory": self.directory, "pipeline_id": self.pipeline_id}

    def __setstate__(self, state: dict[str, Any]) -> None:
        ObservationWriter.__init__(self, state["directory"], state["pipeline_id"])


class RouterCountersEmitter:
    """``on_counters`` callback of a :class:`~rlix_plugins.generation.router.ShardRouter`:
    writes each counters snapshot as a :class:`RouterCountersObserved` (picklable)."""

    def __init__(self, writer: ObservationWriter) -> None:
        self.writer = writer

    def __call__(self, counters: RouterCounters) -> None:
        pid = self.writer.pipeline_id
        if pid is not None and self.writer.enabled:
            self.writer.write(RouterCountersObserved.from_counters(pid, counters))


def router_counters_emitter(pipeline_id: str | None = None) -> RouterCountersEmitter | None:
    """An emitter writing to ``RLIX_OBSERVE_DIR``, or None when observation is off."""
    writer = ObservationWriter.from_env(pipeline_id)
    return RouterCountersEmitter(writer) if writer.enabled else None


# ---------------------------------------------------------------------------- version probes

#: ``await probe(dp_ranks)`` -> each rank's engine-reported weight version (None = unknown).
VersionProbe = Callable[[Sequence[int]], Coroutine[Any, Any, dict[int, int | None]]]


async def _gather_versions(
    ranks: Sequence[int], ask: Callable[[int], Awaitable[Any]]
) -> dict[int, int | None]:
    replies = await asyncio.gather(*(ask(r) for r in ranks), return_exceptions=True)
    out: dict[int, int | None] = {}
    for r, v in zip(ranks, replies, strict=True):
        if isinstance(v, BaseException):
            logger.warning("shard %d: weight version probe failed: %r", r, v)
            out[r] = None
        else:
            out[r] = None if v is None else int(v)
    return out


def engine_version_probe(engines: Sequence[Any]) -> VersionProbe:
    """Probe through each engine's ``async weight_version()`` (host shard engines such as
    :class:`~rlix_plugins.adapters.nemo_rl_generation.NemoRlShard`); an engine without it
    reports None, so the gate fails instead of trusting the sender."""

    async def probe(ranks: Sequence[int]) -> dict[int, int | None]:
        async def ask(r: int) -> Any:
            fn = getattr(engines[r], "weight_version", None)
            return None if fn is None else await fn()

        return await _gather_versions(ranks, ask)

    return probe


def collective_rpc_version_probe(engines: Sequence[Any]) -> VersionProbe:
    """Probe in-process ``AsyncLLM`` engines loaded with
    :class:`~rlix_plugins.training.vllm_receiver.RlixWeightReceiverExtension` (its
    ``rlix_weight_version``, read in every worker of the shard: the shard's version only when
    all its workers hold it, else None)."""
    from rlix_plugins.training.vllm_receiver import common_version

    async def probe(ranks: Sequence[int]) -> dict[int, int | None]:
        async def ask(r: int) -> Any:
            # One reply per worker: with TP > 1 a sync that failed on one worker leaves it on
            # an older version (or none) while worker 0 reports the new one.
            return common_version(await engines[r].collective_rpc("rlix_weight_version"))

        return await _gather_versions(ranks, ask)

    return probe


# ---------------------------------------------------------------------------- reader


@dataclass(frozen=True, slots=True)
class Observations:
    """Every record read from one directory, in file order per pipeline."""

    directory: Path
    shard_versions: tuple[ShardVersionsObserved, ...]
    router_counters: tuple[RouterCountersObserved, ...]
    files: tuple[str, ...]
    busy: tuple[BusyObserved, ...] = ()
    memory: tuple[MemoryObserved, ...] = ()
    lifecycle: tuple[LifecycleObserved, ...] = ()

    @property
    def empty(self) -> bool:
        return not (self.shard_versions or self.router_counters or self.busy or self.memory
                    or self.lifecycle)

    def pipelines(self) -> list[str]:
        ids = {r.pipeline_id for r in self.shard_versions}
        ids |= {r.pipeline_id for r in self.busy}
        ids |= {r.pipeline_id for r in self.memory}
        ids |= {r.pipeline_id for r in self.lifecycle}
        return sorted(ids | {r.pipeline_id for r in self.router_counters})


def parse_line(line: str, where: str) -> Observation:
    """One record from one JSON line; ``where`` (``file:line``) names it in errors."""
    try:
        raw = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ObservationError(f"{where}: not a JSON object ({exc.msg})") from None
    if not isinstance(raw, dict):
        raise ObservationError(f"{where}: expected a JSON object, got {type(raw).__name__}")
    cls = _KINDS.get(str(raw.get("kind")))
    if cls is None:
        raise ObservationError(
            f"{where}: kind {raw.get('kind')!r} is not valid; expected one of "
            f"{', '.join(sorted(_KINDS))}"
        )
    try:
        return cls.from_json(raw)
    except ObservationError as exc:
        raise ObservationError(f"{where}: {exc}") from None
    except (KeyError, TypeError, ValueError) as exc:
        raise ObservationError(f"{where}: malformed {cls.KIND} record ({exc!r})") from None


def read_observations(directory: Path) -> Observations:
    """All records under ``directory`` (``*.jsonl``); an absent directory reads as empty.

    Raises:
        ObservationError: a line is not a valid record (names the file and line).
    """
    versions: list[ShardVersionsObserved] = []
    counters: list[RouterCountersObserved] = []
    busy: list[BusyObserved] = []
    memory: list[MemoryObserved] = []
    lifecycle: list[LifecycleObserved] = []
    files = sorted(directory.glob("*.jsonl")) if directory.is_dir() else []
    for path in files:
        for i, raw in enumerate(path.read_bytes().splitlines(), start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ObservationError(f"{path}:{i}: not UTF-8 text ({exc.reason} at byte "
                                       f"{exc.start})") from None
            if not line.strip():
                continue
            rec = parse_line(line, f"{path}:{i}")
            if isinstance(rec, ShardVersionsObserved):
                versions.append(rec)
            elif isinstance(rec, BusyObserved):
                busy.append(rec)
            elif isinstance(rec, MemoryObserved):
                memory.append(rec)
            elif isinstance(rec, LifecycleObserved):
                lifecycle.append(rec)
            else:
                counters.append(rec)
    return Observations(directory, tuple(versions), tuple(counters),
                        tuple(p.name for p in files), tuple(busy), tuple(memory),
                        tuple(lifecycle))


def write_all(directory: Path, records: Iterable[Observation]) -> None:
    """Append ``records`` under ``directory`` (each to its pipeline's file); for tools/tests."""
    writers: dict[str, ObservationWriter] = {}
    for rec in records:
        w = writers.setdefault(rec.pipeline_id, ObservationWriter(directory, rec.pipeline_id))
        w.write(rec)


__all__ = [
    "BUSY_STAGES",
    "ENV_OBSERVE_DIR",
    "LIFECYCLE_EVENTS",
    "BusyObserved",
    "BusyRecordingEngine",
    "LifecycleObserved",
    "MemoryObserved",
    "Observation",
    "ObservationError",
    "ObservationWriter",
    "Observations",
    "RouterCountersEmitter",
    "RouterCountersObserved",
    "ShardVersionsObserved",
    "VersionProbe",
    "collective_rpc_version_probe",
    "engine_version_probe",
    "observe_dir_from_env",
    "parse_line",
    "read_observations",
    "recording_engines",
    "router_counters_emitter",
    "shard_gpus",
    "write_all",
]
