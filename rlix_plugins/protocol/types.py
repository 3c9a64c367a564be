"""RLix-compatible wire types.

ROLL pickles RLix's own classes (module ``rlix.protocol.types``) across Ray; the coordinator
accepts any object with the right fields (:func:`coerce_progress_report`), never by
``isinstance`` against these classes.
"""

from __future__ import annotations

import contextlib
import enum
import math
import operator
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rlix_plugins.errors import ProtocolError
from rlix_plugins.protocol.names import validate_pipeline_id
from rlix_plugins.values import is_finite, is_int, is_number

#: Progress is reported in 2% steps: bucket 0..50.
PROGRESS_BUCKETS = 50
#: Optional progress metric (our extension; RLix's scheduler ignores unknown metrics):
#: requests the pipeline has admitted and not finished, over every step its staleness bound
#: lets it generate (in flight on a shard or waiting for one).
OUTSTANDING_METRIC = "outstanding"


class Priority(enum.IntEnum):
    """Stage priority; a lower value wins."""

    INITIALIZATION = 0
    ACTOR_TRAINING = 1
    CRITIC_TRAINING = 2
    OLD_LOG_PROBS = 3
    REF_LOG_PROBS = 4
    VALUE_COMPUTE = 5
    GENERATION = 6


def coerce_priority(value: object) -> Priority:
    """Read a wire priority; raise :class:`ProtocolError` (listing the valid ones) if bad.

    Accepted: a ``Priority`` of any module (RLix's ``rlix.protocol.types.Priority`` unpickles
    as a different IntEnum class, or as :mod:`rlix_compat`'s stand-in), any other integer
    (``int``, ``numpy.int64``) or integral float with a valid value, and a priority name
    (``"GENERATION"``, or an object whose ``name`` is one). Refused: ``bool`` (``True`` would
    silently mean ACTOR_TRAINING), non-integral or non-finite floats, numeric strings and
    unknown values or names.
    """
    if isinstance(value, Priority):
        return value
    raw: int | None = None
    if isinstance(value, bool):
        pass
    elif isinstance(value, str):
        if value in Priority.__members__:
            return Priority[value]
    elif isinstance(value, float):
        if math.isfinite(value) and value.is_integer():
            raw = int(value)
    else:
        try:
            raw = operator.index(value)  # type: ignore[arg-type]  # any int-like, not floats
        except TypeError:
            name = getattr(value, "name", None)
            if isinstance(name, str) and name in Priority.__members__:
                return Priority[name]
    if raw is not None:
        with contextlib.suppress(ValueError):
            return Priority(raw)
    valid = ", ".join(f"{p.name}={p.value}" for p in Priority)
    raise ProtocolError(
        f"priority {value!r} ({type(value).__name__}) is not valid; expected a Priority, its "
        f"int value or its name: {valid}"
    )


@dataclass(frozen=True, slots=True)
class ProgressReport:
    """A pipeline's generation progress (demand) for its current step."""

    pipeline_id: str
    step_target_trajectories: int
    fifo_timestamp: float | None = None
    metrics: dict[str, Any] | None = None

    @property
    def completed(self) -> int:
        """Trajectories collected for the current weight version, capped at the target."""
        metrics = self.metrics or {}
        raw = metrics.get("completed", metrics.get("collected", 0))
        return min(int(raw), self.step_target_trajectories)

    @property
    def remaining(self) -> int:
        return self.step_target_trajectories - self.completed

    @property
    def outstanding(self) -> int | None:
        """The optional ``outstanding`` metric (requests admitted and not finished over every
        step the staleness bound lets the pipeline generate); None when it is absent or
        malformed (not a number, negative, NaN or infinite): a bad value is ignored, never an
        error."""
        raw = (self.metrics or {}).get(OUTSTANDING_METRIC)
        return int(raw) if is_number(raw) and 0 <= raw < math.inf else None

    @property
    def stream_key(self) -> tuple[str, str | None]:
        """(mode, adapter_id): a pipeline may report several progress streams."""
        metrics = self.metrics or {}
        mode = metrics.get("mode", "train")
        adapter = metrics.get("adapter_id")
        return (str(mode), None if adapter is None else str(adapter))


@dataclass(frozen=True, slots=True)
class ActionResponse:
    """Answer of ``resize_infer`` and friends."""

    success: bool
    message: str = ""


def progress_bucket(completed: int, target: int) -> int:
    """Map completed/target to a 2% bucket in 0..50 (exact integer arithmetic: a float
    ``completed / target * 50`` puts e.g. 29 of 50 in bucket 28)."""
    if target <= 0:
        return PROGRESS_BUCKETS
    return min(max(completed, 0), target) * PROGRESS_BUCKETS // target


def coerce_progress_report(obj: object) -> ProgressReport:
    """Read a progress report from any object with RLix's fields (or a mapping)."""

    def field(name: str, default: object = ...) -> object:
        if isinstance(obj, Mapping):
            if name in obj:
                return obj[name]
        elif hasattr(obj, name):
            return getattr(obj, name)
        if default is ...:
            raise ProtocolError(
                f"progress report {type(obj).__name__} lacks field {name!r}; expected fields "
                "pipeline_id, step_target_trajectories, fifo_timestamp, metrics"
            )
        return default

    pipeline_id = validate_pipeline_id(field("pipeline_id"))
    target = field("step_target_trajectories")
    if not is_int(target) or target < 0:
        raise ProtocolError(f"step_target_trajectories must be an int >= 0, got {target!r}")
    fifo = field("fifo_timestamp", None)
    # bool is an int and NaN/inf are floats: neither is a time
    if fifo is not None and not is_finite(fifo):
        raise ProtocolError(f"fifo_timestamp must be a finite number or None, got {fifo!r}")
    metrics = field("metrics", None)
    if metrics is not None and not isinstance(metrics, Mapping):
        raise ProtocolError(f"metrics must be a mapping or None, got {type(metrics).__name__}")
    metrics_dict = dict(metrics) if metrics is not None else None
    if metrics_dict is not None:
        raw = metrics_dict.get("completed", metrics_dict.get("collected", 0))
        if not is_int(raw) or raw < 0:
            raise ProtocolError(f"metrics['completed'] must be an int >= 0, got {raw!r}")
    return ProgressReport(
        pipeline_id=pipeline_id,
        step_target_trajectories=target,
        fifo_timestamp=None if fifo is None else float(fifo),
        metrics=metrics_dict,
    )
