"""Route generation requests over the active shards only, re-dispatching preempted ones.

:class:`ShardRouter` is what a host's generation object calls per request. It reads the shard
state through a :class:`~.state_store.ShardStateView` (one owner per pipeline), never keeps its
own copy of the active set beyond the view's snapshot, and is picklable (it carries the view
and the engines, not locks or tasks), so NeMo RL can pickle it into its collector actor.

Per request:
  1. wait (bounded by ``wait_timeout_s``) until some shard is active;
  2. pick one (least-loaded by this copy's in-flight counts, ties round-robin);
  3. run it; if the engine raised :class:`ShardPreemptedError`, or the stream ended with
     ``finish_reason == "abort"``, or raised anything while its shard was no longer active,
     it was preempted: re-dispatch (restart, or continue from the partial tokens), at most
     ``max_attempts`` preempted dispatches. An aborted output is never returned.

Migration (:mod:`.migration`, on by default, ``RouterConfig.migration``): when a shard becomes
active while this copy has requests running, or when the host calls :meth:`ShardRouter.
rebalance`, running requests move from the most loaded shards to the new one: the router
aborts those attempts on their engine (engines with the optional
:class:`~.engine.RequestAbortable` capability only) and continues each on the target shard from
its partial tokens. Migrations are counted apart from preemptions (``migrated``) and do not use
up ``max_attempts``.

Bookkeeping (:class:`RequestLedger`, one per router copy): every request id submitted, how it
left (completed once, lost to an error, cancelled by its caller), duplicates (an id submitted
while already in flight or already completed) and re-dispatches. ``on_counters`` receives a
:class:`RouterCounters` snapshot whenever the copy drains, when it loses a request, and at most
once per ``emit_interval_s`` otherwise (the gates' request criterion reads these).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Protocol, runtime_checkable

from rlix_plugins.errors import (
    NoActiveShardError,
    ProtocolError,
    SettingsError,
    ShardPreemptedError,
)
from rlix_plugins.generation.engine import (
    EngineOutput,
    GenerationRequest,
    GenerationResult,
    ProgressReporting,
    RequestAbortable,
    ShardEngine,
)
from rlix_plugins.generation.migration import (
    MigrationCandidate,
    MigrationConfig,
    MigrationMove,
    plan_migration,
    remaining_tokens,
)
from rlix_plugins.generation.shard_state import ShardSnapshot, ShardStatus, normalize_ranks
from rlix_plugins.generation.state_store import ShardStateView
from rlix_plugins.values import enum_member, is_int, is_number

logger = logging.getLogger(__name__)


@runtime_checkable
class AsyncSnapshotView(Protocol):
    """Optional view capability: ``await snapshot_async()`` is ``snapshot()`` without ever
    blocking the event loop (a remote view's first read in a process awaits its owner instead
    of blocking on it). The router reads the state through it when the view has it."""

    async def snapshot_async(self) -> ShardSnapshot: ...


class RoutingPolicy(str, enum.Enum):
    """How a shard is chosen among the active ones."""

    LEAST_LOADED = "least_loaded"
    ROUND_ROBIN = "round_robin"


class RedispatchMode(str, enum.Enum):
    """What a preempted request does on its next shard.

    ``RESTART`` runs it again from the prompt (exact reproduction for greedy and seeded
    sampling). ``CONTINUE`` appends the partial tokens to the prompt and asks for the remaining
    ``max_tokens`` (no work lost; a seeded sampler restarts its random stream at the cut).
    """

    RESTART = "restart"
    CONTINUE = "continue"


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """Router settings.

    Attributes:
        max_attempts: preempted dispatches per request at most (first one included) before
            :class:`ShardPreemptedError` is raised to the caller (migrations not counted).
        wait_timeout_s: how long one request waits for an active shard before
            :class:`NoActiveShardError`.
        policy: shard choice among active shards.
        redispatch: restart or continue a preempted request.
        migration: moving running requests to newly activated shards (a mapping of its
            fields is accepted too). A migrated request always continues from its partial
            tokens, whatever ``redispatch`` says.
    """

    max_attempts: int = 8
    wait_timeout_s: float = 600.0
    policy: RoutingPolicy = RoutingPolicy.LEAST_LOADED
    redispatch: RedispatchMode = RedispatchMode.RESTART
    migration: MigrationConfig = field(default_factory=MigrationConfig)

    def __post_init__(self) -> None:
        if not (is_int(self.max_attempts) and self.max_attempts >= 1):
            kind = "" if is_int(self.max_attempts) else "an int "
            raise SettingsError(f"max_attempts must be {kind}>= 1, got {self.max_attempts!r}")
        if not (is_number(self.wait_timeout_s) and self.wait_timeout_s > 0):
            raise SettingsError(f"wait_timeout_s must be > 0, got {self.wait_timeout_s!r}")
        # Accept the plain string values too (configs come from YAML); store the enums.
        policy = enum_member(RoutingPolicy, self.policy, SettingsError, "routing policy")
        redispatch = enum_member(RedispatchMode, self.redispatch, SettingsError, "redispatch mode")
        object.__setattr__(self, "policy", policy)
        object.__setattr__(self, "redispatch", redispatch)
        if isinstance(self.migration, Mapping):
            valid = sorted(f.name for f in fields(MigrationConfig))
            unknown = sorted(set(self.migration) - set(valid), key=str)
            if unknown:
                raise SettingsError(
                    f"unknown migration field(s) {unknown}; valid fields are {valid}"
                )
            object.__setattr__(self, "migration", MigrationConfig(**self.migration))
        elif not isinstance(self.migration, MigrationConfig):
            raise SettingsError(
                f"migration must be a MigrationConfig or a mapping of its fields, got "
                f"{self.migration!r}"
            )




@dataclass(frozen=True, slots=True)
class RouterStats:
    """Counters of one router copy.

    ``redispatched``: attempts cut by preemption and sent again; ``waits``: times a request
    found no active shard and waited; ``stale_refreshes``: times this copy's snapshot still
    showed a preempted shard as active and was refreshed from the owner; ``migrated``:
    attempts moved to another shard by migration (continued there).
    """

    requests: int
    completed: int
    redispatched: int
    waits: int
    stale_refreshes: int
    migrated: int = 0


@dataclass(frozen=True, slots=True)
class RouterCounters:
    """Request bookkeeping of one router copy (``copy_id`` is new for every copy and reset).

    ``submitted == completed + lost + cancelled + in_flight``. ``lost``: calls that raised
    (no active shard in time, preempted on every attempt, an engine error) and so returned no
    sample; ``cancelled``: calls their caller cancelled; ``duplicated``: submissions of a
    request id already in flight or already completed by this copy; ``redispatched``:
    attempts cut by preemption and sent again; ``migrated``: attempts moved to another shard
    by migration (aborted there, continued from their partial tokens; the request still
    completes once).
    """

    copy_id: str
    submitted: int
    completed: int
    lost: int
    cancelled: int
    in_flight: int
    duplicated: int
    redispatched: int
    migrated: int = 0


CountersCallback = Callable[[RouterCounters], None]


class RequestLedger:
    """Which request ids a router copy accepted and how each one left (see module docstring).

    Completed ids are remembered in a bounded window (``remember_completed``, newest kept) so a
    long job's memory stays flat; a duplicate older than the window is not detected.
    """

    def __init__(
        self,
        on_counters: CountersCallback | None = None,
        *,
        emit_interval_s: float = 1.0,
        remember_completed: int = 65536,
    ) -> None:
        if remember_completed < 1:
            raise ValueError(f"remember_completed must be >= 1, got {remember_completed}")
        self.copy_id = uuid.uuid4().hex[:12]
        self._on_counters = on_counters
        self._interval = emit_interval_s
        self._remember = remember_completed
        self._in_flight: dict[str, int] = {}
        self._done: OrderedDict[str, None] = OrderedDict()
        self.submitted = 0
        self.completed = 0
        self.lost = 0
        self.cancelled = 0
        self.duplicated = 0
        self.redispatched = 0
        self.migrated = 0
        self._last_emit = 0.0

    @property
    def in_flight(self) -> int:
        return self.submitted - self.completed - self.lost - self.cancelled

    def counters(self) -> RouterCounters:
        return RouterCounters(self.copy_id, self.submitted, self.completed, self.lost,
                              self.cancelled, self.in_flight, self.duplicated,
                              self.redispatched, self.migrated)

    def begin(self, request_id: str) -> None:
        self.submitted += 1
        if request_id in self._in_flight or request_id in self._done:
            self.duplicated += 1
            logger.warning("request id %s submitted again while %s", request_id,
                           "in flight" if request_id in self._in_flight else "already completed")
        self._in_flight[request_id] = self._in_flight.get(request_id, 0) + 1

    def _leave(self, request_id: str) -> None:
        left = self._in_flight.get(request_id, 0) - 1
        if left > 0:
            self._in_flight[request_id] = left
        else:
            self._in_flight.pop(request_id, None)

    def complete(self, request_id: str) -> None:
        self.completed += 1
        self._leave(request_id)
        self._done[request_id] = None
        self._done.move_to_end(request_id)
        while len(self._done) > self._remember:
            self._done.popitem(last=False)
        self._maybe_emit(force=self.in_flight == 0)

    def lose(self, request_id: str) -> None:
        self.lost += 1
        self._leave(request_id)
        self._maybe_emit(force=True)

    def cancel(self, request_id: str) -> None:
        self.cancelled += 1
        self._leave(request_id)
        self._maybe_emit(force=self.in_flight == 0)

    def redispatch(self) -> None:
        self.redispatched += 1

    def migrate(self) -> None:
        self.migrated += 1

    def emit(self) -> None:
        """Hand the current counters to ``on_counters`` now (no-op without a callback)."""
        if self._on_counters is None:
            return
        self._last_emit = time.monotonic()
        try:
            self._on_counters(self.counters())
        except Exception:
            # Observation must never fail a request.
            logger.warning("router counters callback failed", exc_info=True)

    def _maybe_emit(self, *, force: bool) -> None:
        if self._on_counters is not None and (
                force or time.monotonic() - self._last_emit >= self._interval):
            self.emit()


class _Running:
    """One attempt in flight on this router copy (mutable, loop-local bookkeeping)."""

    __slots__ = ("budget", "migrate_to", "migrations", "rank", "request_id")

    def __init__(self, request_id: str, rank: int, budget: int, migrations: int) -> None:
        self.request_id = request_id
        self.rank = rank
        self.budget = budget  # the attempt's max_tokens
        self.migrations = migrations  # earlier migrations of its request
        self.migrate_to: int | None = None  # set while a migration abort is under way


class ShardRouter:
    """Routes requests over a pipeline's active shards (see module docstring).

    Args:
        state: view of the pipeline's shard state owner.
        engines: the shard engines, indexed by dp rank (``len == num_shards``).
        config: router settings.
        on_counters: receives :class:`RouterCounters` snapshots (see module docstring); it
            travels with a pickled router, so it must pickle too.
    """

    def __init__(
        self,
        state: ShardStateView,
        engines: Sequence[ShardEngine],
        config: RouterConfig | None = None,
        *,
        on_counters: CountersCallback | None = None,
    ) -> None:
        self._state = state
        self._engines = tuple(engines)
        if config is not None and not isinstance(config, RouterConfig):
            raise SettingsError(
                f"config must be a RouterConfig, got {type(config).__name__}"
            )
        self._config = config or RouterConfig()
        self._on_counters = on_counters
        n = state.snapshot().num_shards
        if len(self._engines) != n:
            raise ValueError(f"got {len(self._engines)} engines for {n} shards; need one per rank")
        self._reset_runtime()

    def _reset_runtime(self) -> None:
        self._inflight = [0] * len(self._engines)
        self._cursor = 0
        self._ledger = RequestLedger(self._on_counters)
        self._waits = 0
        self._stale_refreshes = 0
        self._running: dict[str, _Running] = {}
        # Migration aborts a cancelled rebalance left running; they settle their marks.
        self._settling: set[asyncio.Task[set[str] | None]] = set()
        self._read_async = (self._state.snapshot_async
                            if isinstance(self._state, AsyncSnapshotView) else None)
        self._abortable = tuple(isinstance(e, RequestAbortable) for e in self._engines)
        self._watcher: asyncio.Task[None] | None = None
        self._watcher_loop: asyncio.AbstractEventLoop | None = None
        self._rebalance_lock: asyncio.Lock | None = None
        self._rebalance_loop: asyncio.AbstractEventLoop | None = None

    @property
    def config(self) -> RouterConfig:
        return self._config

    @property
    def state(self) -> ShardStateView:
        return self._state

    @property
    def engines(self) -> tuple[ShardEngine, ...]:
        return self._engines

    @property
    def inflight(self) -> tuple[int, ...]:
        """Requests this copy has in flight per dp rank."""
        return tuple(self._inflight)

    @property
    def outstanding(self) -> int:
        """Requests this copy accepted and has not finished: running on a shard or waiting
        for one (the ``outstanding`` progress metric)."""
        return self._ledger.in_flight

    def stats(self) -> RouterStats:
        """Counters of this router copy (copies do not share counters)."""
        led = self._ledger
        return RouterStats(
            led.submitted, led.completed, led.redispatched, self._waits, self._stale_refreshes,
            led.migrated,
        )

    def counters(self) -> RouterCounters:
        """This copy's request bookkeeping (submitted, completed, lost, duplicated, ...)."""
        return self._ledger.counters()

    def emit_counters(self) -> None:
        """Hand the current counters to ``on_counters`` now (e.g. at the end of a run)."""
        self._ledger.emit()

    async def _read_state(self) -> ShardSnapshot:
        """The view's newest snapshot; on the event loop, so never a blocking read."""
        if self._read_async is not None:
            return await self._read_async()
        return self._state.snapshot()

    def _pick(self, active: tuple[int, ...]) -> int:
        n = len(active)
        start = self._cursor % n
        self._cursor += 1
        if n == 1 or self._config.policy is RoutingPolicy.ROUND_ROBIN:
            return active[start]
        best = active[start]
        best_load = self._inflight[best]
        for i in range(1, n):
            r = active[(start + i) % n]
            if self._inflight[r] < best_load:
                best, best_load = r, self._inflight[r]
        return best

    async def _wait_for_active(self, snap: ShardSnapshot, request_id: str) -> ShardSnapshot:
        self._waits += 1
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._config.wait_timeout_s
        logger.debug("request %s waits for an active shard (%s)", request_id, snap.describe())
        while not snap.active:
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise NoActiveShardError(
                    f"request {request_id}: no generation shard became active within "
                    f"{self._config.wait_timeout_s:g}s (state {snap.describe()}); wake and "
                    "activate a shard, or raise RouterConfig.wait_timeout_s"
                )
            snap = await self._state.wait_for_update(snap.version, remaining)
        return snap

    def _attempt(
        self, request: GenerationRequest, attempt: int, prefix: tuple[int, ...]
    ) -> GenerationRequest:
        rid = f"{request.request_id}:a{attempt}"
        if not prefix:
            return GenerationRequest(rid, request.prompt_token_ids, request.max_tokens,
                                     request.sampling)
        sampling: Any = request.sampling
        min_tokens = sampling.get("min_tokens")
        if min_tokens:
            sampling = {**sampling, "min_tokens": max(0, int(min_tokens) - len(prefix))}
        return GenerationRequest(
            rid, request.prompt_token_ids + prefix, request.max_tokens - len(prefix), sampling
        )

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        """Generate one complete sample for ``request`` on an active shard.

        Raises:
            NoActiveShardError: no shard became active within ``wait_timeout_s``.
            ShardPreemptedError: preempted on every one of ``max_attempts`` dispatches.
            ProtocolError: an engine broke its contract (e.g. an output whose logprobs do
                not line up with its tokens); the request is counted lost, not retried.
            TypeError: ``request`` is not a :class:`GenerationRequest` (nothing recorded).
        """
        if not isinstance(request, GenerationRequest):
            raise TypeError(
                f"ShardRouter.generate takes a GenerationRequest, got {type(request).__name__}"
            )
        ledger = self._ledger
        ledger.begin(request.request_id)
        try:
            # Inside the try: starting the watcher reads the state view, which can fail (a
            # remote owner gone); the request must then leave the ledger as lost.
            if self._watcher_wanted():
                self._ensure_watcher(await self._read_state())
            result = await self._generate(request)
        except asyncio.CancelledError:
            ledger.cancel(request.request_id)
            raise
        except BaseException:
            ledger.lose(request.request_id)
            raise
        ledger.complete(request.request_id)
        return result

    async def _generate(self, request: GenerationRequest) -> GenerationResult:
        cont = self._config.redispatch is RedispatchMode.CONTINUE
        prefix: tuple[int, ...] = ()
        # Logprobs of the prefix tokens; None once a segment came without them (then the
        # result's logprobs cannot be aligned with its tokens and are None).
        prefix_lp: tuple[float, ...] | None = ()
        preempted = 0
        migrations = 0
        target: int | None = None  # where a migrated request continues
        dispatches = 0
        # The counter of the cut that sends the request again (migrated or re-dispatched),
        # bumped only once it really is sent again: not if no shard comes back in time, the
        # caller cancels while it waits, or the state cannot be read.
        count_resend: Callable[[], None] | None = None
        while True:
            dispatches += 1
            snap = await self._read_state()
            if target is not None and snap.statuses[target] is ShardStatus.ACTIVE:
                rank = target
            else:
                if not snap.active:
                    snap = await self._wait_for_active(snap, request.request_id)
                rank = self._pick(snap.active)
            target = None
            attempt = self._attempt(request, dispatches, prefix)
            run = _Running(request.request_id, rank, attempt.max_tokens, migrations)
            if count_resend is not None:
                count_resend()
                count_resend = None
            out = await self._dispatch(rank, attempt, run)
            if out is not None and not out.aborted:
                token_ids, logprobs = out.token_ids, out.logprobs
                if prefix:
                    token_ids = prefix + token_ids
                    logprobs = (None if logprobs is None or prefix_lp is None
                                else prefix_lp + logprobs)
                return GenerationResult(
                    request.request_id, token_ids, out.finish_reason, logprobs, rank, dispatches
                )
            # An attempt we marked and aborted is a migration, whether the engine returned its
            # partial output or raised (an engine that cannot hand partial output back), and
            # even if a preemption of its shard raced it: the target is active, so that is
            # where it belongs. Migrations never use up max_attempts.
            migrated = run.migrate_to is not None
            if migrated:
                migrations += 1
                target = run.migrate_to
            else:
                preempted += 1
            if out is not None and (migrated or cont):
                # Migrations always continue from the partial tokens (nothing is lost).
                if out.token_ids:
                    # EngineOutput guarantees one logprob per token (or None).
                    prefix += out.token_ids
                    prefix_lp = (None if prefix_lp is None or out.logprobs is None
                                 else prefix_lp + out.logprobs)
            elif not cont and not migrated:
                # RESTART reruns from the prompt, also dropping tokens an earlier migration
                # carried over (a restarted seeded sample is then exact again).
                prefix, prefix_lp = (), ()
            if prefix and len(prefix) >= request.max_tokens:
                # Every token arrived before the abort: the sample is complete.
                return GenerationResult(request.request_id, prefix, "length", prefix_lp,
                                        rank, dispatches)
            logger.debug("request %s %s on shard %d (dispatch %d)", request.request_id,
                         f"migrated to shard {target}" if migrated else "preempted", rank,
                         dispatches)
            if not migrated and preempted >= self._config.max_attempts:
                raise ShardPreemptedError(
                    f"request {request.request_id} was preempted on each of its "
                    f"{self._config.max_attempts} dispatches; raise RouterConfig.max_attempts "
                    "or preempt less often"
                )
            # Counted when the request is sent again (not when it completed from its partial
            # tokens, ran out of attempts, or never reaches another shard).
            count_resend = self._ledger.migrate if migrated else self._ledger.redispatch

    async def _dispatch(
        self, rank: int, attempt: GenerationRequest, run: _Running
    ) -> EngineOutput | None:
        """Run one attempt on ``rank``; ``None`` (or an aborted output) means preempted or,
        if ``run.migrate_to`` is set, migrated."""
        key = attempt.request_id
        self._inflight[rank] += 1
        self._running[key] = run

        def over() -> None:
            # The attempt has ended: no rebalance may mark it from here on. A mark set while
            # the refreshes below await would make a host's abort (or a preemption) pass for
            # a migration: counted as one, continued from its partial tokens under RESTART.
            if self._running.get(key) is run:
                del self._running[key]

        try:
            out = await self._engines[rank].generate(attempt)
            over()
            if out.aborted and run.migrate_to is None:
                await self._refresh_if_stale(rank)
            return out
        except ShardPreemptedError:
            over()
            await self._refresh_if_stale(rank)
            return None
        except ProtocolError:
            # A broken engine contract (a malformed output) is a bug, not the preemption
            # tearing the shard down, even on a preempted shard: retrying would hide it (or
            # repeat it on the next shard), so the caller gets the typed error.
            logger.error("attempt %s on shard %d: engine output rejected", attempt.request_id,
                         rank, exc_info=True)
            raise
        except Exception:
            over()
            if run.migrate_to is not None:
                # A rebalance marked and aborted it: an engine that cannot hand the partial
                # output back fails the attempt instead, on a shard that stays active.
                # _generate continues it on the target (raising here lost the request).
                logger.debug("attempt %s failed on shard %d while migrating to shard %d",
                             attempt.request_id, rank, run.migrate_to, exc_info=True)
                return None
            # A failure on a shard that is no longer active is the preemption tearing it
            # down; on an active shard it is a real error for the caller.
            snap = await self._state.refresh()
            if snap.statuses[rank] is ShardStatus.ACTIVE:
                raise
            logger.debug("attempt %s failed on shard %d while preempted", attempt.request_id,
                         rank, exc_info=True)
            return None
        finally:
            self._inflight[rank] -= 1
            over()

    async def _refresh_if_stale(self, rank: int) -> None:
        # The engine rejected or aborted us; if our view still calls the shard active it is
        # behind the owner: refresh now rather than waiting for the push.
        if (await self._read_state()).statuses[rank] is ShardStatus.ACTIVE:
            snap = await self._state.refresh()
            # Counted only when the owner disagrees: an abort on a shard that is still
            # active (a host's abort) does not mean this copy was behind.
            if snap.statuses[rank] is not ShardStatus.ACTIVE:
                self._stale_refreshes += 1

    # -- migration -------------------------------------------------------------------------

    async def rebalance(self, new_ranks: Iterable[int] | None = None) -> tuple[MigrationMove, ...]:
        """Move running requests of this copy to ``new_ranks`` (default: every active shard)
        by the rule of :func:`~.migration.plan_migration`; returns the moves started.

        A host calls it right after ``ShardLifecycle.activate(new_ranks)``; with
        ``MigrationConfig.auto`` (default) the router also does it by itself when it sees a
        shard become active. Each returned move's attempt was aborted on its source shard
        and continues on its target from its partial tokens. No-op (``()``) when migration is
        disabled, nothing runs, no engine can abort single requests, or nothing is worth it.
        Cancelled, it leaves no mark behind: moves whose abort was not sent yet stay where
        they are; an abort already sent runs on and settles its moves when it reports.

        Raises:
            ShardStateError: a rank in ``new_ranks`` is not an int or does not exist.
        """
        snap = await self._state.refresh()
        targets = snap.active
        if new_ranks is not None:
            if isinstance(new_ranks, Iterable) and not isinstance(new_ranks, (str, bytes)):
                new_ranks = list(new_ranks)
                if not new_ranks:
                    return ()  # no shard newly activated: nothing to fill
            # A rank that does not exist is a caller's mistake, not "nothing to migrate".
            targets = normalize_ranks(snap, new_ranks)
        return await self._rebalance(snap, targets)

    def _lock(self) -> asyncio.Lock:
        loop = asyncio.get_running_loop()
        if self._rebalance_lock is None or self._rebalance_loop is not loop:
            self._rebalance_lock = asyncio.Lock()
            self._rebalance_loop = loop
        return self._rebalance_lock

    async def _rebalance(
        self, snap: ShardSnapshot, new_ranks: Iterable[int]
    ) -> tuple[MigrationMove, ...]:
        mig = self._config.migration
        targets = tuple(new_ranks)
        if not mig.enabled or not any(self._abortable) or not self._running:
            return ()
        async with self._lock():
            moves = await self._plan(snap, targets)
            if not moves:
                return ()
            # Mark before aborting: the aborted output may reach _generate while abort runs.
            by_source: dict[int, list[MigrationMove]] = {}
            for m in moves:
                self._running[m.key].migrate_to = m.target
                by_source.setdefault(m.source, []).append(m)
            started: list[MigrationMove] = []
            pending = list(by_source.items())
            try:
                while pending:
                    source, ms = pending[0]
                    # Shielded: cancelling the rebalance must not cut an abort the engine may
                    # already be carrying out (a remote one runs on regardless); its marks
                    # are kept until it says which ids it aborted, then settled.
                    task = asyncio.ensure_future(self._abort_moves(source, ms))
                    try:
                        done = await asyncio.shield(task)
                    except asyncio.CancelledError:
                        pending.pop(0)
                        self._settle_later(task, ms)
                        raise
                    pending.pop(0)
                    started.extend(self._settle(ms, done))
            finally:
                # Cancelled (or failed) before these sources' aborts were sent: nothing was
                # aborted, so no mark may stay (a later preemption would pass for a migration).
                for _source, ms in pending:
                    self._settle(ms, set())
            if started:
                logger.info("migrating %d request(s) to shard(s) %s (loads %s)", len(started),
                            sorted({m.target for m in started}), list(self._inflight))
            return tuple(started)

    async def _abort_moves(self, source: int, ms: list[MigrationMove]) -> set[str] | None:
        """Abort the attempts of ``ms`` on ``source``; the ids the engine actually aborted,
        or None when the call raised and nobody knows (a remote abort whose reply was lost
        may have landed)."""
        engine = self._engines[source]
        assert isinstance(engine, RequestAbortable)  # only such ranks have candidates
        try:
            return set(await engine.abort_requests([m.key for m in ms]))
        except Exception:
            logger.warning("migration abort failed on shard %d; its requests keep their "
                           "marks until their attempts end", source, exc_info=True)
            return None

    def _settle(self, ms: list[MigrationMove], done: set[str] | None) -> list[MigrationMove]:
        """Keep the marks of the moves whose attempt was aborted (they are under way), clear
        the others; returns the moves under way.

        With ``done`` None (the abort's outcome is unknown) every mark is kept and no move is
        returned: an attempt that was aborted comes back as a migration, not as a preemption
        that would use up one of its ``max_attempts``, and one that was not ends as usual.
        """
        if done is None:
            return []
        started: list[MigrationMove] = []
        for m in ms:
            if m.key in done:
                started.append(m)
                continue
            # Not aborted (finished meanwhile or not yet registered): it stays.
            run = self._running.get(m.key)
            if run is not None and run.migrate_to == m.target:
                run.migrate_to = None
        return started

    def _settle_later(
        self, task: asyncio.Task[set[str] | None], ms: list[MigrationMove]
    ) -> None:
        """Settle ``ms`` when ``task`` (an abort a cancelled rebalance left running) ends."""
        self._settling.add(task)  # the loop holds tasks weakly

        def _done(t: asyncio.Task[set[str] | None]) -> None:
            self._settling.discard(t)
            aborted = set() if t.cancelled() or t.exception() is not None else t.result()
            self._settle(ms, aborted)

        task.add_done_callback(_done)

    async def _plan(
        self, snap: ShardSnapshot, targets: tuple[int, ...]
    ) -> tuple[MigrationMove, ...]:
        mig = self._config.migration
        runs: dict[int, list[tuple[str, _Running]]] = {}
        for key, run in self._running.items():
            if (run.migrate_to is None and self._abortable[run.rank]
                    and snap.statuses[run.rank] is ShardStatus.ACTIVE):
                runs.setdefault(run.rank, []).append((key, run))
        progress: dict[str, int] = {}
        for rank, items in runs.items():
            engine = self._engines[rank]
            if isinstance(engine, ProgressReporting):
                try:
                    progress.update(await engine.request_progress([k for k, _ in items]))
                except Exception:
                    logger.debug("progress query failed on shard %d", rank, exc_info=True)
        # The awaits before this point (the rebalance lock, the progress queries) may have
        # let the state move on: plan on the newest snapshot, so no move targets or leaves
        # a shard that is no longer active.
        current = await self._read_state()
        if current.version > snap.version:
            snap = current
        # Loads as they are now (attempts may have finished during the awaits) and as they
        # will be once migrations already under way have landed.
        loads = list(self._inflight)
        for run in self._running.values():
            if run.migrate_to is not None:
                loads[run.rank] -= 1
                loads[run.migrate_to] += 1
        # The awaits above may have let attempts finish or get marked: use the live ones.
        candidates = [
            MigrationCandidate(key, run.rank, remaining_tokens(run.budget, progress, key),
                               run.migrations)
            for items in runs.values() for key, run in items
            if self._running.get(key) is run and run.migrate_to is None
        ]
        return plan_migration(
            loads, snap.active, targets, candidates, min_gap=mig.min_gap,
            min_remaining_tokens=mig.min_remaining_tokens,
            max_per_request=mig.max_per_request,
        )

    def _watcher_wanted(self) -> bool:
        """Whether this copy should start a migration watcher on the running loop now."""
        mig = self._config.migration
        if not (mig.enabled and mig.auto and any(self._abortable)):
            return False
        loop = asyncio.get_running_loop()
        return not (self._watcher is not None and not self._watcher.done()
                    and self._watcher_loop is loop)

    def _ensure_watcher(self, seen: ShardSnapshot) -> None:
        # Re-checked: another request may have started it while ``seen`` was being read.
        if not self._watcher_wanted():
            return
        loop = asyncio.get_running_loop()
        self._watcher_loop = loop
        self._watcher = loop.create_task(self._watch(seen))

    async def _watch(self, seen: ShardSnapshot) -> None:
        """While requests are in flight: rebalance onto every shard that becomes active.

        Ends by itself at most ``watch_interval_s`` after the last request left (it is not
        cancelled when the copy goes idle): requests sent one after another then share one
        watcher instead of each starting and cancelling its own task (docs/generation.md,
        "Measured": a scratch A/B of that cost, not a repo command).
        """
        interval = self._config.migration.watch_interval_s
        try:
            while self._ledger.in_flight > 0:
                snap = await self._state.wait_for_update(seen.version, interval)
                if snap.version <= seen.version:
                    continue
                new = [r for r in snap.active if r not in seen.active]
                seen = snap
                if new:
                    await self._rebalance(snap, new)
        except Exception:
            # Migration is an optimization: it must never fail a request. The next request
            # of this copy starts a new watcher.
            logger.warning("migration watcher stopped", exc_info=True)

    def __getstate__(self) -> dict[str, Any]:
        # Counters and in-flight counts belong to this copy; only wiring travels.
        return {"state": self._state, "engines": self._engines, "config": self._config,
                "on_counters": self._on_counters}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._state = state["state"]
        self._engines = state["engines"]
        self._config = state["config"]
        self._on_counters = state.get("on_counters")
        self._reset_runtime()
