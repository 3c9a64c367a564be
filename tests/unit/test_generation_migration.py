"""The pure migration policy (``plan_migration``): examples and hypothesis properties."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlix_plugins.generation import (
    MigrationCandidate,
    MigrationConfig,
    MigrationMove,
    RouterConfig,
    plan_migration,
)
from rlix_plugins.generation.migration import plan_loads_after


def cands(rank: int, remaining: list[int], prefix: str = "") -> list[MigrationCandidate]:
    return [MigrationCandidate(f"{prefix}r{rank}-{i}", rank, rem)
            for i, rem in enumerate(remaining)]


def test_overloaded_shard_is_split_evenly_with_the_new_one() -> None:
    moves = plan_migration([12, 0], active=[0, 1], targets=[1],
                           candidates=cands(0, [100] * 12))
    assert len(moves) == 6
    assert {(m.source, m.target) for m in moves} == {(0, 1)}
    assert plan_loads_after([12, 0], moves) == (6, 6)


def test_odd_total_stops_one_apart() -> None:
    moves = plan_migration([7, 0], [0, 1], [1], cands(0, [50] * 7))
    assert plan_loads_after([7, 0], moves) == (4, 3)


def test_tiny_imbalance_moves_nothing() -> None:
    assert plan_migration([3, 2], [0, 1], [1], cands(0, [50] * 3)) == ()
    # min_gap raises the bar: a gap of 3 is not enough for min_gap=4.
    assert plan_migration([3, 0], [0, 1], [1], cands(0, [50] * 3), min_gap=4) == ()


def test_most_remaining_work_moves_first_and_nearly_finished_stay() -> None:
    moves = plan_migration([6, 0], [0, 1], [1], cands(0, [5, 80, 10, 300, 40, 3]),
                           min_remaining_tokens=16)
    # Loads 6/0 would allow 3 moves; only 3 requests have >= 16 tokens left.
    assert [m.key for m in moves] == ["r0-3", "r0-1", "r0-4"]
    moves = plan_migration([6, 0], [0, 1], [1], cands(0, [5, 80, 10, 300, 40, 3]),
                           min_remaining_tokens=100)
    assert [m.key for m in moves] == ["r0-3"]


def test_ties_take_the_lower_key_and_lower_rank() -> None:
    moves = plan_migration([4, 4, 0], [0, 1, 2], [2],
                           cands(0, [10, 10, 10, 10]) + cands(1, [10, 10, 10, 10]))
    assert [(m.key, m.source) for m in moves] == [("r0-0", 0), ("r1-0", 1)]
    assert plan_loads_after([4, 4, 0], moves) == (3, 3, 2)


def test_fills_several_new_shards_from_several_sources() -> None:
    loads = [10, 8, 0, 0]
    moves = plan_migration(loads, [0, 1, 2, 3], [2, 3], cands(0, [20] * 10) + cands(1, [20] * 8))
    after = plan_loads_after(loads, moves)
    assert sorted(after) == [4, 4, 5, 5]
    assert {m.target for m in moves} == {2, 3}


def test_only_active_targets_and_active_sources() -> None:
    # Target 1 is not active (woken, not yet activated): nothing goes there.
    assert plan_migration([8, 0], [0], [1], cands(0, [50] * 8)) == ()
    # Requests on a preempted shard (not active) are re-dispatched anyway: not candidates.
    assert plan_migration([0, 8, 0], [0, 2], [2], cands(1, [50] * 8)) == ()


def test_migration_limit_per_request() -> None:
    once = [MigrationCandidate(f"k{i}", 0, 50, migrations=1) for i in range(6)]
    assert plan_migration([6, 0], [0, 1], [1], once) == ()
    assert len(plan_migration([6, 0], [0, 1], [1], once, max_per_request=2)) == 3


def test_bad_inputs_raise_typed_errors() -> None:
    with pytest.raises(ValueError, match="min_gap must be >= 2"):
        plan_migration([4, 0], [0, 1], [1], cands(0, [9]), min_gap=1)
    with pytest.raises(ValueError, match=r"valid ranks are 0\.\.1"):
        plan_migration([4, 0], [0, 1], [1], cands(5, [9]))
    with pytest.raises(ValueError, match="loads must be >= 0"):
        plan_migration([-1, 0], [0, 1], [1], [])


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"min_gap": 1}, r"min_gap must be >= 2 .*got 1"),
    ({"min_remaining_tokens": -1}, "min_remaining_tokens must be >= 0, got -1"),
    ({"max_per_request": 0}, "max_per_request must be >= 1, got 0"),
    ({"watch_interval_s": 0}, "watch_interval_s must be > 0, got 0"),
])
def test_migration_config_rejects_bad_values(kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MigrationConfig(**kwargs)  # type: ignore[arg-type]


def test_router_config_takes_migration_as_mapping() -> None:
    cfg = RouterConfig(migration={"min_gap": 3, "enabled": False})  # type: ignore[arg-type]
    assert cfg.migration == MigrationConfig(enabled=False, min_gap=3)
    assert RouterConfig().migration == MigrationConfig()
    with pytest.raises(ValueError, match="migration must be"):
        RouterConfig(migration=3)  # type: ignore[arg-type]


@st.composite
def situations(draw: st.DrawFn) -> tuple[list[int], list[int], list[int],
                                         list[MigrationCandidate], int, int, int]:
    n = draw(st.integers(1, 6))
    loads = draw(st.lists(st.integers(0, 20), min_size=n, max_size=n))
    active = draw(st.lists(st.integers(0, n - 1), unique=True, max_size=n))
    targets = draw(st.lists(st.integers(0, n - 1), unique=True, max_size=n))
    candidates: list[MigrationCandidate] = []
    for r, load in enumerate(loads):
        k = draw(st.integers(0, load))  # some of a shard's requests may not be movable
        for i in range(k):
            candidates.append(MigrationCandidate(
                f"r{r}-{i}", r, draw(st.integers(0, 100)), draw(st.integers(0, 2))))
    return (loads, active, targets, candidates, draw(st.integers(2, 5)),
            draw(st.integers(0, 60)), draw(st.integers(1, 3)))


@settings(max_examples=400, deadline=None)
@given(situations())
def test_policy_properties(
    s: tuple[list[int], list[int], list[int], list[MigrationCandidate], int, int, int],
) -> None:
    loads, active, targets, candidates, min_gap, min_rem, max_per = s
    moves = plan_migration(loads, active, targets, candidates, min_gap=min_gap,
                           min_remaining_tokens=min_rem, max_per_request=max_per)
    by_key = {c.key: c for c in candidates}
    after = plan_loads_after(loads, moves)
    # Never to a non-active shard, never from one, never to a shard not named as target.
    for m in moves:
        assert m.target in active and m.target in targets
        assert m.source in active and m.source != m.target
        c = by_key[m.key]
        assert c.rank == m.source
        assert c.remaining_tokens >= min_rem and c.migrations < max_per
    # Each request moves at most once; totals conserved; no shard goes negative.
    assert max(Counter(m.key for m in moves).values(), default=0) <= 1
    assert sum(after) == sum(loads) and min(after, default=0) >= 0
    # Never increases the maximum load over the active shards (nor over all shards).
    if active:
        assert max(after[r] for r in active) <= max(loads[r] for r in active)
    assert max(after) <= max(loads)
    # Balanced at the end: no eligible request left whose move would still pass min_gap.
    live_targets = [t for t in targets if t in active]
    if live_targets:
        moved = {m.key for m in moves}
        t_min = min(after[t] for t in live_targets)
        t_arg = min(live_targets, key=lambda t: (after[t], t))
        for c in candidates:
            if (c.key not in moved and c.rank in active and c.rank != t_arg
                    and c.remaining_tokens >= min_rem and c.migrations < max_per):
                assert after[c.rank] - t_min < min_gap, (c, after, moves)
    else:
        assert moves == ()


def test_move_is_a_frozen_record() -> None:
    m = MigrationMove("k", 0, 1)
    with pytest.raises(AttributeError):
        m.target = 2  # type: ignore[misc]
