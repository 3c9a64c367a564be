"""What the scheduler saves besides the core state: written by :func:`write_record`, read
back strictly by :meth:`SavedRecord.read`.

The record is JSON (a file or Ray's KV store): anything in it may have been damaged or written
by another release, so every field is checked on the way in and a bad one is a
:class:`CorruptStateError` naming it, never a KeyError or TypeError from deep in recovery.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from rlix_plugins.coordinator.core.status import DeadPipeline
from rlix_plugins.errors import CorruptStateError
from rlix_plugins.values import is_finite, is_int


@dataclass(frozen=True, slots=True)
class InflightIntent:
    """A cycle's resizes between its plan and its commit (what a restart settles)."""

    #: ``(cluster_id, dp_rank)`` shrinks that answered success
    confirmed_shrinks: tuple[tuple[str, int], ...] = ()
    #: ``(cluster_id, dp_rank)`` expands sent (or about to be) without a known answer
    expands: tuple[tuple[str, int], ...] = ()

    def to_json(self) -> dict[str, list[list[object]]]:
        return {
            "confirmed_shrinks": [[c, r] for c, r in self.confirmed_shrinks],
            "expands": [[c, r] for c, r in self.expands],
        }


@dataclass(frozen=True, slots=True)
class SavedRecord:
    """The saved record: the core's snapshot plus the service's own bookkeeping."""

    #: :func:`rlix_plugins.coordinator.core.snapshot.snapshot`'s output (checked by restore)
    state: dict[str, Any]
    #: the in-flight records as saved: settle_inflight checks each (they stay untyped here)
    inflight: _RawInflight | None
    dead: tuple[DeadPipeline, ...]
    seen: tuple[str, ...]
    leased: tuple[str, ...]
    fencing: dict[str, str]
    #: GPUs each recent unregistration freed (absent from older records): a call Ray retries
    #: on the restarted scheduler gets the first call's answer
    unregistered: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)

    @staticmethod
    def read(record: Mapping[str, Any]) -> SavedRecord:
        """``record`` checked field by field (:class:`CorruptStateError` naming the field)."""
        state = record.get("state")
        if not isinstance(state, dict):
            raise CorruptStateError("the saved record has no 'state' object")
        return SavedRecord(
            state=state,
            inflight=_read_inflight(record.get("inflight")),
            dead=tuple(_read_dead(d) for d in _list(record, "dead")),
            seen=_strings(record, "seen"),
            leased=_strings(record, "leased"),
            fencing=_reasons(record.get("fencing", {})),
            unregistered=_freed(record.get("unregistered", {})),
        )


def write_record(
    *,
    state: dict[str, Any],
    inflight: InflightIntent | None,
    dead: Iterable[DeadPipeline],
    seen: Iterable[str],
    leased: Iterable[str],
    fencing: Mapping[str, str],
    unregistered: Mapping[str, Iterable[int]] | None = None,
) -> dict[str, Any]:
    """The JSON record :meth:`SavedRecord.read` reads back (``state``: the core's snapshot)."""
    return {
        "state": state,
        "inflight": inflight.to_json() if inflight is not None else None,
        "dead": [dataclasses.asdict(d) for d in dead],
        "seen": sorted(seen),
        "leased": sorted(leased),
        "fencing": dict(fencing),
        "unregistered": {p: list(g) for p, g in (unregistered or {}).items()},
    }


@dataclass(frozen=True, slots=True)
class _RawInflight:
    confirmed_shrinks: list[Any]
    expands: list[Any]


def _list(record: Mapping[str, Any], key: str) -> list[Any]:
    value = record.get(key, [])
    if not isinstance(value, list):
        raise CorruptStateError(
            f"the saved record's {key!r} is {type(value).__name__}, not a list"
        )
    return value


def _strings(record: Mapping[str, Any], key: str) -> tuple[str, ...]:
    values = _list(record, key)
    bad = [v for v in values if not isinstance(v, str)]
    if bad:
        raise CorruptStateError(f"the saved record's {key!r} holds non-string {bad[0]!r}")
    return tuple(values)


def _reasons(value: object) -> dict[str, str]:
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise CorruptStateError(
            f"the saved record's 'fencing' must map pipeline ids to reasons, got {value!r}"
        )
    return dict(value)


def _freed(value: object) -> dict[str, tuple[int, ...]]:
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, list) and all(is_int(g) for g in v)
        for k, v in value.items()
    ):
        raise CorruptStateError(
            f"the saved record's 'unregistered' must map pipeline ids to lists of GPU ids, "
            f"got {value!r}"
        )
    return {k: tuple(v) for k, v in value.items()}


def _read_dead(value: object) -> DeadPipeline:
    if (
        not isinstance(value, dict)
        or not isinstance(value.get("pipeline_id"), str)
        or not isinstance(value.get("reason"), str)
        or not is_finite(value.get("at"))
    ):
        raise CorruptStateError(
            f"the saved record's dead pipeline {value!r} is malformed; expected "
            "{'pipeline_id': str, 'reason': str, 'at': seconds}"
        )
    return DeadPipeline(value["pipeline_id"], value["reason"], float(value["at"]))


def _read_inflight(value: object) -> _RawInflight | None:
    if not value:
        return None
    if not isinstance(value, dict):
        raise CorruptStateError(
            f"the saved in-flight record is {type(value).__name__}, not an object"
        )
    return _RawInflight(
        confirmed_shrinks=_list(value, "confirmed_shrinks"), expands=_list(value, "expands")
    )
