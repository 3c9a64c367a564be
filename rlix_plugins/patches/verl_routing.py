"""veRL routing under RLix: a load balancer that skips non-active replicas, and a client that
re-dispatches aborted generations.

Both are subclasses of veRL 0.9.1 classes and are imported only where veRL is importable.

* :class:`RLixRequestLoadBalancer` subclasses ``GlobalRequestLoadBalancer`` (veRL's one Ray
  actor shared by every agent-loop worker). It is the ONE owner of the pipeline's shard state:
  it holds a :class:`~rlix_plugins.generation.state_store.ShardStateStore` and routes only to
  replicas whose dp rank is ``ACTIVE``, so no copy of the active set can go stale in an agent
  loop worker. Before :meth:`RLixRequestLoadBalancer.bind_shards` it behaves exactly like the
  stock balancer. ``add_servers``/``remove_servers`` (used by veRL's own separate-async mode)
  keep working for servers that are not bound shards.
* :class:`RLixLLMServerClient` subclasses ``LLMServerClient``. veRL's vLLM server returns
  ``stop_reason="aborted"`` (with the partial tokens) when its replica is aborted; the stock
  sync-mode client would hand that back as a finished, truncated sample. This client treats it
  as preemption: it continues the request from the partial tokens on another active replica
  (at most ``max_attempts`` preempted dispatches, then :class:`ShardPreemptedError`; aborts by
  an in-place weight refresh, which the server tags, and migrations are re-dispatched without
  counting), and waits a bounded
  time when no replica is active (then :class:`NoActiveShardError`). An attempt still out on a
  replica that has been out of routing for ``stranded_after_s`` (default
  ``RLIX_RESIZE_TIMEOUT_S``: every shrink is over by then) is cancelled on its server and
  re-dispatched like a preempted one (see :meth:`RLixLLMServerClient.generate`). Its
  :class:`~rlix_plugins.generation.router.RequestLedger` counts what the gates judge (submitted,
  completed once, lost, cancelled, duplicated, re-dispatched); with ``RLIX_OBSERVE_DIR`` set the
  counters go to the pipeline's records as
  :class:`~rlix_plugins.adapters.observability.RouterCountersObserved` (veRL routes through this
  client, not through :class:`~rlix_plugins.generation.router.ShardRouter`).

Request migration (on by default, :class:`~rlix_plugins.generation.migration.MigrationConfig`):
when a replica becomes ACTIVE, the load balancer moves running requests onto it with the
router's rule (:func:`~rlix_plugins.generation.migration.plan_migration`, same defaults). Design,
and why it lives in the load balancer rather than in the clients:

* The balancer is the one actor every client copy (every agent-loop worker) acquires and
  releases through, and the one that applies shard events, so it alone sees the global load
  and the activation at the same moment. Asking the clients would need a channel into every
  worker process and a merge of their partial views; telling the balancer costs nothing
  extra: the client already makes the acquire/release calls.
* Per request the client sends, with the acquire it already makes (a declared acquire field,
  ``rlix_attempt``), the id the attempt will carry on the server (veRL's own choice of vLLM
  request id, fixed before the acquire) and its token budget; the release carries that id
  back (a declared release field). Stock veRL clients send neither and are simply never
  migrated.
* On an activation (:meth:`RLixRequestLoadBalancer.apply_shard_event`, or
  :meth:`RLixRequestLoadBalancer.rlix_rebalance`) the balancer asks the donor servers for
  progress (``rlix_request_progress``, best effort; else the budget, an upper bound, as the
  rule says), plans, and aborts the chosen attempts on their donor server one by one
  (``rlix_abort_requests``: vLLM's public ``AsyncLLM.abort``; veRL's own ``abort_request``
  does not find requests on the vLLM here, see :mod:`.verl_vllm`). It then points the
  request's sticky session at the target, so the continuation lands there (if the target is
  no longer routable, veRL's least-loaded pick applies).
* The aborted attempt comes back to its client as ``stop_reason="aborted"`` with its partial
  tokens; the client's existing continue path re-dispatches prompt + partial tokens. To tell
  a migration from a preemption it asks the balancer once per aborted attempt
  (``rlix_migration_outcome``): migrations are counted as ``migrated`` in the ledger and do
  not use up ``max_attempts``. The balancer is a synchronous actor, so that question is
  answered only after the planning call that aborted the attempt has finished.

In-place refresh claims: a weight refresh (``RLixCheckpointEngineManager``) claims its replicas
with :meth:`RLixRequestLoadBalancer.rlix_refresh_begin` (only those ACTIVE at that moment, read
and claimed in one actor call) and releases them with ``rlix_refresh_end`` once its parking
aborts reached their servers (from then on each server holds itself until its gate reopens,
:mod:`.verl_vllm`). Meanwhile a ``preempt`` of a claimed replica is refused with
:class:`~rlix_plugins.errors.RefreshHoldError` (nothing changed), which
:class:`~rlix_plugins.adapters.verl_shards.LoadBalancerShardState` retries for a bounded time;
a claim nobody ends expires after its ``hold_s``, shorter than that retry bound.

Config: :meth:`RLixRequestLoadBalancer.set_migration` (a ``MigrationConfig`` or a mapping of its
fields), ``bind_shards(..., migration=...)``, or ``RLIX_VERL_MIGRATION=off`` in the job's
environment (read when the balancer starts). ``auto=False``: only an explicit
``rlix_rebalance`` migrates; ``watch_interval_s`` is unused here (the balancer sees the events
themselves).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from verl.workers.rollout.llm_server import LLMServerClient
from verl.workers.rollout.replica import TokenOutput
from verl.workers.rollout.router import GlobalRequestLoadBalancer

from rlix_plugins.adapters.observability import router_counters_emitter
from rlix_plugins.adapters.verl_shards import DEFAULT_SHRINK_BUDGET
from rlix_plugins.errors import (
    NoActiveShardError,
    RefreshHoldError,
    SettingsError,
    ShardPreemptedError,
    ShardStateError,
)
from rlix_plugins.generation.migration import (
    MigrationCandidate,
    MigrationConfig,
    MigrationMove,
    plan_migration,
)
from rlix_plugins.generation.router import CountersCallback, RequestLedger, RouterCounters
from rlix_plugins.generation.shard_state import (
    ShardEvent,
    ShardSnapshot,
    ShardStatus,
    normalize_ranks,
)
from rlix_plugins.generation.state_store import ShardStateStore
from rlix_plugins.settings import load_settings
from rlix_plugins.values import count, is_int, is_number

logger = logging.getLogger(__name__)

#: veRL's stock balancer raises RuntimeError with this text when its pool is empty; the client
#: matches it (it crosses Ray as a RayTaskError wrapping RuntimeError).
NO_SERVER_MESSAGE = "No available servers in load balancer"
#: stop reasons veRL (and vLLM) use for an aborted request
ABORT_REASONS = frozenset({"aborted", "abort"})
#: ``extra_fields`` key / value the RLix vLLM server (``verl_vllm``, which imports them from
#: here: that module needs vLLM, this one runs in agent-loop workers too) puts on an attempt
#: aborted by an in-place weight refresh
ABORT_CAUSE_FIELD = "rlix_abort"
REFRESH_ABORT = "refresh"
#: ``on`` (default) / ``off``: request migration in the load balancer
ENV_VERL_MIGRATION = "RLIX_VERL_MIGRATION"
#: the acquire field carrying an attempt's id / budget / migrations, and the release field
ATTEMPT_FIELD = "rlix_attempt"
ATTEMPT_ID_FIELD = "rlix_attempt_id"
#: remaining tokens assumed for an attempt whose budget nobody told the balancer
UNKNOWN_BUDGET = 1 << 30
#: bound on the balancer's blocking calls to a server while it migrates
SERVER_CALL_TIMEOUT_S = 30.0
#: longest pause between two looks at the balancer for stranded attempts (seconds)
STRANDED_POLL_S = 5.0
#: bound on a stranded attempt's cancel being confirmed by its server (seconds)
CANCEL_CONFIRM_S = SERVER_CALL_TIMEOUT_S
#: migration outcomes / steered requests remembered (bounded like veRL's sticky cache)
_REMEMBER = 10000
#: default bound on an in-place refresh's claim of its replicas (one whose trainer died never
#: ends it); below the shrink's retry bound (``verl_shards.ShrinkBudget``), so such a claim
#: only delays a shrink. The trainer passes its controller's ``shrink_budget.claim_s``.
REFRESH_HOLD_S = DEFAULT_SHRINK_BUDGET.claim_s


def _now() -> float:
    """Clock of the refresh claims (a module function: tests replace it, not the loop's)."""
    return time.monotonic()


def migration_config(value: MigrationConfig | Mapping[str, Any] | None) -> MigrationConfig:
    """A :class:`MigrationConfig` from itself, a mapping of its fields, or None (defaults).

    Raises:
        SettingsError: another type, an unknown field, or a value ``MigrationConfig`` rejects.
    """
    if value is None:
        return MigrationConfig()
    if isinstance(value, MigrationConfig):
        return value
    if not isinstance(value, Mapping):
        raise SettingsError(
            f"migration must be a MigrationConfig, a mapping of its fields or None, got "
            f"{type(value).__name__}"
        )
    valid = sorted(f.name for f in fields(MigrationConfig))
    unknown = sorted(set(value) - set(valid))
    if unknown:
        raise SettingsError(f"unknown migration field(s) {unknown}; valid fields are {valid}")
    try:
        return MigrationConfig(**value)
    except (TypeError, ValueError) as exc:
        raise SettingsError(f"bad migration config {dict(value)!r}: {exc}") from None


def migration_from_env(env: Mapping[str, str] | None = None) -> MigrationConfig:
    """``RLIX_VERL_MIGRATION``: unset / ``on`` = defaults, ``off`` = disabled.

    Raises:
        SettingsError: any other value.
    """
    raw = (env if env is not None else os.environ).get(ENV_VERL_MIGRATION, "").strip().lower()
    if raw in ("", "on"):
        return MigrationConfig()
    if raw == "off":
        return MigrationConfig(enabled=False)
    raise SettingsError(f"{ENV_VERL_MIGRATION}={raw!r} is not valid; use 'on' or 'off'")


@dataclass(frozen=True, slots=True)
class MigrationStats:
    """What the balancer's migrations did (one balancer, all clients).

    Attributes:
        planned: moves the rule chose.
        aborted: of those, attempts the donor server aborted (the others had finished or were
            not registered yet and stay where they are).
        landed: continuations of aborted attempts acquired on their planned target.
        rerouted: continuations acquired elsewhere (the target was no longer routable).
    """

    planned: int = 0
    aborted: int = 0
    landed: int = 0
    rerouted: int = 0


class _LbAttempt:
    """One attempt in flight as the balancer knows it (mutable, actor-local)."""

    __slots__ = ("budget", "migrations", "moving_to", "request_id", "server_id")

    def __init__(self, request_id: str, server_id: str, budget: int | None,
                 migrations: int) -> None:
        self.request_id = request_id
        self.server_id = server_id
        self.budget = budget
        self.migrations = migrations
        self.moving_to: int | None = None  # set once its donor aborted it for migration


@dataclass(frozen=True, slots=True)
class _ClientAttempt:
    """One dispatch of a client request: its id on the server, token budget, migrations."""

    attempt_id: str
    budget: int | None
    migrations: int

    def acquire_field(self) -> dict[str, Any]:
        return {"id": self.attempt_id, "budget": self.budget, "migrations": self.migrations}


#: the attempt the current task is dispatching (read by the acquire / id / release hooks that
#: veRL's ``generate`` calls; each asyncio task has its own value)
_ATTEMPT: contextvars.ContextVar[_ClientAttempt | None] = contextvars.ContextVar(
    "rlix_verl_attempt", default=None
)


class _Dispatch:
    """Where one attempt went: filled in by its acquire (server) and its server call (the
    call's ObjectRef, so that a stranded attempt can be cancelled on the server)."""

    __slots__ = ("ref", "server_id")

    def __init__(self) -> None:
        self.server_id: str | None = None
        self.ref: Any = None


#: the dispatch record of the attempt the current task runs (see :class:`_Dispatch`)
_DISPATCH: contextvars.ContextVar[_Dispatch | None] = contextvars.ContextVar(
    "rlix_verl_dispatch", default=None
)


class _RecordingMethod:
    """``server.generate`` whose ``remote`` call records its ObjectRef in the dispatch."""

    __slots__ = ("_dispatch", "_method")

    def __init__(self, method: Any, dispatch: _Dispatch) -> None:
        self._method = method
        self._dispatch = dispatch

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        ref = self._method.remote(*args, **kwargs)
        self._dispatch.ref = ref
        return ref


class _RecordingServer:
    """The acquired server's handle as veRL's ``generate`` sees it: every attribute is the
    handle's, ``generate`` records the attempt's ObjectRef."""

    __slots__ = ("_dispatch", "_handle")

    def __init__(self, handle: Any, dispatch: _Dispatch) -> None:
        self._handle = handle
        self._dispatch = dispatch

    @property
    def generate(self) -> _RecordingMethod:
        return _RecordingMethod(self._handle.generate, self._dispatch)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handle, name)


def _retrieve(task: asyncio.Future[Any]) -> None:
    # An attempt abandoned by a cancelled caller: its outcome is nobody's (no asyncio warning).
    if not task.cancelled():
        task.exception()


def _remember(cache: OrderedDict[str, Any], key: str, value: Any) -> None:
    cache[key] = value
    cache.move_to_end(key)
    while len(cache) > _REMEMBER:
        cache.popitem(last=False)


class RLixRequestLoadBalancer(GlobalRequestLoadBalancer):  # type: ignore[misc]
    """veRL's sticky, least-in-flight balancer restricted to ACTIVE shards.

    Args are veRL's (``servers``, ``max_cache_size``, ``full_determinism``); veRL constructs it
    through ``router._create_global_sticky_inflight`` once the patch replaced the class there.
    """

    def __init__(
        self,
        servers: dict[str, Any],
        max_cache_size: int = 10000,
        full_determinism: bool = False,
    ) -> None:
        super().__init__(
            servers=servers, max_cache_size=max_cache_size, full_determinism=full_determinism
        )
        self._store: ShardStateStore | None = None
        self._shard_ids: tuple[str, ...] = ()
        self._shard_handles: dict[str, Any] = {}
        self._routed: set[str] = set()
        # trajectories stored by the agent-loop workers / taken by the trainer (progress)
        self._finished = 0
        self._consumed = 0
        # migration: attempts in flight by attempt id, outcomes for the clients, steering
        self._migration = migration_from_env()
        self._attempts: dict[str, _LbAttempt] = {}
        self._outcomes: OrderedDict[str, int] = OrderedDict()  # attempt id -> target rank
        self._steered: OrderedDict[str, str] = OrderedDict()  # request id -> target server
        self._mig_stats = MigrationStats()
        # in-place refresh claims: dp rank -> when the claim expires (_now())
        self._refresh_holds: dict[int, float] = {}
        # bound shards out of routing: address -> since when (_now())
        self._unrouted_since: dict[str, float] = {}

    # ---------------------------------------------------------------- shard state (owner)
    def bind_shards(
        self,
        servers: list[tuple[str, Any]],
        initial: str = ShardStatus.ACTIVE.value,
        migration: MigrationConfig | Mapping[str, Any] | None = None,
    ) -> ShardSnapshot:
        """Declare the pipeline's shards: ``servers[d]`` is (address, handle) of dp rank ``d``.

        Called once by the adapter. Shards start ``initial`` (``active`` or ``sleeping``); only
        ACTIVE shards are routed to from now on. ``migration``: see :meth:`set_migration`
        (None keeps the current config: defaults, or off by ``RLIX_VERL_MIGRATION=off``).
        """
        # Everything is checked before anything changes: a refused bind leaves the balancer
        # (its migration config included) as it was.
        if self._store is not None:
            raise ShardStateError("shards are already bound to this load balancer")
        if not servers:
            raise ShardStateError("bind_shards needs at least one (address, handle)")
        valid = [s.value for s in ShardStatus]
        if initial not in valid:
            raise ShardStateError(f"initial shard status {initial!r} is not valid; use one of "
                                  f"{valid}")
        ids = [sid for sid, _ in servers]
        repeated = sorted({sid for sid in ids if ids.count(sid) > 1})
        if repeated:
            raise ShardStateError(f"server address(es) {repeated} given more than once; each "
                                  "dp rank needs its own server")
        config = None if migration is None else migration_config(migration)
        if config is not None:
            self._migration = config
        self._store = ShardStateStore(len(servers), initial=ShardStatus(initial))
        self._shard_ids = tuple(sid for sid, _ in servers)
        self._shard_handles = dict(servers)
        self._sync_pool(self._store.snapshot())
        return self._store.snapshot()

    def shard_snapshot(self) -> ShardSnapshot:
        """Current shard snapshot (authoritative; this actor is the owner)."""
        return self._require_store().snapshot()

    def apply_shard_event(self, dp_ranks: list[int], event: str) -> ShardSnapshot:
        """Apply a shard transition (all ranks or none) and re-derive the routing pool.

        A replica that became ACTIVE gets running requests migrated onto it (when migration is
        enabled and ``auto``) before this returns.
        """
        store = self._require_store()
        valid = [e.value for e in ShardEvent]
        if event not in valid:
            raise ShardStateError(f"shard event {event!r} is not valid; use one of {valid}")
        before = set(store.snapshot().active)
        if event == ShardEvent.PREEMPT.value:
            held = self._held(dp_ranks)
            if held:
                raise RefreshHoldError(
                    f"replica(s) {held} are claimed by an in-place weight refresh until its "
                    "aborts reach them; preempt refused, nothing changed (retry)"
                )
        new = store.apply(dp_ranks, ShardEvent(event))
        self._sync_pool(new)
        fresh = [r for r in new.active if r not in before]
        if fresh and self._migration.auto:
            try:
                self._migrate(fresh)
            except Exception:
                # Migration is an optimization: it must never fail the activation.
                logger.warning("migration onto replica(s) %s failed", fresh, exc_info=True)
        return new

    # ---------------------------------------------------------------- in-place refresh claims
    def rlix_refresh_begin(
        self, dp_ranks: list[int], hold_s: float = REFRESH_HOLD_S
    ) -> list[int]:
        """Claim, for an in-place weight refresh, those of ``dp_ranks`` that are ACTIVE now;
        returns them (ascending). Until :meth:`rlix_refresh_end` (or ``hold_s`` seconds) a
        ``preempt`` naming one of them is refused with :class:`RefreshHoldError`. Claims do
        not nest: each replica is refreshed by one manager, one update at a time.

        Raises:
            ShardStateError: a rank is not an int or does not exist (nothing claimed).
            SettingsError: ``hold_s`` is not seconds > 0 (nothing claimed).
        """
        if not (is_number(hold_s) and hold_s > 0):
            raise SettingsError(f"hold_s={hold_s!r} is not valid; expected seconds > 0")
        snap = self._require_store().snapshot()
        if isinstance(dp_ranks, (list, tuple)) and not dp_ranks:
            return []
        ranks = normalize_ranks(snap, dp_ranks)
        claimed = [r for r in ranks if snap.statuses[r] is ShardStatus.ACTIVE]
        until = _now() + float(hold_s)
        for r in claimed:
            self._refresh_holds[r] = until
        return claimed

    def rlix_refresh_end(self, dp_ranks: list[int]) -> None:
        """Release the refresh claims of ``dp_ranks`` (a rank not claimed is ignored).

        Raises:
            ShardStateError: ``dp_ranks`` is not a list of ranks (nothing released).
        """
        if isinstance(dp_ranks, (str, bytes)) or not isinstance(dp_ranks, Iterable):
            raise ShardStateError(f"dp ranks must be an iterable of ints such as [0, 1], got "
                                  f"{dp_ranks!r}")
        for r in list(dp_ranks):
            if is_int(r):
                self._refresh_holds.pop(r, None)

    def rlix_refresh_held(self) -> list[int]:
        """Ranks an in-place refresh claims now (expired claims dropped)."""
        return self._held(list(self._refresh_holds))

    def _held(self, dp_ranks: Iterable[int]) -> list[int]:
        """Those of ``dp_ranks`` under an unexpired refresh claim (bad ranks are left to the
        store's own checks)."""
        now = _now()
        for r, until in list(self._refresh_holds.items()):
            if until <= now:
                del self._refresh_holds[r]
                logger.warning("in-place refresh claim of replica %d expired unreleased "
                               "(its refresh died or stalled before its abort); released", r)
        given = list(dp_ranks) if isinstance(dp_ranks, Iterable) else []
        return sorted({r for r in given if is_int(r) and r in self._refresh_holds})

    def rlix_unrouted(self) -> dict[str, float]:
        """Seconds each bound shard that is not routed now has been out of routing (server
        address -> seconds); the clients' test for stranded attempts."""
        now = _now()
        return {sid: now - since for sid, since in self._unrouted_since.items()}

    def shard_inflight(self) -> dict[int, int]:
        """In-flight request count per bound dp rank (routed ones only)."""
        return {
            r: self._inflight_requests.get(sid, 0) for r, sid in enumerate(self._shard_ids)
        }

    def _require_store(self) -> ShardStateStore:
        if self._store is None:
            raise ShardStateError("no shards bound; the adapter must call bind_shards first")
        return self._store

    def _sync_pool(self, snap: ShardSnapshot) -> None:
        """Routing pool = unbound servers + bound shards that are ACTIVE."""
        active = {self._shard_ids[r] for r in snap.active}
        now = _now()
        for sid in self._shard_ids:
            if sid in active:
                self._unrouted_since.pop(sid, None)
            else:
                self._unrouted_since.setdefault(sid, now)
        for sid in self._shard_ids:
            if sid in active and sid not in self._inflight_requests:
                self._servers[sid] = self._shard_handles[sid]
                self._inflight_requests[sid] = 0
            elif sid not in active and sid in self._inflight_requests:
                # Dropping the pool entry also invalidates sticky sessions pointing here
                # (the stock acquire_server re-selects when the server is gone).
                self._inflight_requests.pop(sid, None)
                self._servers.pop(sid, None)
        self._routed = active
        logger.info("routing to %d active shard(s): %s", len(active), snap.describe())

    # ---------------------------------------------------------------- progress (per trajectory)
    def rlix_trajectory_done(self, n: int = 1) -> int:
        """Count ``n`` trajectories stored by an agent-loop worker; returns the uncounted rest.

        Every agent-loop worker calls this as each trajectory lands in the replay buffer (this
        actor is shared by all of them, so the count is the pipeline's, not one worker's).
        """
        self._finished += count(n, ValueError, "rlix_trajectory_done: n")
        return self.rlix_pending()

    def rlix_consume(self, n: int) -> int:
        """The trainer took ``n`` trajectories for a train step; returns what is left."""
        self._consumed += count(n, ValueError, "rlix_consume: n")
        return self.rlix_pending()

    def rlix_pending(self) -> int:
        """Trajectories finished and not yet taken by the trainer."""
        return max(0, self._finished - self._consumed)

    def rlix_outstanding(self) -> int:
        """Requests in flight on the shards (acquired, not released): the ``outstanding``
        progress metric. A multi-turn trajectory between two turns holds no server and is not
        counted, so this is a lower bound of the job's unfinished work."""
        return sum(self._inflight_requests.values())

    def rlix_progress_counts(self) -> tuple[int, int]:
        """``(rlix_pending(), rlix_outstanding())`` in one call (one actor round trip per
        progress read)."""
        return self.rlix_pending(), self.rlix_outstanding()

    # ---------------------------------------------------------------- stock API, guarded
    def add_servers(self, servers: dict[str, Any]) -> None:
        """veRL's add_servers; a bound shard is only routed once it is ACTIVE."""
        bound = {sid: h for sid, h in servers.items() if sid in self._shard_handles}
        free = {sid: h for sid, h in servers.items() if sid not in self._shard_handles}
        if free:
            super().add_servers(free)
        if bound:
            # A host switch must not route to a replica the coordinator preempted.
            self._shard_handles.update(bound)
            if self._store is not None:
                self._sync_pool(self._store.snapshot())

    def require_acquire_fields(self) -> list[str]:
        """The attempt record RLix clients send (id on the server, budget, migrations)."""
        return [ATTEMPT_FIELD]

    def require_release_fields(self) -> list[str]:
        """The request id and the attempt id (ends the attempt record)."""
        return ["request_id", ATTEMPT_ID_FIELD]

    def acquire_server(
        self, request_id: str, rlix_attempt: Mapping[str, Any] | None = None, **extra: Any
    ) -> tuple[str, Any]:
        """Sticky + least-loaded among routable servers (never a non-active shard); a request
        whose attempt was migrated goes to its planned target while that is routable."""
        del extra
        target = self._steered.pop(request_id, None)
        if target is not None and target in self._inflight_requests:
            self._request_id_to_server[request_id] = target
        server_id, handle = super().acquire_server(request_id)
        if target is not None:
            landed = server_id == target
            self._mig_stats = MigrationStats(
                self._mig_stats.planned, self._mig_stats.aborted,
                self._mig_stats.landed + int(landed), self._mig_stats.rerouted + int(not landed),
            )
        if rlix_attempt is not None:
            budget = rlix_attempt.get("budget")
            self._attempts[str(rlix_attempt["id"])] = _LbAttempt(
                request_id, server_id, None if budget is None else int(budget),
                int(rlix_attempt.get("migrations", 0)),
            )
        return server_id, handle

    def release_server(
        self, server_id: str, request_id: str | None = None,
        rlix_attempt_id: str | None = None,
    ) -> None:
        """veRL's release; also ends the attempt's record."""
        del request_id
        super().release_server(server_id)
        if rlix_attempt_id is not None:
            self._attempts.pop(rlix_attempt_id, None)

    def get_status(self) -> dict[str, Any]:
        status: dict[str, Any] = super().get_status()
        if self._store is not None:
            status["shards"] = self._store.snapshot().describe()
        status["migration"] = asdict(self._mig_stats)  # plain dict: veRL logs the status
        return status

    # ---------------------------------------------------------------- migration
    def set_migration(
        self, config: MigrationConfig | Mapping[str, Any] | None
    ) -> MigrationConfig:
        """Set the migration config (None: defaults); returns it.

        Raises:
            SettingsError: not a ``MigrationConfig`` / mapping of its fields, or bad values.
        """
        self._migration = migration_config(config)
        return self._migration

    def migration(self) -> MigrationConfig:
        """The migration config in force."""
        return self._migration

    def migration_stats(self) -> MigrationStats:
        """Counts of this balancer's migrations so far."""
        return self._mig_stats

    def rlix_running(self) -> dict[str, int]:
        """Attempts known to be running on bound replicas: attempt id -> dp rank."""
        rank_of = {sid: r for r, sid in enumerate(self._shard_ids)}
        return {k: rank_of[a.server_id] for k, a in self._attempts.items()
                if a.server_id in rank_of}

    def rlix_migration_outcome(self, attempt_id: str) -> int | None:
        """The dp rank an aborted attempt was migrated to, or None (it was preempted).

        Asked once by the attempt's client when the attempt came back aborted.
        """
        return self._outcomes.pop(attempt_id, None)

    def rlix_plan_migration(
        self, targets: Iterable[int] | None = None, progress: Mapping[str, int] | None = None
    ) -> tuple[MigrationMove, ...]:
        """The moves the rule makes now onto ``targets`` (default: every active shard), with
        ``progress`` (tokens generated per attempt id, where known). No I/O, nothing changed;
        ``()`` when migration is disabled."""
        store = self._require_store()
        if not self._migration.enabled:
            return ()
        snap = store.snapshot()
        tgts = tuple(snap.active if targets is None else targets)
        loads, candidates = self._loads_and_candidates(snap.active, progress or {})
        mig = self._migration
        return plan_migration(
            loads, snap.active, tgts, candidates, min_gap=mig.min_gap,
            min_remaining_tokens=mig.min_remaining_tokens, max_per_request=mig.max_per_request,
        )

    def rlix_rebalance(self, targets: list[int] | None = None) -> tuple[MigrationMove, ...]:
        """Migrate now onto ``targets`` (default: every active shard); returns the moves whose
        attempts were aborted on their donor (they continue on their target)."""
        snap = self._require_store().snapshot()
        return self._migrate(list(snap.active if targets is None else targets))

    def _loads_and_candidates(
        self, active: Iterable[int], progress: Mapping[str, int]
    ) -> tuple[list[int], list[MigrationCandidate]]:
        rank_of = {sid: r for r, sid in enumerate(self._shard_ids)}
        act = set(active)
        # In-flight per bound rank (all clients), with moves under way counted at their target.
        loads = [self._inflight_requests.get(sid, 0) for sid in self._shard_ids]
        candidates: list[MigrationCandidate] = []
        for key, att in self._attempts.items():
            rank = rank_of.get(att.server_id)
            if rank is None:
                continue  # an unbound server (veRL's own add_servers): not a shard
            if att.moving_to is not None:
                loads[rank] = max(0, loads[rank] - 1)
                loads[att.moving_to] += 1
            elif rank in act:
                budget = UNKNOWN_BUDGET if att.budget is None else att.budget
                left = max(0, budget - progress.get(key, 0))
                candidates.append(MigrationCandidate(key, rank, left, att.migrations))
        return loads, candidates

    def _progress(self, active: Iterable[int]) -> dict[str, int]:
        """Tokens generated so far per attempt on the active shards (best effort)."""
        import ray

        rank_of = {sid: r for r, sid in enumerate(self._shard_ids)}
        act = set(active)
        by_rank: dict[int, list[str]] = {}
        for key, att in self._attempts.items():
            rank = rank_of.get(att.server_id)
            if rank is not None and rank in act and att.moving_to is None:
                by_rank.setdefault(rank, []).append(key)
        progress: dict[str, int] = {}
        for rank, keys in by_rank.items():
            handle = self._shard_handles[self._shard_ids[rank]]
            try:
                got = ray.get(handle.rlix_request_progress.remote(keys),
                              timeout=SERVER_CALL_TIMEOUT_S)
                progress.update({str(k): int(v) for k, v in got.items()})
            except Exception:
                logger.debug("progress query failed on replica %d", rank, exc_info=True)
        return progress

    def _abort(self, rank: int, keys: list[str]) -> set[str]:
        """Abort ``keys`` on replica ``rank``'s server; the ids it aborted."""
        import ray

        handle = self._shard_handles[self._shard_ids[rank]]
        try:
            done = ray.get(handle.rlix_abort_requests.remote(keys),
                           timeout=SERVER_CALL_TIMEOUT_S)
        except Exception:
            logger.warning("migration abort failed on replica %d; those requests stay", rank,
                           exc_info=True)
            return set()
        return {str(k) for k in done}

    def _migrate(self, targets: list[int]) -> tuple[MigrationMove, ...]:
        if not self._migration.enabled or not self._attempts:
            return ()
        snap = self._require_store().snapshot()
        moves = self.rlix_plan_migration(targets, self._progress(snap.active))
        if not moves:
            return ()
        by_source: dict[int, list[MigrationMove]] = {}
        for m in moves:
            by_source.setdefault(m.source, []).append(m)
        started: list[MigrationMove] = []
        for source, ms in by_source.items():
            done = self._abort(source, [m.key for m in ms])
            for m in ms:
                att = self._attempts.get(m.key)
                if m.key not in done:
                    continue  # finished meanwhile or not registered yet: it stays
                started.append(m)
                _remember(self._outcomes, m.key, m.target)
                if att is not None:
                    att.moving_to = m.target
                    target_sid = self._shard_ids[m.target]
                    _remember(self._steered, att.request_id, target_sid)
                    self._request_id_to_server[att.request_id] = target_sid
        st = self._mig_stats
        self._mig_stats = MigrationStats(st.planned + len(moves), st.aborted + len(started),
                                         st.landed, st.rerouted)
        if started:
            logger.info("migrated %d of %d planned request(s) to replica(s) %s (loads %s)",
                        len(started), len(moves), sorted({m.target for m in started}),
                        self.shard_inflight())
        return tuple(started)


def _concat_rows(head: Any, tail: Any) -> Any:
    """``head`` then ``tail`` along the first axis (numpy arrays or torch tensors, as the
    server returns them)."""
    if hasattr(head, "dim") and hasattr(tail, "dim"):
        import torch

        return torch.cat([head, tail], dim=0)
    import numpy as np

    return np.concatenate([np.asarray(head), np.asarray(tail)], axis=0)


class RLixLLMServerClient(LLMServerClient):  # type: ignore[misc]
    """veRL's LLM server client that never returns an aborted generation.

    An aborted result (its replica was preempted, or the load balancer migrated it) is
    continued from its partial tokens on another active replica (a migrated one on its target),
    keeping the partial log-probs; ``num_preempted`` counts the re-dispatches after preemption,
    ``extra_fields["rlix_migrations"]`` the migrations and ``extra_fields["rlix_migrated_at"]``
    the tokens carried over at each one, ``extra_fields["rlix_refresh_aborts"]`` the aborts by
    in-place weight refreshes (tagged by the server, re-dispatched like preemptions but, like
    migrations, not counted toward ``max_attempts``: the replica stayed in service). Extra
    keyword args: ``max_attempts`` (preempted dispatches per request, default 8; migrations
    and refresh aborts not counted),
    ``wait_timeout_s`` (bound on waiting for an active replica; default
    ``RLIX_REQUEST_TIMEOUT_S``, 1800 s unless set), ``stranded_after_s`` (how long an attempt
    may stay out on a replica that is out of routing; default ``RLIX_RESIZE_TIMEOUT_S``, 120 s
    unless set) and
    ``on_counters`` (receives the ledger's :class:`RouterCounters`; default: the
    ``RLIX_OBSERVE_DIR`` records of ``PIPELINE_ID``, none when that is unset).

    Ledger key: veRL's multi-turn agent loops reuse one ``request_id`` per trajectory (sticky
    routing), so a sample is ``(request_id, prompt length)``: the next turn has a longer prompt,
    a second submission of the same turn is counted as a duplicate.
    """

    def __init__(
        self,
        config: Any,
        load_balancer_handle: Any = None,
        *,
        max_attempts: int = 8,
        wait_timeout_s: float | None = None,
        stranded_after_s: float | None = None,
        on_counters: CountersCallback | None = None,
        **kwargs: Any,
    ) -> None:
        # bool is an int, and a float or str count would compare (or fail) oddly later
        if not is_int(max_attempts) or max_attempts < 1:
            raise SettingsError(
                f"max_attempts={max_attempts!r} is not valid; use an int >= 1"
            )
        if wait_timeout_s is None:
            # As long as the coordinator lets a generation request wait for its GPUs: in
            # colocate_async every replica sleeps through each training step, and a shorter
            # bound failed every in-flight rollout of a long step.
            wait_timeout_s = load_settings().request_timeout_s
        if not is_number(wait_timeout_s) or not wait_timeout_s > 0:
            raise SettingsError(
                f"wait_timeout_s={wait_timeout_s!r} is not valid; use a number of seconds > 0"
            )
        if stranded_after_s is None:
            # Every shrink of a replica (take-down, drain, sleep) ends within the coordinator's
            # resize timeout: an attempt the take-down aborted came back by then.
            stranded_after_s = load_settings().resize_timeout_s
        if not is_number(stranded_after_s) or not stranded_after_s > 0:
            raise SettingsError(
                f"stranded_after_s={stranded_after_s!r} is not valid; use a number of "
                "seconds > 0"
            )
        super().__init__(config=config, load_balancer_handle=load_balancer_handle, **kwargs)
        self.max_attempts = max_attempts
        self.wait_timeout_s = wait_timeout_s
        self.stranded_after_s = float(stranded_after_s)
        # the balancer's rlix_unrouted answer shared by this copy's attempts: (loop, when, fut)
        self._unrouted_read: tuple[Any, float, asyncio.Future[dict[str, float]]] | None = None
        self._on_counters = on_counters if on_counters is not None else router_counters_emitter()
        self._ledger = RequestLedger(self._on_counters)

    @property
    def ledger(self) -> RequestLedger:
        """This client copy's request bookkeeping."""
        return self._ledger

    def counters(self) -> RouterCounters:
        """Submitted / completed / lost / duplicated / re-dispatched requests of this copy."""
        return self._ledger.counters()

    def emit_counters(self) -> None:
        """Hand the current counters to ``on_counters`` now (e.g. when a run ends)."""
        self._ledger.emit()

    def __getstate__(self) -> dict[str, Any]:
        # A pickled copy (e.g. sent to an agent-loop worker) gets its own ledger and copy id:
        # counts belong to the process that routes.
        state = dict(self.__dict__)
        state.pop("_ledger", None)
        state.pop("_unrouted_read", None)  # bound to this process's event loop
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._ledger = RequestLedger(self._on_counters)
        self._unrouted_read = None

    def _vllm_request_id(self, request_id: str) -> str:
        # The id fixed for this attempt before its acquire (veRL's own choice, see _generate):
        # the balancer knows the attempt by it and aborts it by it.
        attempt = _ATTEMPT.get()
        if attempt is not None:
            return attempt.attempt_id
        return super()._vllm_request_id(request_id)  # type: ignore[no-any-return]

    def _release_server(self, server_id: str, request_id: str | None = None) -> None:
        # veRL's fire-and-forget release, plus the attempt id where the balancer asks for it.
        self._release(server_id, request_id, _ATTEMPT.get())

    def _release(self, server_id: str, request_id: str | None,
                 attempt: _ClientAttempt | None) -> None:
        declared = self._lb_require_release_fields or []
        pool: dict[str, Any] = {"request_id": request_id}
        if attempt is not None:
            pool[ATTEMPT_ID_FIELD] = attempt.attempt_id
        fields_ = {name: pool[name] for name in declared if name in pool}
        self._load_balancer.release_server.remote(server_id=server_id, **fields_)

    async def _migration_outcome(self, attempt_id: str) -> int | None:
        """The replica the balancer migrated this aborted attempt to (None: preempted)."""
        try:
            method = self._load_balancer.rlix_migration_outcome
        except AttributeError:
            return None  # a stock balancer never migrates
        try:
            target = await method.remote(attempt_id)
        except Exception:
            logger.warning("migration outcome of %s unavailable; treated as preemption",
                           attempt_id, exc_info=True)
            return None
        return None if target is None else int(target)

    def _response_length(self) -> int | None:
        rollout = getattr(getattr(self.config, "actor_rollout_ref", None), "rollout", None)
        length = getattr(rollout, "response_length", None) if rollout is not None else None
        return length if isinstance(length, int) and length > 0 else None

    def _default_budget(self, prompt_len: int) -> int | None:
        """The token budget veRL's vLLM server gives a request without ``max_tokens``:
        ``min(response_length, prompt_length + response_length - prompt_len)`` (at least 1);
        None when the config does not say."""
        response = self._response_length()
        if response is None:
            return None
        rollout = self.config.actor_rollout_ref.rollout
        prompt = getattr(rollout, "prompt_length", None)
        if isinstance(prompt, int) and prompt > 0:
            return max(1, min(response, prompt + response - prompt_len))
        return response

    async def _acquire_server(self, request_id: str, **extra: Any) -> tuple[str, Any]:
        attempt = _ATTEMPT.get()
        if attempt is not None:
            extra = {**extra, ATTEMPT_FIELD: attempt.acquire_field()}
        deadline = time.monotonic() + self.wait_timeout_s
        delay = 0.01
        while True:
            try:
                server_id, handle = await self._acquire_once(request_id, attempt, extra)
            except Exception as exc:  # RayTaskError(RuntimeError) crosses the actor boundary
                if NO_SERVER_MESSAGE not in str(exc):
                    raise
                if time.monotonic() >= deadline:
                    raise NoActiveShardError(
                        f"request {request_id}: no active replica for {self.wait_timeout_s:g}s "
                        "(the client's wait_timeout_s, default RLIX_REQUEST_TIMEOUT_S); wake "
                        "and activate a replica, or raise the bound"
                    ) from None
                # Back off: every replica is preempted until the coordinator expands one.
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.5)
                continue
            dispatch = _DISPATCH.get()
            if dispatch is None:
                return server_id, handle
            dispatch.server_id = server_id
            return server_id, _RecordingServer(handle, dispatch)

    async def _acquire_once(
        self, request_id: str, attempt: _ClientAttempt | None, extra: dict[str, Any]
    ) -> tuple[str, Any]:
        """veRL's acquire; one its caller gave up on (cancelled) is released once it lands.

        The balancer runs an acquire that was sent whether or not anyone awaits its reply;
        unreleased, it would count as in flight (``rlix_outstanding``) for good.
        """
        acquire = asyncio.ensure_future(super()._acquire_server(request_id, **extra))
        try:
            return await asyncio.shield(acquire)
        except asyncio.CancelledError:
            def release(done: asyncio.Future[Any]) -> None:
                if not done.cancelled() and done.exception() is None:
                    self._release(done.result()[0], request_id, attempt)

            acquire.add_done_callback(release)
            raise

    async def _unrouted(self) -> dict[str, float]:
        """The balancer's :meth:`RLixRequestLoadBalancer.rlix_unrouted`, read at most once per
        poll interval per event loop whatever the number of attempts waiting; ``{}`` from a
        stock balancer or when the read fails (nothing is taken for stranded then)."""
        loop = asyncio.get_running_loop()
        read = self._unrouted_read
        if read is None or read[0] is not loop or time.monotonic() - read[1] >= self._poll_s():
            read = (loop, time.monotonic(), asyncio.ensure_future(self._read_unrouted()))
            self._unrouted_read = read
        return await asyncio.shield(read[2])

    async def _read_unrouted(self) -> dict[str, float]:
        try:
            method = self._load_balancer.rlix_unrouted
        except AttributeError:
            return {}  # a stock balancer: no shard ever leaves routing
        try:
            got = await method.remote()
        except Exception:
            logger.warning("routing state unavailable; no attempt taken for stranded this time",
                           exc_info=True)
            return {}
        return {str(k): float(v) for k, v in got.items()}

    def _poll_s(self) -> float:
        return min(STRANDED_POLL_S, self.stranded_after_s / 4)

    async def _bounded_attempt(
        self, request_id: str, attempt: _ClientAttempt, dispatch: _Dispatch, call: Any
    ) -> TokenOutput | None:
        """Run one attempt (veRL's ``generate``, ``call``); None when it was stranded: out on
        a replica that has been out of routing for ``stranded_after_s`` (a take-down aborts
        every attempt it finds, so it never comes back on its own) and then cancelled on its
        server. Until ``stranded_after_s`` after its dispatch it cannot be stranded (it was
        acquired on a routed replica), so a short attempt never reads the balancer.

        Raises:
            ShardPreemptedError: the server did not confirm the cancel within
                ``CANCEL_CONFIRM_S`` (the attempt is abandoned).
        """
        task: asyncio.Future[TokenOutput] = asyncio.ensure_future(call)
        try:
            done, _ = await asyncio.wait({task}, timeout=self.stranded_after_s)
            while not done:
                out_for = (await self._unrouted()).get(dispatch.server_id or "")
                if out_for is not None and out_for >= self.stranded_after_s:
                    return await self._cancel_stranded(request_id, attempt, dispatch, task,
                                                       out_for)
                done, _ = await asyncio.wait({task}, timeout=self._poll_s())
        except asyncio.CancelledError:
            task.cancel()
            task.add_done_callback(_retrieve)
            raise
        return task.result()

    async def _cancel_stranded(
        self, request_id: str, attempt: _ClientAttempt, dispatch: _Dispatch,
        task: asyncio.Future[TokenOutput], out_for: float,
    ) -> TokenOutput | None:
        import ray
        from ray.exceptions import TaskCancelledError

        logger.warning(
            "request %s: attempt %s is still out on replica %s, out of routing for %.0fs "
            "(stranded_after_s=%g); cancelling it there and re-dispatching", request_id,
            attempt.attempt_id, dispatch.server_id, out_for, self.stranded_after_s)
        if dispatch.ref is None:
            task.cancel()  # the server call was never made
        else:
            try:
                # The server is an async actor: Ray cancels the call's coroutine there, so a
                # parked or queued attempt never runs after the replica comes back.
                ray.cancel(dispatch.ref)
            except Exception:
                logger.warning("cancel of attempt %s failed", attempt.attempt_id, exc_info=True)
        done, _ = await asyncio.wait({task}, timeout=CANCEL_CONFIRM_S)
        if not done:
            task.cancel()
            task.add_done_callback(_retrieve)
            raise ShardPreemptedError(
                f"request {request_id}: its attempt on replica {dispatch.server_id} stayed out "
                f"after the replica left routing ({out_for:.0f}s, over the client's "
                f"stranded_after_s={self.stranded_after_s:g}s) and the server did not confirm "
                f"its cancel within {CANCEL_CONFIRM_S:g}s; check that replica's server"
            )
        if task.cancelled() or isinstance(task.exception(), TaskCancelledError):
            return None
        return task.result()  # it came back while being cancelled: used as it is

    async def generate(
        self,
        request_id: str,
        *,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        **kwargs: Any,
    ) -> TokenOutput:
        """Generate; continue on another replica whenever an attempt comes back aborted.

        An attempt still out on a replica that has been out of routing for
        ``stranded_after_s`` (one parked behind a gate the coordinator's take-down kept
        closed, or admitted after veRL's gate barrier timed out) never comes back on its
        own: it is cancelled on its server and re-dispatched like a preempted attempt
        (counted toward ``max_attempts``; the tokens of earlier attempts are kept).

        Raises:
            NoActiveShardError: no replica became active within ``wait_timeout_s``.
            ShardPreemptedError: preempted on ``max_attempts`` dispatches (migrations and
                in-place refresh aborts do not count), or a stranded attempt's server did not
                confirm its cancel (the message names the replica and the bound).
        """
        key = f"{request_id}#{len(prompt_ids)}"
        ledger = self._ledger
        ledger.begin(key)
        try:
            out = await self._generate(request_id, prompt_ids, sampling_params, **kwargs)
        except asyncio.CancelledError:
            ledger.cancel(key)
            raise
        except BaseException:
            ledger.lose(key)
            raise
        ledger.complete(key)
        return out

    async def _generate(
        self,
        request_id: str,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        **kwargs: Any,
    ) -> TokenOutput:
        params = dict(sampling_params)
        limit_key = next((k for k in ("max_tokens", "max_new_tokens") if k in params), None)
        budget = params.get(limit_key) if limit_key else None
        if limit_key is None:
            # No explicit limit: the server derives each attempt's budget from its prompt, and a
            # continuation's prompt (prompt + tokens so far) would be granted up to a whole
            # response_length again. Keep the first attempt's budget for the whole request; the
            # first attempt itself goes out unchanged.
            budget = self._default_budget(len(prompt_ids))
            if budget is not None:
                limit_key = "max_tokens"
        min_tokens = int(params.get("min_tokens") or 0)
        tokens: list[int] = []
        log_probs: list[float] | None = None
        # Routing of every generated token as it was generated (MoE router replay): the first
        # attempt's rows, then only the new tokens' rows of each continuation (its prefill
        # re-routes the earlier tokens, possibly under newer weights), as veRL's own
        # resumable client keeps them. The prefix-cache hit count is the first prefill's.
        routed: Any = None
        cached_tokens: Any = None
        first_steps: Any = None
        answered = False  # an attempt came back (a stranded one does not)
        dispatches = preempted = refreshed = 0
        migrated_at: list[int] = []
        while True:
            dispatches += 1
            hint = int(params[limit_key]) if limit_key in params else budget
            attempt = _ClientAttempt(
                super()._vllm_request_id(request_id), hint, len(migrated_at)
            )
            dispatch = _Dispatch()
            token, dtoken = _ATTEMPT.set(attempt), _DISPATCH.set(dispatch)
            try:
                got = await self._bounded_attempt(request_id, attempt, dispatch, super().generate(
                    request_id, prompt_ids=list(prompt_ids) + tokens,
                    sampling_params=dict(params), **kwargs,
                ))
            finally:
                _DISPATCH.reset(dtoken)
                _ATTEMPT.reset(token)
            if got is None:
                # Stranded and cancelled: preempted-shard semantics, nothing generated by it.
                preempted += 1
                if preempted >= self.max_attempts:
                    raise ShardPreemptedError(
                        f"request {request_id}: aborted {self.max_attempts} times (the last "
                        f"attempt stranded on replica {dispatch.server_id}, out of routing for "
                        f"over stranded_after_s={self.stranded_after_s:g}s); raise "
                        "max_attempts or check the coordinator's churn"
                    )
                self._ledger.redispatch()
                continue
            out: TokenOutput = got
            if not answered:
                answered = True
                first_steps = out.extra_fields.get("min_global_steps")
                cached_tokens = out.extra_fields.get("num_cached_tokens")
            if out.routed_experts is not None and out.token_ids:
                routed = (out.routed_experts if routed is None else _concat_rows(
                    routed, out.routed_experts[-len(out.token_ids):]))
            tokens.extend(out.token_ids)
            if out.log_probs is not None:
                log_probs = (log_probs or []) + list(out.log_probs)
            done = out.stop_reason not in ABORT_REASONS
            moved_to: int | None = None
            by_refresh = False
            if not done:
                moved_to = await self._migration_outcome(attempt.attempt_id)
                if moved_to is not None:
                    migrated_at.append(len(tokens))
                    self._ledger.migrate()
                elif (out.extra_fields or {}).get(ABORT_CAUSE_FIELD) == REFRESH_ABORT:
                    # The host refreshed the replica's weights in place: a re-dispatch, not a
                    # preemption, so a request living across many refreshes is never failed.
                    by_refresh = True
                    refreshed += 1
                else:
                    preempted += 1
            if not done and budget is not None and limit_key is not None:
                left = int(budget) - len(tokens)
                if left <= 0:
                    done = True  # the budget was used up just as the abort landed
                    out.stop_reason = "length"
                else:
                    params[limit_key] = left
            if not done and min_tokens:
                # min_tokens counts the whole response: the continuation owes only the rest
                # (unchanged, vLLM rejects it above the remaining max_tokens).
                params["min_tokens"] = max(0, min_tokens - len(tokens))
            if done:
                out.token_ids = tokens
                out.log_probs = log_probs
                out.routed_experts = routed if routed is not None else out.routed_experts
                if cached_tokens is not None:
                    out.extra_fields["num_cached_tokens"] = cached_tokens
                out.num_preempted = (out.num_preempted or 0) + preempted
                out.extra_fields["min_global_steps"] = first_steps
                out.extra_fields["rlix_attempts"] = dispatches
                out.extra_fields["rlix_migrations"] = len(migrated_at)
                out.extra_fields["rlix_migrated_at"] = list(migrated_at)
                out.extra_fields["rlix_refresh_aborts"] = refreshed
                return out
            if moved_to is None:
                if not by_refresh and preempted >= self.max_attempts:
                    raise ShardPreemptedError(
                        f"request {request_id}: aborted {self.max_attempts} times (replicas "
                        "kept being preempted); raise max_attempts or check the coordinator's "
                        "churn"
                    )
                self._ledger.redispatch()
            logger.debug(
                "request %s %s on dispatch %d (%d tokens so far); continuing",
                request_id, f"migrated to replica {moved_to}" if moved_to is not None
                else "aborted by a weight refresh" if by_refresh else "aborted", dispatches,
                len(tokens),
            )
