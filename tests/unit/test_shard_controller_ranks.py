"""LifecycleShardController guards: rank validation and expand without a cached version.

The real ShardLifecycle and shard-state store run here; only the engines are FAKE (a vLLM engine
per shard is what the integration suites start).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from rlix_plugins.adapters.observability import ObservationWriter, read_observations
from rlix_plugins.adapters.shard_controller import LifecycleShardController
from rlix_plugins.errors import ShardStateError, WeightSyncError
from rlix_plugins.generation import ShardLifecycle
from rlix_plugins.generation.loop_thread import LoopThread
from rlix_plugins.generation.shard_state import ShardEvent, ShardStatus
from rlix_plugins.generation.state_store import LocalShardState, ShardStateStore
from tests.support.recording_engine import FakeRecordingEngine

A, S, W = ShardStatus.ACTIVE, ShardStatus.SLEEPING, ShardStatus.WOKEN


@dataclass
class Weights:
    """The host side of the controller: the newest cached version and the syncs asked for."""

    version: int | None = None
    synced: list[tuple[list[int], int]] = field(default_factory=list)

    def latest(self) -> int | None:
        return self.version

    def sync(self, dp_ranks: Sequence[int], version: int) -> None:
        self.synced.append((list(dp_ranks), version))


@dataclass
class Rig:
    store: ShardStateStore
    controller: LifecycleShardController
    weights: Weights
    calls: list[tuple[str, int]]

    def statuses(self) -> tuple[ShardStatus, ...]:
        return self.store.snapshot().statuses


def make_rig(observer: ObservationWriter,
             rank_gpus: Sequence[Sequence[int]] | None = None) -> Iterator[Rig]:
    """Two shards, shard 0 ACTIVE and shard 1 SLEEPING (preempted once), nothing cached."""
    store = ShardStateStore(2)
    view = LocalShardState(store)
    calls: list[tuple[str, int]] = []
    lifecycle = ShardLifecycle(view, [FakeRecordingEngine(r, calls) for r in range(2)])
    weights = Weights()
    loop = LoopThread(name="test-shard-controller")
    controller = LifecycleShardController(
        lifecycle, view, weights.sync, weights.latest, observer=observer, loop=loop,
        rank_gpus=rank_gpus,
    )
    controller.shrink([1])
    calls.clear()
    try:
        yield Rig(store, controller, weights, calls)
    finally:
        loop.close()


@pytest.fixture
def rig() -> Iterator[Rig]:
    yield from make_rig(ObservationWriter(None, None))


def test_each_rank_a_shrink_takes_down_is_recorded_with_its_gpus(tmp_path: Path) -> None:
    """The gates tell the shard on the training GPUs by these records (overlap cycle)."""
    for rig in make_rig(ObservationWriter(tmp_path, "ft_shrinks00001"), [(4,), (5,)]):
        rig.weights.version = 1
        rig.controller.expand([1])
        rig.controller.shrink([0, 1])
        rig.controller.shrink([1])  # already asleep: nothing taken down, nothing recorded
        # the coordinator actor's copy keeps them (its local state view cannot be pickled
        # here: the state round trip without pickle)
        copy = LifecycleShardController.__new__(LifecycleShardController)
        copy.__setstate__(rig.controller.__getstate__())
        assert copy._rank_gpus == ((4,), (5,))
        copy.close()
    recs = read_observations(tmp_path).lifecycle
    # the fixture's first shrink of rank 1, then ranks 0 and 1
    assert [(r.event, r.rank, r.gpus) for r in recs] == [
        ("shrink", 1, (5,)), ("shrink", 0, (4,)), ("shrink", 1, (5,))]


@pytest.mark.parametrize("op", ["shrink", "expand"])
@pytest.mark.parametrize("rank", [-1, 2, 7])
def test_unknown_rank_is_refused_before_any_lifecycle_call(rig: Rig, op: str, rank: int) -> None:
    rig.weights.version = 3
    with pytest.raises(ShardStateError, match=rf"{op}: dp rank\(s\) \[{rank}\] do not exist; "
                                              r"valid ranks are 0\.\.1"):
        getattr(rig.controller, op)([0, rank])
    assert rig.calls == [] and rig.weights.synced == []
    assert rig.statuses() == (A, S)


def test_expand_without_a_cached_version_leaves_the_shard_asleep(rig: Rig) -> None:
    with pytest.raises(ShardStateError, match=r"expand: shard\(s\) \[1\] need weights but no "
                                              "weight version is cached yet"):
        rig.controller.expand([1])
    assert rig.calls == [] and rig.weights.synced == []
    assert rig.statuses() == (A, S)
    # An active rank needs no weights: expanding it stays a no-op without a version.
    rig.controller.expand([0])
    assert rig.statuses() == (A, S)


def test_expand_without_a_cached_version_never_routes_a_woken_shard(rig: Rig) -> None:
    rig.store.apply([1], ShardEvent.WAKE)  # an earlier expand woke it, then failed before the sync
    with pytest.raises(ShardStateError, match="no weight version is cached yet"):
        rig.controller.expand([1])
    assert rig.statuses() == (A, W) and rig.calls == []


def test_expand_with_a_version_wakes_syncs_and_activates(rig: Rig) -> None:
    rig.weights.version = 3
    rig.controller.expand([1, 1])
    assert rig.calls == [("wake_up", 1), ("resume", 1)]
    assert rig.weights.synced == [([1], 3)]
    assert rig.statuses() == (A, A)


def test_a_version_cached_while_an_expand_syncs_reaches_the_expanded_shard(rig: Rig) -> None:
    """The host caches v4 while the expand syncs v3, and refreshes v4 into the shards active
    then: shard 1 is not active yet, so without a second look it would serve v3 to the next
    step (its own refresh)."""
    rig.weights.version = 3
    sync = rig.weights.sync

    def sync_then_cache_newer(dp_ranks: Sequence[int], version: int) -> None:
        sync(dp_ranks, version)
        if version == 3:
            rig.weights.version = 4  # the trainer's next version, cached meanwhile

    rig.controller._sync = sync_then_cache_newer  # the host's sync callback, wrapped
    rig.controller.expand([1])
    assert rig.weights.synced == [([1], 3), ([1], 4)]
    assert rig.statuses() == (A, A)


def test_an_expand_catches_up_to_a_newer_version_before_it_routes_the_shard(rig: Rig) -> None:
    # Synced in place after activation, requests already routed to the shard would see its
    # weights change under them: the catch-up must come before the shard is routed.
    rig.weights.version = 3
    sync = rig.weights.sync
    routed_at_sync: list[tuple[int, bool]] = []

    def sync_then_cache_newer(dp_ranks: Sequence[int], version: int) -> None:
        routed_at_sync.append((version, rig.statuses()[1] is A))
        sync(dp_ranks, version)
        if version == 3:
            rig.weights.version = 4

    rig.controller._sync = sync_then_cache_newer
    rig.controller.expand([1])
    assert routed_at_sync == [(3, False), (4, False)]
    assert rig.statuses() == (A, A)


def test_a_version_cached_during_activation_is_still_synced_in_place(rig: Rig) -> None:
    rig.weights.version = 3
    activate = rig.controller._lifecycle.activate

    async def activate_then_cache_newer(ranks: Sequence[int]) -> None:
        await activate(ranks)
        rig.weights.version = 4  # cached between the last check and the activation

    rig.controller._lifecycle.activate = activate_then_cache_newer  # type: ignore[method-assign]
    rig.controller.expand([1])
    assert rig.weights.synced == [([1], 3), ([1], 4)]
    assert rig.statuses() == (A, A)


def test_expand_of_a_half_taken_down_shard_finishes_the_take_down_then_routes_it(
    rig: Rig,
) -> None:
    # An earlier shrink failed part-way: the shard is PREEMPTED (unrouted, maybe still awake).
    rig.store.apply([0], ShardEvent.PREEMPT)
    rig.weights.version = 3
    rig.controller.expand([0])
    # expand promises "awake, synced and routable": never a silent success on an unrouted shard.
    assert rig.statuses() == (A, S)
    assert rig.calls == [("abort_all", 0), ("sleep", 0), ("wake_up", 0), ("resume", 0)]
    assert rig.weights.synced == [([0], 3)]


def test_shard_controller_close_stops_its_own_loop_thread_only() -> None:
    store = ShardStateStore(1)
    view = LocalShardState(store)
    lifecycle = ShardLifecycle(view, [FakeRecordingEngine(0, [])])
    weights = Weights()
    owned = LifecycleShardController(lifecycle, view, weights.sync, weights.latest,
                                     observer=ObservationWriter(None, None))
    owned.shrink([0])  # starts the controller's own event-loop thread
    loop = owned._loop
    assert loop is not None and not loop.closed
    owned.close()
    owned.close()  # idempotent
    assert loop.closed
    given = LoopThread(name="test-given-loop")
    try:
        borrowed = LifecycleShardController(lifecycle, view, weights.sync, weights.latest,
                                            observer=ObservationWriter(None, None), loop=given)
        borrowed.close()
        assert not given.closed  # a loop handed in belongs to the caller
    finally:
        given.close()


def test_a_refresh_skips_shards_shrunk_since_the_host_read_the_active_set(rig: Rig) -> None:
    """The coordinator's copy of the controller (another process) may shrink a shard between
    the host reading the active set and its refresh: no push into a shard asleep at level 2
    (its weight memory is released); its next expand syncs it."""
    rig.weights.version = 3
    rig.controller.expand([1])
    active = [0, 1]  # what the host read
    rig.controller.shrink([1])  # the coordinator's shrink, in between
    rig.controller.refresh(active, 4)
    assert rig.weights.synced[-1] == ([0], 4)


def test_a_refresh_that_failed_on_a_shard_shrunk_mid_sync_resyncs_the_others(rig: Rig) -> None:
    rig.weights.version = 3
    rig.controller.expand([1])
    pushed: list[list[int]] = []

    def sync(dp_ranks: Sequence[int], version: int) -> None:
        pushed.append(list(dp_ranks))
        if len(pushed) == 1:  # shard 1 is shrunk while the sync runs: it fails the sync
            rig.controller.shrink([1])
            raise WeightSyncError("sync of weight version 4 failed for ['s1']")

    rig.controller._sync = sync
    rig.controller.refresh([0, 1], 4)
    assert pushed == [[0, 1], [0]]
    # a failure with every shard still active is the caller's
    def broken(dp_ranks: Sequence[int], version: int) -> None:
        raise WeightSyncError("broken")

    rig.controller._sync = broken
    with pytest.raises(WeightSyncError, match="broken"):
        rig.controller.refresh([0], 5)


@pytest.mark.parametrize("rank", [-1, 2, "0", 1.0])
def test_a_refresh_of_an_unknown_rank_is_refused_before_any_sync(rig: Rig, rank: object) -> None:
    """A negative rank read the statuses from the end and was synced as is ([-1] pushed the
    version to "shard -1"); one past the end was an untyped IndexError; the step was taken
    before either."""
    rig.weights.version = 3
    rig.controller.expand([1])
    rig.weights.synced.clear()
    with pytest.raises(ShardStateError, match=r"refresh: dp rank\(s\) \[.*\] do not exist; "
                                              r"valid ranks are 0\.\.1"):
        rig.controller.refresh([0, rank], 4, step=9)  # type: ignore[list-item]
    assert rig.weights.synced == [] and rig.controller._step is None


@pytest.mark.parametrize("op", ["shrink", "expand", "refresh"])
@pytest.mark.parametrize("ranks", [1, "01", None])
def test_ranks_that_are_not_a_collection_get_a_typed_error(
    rig: Rig, op: str, ranks: object
) -> None:
    """``shrink(1)`` failed with an untyped "'int' object is not iterable"."""
    rig.weights.version = 3
    args = (ranks, 4) if op == "refresh" else (ranks,)
    with pytest.raises(ShardStateError, match=rf"{op}: dp ranks must be an iterable of ints"):
        getattr(rig.controller, op)(*args)
    assert rig.calls == [] and rig.weights.synced == []
    assert rig.statuses() == (A, S)
