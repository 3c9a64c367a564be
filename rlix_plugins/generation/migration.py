"""Which running requests to move to newly activated shards: a pure policy.

Why: when a shard is activated mid-rollout (the coordinator expanded the pipeline), routing
alone only sends it NEW requests. The requests already running stay on the old shards, which
share their decode throughput among more requests than the new one, and at the end of a
rollout (the long tail, when no new requests arrive) the new shard idles. Migration moves some
running requests there: abort on the old shard, continue on the new one from the partial tokens
(nothing generated is lost).

The rule (:func:`plan_migration`), on one router copy's in-flight counts ``load[r]``:

  repeat:
    * ``t`` = the target (a shard named as newly active, and active) with the lowest load;
    * ``s`` = the active shard other than ``t`` with the highest load among those that still
      have an eligible request;
    * stop unless ``load[s] - load[t] >= min_gap`` (default 2);
    * move from ``s`` the eligible request with the most tokens still to generate;
      ``load[s] -= 1``, ``load[t] += 1``.

Ties: lowest rank; among requests, the lower key. A request is eligible when it runs on an
active shard, has not been moved already in this plan, has at most ``max_per_request - 1``
earlier migrations, and has at least ``min_remaining_tokens`` tokens still to generate (exact
when the engine reports progress, otherwise its attempt's token budget, an upper bound).

Why this rule: a move only happens across a gap of at least 2, so the source stays at least
as loaded as the target after the move; the maximum load over the active shards never grows
and the sum of squared loads drops by at least 2 per move (so the loop ends, at most
``len(candidates)`` moves). Moving the requests with the most work left buys the most: the
cost of a move is fixed per request (abort round trip, and the target re-reads the prompt and
the partial tokens: one prefill of ``prompt + generated`` tokens), while the gain grows with
the tokens still to decode. Nearly finished requests and a tiny imbalance are left alone
because that fixed cost would exceed the gain. Nothing here reads clocks or does I/O.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from rlix_plugins.errors import SettingsError
from rlix_plugins.values import is_int, is_number


@dataclass(frozen=True, slots=True)
class MigrationConfig:
    """Request migration to newly activated shards (a :class:`~.router.RouterConfig` field).

    Attributes:
        enabled: migrate at all. On by default: a migrated request continues from its partial
            tokens, so nothing is lost; for seeded sampling the tokens after the cut come from
            a fresh seeded stream (as with ``RedispatchMode.CONTINUE``). Turn it off where
            bit-exact seeded replay matters.
        auto: the router watches the shard state while it has requests in flight and
            rebalances when a shard becomes active; ``False``: only an explicit
            :meth:`~.router.ShardRouter.rebalance` call migrates.
        min_gap: a move needs ``load[source] - load[target] >= min_gap`` (at least 2, which
            is what keeps the maximum load from growing).
        min_remaining_tokens: requests with fewer tokens left are not moved.
        max_per_request: migrations per request at most (no ping-pong).
        watch_interval_s: how often the watcher re-checks that requests are still in flight
            (it wakes at once on a state change).
    """

    enabled: bool = True
    auto: bool = True
    min_gap: int = 2
    min_remaining_tokens: int = 16
    max_per_request: int = 1
    watch_interval_s: float = 1.0

    def __post_init__(self) -> None:
        # Values arrive from YAML, env and host configs: "false" or 2.5 must not pass.
        for name in ("enabled", "auto"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise SettingsError(f"{name} must be a bool, got {value!r}")
        _check_int("min_gap", self.min_gap, 2, " (a gap of 1 would only swap the loads)")
        _check_int("min_remaining_tokens", self.min_remaining_tokens, 0)
        _check_int("max_per_request", self.max_per_request, 1)
        if not (is_number(self.watch_interval_s) and self.watch_interval_s > 0):
            raise SettingsError(f"watch_interval_s must be > 0, got {self.watch_interval_s!r}")


def _check_int(name: str, value: object, minimum: int, why: str = "") -> None:
    """SettingsError unless ``value`` is an int (not a bool) >= ``minimum``."""
    if not (is_int(value) and value >= minimum):
        kind = "" if is_int(value) else "an int "
        raise SettingsError(f"{name} must be {kind}>= {minimum}{why}, got {value!r}")


@dataclass(frozen=True, slots=True)
class MigrationCandidate:
    """A running attempt the router could move.

    Attributes:
        key: the attempt id on its engine.
        rank: the shard it runs on.
        remaining_tokens: tokens it still has to generate (its budget when progress is
            unknown).
        migrations: times its request was migrated already.
    """

    key: str
    rank: int
    remaining_tokens: int
    migrations: int = 0


@dataclass(frozen=True, slots=True)
class MigrationMove:
    """Move attempt ``key`` from shard ``source`` to shard ``target``."""

    key: str
    source: int
    target: int


def plan_migration(
    loads: Sequence[int],
    active: Collection[int],
    targets: Iterable[int],
    candidates: Iterable[MigrationCandidate],
    *,
    min_gap: int = 2,
    min_remaining_tokens: int = 0,
    max_per_request: int = 1,
) -> tuple[MigrationMove, ...]:
    """The moves the rule in the module docstring makes; ``()`` when nothing is worth moving.

    Args:
        loads: in-flight requests per shard, indexed by dp rank.
        active: the shards routers may dispatch to now.
        targets: shards to fill (newly active ones); those not active are ignored.
        candidates: running attempts that could be moved (their engine can abort them).
        min_gap, min_remaining_tokens, max_per_request: as in :class:`MigrationConfig`.

    Raises:
        ValueError: ``min_gap < 2``, a negative load, or a candidate on a rank outside
            ``loads``.
    """
    if min_gap < 2:
        raise ValueError(f"min_gap must be >= 2, got {min_gap}")
    load = list(loads)
    if any(x < 0 for x in load):
        raise ValueError(f"loads must be >= 0, got {load}")
    act = {r for r in active if 0 <= r < len(load)}
    tgts = sorted({t for t in targets if t in act})
    if not tgts:
        return ()
    per_rank: dict[int, list[MigrationCandidate]] = {}
    for c in candidates:
        if not 0 <= c.rank < len(load):
            raise ValueError(
                f"candidate {c.key!r} is on rank {c.rank}; valid ranks are 0..{len(load) - 1}"
            )
        if (c.rank in act and c.remaining_tokens >= min_remaining_tokens
                and c.migrations < max_per_request):
            per_rank.setdefault(c.rank, []).append(c)
    # list.pop() takes the last: the most remaining work, ties the lowest key.
    for lst in per_rank.values():
        lst.sort(key=lambda c: (-c.remaining_tokens, c.key), reverse=True)
    moves: list[MigrationMove] = []
    while True:
        t = min(tgts, key=lambda r: (load[r], r))
        sources = [r for r, lst in per_rank.items() if lst and r != t]
        if not sources:
            break
        s = max(sources, key=lambda r: (load[r], -r))
        if load[s] - load[t] < min_gap:
            break
        c = per_rank[s].pop()
        moves.append(MigrationMove(c.key, s, t))
        load[s] -= 1
        load[t] += 1
    return tuple(moves)


def plan_loads_after(
    loads: Sequence[int], moves: Iterable[MigrationMove]
) -> tuple[int, ...]:
    """Loads after ``moves`` (for callers and tests checking a plan)."""
    out = list(loads)
    for m in moves:
        out[m.source] -= 1
        out[m.target] += 1
    return tuple(out)


def remaining_tokens(budget: int, progress: Mapping[str, int], key: str) -> int:
    """Tokens an attempt still has to generate: ``budget`` minus reported progress (if any)."""
    return max(0, budget - progress.get(key, 0))
