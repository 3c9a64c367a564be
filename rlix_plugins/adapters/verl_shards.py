"""veRL replicas as generation shards: the engine and state-view sides of RLix preemption.

:class:`VerlReplicaEngine` is a :class:`~rlix_plugins.generation.engine.ShardEngine` over one
veRL rollout replica (its server actor handles), so the generation module's
:class:`~rlix_plugins.generation.preemption.ShardLifecycle` drives veRL's own calls:

* ``abort_all`` -> ``rlix_take_down`` on every server of the replica: veRL's
  ``abort_all_requests(reject_request=True)`` (the submission gate closes, late arrivals come
  back ``stop_reason="aborted"`` at once, so the client re-routes them; in-flight requests are
  aborted through vLLM's ``pause_generation`` and come back with their partial tokens), and
  the server is marked taken down: veRL's own resume (an in-place refresh) leaves it paused.
* ``num_running`` -> the engine's unfinished-request count (drain poll).
* ``sleep``/``wake_up`` -> engine-level sleep/wake on the RLix server subclass (works for
  standalone replicas too, which veRL itself never sleeps). The level is the engine's
  ``sleep_level`` (``RLIX_VLLM_SLEEP_LEVEL`` through :func:`~.verl.make_shard_controller`);
  the server waits for an in-place refresh holding it (up to ``refresh_wait_s``).
* ``resume`` -> ``rlix_resume_engine`` then ``rlix_open_gate`` (veRL's resume order; these
  reopen a server that was taken down).
* ``weight_version`` -> the server's ``rlix_weight_version`` (the version its engine applied
  completely), read by the shard controller after each sync for the gates' weights record;
  None when the server class has no such method.

:class:`LoadBalancerShardState` is the :class:`~rlix_plugins.generation.state_store.ShardStateView`
whose owner is the pipeline's :class:`~rlix_plugins.patches.verl_routing.RLixRequestLoadBalancer`
actor: every agent-loop worker routes through that one actor, so the state it routes by and the
state the lifecycle changes are the same object. Its ``apply`` retries a ``preempt`` the
balancer refused because an in-place refresh claims the replica (:class:`RefreshHoldError`,
until the refresh's aborts reached its servers), up to ``hold_wait_s``, then raises
:class:`~rlix_plugins.errors.PreemptionError` with nothing changed (the replica stays ACTIVE).

Every wait inside one shrink is a share of the coordinator's ``RLIX_RESIZE_TIMEOUT_S``
(:class:`ShrinkBudget`): the coordinator fences a pipeline whose ``resize_infer`` fails or
outlasts that timeout (docs/coordinator.md), so a wait longer than the timeout would never get
to give up cleanly.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from rlix_plugins.errors import PreemptionError, RefreshHoldError, SettingsError
from rlix_plugins.generation.engine import EngineOutput, GenerationRequest
from rlix_plugins.generation.shard_state import ShardEvent, ShardSnapshot
from rlix_plugins.values import is_int, is_number

__all__ = [
    "DEFAULT_SHRINK_BUDGET",
    "HOLD_POLL_S",
    "HOLD_WAIT_S",
    "REFRESH_WAIT_S",
    "LoadBalancerShardState",
    "RefreshHoldError",
    "ShrinkBudget",
    "VerlReplicaEngine",
]


@dataclass(frozen=True, slots=True)
class ShrinkBudget:
    """How one shrink of a veRL replica splits the coordinator's resize timeout (seconds).

    A shrink is: the preempt on the load balancer (retried up to ``hold_wait_s`` while an
    in-place refresh claims the replica), abort + drain (up to the lifecycle's
    ``drain_timeout_s``), then the sleep (waiting up to ``refresh_wait_s`` for a refresh
    holding the server). The coordinator fences the pipeline when the whole ``resize_infer``
    outlasts ``RLIX_RESIZE_TIMEOUT_S``, so the waits share what the drain leaves of it:

    * ``claim_s`` (a refresh's claim expires, 30%) < ``hold_wait_s`` (40%): an abandoned claim
      (its trainer died) expires before the preempt gives up, so the shrink goes on;
    * ``claim_s + drain + refresh_wait_s`` (30% + 60%) fits in the timeout: a shrink delayed
      by a claim and then by a refresh hold still answers before the coordinator's timeout.
    """

    claim_s: float
    hold_wait_s: float
    refresh_wait_s: float

    @classmethod
    def within(cls, resize_timeout_s: float, drain_timeout_s: float) -> ShrinkBudget:
        """The budget of a shrink under ``resize_timeout_s`` with the given drain bound.

        Raises:
            SettingsError: a bound is not seconds > 0, or the drain leaves no time.
        """
        for name, value in (("resize_timeout_s", resize_timeout_s),
                            ("drain_timeout_s", drain_timeout_s)):
            if not (is_number(value) and value > 0):
                raise SettingsError(f"{name} must be seconds > 0, got {value!r}")
        spare = float(resize_timeout_s) - float(drain_timeout_s)
        if spare <= 0:
            raise SettingsError(
                f"RLIX_RESIZE_TIMEOUT_S={resize_timeout_s:g}s leaves no time for a veRL shrink "
                f"after its drain bound ({drain_timeout_s:g}s): raise the timeout above the drain "
                "bound (PreemptionConfig.drain_timeout_s)"
            )
        return cls(claim_s=0.3 * spare, hold_wait_s=0.4 * spare, refresh_wait_s=0.6 * spare)


#: under the coordinator's default resize timeout (120 s) and drain bound (30 s)
DEFAULT_SHRINK_BUDGET = ShrinkBudget.within(120.0, 30.0)
#: default bound on a sleep waiting for an in-place refresh of the replica (seconds)
REFRESH_WAIT_S = DEFAULT_SHRINK_BUDGET.refresh_wait_s
#: default bound on a preempt retried while an in-place refresh claims the replica (seconds)
HOLD_WAIT_S = DEFAULT_SHRINK_BUDGET.hold_wait_s
#: pause between two such retries (seconds)
HOLD_POLL_S = 0.01


def _is_refresh_hold(exc: BaseException) -> bool:
    # A Ray actor's error arrives as a RayTaskError that is also an instance of its cause
    # where Ray can build that class, else only carrying it as ``cause``.
    return isinstance(exc, RefreshHoldError) or isinstance(
        getattr(exc, "cause", None), RefreshHoldError)


class VerlReplicaEngine:
    """ShardEngine over one veRL replica: ``servers[0]`` holds the engine (node rank 0).

    Args:
        servers: the replica's server actor handles.
        sleep_level: vLLM sleep level when the lifecycle names none (0, 1, 2; None: veRL's
            own level); the server never sleeps deeper than veRL's restorable level.
        refresh_wait_s: how long a sleep waits for an in-place refresh of the replica.

    Raises:
        SettingsError: a bad ``sleep_level`` or ``refresh_wait_s``.
    """

    def __init__(self, servers: Sequence[Any], *, sleep_level: int | None = None,
                 refresh_wait_s: float = REFRESH_WAIT_S) -> None:
        if not servers:
            raise ValueError("a replica needs at least one server handle")
        if sleep_level is not None and not (is_int(sleep_level) and sleep_level in (0, 1, 2)):
            raise SettingsError(f"sleep_level must be None, 0, 1 or 2, got {sleep_level!r}")
        if not (is_number(refresh_wait_s) and refresh_wait_s > 0):
            raise SettingsError(f"refresh_wait_s must be seconds > 0, got {refresh_wait_s!r}")
        self._servers = tuple(servers)
        self._sleep_level = sleep_level
        self._refresh_wait_s = float(refresh_wait_s)

    @property
    def sleep_level(self) -> int | None:
        return self._sleep_level

    @property
    def servers(self) -> tuple[Any, ...]:
        return self._servers

    async def generate(self, request: GenerationRequest) -> EngineOutput:
        """One attempt through veRL's token-in/token-out server call."""
        params: dict[str, Any] = dict(request.sampling)
        params["max_tokens"] = request.max_tokens
        out = await self._servers[0].generate.remote(
            prompt_ids=list(request.prompt_token_ids),
            sampling_params=params,
            request_id=request.request_id,
        )
        reason = "abort" if out.stop_reason in ("aborted", "abort") else str(out.stop_reason)
        logprobs = tuple(out.log_probs) if out.log_probs is not None else None
        return EngineOutput(tuple(out.token_ids), reason, logprobs)

    async def abort_all(self) -> int:
        results = await asyncio.gather(*(s.rlix_take_down.remote() for s in self._servers))
        return sum(int(r.get("aborted_count", 0)) for r in results)

    async def num_running(self) -> int:
        counts = await asyncio.gather(*(s.rlix_num_running.remote() for s in self._servers))
        return sum(int(c) for c in counts)

    async def sleep(self, level: int | None = None) -> None:
        lvl = self._sleep_level if level is None else level
        await asyncio.gather(
            *(s.rlix_sleep.remote(lvl, self._refresh_wait_s) for s in self._servers))

    async def wake_up(self) -> None:
        await asyncio.gather(*(s.rlix_wake_up.remote() for s in self._servers))

    async def resume(self) -> None:
        # veRL's order: resume the engines with admission closed, then open every gate.
        await self._servers[0].rlix_resume_engine.remote()
        await asyncio.gather(*(s.rlix_open_gate.remote() for s in self._servers))

    async def weight_version(self) -> int | None:
        """Weight version the replica's engine reports (None: unknown or not recorded)."""
        try:
            method = self._servers[0].rlix_weight_version
        except AttributeError:
            return None
        version = await method.remote()
        return None if version is None else int(version)

    async def pause(self) -> int:
        """Abort in-flight requests but PARK late arrivals (active refresh, not preemption)."""
        results = await asyncio.gather(
            *(s.abort_all_requests.remote(reject_request=False) for s in self._servers)
        )
        return sum(int(r.get("aborted_count", 0)) for r in results)


class LoadBalancerShardState:
    """ShardStateView whose owner is the RLix load-balancer actor (picklable: a handle).

    Args:
        load_balancer: the balancer actor handle.
        hold_wait_s: how long ``apply`` retries a preempt refused under a refresh claim.
        poll_s: pause between those retries.

    Raises:
        SettingsError: ``hold_wait_s`` or ``poll_s`` is not seconds > 0.
    """

    def __init__(self, load_balancer: Any, *, hold_wait_s: float = HOLD_WAIT_S,
                 poll_s: float = HOLD_POLL_S) -> None:
        for name, value in (("hold_wait_s", hold_wait_s), ("poll_s", poll_s)):
            if not (is_number(value) and value > 0):
                raise SettingsError(f"{name} must be seconds > 0, got {value!r}")
        self._lb = load_balancer
        self._hold_wait_s = float(hold_wait_s)
        self._poll_s = float(poll_s)
        self._cached: ShardSnapshot | None = None

    def _update(self, snap: ShardSnapshot) -> ShardSnapshot:
        if self._cached is None or snap.version >= self._cached.version:
            self._cached = snap
        return self._cached

    def snapshot(self) -> ShardSnapshot:
        if self._cached is None:
            import ray

            return self._update(ray.get(self._lb.shard_snapshot.remote()))
        return self._cached

    async def refresh(self) -> ShardSnapshot:
        return self._update(await self._lb.shard_snapshot.remote())

    async def wait_for_update(self, after_version: int, timeout_s: float) -> ShardSnapshot:
        # Only the lifecycle (one per pipeline, the sole writer) uses this view; polling is
        # enough and keeps the balancer a plain synchronous actor like veRL's.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(timeout_s, 0.0)
        while True:
            snap = await self.refresh()
            if snap.version > after_version or loop.time() >= deadline:
                return snap
            await asyncio.sleep(0.05)

    async def apply(self, dp_ranks: Iterable[int], event: ShardEvent) -> ShardSnapshot:
        """Apply ``event`` on the balancer; a preempt refused under an in-place refresh claim
        is retried (the balancer is a synchronous actor: it cannot wait itself).

        Raises:
            PreemptionError: still refused after ``hold_wait_s`` (nothing changed).
        """
        ranks, name = list(dp_ranks), ShardEvent(event).value
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._hold_wait_s
        while True:
            try:
                snap = await self._lb.apply_shard_event.remote(ranks, name)
            except Exception as exc:
                if not _is_refresh_hold(exc):
                    raise
                if loop.time() >= deadline:
                    raise PreemptionError(
                        f"replica(s) {ranks} still claimed by an in-place weight refresh after "
                        f"{self._hold_wait_s:g}s; not preempted (the resize fails)"
                    ) from exc
                await asyncio.sleep(self._poll_s)
                continue
            return self._update(snap)

    def __getstate__(self) -> dict[str, Any]:
        return {"lb": self._lb, "hold_wait_s": self._hold_wait_s, "poll_s": self._poll_s}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._lb = state["lb"]
        self._hold_wait_s = float(state.get("hold_wait_s", HOLD_WAIT_S))
        self._poll_s = float(state.get("poll_s", HOLD_POLL_S))
        self._cached = None
