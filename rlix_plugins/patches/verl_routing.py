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
  (at most ``max_attempts`` dispatches, then :class:`ShardPreemptedError`), and waits a bounded
  time when no replica is active (then :class:`NoActiveShardError`). Its
  :class:`~rlix_plugins.generation.router.RequestLedger` counts what the gates judge (submitted,
  completed once, lost, cancelled, duplicated, re-dispatched); with ``RLIX_OBSERVE_DIR`` set the
  counters go to the pipeline's records as
  :class:`~rlix_plugins.adapters.observability.RouterCountersObserved` (veRL routes through this
  client, not through :class:`~rlix_plugins.generation.router.ShardRouter`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from verl.workers.rollout.llm_server import LLMServerClient
from verl.workers.rollout.replica import TokenOutput
from verl.workers.rollout.router import GlobalRequestLoadBalancer

from rlix_plugins.adapters.observability import router_counters_emitter
from rlix_plugins.errors import NoActiveShardError, ShardPreemptedError, ShardStateError
from rlix_plugins.generation.router import CountersCallback, RequestLedger, RouterCounters
from rlix_plugins.generation.shard_state import ShardEvent, ShardSnapshot, ShardStatus
from rlix_plugins.generation.state_store import ShardStateStore

logger = logging.getLogger(__name__)

#: veRL's stock balancer raises RuntimeError with this text when its pool is empty; the client
#: matches it (it crosses Ray as a RayTaskError wrapping RuntimeError).
NO_SERVER_MESSAGE = "No available servers in load balancer"
#: stop reasons veRL (and vLLM) use for an aborted request
ABORT_REASONS = frozenset({"aborted", "abort"})


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

    # ---------------------------------------------------------------- shard state (owner)
    def bind_shards(
        self,
        servers: list[tuple[str, Any]],
        initial: str = ShardStatus.ACTIVE.value,
    ) -> ShardSnapshot:
        """Declare the pipeline's shards: ``servers[d]`` is (address, handle) of dp rank ``d``.

        Called once by the adapter. Shards start ``initial`` (``active`` or ``sleeping``); only
        ACTIVE shards are routed to from now on.
        """
        if self._store is not None:
            raise ShardStateError("shards are already bound to this load balancer")
        if not servers:
            raise ShardStateError("bind_shards needs at least one (address, handle)")
        self._store = ShardStateStore(len(servers), initial=ShardStatus(initial))
        self._shard_ids = tuple(sid for sid, _ in servers)
        self._shard_handles = dict(servers)
        self._sync_pool(self._store.snapshot())
        return self._store.snapshot()

    def shard_snapshot(self) -> ShardSnapshot:
        """Current shard snapshot (authoritative; this actor is the owner)."""
        return self._require_store().snapshot()

    def apply_shard_event(self, dp_ranks: list[int], event: str) -> ShardSnapshot:
        """Apply a shard transition (all ranks or none) and re-derive the routing pool."""
        new = self._require_store().apply(dp_ranks, ShardEvent(event))
        self._sync_pool(new)
        return new

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
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        self._finished += n
        return self.rlix_pending()

    def rlix_consume(self, n: int) -> int:
        """The trainer took ``n`` trajectories for a train step; returns what is left."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        self._consumed += n
        return self.rlix_pending()

    def rlix_pending(self) -> int:
        """Trajectories finished and not yet taken by the trainer."""
        return max(0, self._finished - self._consumed)

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

    def acquire_server(self, request_id: str, **extra: Any) -> tuple[str, Any]:
        """Sticky + least-loaded among routable servers (never a non-active shard)."""
        del extra
        return super().acquire_server(request_id)  # type: ignore[no-any-return]

    def get_status(self) -> dict[str, Any]:
        status: dict[str, Any] = super().get_status()
        if self._store is not None:
            status["shards"] = self._store.snapshot().describe()
        return status


class RLixLLMServerClient(LLMServerClient):  # type: ignore[misc]
    """veRL's LLM server client that never returns an aborted generation.

    An aborted result (its replica was preempted) is continued from its partial tokens on
    another active replica, keeping the partial log-probs; ``num_preempted`` counts the
    re-dispatches. Extra keyword args: ``max_attempts`` (dispatches per request, default 8),
    ``wait_timeout_s`` (bound on waiting for an active replica, default 600) and
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
        wait_timeout_s: float = 600.0,
        on_counters: CountersCallback | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(config=config, load_balancer_handle=load_balancer_handle, **kwargs)
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        if not wait_timeout_s > 0:
            raise ValueError(f"wait_timeout_s must be > 0, got {wait_timeout_s}")
        self.max_attempts = max_attempts
        self.wait_timeout_s = wait_timeout_s
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
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._ledger = RequestLedger(self._on_counters)

    async def _acquire_server(self, request_id: str, **extra: Any) -> tuple[str, Any]:
        deadline = time.monotonic() + self.wait_timeout_s
        delay = 0.01
        while True:
            try:
                return await super()._acquire_server(request_id, **extra)  # type: ignore[no-any-return]
            except Exception as exc:  # RayTaskError(RuntimeError) crosses the actor boundary
                if NO_SERVER_MESSAGE not in str(exc):
                    raise
                if time.monotonic() >= deadline:
                    raise NoActiveShardError(
                        f"request {request_id}: no active replica for {self.wait_timeout_s:g}s"
                    ) from None
                # Back off: every replica is preempted until the coordinator expands one.
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.5)

    async def generate(
        self,
        request_id: str,
        *,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        **kwargs: Any,
    ) -> TokenOutput:
        """Generate; continue on another replica whenever an attempt comes back aborted.

        Raises:
            NoActiveShardError: no replica became active within ``wait_timeout_s``.
            ShardPreemptedError: aborted on each of ``max_attempts`` dispatches.
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
        tokens: list[int] = []
        log_probs: list[float] | None = None
        first_steps: Any = None
        for attempt in range(1, self.max_attempts + 1):
            out: TokenOutput = await super().generate(
                request_id, prompt_ids=list(prompt_ids) + tokens, sampling_params=dict(params),
                **kwargs,
            )
            if attempt == 1:
                first_steps = out.extra_fields.get("min_global_steps")
            tokens.extend(out.token_ids)
            if out.log_probs is not None:
                log_probs = (log_probs or []) + list(out.log_probs)
            done = out.stop_reason not in ABORT_REASONS
            if not done and budget is not None and limit_key is not None:
                left = int(budget) - len(tokens)
                if left <= 0:
                    done = True  # the budget was used up just as the abort landed
                    out.stop_reason = "length"
                else:
                    params[limit_key] = left
            if done:
                out.token_ids = tokens
                out.log_probs = log_probs
                out.num_preempted = (out.num_preempted or 0) + attempt - 1
                out.extra_fields["min_global_steps"] = first_steps
                out.extra_fields["rlix_attempts"] = attempt
                return out
            if attempt < self.max_attempts:
                self._ledger.redispatch()
            logger.debug(
                "request %s aborted on attempt %d (%d tokens so far); re-dispatching",
                request_id, attempt, len(tokens),
            )
        raise ShardPreemptedError(
            f"request {request_id}: aborted {self.max_attempts} times (replicas kept being "
            "preempted); raise max_attempts or check the coordinator's churn"
        )

