"""The host-agnostic :class:`ShardController`: the generation lifecycle plus a weight sync.

``shrink`` = preempt (abort -> drain -> sleep); ``expand`` = wake -> selective sync of the newest
cached version to exactly those ranks -> activate. Both are idempotent per rank, as the protocol
requires (a restarted scheduler may repeat a move it cannot prove happened). Host adapters only
supply the sync and version functions and the engines behind the lifecycle.

After every expand and every active refresh (:meth:`LifecycleShardController.refresh`) the
controller asks each ACTIVE shard's engine which weight version it holds and records it
(:class:`~rlix_plugins.adapters.observability.ShardVersionsObserved`) when ``RLIX_OBSERVE_DIR``
is set, and every rank a shrink took down
(:class:`~rlix_plugins.adapters.observability.LifecycleObserved`); the validation gates judge
those records. Nothing is probed when it is unset.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from rlix_plugins.adapters.observability import (
    LifecycleObserved,
    ObservationWriter,
    ShardVersionsObserved,
    VersionProbe,
    engine_version_probe,
)
from rlix_plugins.errors import ShardStateError, WeightSyncError
from rlix_plugins.generation.loop_thread import LoopThread
from rlix_plugins.generation.preemption import ShardLifecycle
from rlix_plugins.generation.shard_state import ShardStatus
from rlix_plugins.generation.state_store import ShardStateView
from rlix_plugins.values import as_index

logger = logging.getLogger(__name__)

#: ``sync(dp_ranks, version)`` streams cached ``version`` to exactly those shards.
SyncFn = Callable[[Sequence[int], int], object]


def _lifecycle_engines(lifecycle: ShardLifecycle) -> Sequence[Any]:
    # ShardLifecycle keeps its engines private; they are the same objects the router drives.
    engines: Sequence[Any] = getattr(lifecycle, "engines", None) or lifecycle._engines
    return engines


class LifecycleShardController:
    """ShardController over a :class:`ShardLifecycle` (picklable if its parts are).

    Args:
        lifecycle: preempt/wake/activate of the pipeline's shards.
        state: the shard-state view the lifecycle and routers share.
        sync: streams a cached version to exactly the given ranks.
        version: the newest cached version (None before the first cache build).
        probe: asks engines which version they hold (default: each engine's
            ``weight_version()``; an engine without it reports None).
        observer: where version records go (default: ``RLIX_OBSERVE_DIR`` and ``PIPELINE_ID``
            of the constructing process; off when unset).
        rank_gpus: each dp rank's global GPU ids, named in the shrink records (the gates tell
            the shard that overlaps the training GPUs by them); unknown when None.
        loop: the event loop the engines are bound to (default: a loop of this controller).
    """

    def __init__(
        self,
        lifecycle: ShardLifecycle,
        state: ShardStateView,
        sync: SyncFn,
        version: Callable[[], int | None],
        *,
        probe: VersionProbe | None = None,
        observer: ObservationWriter | None = None,
        loop: LoopThread | None = None,
        rank_gpus: Sequence[Sequence[int]] | None = None,
    ) -> None:
        self._lifecycle = lifecycle
        self._state = state
        self._sync = sync
        self._version = version
        self._probe = probe
        self._observer = observer if observer is not None else ObservationWriter.from_env()
        self._loop: LoopThread | None = loop
        # A loop handed in belongs to the caller; only one this controller started is closed.
        self._owns_loop = loop is None
        self._lock = threading.Lock()
        self._step: int | None = None
        self._rank_gpus = (None if rank_gpus is None
                           else tuple(tuple(int(g) for g in gpus) for gpus in rank_gpus))

    @property
    def observer(self) -> ObservationWriter:
        return self._observer

    def _loop_thread(self) -> LoopThread:
        with self._lock:
            if self._loop is None:
                self._loop = LoopThread()
            return self._loop

    def close(self) -> None:
        """Stop the event-loop thread this controller started (idempotent; a loop passed in
        is left to its owner). The controller must not be used afterwards."""
        if not self._owns_loop:
            return
        with self._lock:
            loop, self._loop = self._loop, None
        if loop is not None:
            loop.close()

    def _statuses(self) -> tuple[ShardStatus, ...]:
        async def read() -> tuple[ShardStatus, ...]:
            return (await self._state.refresh()).statuses

        return self._loop_thread().run(read())

    def _checked(
        self, op: str, dp_ranks: Sequence[int]
    ) -> tuple[list[int], tuple[ShardStatus, ...]]:
        """De-duplicated ``dp_ranks`` and the current statuses; :class:`ShardStateError` naming
        the bad ranks and the valid range before anything is changed."""
        if isinstance(dp_ranks, (str, bytes)) or not isinstance(dp_ranks, Iterable):
            # A bare rank (``shrink(1)``) failed below with an untyped "not iterable".
            raise ShardStateError(
                f"{op}: dp ranks must be an iterable of ints such as [0, 1], got "
                f"{dp_ranks!r}; nothing was changed"
            )
        statuses = self._statuses()
        # Checked before de-duplicating (an unhashable entry raised TypeError there); numpy
        # ints are ranks too (they failed ``isinstance(r, int)`` and were "do not exist").
        ranks: list[int] = []
        bad: list[object] = []
        for r in dp_ranks:
            rank = as_index(r)
            if rank is None or not 0 <= rank < len(statuses):
                bad.append(r)
            elif rank not in ranks:
                ranks.append(rank)
        if bad:
            raise ShardStateError(
                f"{op}: dp rank(s) {bad} do not exist; valid ranks are 0..{len(statuses) - 1} "
                f"({len(statuses)} shards); nothing was changed"
            )
        return ranks, statuses

    def shrink(self, dp_ranks: Sequence[int]) -> None:
        """Preempt ranks that still run or are half taken down; sleeping ones are left alone.

        Raises:
            ShardStateError: a rank does not exist (nothing changed).
        """
        ranks, statuses = self._checked("shrink", dp_ranks)
        todo = [r for r in ranks if statuses[r] is not ShardStatus.SLEEPING]
        if todo:
            self._loop_thread().run(self._lifecycle.preempt(todo))
            self._record_shrinks(todo)

    def _record_shrinks(self, ranks: Sequence[int]) -> None:
        """One lifecycle record per rank taken down (evidence only: never fails a shrink).
        ``step`` is the driver's last refresh step: None in the coordinator's copy."""
        writer = self._observer
        if not writer.enabled or writer.pipeline_id is None:
            return
        for r in ranks:
            gpus = self._rank_gpus[r] if self._rank_gpus and r < len(self._rank_gpus) else ()
            try:
                writer.write(LifecycleObserved(writer.pipeline_id, "shrink", step=self._step,
                                               rank=r, gpus=gpus))
            except Exception:
                logger.warning("shrink record of rank %s not written", r, exc_info=True)

    def expand(self, dp_ranks: Sequence[int]) -> None:
        """Wake sleeping ranks, sync the newest cached weights to exactly them, activate.

        A rank left PREEMPTED by a shrink that failed part-way is taken down again first
        (abort, drain, sleep), then woken like a sleeping one.

        Raises:
            ShardStateError: a rank does not exist, or a rank needs weights and no version is
                cached yet (nothing changed in either case).
        """
        ranks, statuses = self._checked("expand", dp_ranks)
        inactive = [r for r in ranks if statuses[r] is not ShardStatus.ACTIVE]
        if not inactive:
            return
        # The state does not record a shard's sleep level, and WOKEN means "weights stale until
        # synced": with nothing cached there is nothing to sync, so refuse before waking.
        # Hosts build the first version before the first shrink, so this is an ordering bug.
        if self._version() is None:
            raise ShardStateError(
                f"expand: shard(s) {inactive} need weights but no weight version is cached yet "
                "(a shard woken from level-2 sleep holds none); build the cache before the "
                "first shrink; nothing was changed"
            )
        # PREEMPTED is unrouted but in an unknown engine state (awake or asleep): skipping it
        # would report an expand that never happened. The lifecycle retakes it down.
        half_down = [r for r in inactive if statuses[r] is ShardStatus.PREEMPTED]
        if half_down:
            self._loop_thread().run(self._lifecycle.preempt(half_down))
        sleeping = [r for r in inactive if statuses[r] is not ShardStatus.WOKEN]
        if sleeping:
            self._loop_thread().run(self._lifecycle.wake(sleeping))
        # Read again after the wake: a version cached meanwhile is the one to serve.
        version = self._version()
        if version is None:
            raise ShardStateError(
                f"expand: the weight cache lost every version while waking {sleeping}; they "
                "stay woken and unrouted"
            )
        # Woken from level-2 sleep a shard has no valid weights: routed only after this. A
        # version cached while these ranks synced was refreshed by the host into the shards
        # active at that moment, not into these: they catch up before they are routed, so no
        # request of theirs sees its weights change under it.
        version = self._catch_up(inactive, version, synced=False)
        self._loop_thread().run(self._lifecycle.activate(inactive))
        # One cached between the last check and the activation: in place, as an active
        # refresh does, or they would serve the older version to the next step.
        version = self._catch_up(inactive, version, synced=True)
        self.observe("expand", inactive, version)

    def _catch_up(self, ranks: list[int], version: int, *, synced: bool) -> int:
        """Sync ``ranks`` to ``version`` (unless ``synced``), then to every newer version
        cached meanwhile; the version they hold at the end."""
        if not synced:
            self._sync(ranks, version)
        newest = self._version()
        while newest is not None and newest > version:
            version = newest
            self._sync(ranks, version)
            newest = self._version()
        return version

    def refresh(self, dp_ranks: Sequence[int], version: int, *, step: int | None = None) -> None:
        """Active refresh: sync ``version`` into shards that stay active (no drain), then
        record what every active shard serves. Hosts call this after caching a new version.

        Raises:
            ShardStateError: a rank does not exist (nothing synced or recorded).
        """
        # Validated like shrink/expand, before anything changes: a negative rank indexed the
        # statuses from the end and was synced as is; one past the end was an IndexError.
        checked, statuses = self._checked("refresh", dp_ranks)
        if step is not None:
            self._step = step
        # The coordinator's copy of this controller (another process) may have shrunk some of
        # them since the host read the active set: a push into a shard asleep at level 2
        # would write into released weight memory. Shards that left ACTIVE are skipped (their
        # next expand syncs the newest version before they serve); a sync that failed is
        # retried once on the shards still active, since one shrunk mid-sync fails it too.
        ranks = [r for r in checked if statuses[r] is ShardStatus.ACTIVE]
        if ranks:
            try:
                self._sync(ranks, version)
            except WeightSyncError:
                still = self._still_active(ranks)
                if len(still) == len(ranks):
                    raise
                logger.info("refresh of version %d: shard(s) %s left ACTIVE during the "
                            "sync; syncing the others again", version,
                            sorted(set(ranks) - set(still)))
                ranks = still
                if ranks:
                    self._sync(ranks, version)
        self.observe("refresh", ranks, version)

    def _still_active(self, dp_ranks: Sequence[int]) -> list[int]:
        statuses = self._statuses()
        return [int(r) for r in dp_ranks if statuses[int(r)] is ShardStatus.ACTIVE]

    def observe(self, event: str, synced: Sequence[int], version: int) -> None:
        """Ask every ACTIVE shard's engine for its version and record it (no-op when
        observation is off). A shard that leaves ACTIVE while being asked is left out."""
        writer = self._observer
        if not writer.enabled or writer.pipeline_id is None:
            return
        probe = self._probe or engine_version_probe(_lifecycle_engines(self._lifecycle))

        async def read() -> dict[int, int | None]:
            before = set((await self._state.refresh()).active)
            versions = await probe(sorted(before))
            after = set((await self._state.refresh()).active)
            return {r: v for r, v in versions.items() if r in after}

        try:
            versions = self._loop_thread().run(read())
        except Exception:
            # Observation never fails a resize; the gate then lacks this record and says so.
            logger.warning("weight version probe after %s failed", event, exc_info=True)
            return
        writer.write(ShardVersionsObserved(
            pipeline_id=writer.pipeline_id, event=event, trainer_version=int(version),
            synced=tuple(sorted(int(r) for r in synced)), shard_versions=versions,
            step=self._step,
        ))

    def __getstate__(self) -> dict[str, Any]:
        return {
            "lifecycle": self._lifecycle,
            "state": self._state,
            "sync": self._sync,
            "version": self._version,
            "probe": self._probe,
            "observer": self._observer,
            "rank_gpus": self._rank_gpus,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        LifecycleShardController.__init__(
            self, state["lifecycle"], state["state"], state["sync"], state["version"],
            probe=state.get("probe"), observer=state.get("observer"),
            rank_gpus=state.get("rank_gpus"),
        )
