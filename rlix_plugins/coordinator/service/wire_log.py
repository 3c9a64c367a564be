"""What each pipeline said to the scheduler over the wire protocol, and which calls failed.

Per pipeline: how often each protocol method was called, which calls failed and with which
error, which classes its progress reports and priorities were (RLix's own
``rlix.protocol.types`` classes from a ROLL pipeline, ours from NeMo RL and veRL), and at
which priorities it asked for GPUs. Gate 3 judges a ROLL pipeline's protocol from it
(``gates.criteria.roll_protocol``): the evidence is what the coordinator RECEIVED, not what a
sender says it sent.

Counters only (no per-call history), for at most :data:`MAX_PIPELINES` pipelines (the least
recently heard from is forgotten first), so a long-lived coordinator keeps a bounded log.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

from rlix_plugins.errors import ProtocolError
from rlix_plugins.protocol.names import parse_cluster_id
from rlix_plugins.protocol.types import coerce_priority

logger = logging.getLogger(__name__)

#: pipelines kept; a coordinator serving more forgets the least recently heard from
MAX_PIPELINES = 1024
#: the key of calls whose pipeline could not be read from their arguments
UNKNOWN_CALLER = "?"

_PIPELINE_ARGS = ("pipeline_id",)
_CLUSTER_ARGS = ("cluster_id", "request_cluster_id", "release_cluster_id")
_PRIORITY_ARGS = ("priority", "request_priority")


@dataclass(frozen=True, slots=True)
class PipelineWire:
    """One pipeline's calls as the scheduler received them (counts since it first called)."""

    pipeline_id: str
    #: method -> calls received
    calls: dict[str, int]
    #: "method: ErrorType" -> calls that raised it (refused, timed out, cancelled)
    failures: dict[str, int]
    #: qualified class of each progress report received -> count
    report_classes: dict[str, int]
    #: qualified class of each priority received -> count
    priority_classes: dict[str, int]
    #: "method: PRIORITY" -> requests at that priority ("method: invalid" if unreadable)
    priorities: dict[str, int]

    def requested(self, priority: str) -> int:
        """Requests at ``priority`` (a Priority name) through any method."""
        return sum(n for key, n in self.priorities.items() if key.split(": ", 1)[1] == priority)

    def failed(self) -> int:
        """Calls that raised, all methods together."""
        return sum(self.failures.values())


class _Entry:
    """The mutable counters behind one :class:`PipelineWire`."""

    __slots__ = ("calls", "failures", "priorities", "priority_classes", "report_classes")

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.failures: Counter[str] = Counter()
        self.report_classes: Counter[str] = Counter()
        self.priority_classes: Counter[str] = Counter()
        self.priorities: Counter[str] = Counter()


def qualified_class(obj: object) -> str:
    """``module.QualName`` of ``obj``'s class, as it was unpickled here."""
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def caller_of(kwargs: Mapping[str, Any]) -> str:
    """The pipeline a call speaks for: its ``pipeline_id``, its report's, or the pipeline of
    a cluster id it names; :data:`UNKNOWN_CALLER` when none of them reads."""
    for name in _PIPELINE_ARGS:
        value = kwargs.get(name)
        if isinstance(value, str) and value:
            return value
    report = kwargs.get("report")
    pid = getattr(report, "pipeline_id", None)
    if pid is None and isinstance(report, Mapping):
        pid = report.get("pipeline_id")
    if isinstance(pid, str) and pid:
        return pid
    for name in _CLUSTER_ARGS:
        if name in kwargs:
            try:
                return parse_cluster_id(kwargs[name])[0]
            except ProtocolError:
                continue
    return UNKNOWN_CALLER


class WireLog:
    """Counters of protocol calls per pipeline (see module docstring). Not thread-safe: the
    scheduler actor runs on one event loop."""

    def __init__(
        self,
        max_pipelines: int = MAX_PIPELINES,
        on_failure: Callable[[str, str], None] | None = None,
    ) -> None:
        """``on_failure(method, error type name)`` is told of every failed call (metrics)."""
        if max_pipelines < 1:
            raise ValueError(f"max_pipelines must be >= 1, got {max_pipelines!r}")
        self._max = max_pipelines
        self._on_failure = on_failure
        self._entries: OrderedDict[str, _Entry] = OrderedDict()

    def _entry(self, pipeline_id: str) -> _Entry:
        entry = self._entries.get(pipeline_id)
        if entry is None:
            entry = self._entries[pipeline_id] = _Entry()
            while len(self._entries) > self._max:
                self._entries.popitem(last=False)
        else:
            self._entries.move_to_end(pipeline_id)
        return entry

    def received(self, method: str, kwargs: Mapping[str, Any]) -> str:
        """Count a call of ``method`` with keyword arguments ``kwargs``; returns the caller."""
        caller = caller_of(kwargs)
        entry = self._entry(caller)
        entry.calls[method] += 1
        if "report" in kwargs:
            entry.report_classes[qualified_class(kwargs["report"])] += 1
        for name in _PRIORITY_ARGS:
            if name in kwargs:
                value = kwargs[name]
                entry.priority_classes[qualified_class(value)] += 1
                try:
                    label = coerce_priority(value).name
                except (ProtocolError, TypeError, ValueError):
                    label = "invalid"
                entry.priorities[f"{method}: {label}"] += 1
        return caller

    def raised(self, caller: str, method: str, exc: BaseException) -> None:
        """Count a call of ``method`` by ``caller`` that raised ``exc``."""
        error = type(exc).__name__
        self._entry(caller).failures[f"{method}: {error}"] += 1
        if self._on_failure is not None:
            try:
                self._on_failure(method, error)
            except Exception:  # metrics must never change the error the caller gets
                logger.warning("failure hook of %s raised", method, exc_info=True)

    def snapshot(self) -> dict[str, PipelineWire]:
        """Every pipeline's counters now (copies: later calls do not change them)."""
        return {
            pid: PipelineWire(pid, dict(e.calls), dict(e.failures), dict(e.report_classes),
                              dict(e.priority_classes), dict(e.priorities))
            for pid, e in self._entries.items()
        }


def format_wire(wire: Mapping[str, PipelineWire]) -> str:
    """A block per pipeline (``rlix-plugins status --wire``): calls, failures, classes."""
    if not wire:
        return "no protocol calls received"

    def counts(items: Mapping[str, int]) -> str:
        return ", ".join(f"{k} {n}" for k, n in sorted(items.items())) or "-"

    lines: list[str] = []
    for pid in sorted(wire):
        w = wire[pid]
        lines += [
            f"{pid}: {sum(w.calls.values())} calls, {w.failed()} failed",
            f"  calls: {counts(w.calls)}",
            f"  failures: {counts(w.failures)}",
            f"  report classes: {counts(w.report_classes)}",
            f"  priority classes: {counts(w.priority_classes)}",
            f"  priorities: {counts(w.priorities)}",
        ]
    return "\n".join(lines)


class HasWireLog(Protocol):
    """An object whose protocol methods :func:`on_wire` counts."""

    wire_log: WireLog


S = TypeVar("S", bound=HasWireLog)
P = ParamSpec("P")
R = TypeVar("R")


def on_wire(
    method: str,
) -> Callable[[Callable[Concatenate[S, P], Awaitable[R]]],
              Callable[Concatenate[S, P], Coroutine[Any, Any, R]]]:
    """Count every call of the decorated async method in ``self.wire_log`` under ``method``,
    and the error of every call that raises (then re-raised unchanged). Arguments are read by
    name whether they came by keyword or by position (``report_progress(report)``)."""

    def decorate(
        fn: Callable[Concatenate[S, P], Awaitable[R]],
    ) -> Callable[Concatenate[S, P], Coroutine[Any, Any, R]]:
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        async def counted(self: S, /, *args: P.args, **kwargs: P.kwargs) -> R:
            try:
                named: Mapping[str, Any] = signature.bind_partial(self, *args, **kwargs).arguments
            except TypeError:  # the call itself raises it below, and is counted then
                named = kwargs
            caller = self.wire_log.received(method, named)
            try:
                return await fn(self, *args, **kwargs)
            except BaseException as exc:  # counted, never swallowed
                self.wire_log.raised(caller, method, exc)
                raise

        return counted

    return decorate


__all__ = [
    "MAX_PIPELINES",
    "UNKNOWN_CALLER",
    "HasWireLog",
    "PipelineWire",
    "WireLog",
    "caller_of",
    "format_wire",
    "on_wire",
    "qualified_class",
]
