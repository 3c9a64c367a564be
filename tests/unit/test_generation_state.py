"""Pure shard state machine, the in-process owner and its view (no engines, no Ray)."""

from __future__ import annotations

import asyncio
import pickle
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlix_plugins.errors import LastActiveShardError, RlixPluginsError, ShardStateError
from rlix_plugins.generation import (
    LastActivePolicy,
    LocalShardState,
    RayShardState,
    ShardEvent,
    ShardSnapshot,
    ShardStateStore,
    ShardStatus,
    apply_event,
)

A, P, S, W = ShardStatus.ACTIVE, ShardStatus.PREEMPTED, ShardStatus.SLEEPING, ShardStatus.WOKEN


def test_full_lifecycle_bumps_version_and_active_set() -> None:
    snap = ShardSnapshot.initial(2)
    assert snap.version == 0 and snap.active == (0, 1)
    snap = apply_event(snap, [0], ShardEvent.PREEMPT)
    assert snap.statuses == (P, A) and snap.active == (1,) and snap.version == 1
    snap = apply_event(snap, [0], ShardEvent.ASLEEP)
    assert snap.statuses == (S, A)
    snap = apply_event(snap, [0], ShardEvent.WAKE)
    assert snap.statuses == (W, A) and snap.active == (1,), "woken is not routable"
    snap = apply_event(snap, [0], ShardEvent.ACTIVATE)
    assert snap.statuses == (A, A) and snap.active == (0, 1) and snap.version == 4


@pytest.mark.parametrize(
    ("start", "event"),
    [
        (A, ShardEvent.ASLEEP), (A, ShardEvent.WAKE), (A, ShardEvent.ACTIVATE),
        (P, ShardEvent.PREEMPT), (P, ShardEvent.WAKE), (P, ShardEvent.ACTIVATE),
        (S, ShardEvent.PREEMPT), (S, ShardEvent.ASLEEP), (S, ShardEvent.ACTIVATE),
        (W, ShardEvent.ASLEEP), (W, ShardEvent.WAKE),
    ],
)
def test_bad_transition_is_typed_and_changes_nothing(start: ShardStatus, event: ShardEvent) -> None:
    store = ShardStateStore(3)
    path = {A: [], P: [ShardEvent.PREEMPT], S: [ShardEvent.PREEMPT, ShardEvent.ASLEEP],
            W: [ShardEvent.PREEMPT, ShardEvent.ASLEEP, ShardEvent.WAKE]}[start]
    for ev in path:
        store.apply([1], ev)
    before = store.snapshot()
    with pytest.raises(ShardStateError, match=f"cannot {event.value}") as info:
        store.apply([0, 1], event)  # rank 0 is active: all-or-nothing must reject both
    assert isinstance(info.value, RlixPluginsError)
    assert store.snapshot() is before


def test_woken_shard_may_be_preempted_again() -> None:
    snap = ShardSnapshot.build(7, [W, A])
    assert apply_event(snap, [0], ShardEvent.PREEMPT).statuses == (P, A)


@pytest.mark.parametrize(("ranks", "message"), [
    ([2], r"dp rank 2 does not exist; valid ranks are 0\.\.1"),
    ([-1], r"dp rank -1 does not exist; valid ranks are 0\.\.1"),
    ([], "no dp ranks given"),
    ([True], "dp rank must be an int, got True"),
])
def test_unknown_or_empty_ranks_are_rejected(ranks: list[int], message: str) -> None:
    snap = ShardSnapshot.initial(2)
    with pytest.raises(ShardStateError, match=message):
        apply_event(snap, ranks, ShardEvent.PREEMPT)


def test_initial_state_must_be_active_or_sleeping() -> None:
    assert ShardSnapshot.initial(2, S).active == ()
    with pytest.raises(ShardStateError, match="initial status 'woken' is not valid"):
        ShardSnapshot.initial(2, W)
    with pytest.raises(ShardStateError, match="num_shards must be >= 1, got 0"):
        ShardSnapshot.initial(0)


def test_last_active_policy_refuse_vs_allow() -> None:
    refuse = ShardStateStore(2, last_active=LastActivePolicy.REFUSE)
    refuse.apply([0], ShardEvent.PREEMPT)
    before = refuse.snapshot()
    with pytest.raises(LastActiveShardError, match="last-active policy is 'refuse'"):
        refuse.apply([1], ShardEvent.PREEMPT)
    assert refuse.snapshot() is before
    with pytest.raises(LastActiveShardError, match=r"preempting \[0, 1\] would leave no active"):
        ShardStateStore(2, last_active=LastActivePolicy.REFUSE).apply([0, 1], ShardEvent.PREEMPT)

    allow = ShardStateStore(2)
    assert allow.apply([0, 1], ShardEvent.PREEMPT).active == ()


def test_refuse_still_allows_preempting_woken_shards_when_none_active() -> None:
    # With nothing active there is no "last active shard" to protect.
    store = ShardStateStore(1, initial=S, last_active=LastActivePolicy.REFUSE)
    store.apply([0], ShardEvent.WAKE)
    assert store.apply([0], ShardEvent.PREEMPT).statuses == (P,)


_EVENTS = list(ShardEvent)
_ALLOWED = {
    ShardEvent.PREEMPT: ({A, W}, P), ShardEvent.ASLEEP: ({P}, S),
    ShardEvent.WAKE: ({S}, W), ShardEvent.ACTIVATE: ({W}, A),
}


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(_EVENTS),
                          st.sets(st.integers(0, 3), min_size=1, max_size=4)), max_size=40))
def test_random_event_sequences_match_the_transition_table(
    steps: list[tuple[ShardEvent, set[int]]],
) -> None:
    store = ShardStateStore(4)
    model = [A] * 4
    for event, ranks in steps:
        before = store.snapshot()
        sources, target = _ALLOWED[event]
        ok = all(model[r] in sources for r in ranks)
        if ok:
            after = store.apply(ranks, event)
            for r in ranks:
                model[r] = target
            assert after.version == before.version + 1
        else:
            with pytest.raises(ShardStateError):
                store.apply(ranks, event)
            assert store.snapshot() is before
        snap = store.snapshot()
        assert list(snap.statuses) == model
        assert snap.active == tuple(r for r, s in enumerate(model) if s is A)


def test_store_and_local_view_refuse_to_be_copied() -> None:
    store = ShardStateStore(2)
    with pytest.raises(TypeError, match="single owner"):
        pickle.dumps(store)
    with pytest.raises(TypeError, match="RayShardState"):
        pickle.dumps(LocalShardState(store))


def test_snapshot_pickles_by_value() -> None:
    snap = apply_event(ShardSnapshot.initial(3), [1], ShardEvent.PREEMPT)
    assert pickle.loads(pickle.dumps(snap)) == snap


def test_ray_view_pickles_as_handle_and_last_snapshot() -> None:
    # the copy starts from the sender's snapshot (its first snapshot() needs no RPC); the poll
    # task belongs to the sender's loop and stays
    view = RayShardState(handle="HANDLE")
    view._cached = ShardSnapshot.initial(2)
    copy = pickle.loads(pickle.dumps(view))
    assert copy.handle == "HANDLE" and copy._cached == view._cached and copy._poller is None
    empty = pickle.loads(pickle.dumps(RayShardState(handle="HANDLE")))
    assert empty._cached is None


def test_local_view_wait_is_woken_by_a_transition_from_another_thread() -> None:
    store = ShardStateStore(2)
    view = LocalShardState(store)

    async def go() -> ShardSnapshot:
        timer = threading.Timer(0.05, lambda: store.apply([0], ShardEvent.PREEMPT))
        timer.start()
        t0 = asyncio.get_running_loop().time()
        snap = await view.wait_for_update(0, timeout_s=10)
        assert asyncio.get_running_loop().time() - t0 < 5
        return snap

    snap = asyncio.run(go())
    assert snap.version == 1 and snap.statuses == (P, A)


def test_local_view_wait_times_out_with_current_snapshot() -> None:
    view = LocalShardState(ShardStateStore(1))
    snap = asyncio.run(view.wait_for_update(0, timeout_s=0.05))
    assert snap.version == 0


def test_listener_failure_does_not_block_transitions() -> None:
    store = ShardStateStore(1)
    seen: list[int] = []

    def bad(_: ShardSnapshot) -> None:
        raise RuntimeError("boom")

    store.subscribe(bad)
    unsubscribe = store.subscribe(lambda s: seen.append(s.version))
    store.apply([0], ShardEvent.PREEMPT)
    unsubscribe()
    store.apply([0], ShardEvent.ASLEEP)
    assert seen == [1] and store.snapshot().version == 2
