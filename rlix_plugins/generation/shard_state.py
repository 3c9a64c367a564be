"""Pure shard state machine of one pipeline's generation shards (vLLM data-parallel ranks).

Each shard is in exactly one :class:`ShardStatus`; the whole pipeline's state is an immutable,
versioned :class:`ShardSnapshot`. :func:`apply_event` is a pure function: it validates every
named rank first and returns a NEW snapshot, so a rejected transition leaves the old snapshot
(the state) untouched. No clocks, no I/O, no locks: the owner (:mod:`.state_store`) adds those.

Lifecycle of one shard::

    ACTIVE --preempt--> PREEMPTED --asleep--> SLEEPING --wake--> WOKEN --activate--> ACTIVE
                            ^                                       |
                            +----------------preempt----------------+

``PREEMPTED`` covers "no new dispatch; abort + drain + sleep under way". ``WOKEN`` is awake but
without valid weights until its weight sync is done: it gets no traffic until ``activate``.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Iterable
from dataclasses import dataclass

from rlix_plugins.errors import LastActiveShardError, ShardStateError
from rlix_plugins.values import enum_member, is_int


class ShardStatus(str, enum.Enum):
    """State of one generation shard."""

    ACTIVE = "active"
    PREEMPTED = "preempted"
    SLEEPING = "sleeping"
    WOKEN = "woken"


class ShardEvent(str, enum.Enum):
    """A transition request for a set of shards."""

    PREEMPT = "preempt"
    ASLEEP = "asleep"
    WAKE = "wake"
    ACTIVATE = "activate"


class LastActivePolicy(str, enum.Enum):
    """What preempting the last active shard(s) does.

    ``ALLOW``: it is done; routers then hold new requests (bounded wait) until a shard is
    activated again. ``REFUSE``: the preempt is rejected with :class:`LastActiveShardError`,
    so a pipeline always keeps at least one shard generating.
    """

    ALLOW = "allow"
    REFUSE = "refuse"


#: event -> (states it may start from, state it leads to)
_TRANSITIONS: dict[ShardEvent, tuple[frozenset[ShardStatus], ShardStatus]] = {
    ShardEvent.PREEMPT: (frozenset({ShardStatus.ACTIVE, ShardStatus.WOKEN}), ShardStatus.PREEMPTED),
    ShardEvent.ASLEEP: (frozenset({ShardStatus.PREEMPTED}), ShardStatus.SLEEPING),
    ShardEvent.WAKE: (frozenset({ShardStatus.SLEEPING}), ShardStatus.WOKEN),
    ShardEvent.ACTIVATE: (frozenset({ShardStatus.WOKEN}), ShardStatus.ACTIVE),
}


@dataclass(frozen=True, slots=True)
class ShardSnapshot:
    """Versioned state of every shard of one pipeline; ``statuses[r]`` is dp rank ``r``.

    ``version`` grows by one with every applied transition, so a reader can tell whether its
    copy is current. ``active`` is derived (the ranks routers may dispatch to) and kept as a
    field because routers read it on every request.
    """

    version: int
    statuses: tuple[ShardStatus, ...]
    active: tuple[int, ...]

    @classmethod
    def build(cls, version: int, statuses: Iterable[ShardStatus]) -> ShardSnapshot:
        """Snapshot with ``active`` derived from ``statuses``."""
        st = tuple(ShardStatus(s) for s in statuses)
        return cls(version, st, tuple(r for r, s in enumerate(st) if s is ShardStatus.ACTIVE))

    @classmethod
    def initial(
        cls, num_shards: int, status: ShardStatus = ShardStatus.ACTIVE
    ) -> ShardSnapshot:
        """Version-0 snapshot with every one of ``num_shards`` shards in ``status``."""
        if not is_int(num_shards) or num_shards < 1:
            kind = "" if is_int(num_shards) else "an int "
            raise ShardStateError(f"num_shards must be {kind}>= 1, got {num_shards!r}")
        with contextlib.suppress(ValueError):
            status = ShardStatus(status)  # its string value is accepted too
        if status not in (ShardStatus.ACTIVE, ShardStatus.SLEEPING):
            shown = status.value if isinstance(status, ShardStatus) else status
            raise ShardStateError(
                f"initial status {shown!r} is not valid; expected 'active' or 'sleeping'"
            )
        return cls.build(0, [status] * num_shards)

    @property
    def num_shards(self) -> int:
        return len(self.statuses)

    def status(self, dp_rank: int) -> ShardStatus:
        """Status of ``dp_rank``; :class:`ShardStateError` if the rank does not exist."""
        _check_rank(self, dp_rank)
        return self.statuses[dp_rank]

    def ranks_in(self, status: ShardStatus) -> tuple[int, ...]:
        """Ranks currently in ``status``, ascending."""
        return tuple(r for r, s in enumerate(self.statuses) if s is status)

    def describe(self) -> str:
        """Compact human-readable form for error messages and logs."""
        body = ", ".join(f"{r}:{s.value}" for r, s in enumerate(self.statuses))
        return f"v{self.version} [{body}]"


def parse_event(event: ShardEvent | str) -> ShardEvent:
    """``event`` as a :class:`ShardEvent`; :class:`ShardStateError` naming the valid ones."""
    return enum_member(ShardEvent, event, ShardStateError, "shard event")


def parse_last_active(policy: LastActivePolicy | str) -> LastActivePolicy:
    """``policy`` as a :class:`LastActivePolicy` (its string value is accepted too);
    :class:`ShardStateError` naming the valid ones."""
    return enum_member(LastActivePolicy, policy, ShardStateError, "last-active policy")


def _check_rank(snapshot: ShardSnapshot, dp_rank: int) -> None:
    if not is_int(dp_rank):
        raise ShardStateError(f"dp rank must be an int, got {dp_rank!r}")
    if not 0 <= dp_rank < snapshot.num_shards:
        raise ShardStateError(
            f"dp rank {dp_rank} does not exist; valid ranks are 0..{snapshot.num_shards - 1}"
        )


def normalize_ranks(snapshot: ShardSnapshot, dp_ranks: Iterable[int]) -> tuple[int, ...]:
    """Validated, de-duplicated, sorted ranks; at least one."""
    if isinstance(dp_ranks, (str, bytes)) or not isinstance(dp_ranks, Iterable):
        raise ShardStateError(
            f"dp ranks must be an iterable of ints such as [0, 1], got {dp_ranks!r}"
        )
    given = list(dp_ranks)
    # Each rank is checked before sorting: mixed types (0 and "1") would otherwise fail in
    # sorted() with an untyped TypeError.
    for r in given:
        _check_rank(snapshot, r)
    ranks = tuple(sorted(set(given)))
    if not ranks:
        raise ShardStateError("no dp ranks given; name at least one shard")
    return ranks


def check_event(
    snapshot: ShardSnapshot,
    dp_ranks: Iterable[int],
    event: ShardEvent,
    last_active: LastActivePolicy = LastActivePolicy.ALLOW,
) -> tuple[int, ...]:
    """Raise unless ``event`` may be applied to every rank; return the normalized ranks."""
    event = parse_event(event)
    # Compared by identity below: the string "refuse" must not silently mean ALLOW.
    last_active = parse_last_active(last_active)
    ranks = normalize_ranks(snapshot, dp_ranks)
    sources, _target = _TRANSITIONS[event]
    bad = [r for r in ranks if snapshot.statuses[r] not in sources]
    if bad:
        allowed = " or ".join(sorted(s.value for s in sources))
        raise ShardStateError(
            f"cannot {event.value} shard(s) {bad}: they must be {allowed}; "
            f"state is {snapshot.describe()}"
        )
    if event is ShardEvent.PREEMPT and last_active is LastActivePolicy.REFUSE:
        remaining = set(snapshot.active) - set(ranks)
        if snapshot.active and not remaining:
            raise LastActiveShardError(
                f"preempting {list(ranks)} would leave no active shard and the last-active "
                f"policy is 'refuse'; state is {snapshot.describe()}"
            )
    return ranks


def apply_event(
    snapshot: ShardSnapshot,
    dp_ranks: Iterable[int],
    event: ShardEvent,
    last_active: LastActivePolicy = LastActivePolicy.ALLOW,
) -> ShardSnapshot:
    """Return the snapshot after ``event`` on ``dp_ranks`` (all or nothing, version + 1)."""
    event = parse_event(event)
    ranks = check_event(snapshot, dp_ranks, event, last_active)
    target = _TRANSITIONS[event][1]
    statuses = list(snapshot.statuses)
    for r in ranks:
        statuses[r] = target
    return ShardSnapshot.build(snapshot.version + 1, statuses)
