"""veRL's vLLM server and replica with the calls RLix preemption needs.

veRL's ``vLLMHttpServer.sleep``/``wake_up`` act only in hybrid/colocated mode (standalone
replicas never sleep in veRL) and it has no running-request count. Under RLix every replica is
a shard the coordinator may put to sleep, so :class:`RLixvLLMHttpServer` adds, on node rank 0
(the one holding ``AsyncLLM``): ``rlix_num_running``, ``rlix_sleep(level)``,
``rlix_wake_up(tags)``, ``rlix_is_sleeping`` and ``rlix_weight_version``, and for request
migration ``rlix_abort_requests(ids)`` / ``rlix_request_progress(ids)``. Ray freezes a
decorated actor class, so the methods are added by subclassing the undecorated server and
decorating that subclass (:class:`RLixvLLMReplica` sets ``server_class``); veRL's class is
never touched.

Migration aborts single requests through vLLM's public ``AsyncLLM.abort(ids)`` (external ids,
the ids veRL's ``generate`` passes). veRL's own ``abort_request(request_id)`` is not used: it
looks the id up in the output processor's ``request_states`` and calls
``output_processor.abort_requests([id])``; on the vLLM here (0.32) that dict is keyed by vLLM's
internal ids and that method needs an ``internal`` argument, so it finds nothing. An aborted
request's ``generate`` returns its partial tokens (vLLM's cumulative output) with
``stop_reason="aborted"``, which the RLix client continues elsewhere.

``rlix_weight_version`` is the weight version the engine holds completely: veRL's rollout-side
``ServerAdapter.update_weights`` calls the server's ``set_global_steps(v)`` only after the
weight load into the engine has returned, so the subclass records ``v`` there; a level-2 sleep
discards the weights and clears it (None until the next complete load).

In-place refresh vs. the coordinator (one state machine per server, on its event loop). A
refresh is veRL's weight update: a PARKING abort (``abort_all_requests(reject_request=False)``),
the load, then ``resume_engine_generation`` + ``open_submission_gate``. The coordinator's shrink
is ``rlix_take_down`` (rejecting abort), drain, ``rlix_sleep``; its expand ``rlix_wake_up``, the
load, ``rlix_resume_engine`` + ``rlix_open_gate``. So that neither undoes the other:

* a refresh holds the server from its abort until its gate opens; ``rlix_sleep`` waits for
  that (bounded by its share of ``RLIX_RESIZE_TIMEOUT_S``, then
  :class:`~rlix_plugins.errors.PreemptionError`: the engine stays awake and the resize fails,
  which fences the pipeline), so the engine never sleeps under a weight load;
* once the coordinator took the server down (until its own ``rlix_open_gate``), veRL's resume
  calls neither resume the engine nor open the gate, and a refresh's abort keeps the gate
  rejecting; on a sleeping engine it does nothing, and a version loaded meanwhile is not
  recorded as held.

A request aborted by a refresh's abort (and by no take-down) comes back with
``extra_fields["rlix_abort"] = "refresh"``: the RLix client re-dispatches it without counting
it as a preemption.

Sleep level: ``rlix_sleep(level)`` with the level the controller sends
(``RLIX_VLLM_SLEEP_LEVEL``), but never deeper than veRL's own ``_resolve_sleep_level`` (1 for
LoRA adapters, MTP drafters, NPUs: level 2 would discard state the weight sync cannot restore).

:func:`load_rlix_vllm_replica` is the loader registered in veRL's ``RolloutReplicaRegistry``
under ``"vllm"`` (the official seam), so ``LLMServerManager`` builds RLix replicas. It imports
vLLM lazily, like veRL's own loader.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer, vLLMReplica

from rlix_plugins.adapters.verl_shards import REFRESH_WAIT_S
from rlix_plugins.errors import PreemptionError, SettingsError
from rlix_plugins.patches.verl_routing import ABORT_CAUSE_FIELD, ABORT_REASONS, REFRESH_ABORT
from rlix_plugins.values import is_int, is_number

logger = logging.getLogger(__name__)

#: vLLM sleep levels
SLEEP_LEVELS = (0, 1, 2)


class RLixvLLMHttpServer(vLLMHttpServer):  # type: ignore[misc]
    """veRL's vLLM server plus engine-level sleep/wake/count usable in every rollout mode,
    and the weight version its engine holds."""

    # Class-level defaults: test servers (and veRL subclasses) may skip __init__.
    #: version set by the last complete weight load (None: none yet, or discarded by sleep)
    _rlix_version: int | None = None
    #: the coordinator took this server down and has not reopened it (rlix_open_gate)
    _rlix_down: bool = False
    #: rlix_sleep put the engine to sleep (cleared by rlix_wake_up)
    _rlix_asleep: bool = False
    #: in-place refreshes between their parking abort and their gate reopening
    _rlix_refreshes: int = 0
    _rlix_refresh_done: asyncio.Event | None = None
    #: parking aborts / take-downs performed so far (tell a refresh abort from a preemption)
    _rlix_pause_epoch: int = 0
    _rlix_down_epoch: int = 0

    async def set_global_steps(self, global_steps: int) -> None:
        """veRL's call after a complete weight load; also recorded as the engine's version."""
        await super().set_global_steps(global_steps)
        if self._rlix_asleep:
            # A stale refresh loaded into a sleeping engine: what it holds is not that version.
            logger.warning("weights v%s loaded while the engine sleeps; not recorded as held",
                           global_steps)
            return
        self._rlix_version = None if global_steps is None else int(global_steps)

    # ---------------------------------------------------------------- refresh vs. coordinator
    def _rlix_refresh_event(self) -> asyncio.Event:
        # Created lazily on the actor's own loop (the server may skip __init__).
        if self._rlix_refresh_done is None:
            self._rlix_refresh_done = asyncio.Event()
            self._rlix_refresh_done.set()
        return self._rlix_refresh_done

    def _rlix_end_refresh(self) -> None:
        # An open gate ends every pause (veRL's open_submission_gate is idempotent, and one
        # resume may follow several parking aborts, e.g. the fully-async rebalance's during a
        # refresh): a count left above 0 would make every later shrink wait and fail.
        self._rlix_refreshes = 0
        self._rlix_refresh_event().set()

    async def generate(self, *args: Any, **kwargs: Any) -> Any:
        """veRL's generate; an attempt aborted by an in-place refresh (not by a take-down)
        is tagged ``extra_fields["rlix_abort"] = "refresh"``."""
        pauses, downs = self._rlix_pause_epoch, self._rlix_down_epoch
        out = await super().generate(*args, **kwargs)
        if (getattr(out, "stop_reason", None) in ABORT_REASONS and not self._rlix_down
                and self._rlix_pause_epoch != pauses and self._rlix_down_epoch == downs):
            out.extra_fields[ABORT_CAUSE_FIELD] = REFRESH_ABORT
        return out

    async def abort_all_requests(
        self, reset_prefix_cache: bool = True, reject_request: bool = False
    ) -> dict[str, Any]:
        """veRL's abort. A parking one (veRL's weight update, i.e. an in-place refresh) holds
        the server until its gate reopens; on a server the coordinator took down it keeps the
        gate rejecting, and on a sleeping engine it does nothing."""
        if reject_request:
            return await super().abort_all_requests(  # type: ignore[no-any-return]
                reset_prefix_cache=reset_prefix_cache, reject_request=True)
        if self._rlix_asleep:
            logger.warning("in-place refresh reached a replica the coordinator put to sleep; "
                           "its engine is left asleep and its gate closed")
            return {"aborted_count": 0, "request_ids": []}
        self._rlix_refreshes += 1
        self._rlix_refresh_event().clear()
        if not self._rlix_down:
            self._rlix_pause_epoch += 1
        # The hold is kept when the abort fails: veRL's update resumes every replica anyway.
        return await super().abort_all_requests(  # type: ignore[no-any-return]
            reset_prefix_cache=reset_prefix_cache, reject_request=self._rlix_down)

    async def resume_engine_generation(self) -> None:
        """veRL's engine resume; nothing while the coordinator holds the server down."""
        if self._rlix_down:
            logger.info("veRL resume of a replica the coordinator took down: left paused")
            return
        await super().resume_engine_generation()

    async def open_submission_gate(self) -> None:
        """veRL's gate reopening (end of a refresh); the gate stays closed and rejecting while
        the coordinator holds the server down."""
        try:
            if not self._rlix_down:
                await super().open_submission_gate()
        finally:
            self._rlix_end_refresh()

    async def rlix_take_down(self) -> dict[str, Any]:
        """The coordinator's abort: close the gate rejecting late arrivals, abort in-flight
        requests; veRL's resume calls do nothing until :meth:`rlix_open_gate`."""
        self._rlix_down = True
        self._rlix_down_epoch += 1
        if self._rlix_asleep:
            return {"aborted_count": 0, "request_ids": []}
        return await super().abort_all_requests(  # type: ignore[no-any-return]
            reject_request=True)

    async def rlix_resume_engine(self) -> None:
        """The coordinator's engine resume (expand, after the weight sync)."""
        await super().resume_engine_generation()

    async def rlix_open_gate(self) -> None:
        """The coordinator's gate reopening (expand): the server is routable again."""
        self._rlix_down = False
        await super().open_submission_gate()

    async def rlix_refreshing(self) -> int:
        """In-place refreshes holding this server now."""
        return self._rlix_refreshes

    async def rlix_weight_version(self) -> int | None:
        """Weight version the engine applied completely (None: unknown or discarded)."""
        return self._rlix_version

    async def rlix_num_running(self) -> int:
        """Unfinished requests in this server's engine (0 on non-leader nodes)."""
        if self.node_rank != 0 or self.engine is None:
            return 0
        return int(self.engine.get_num_unfinished_requests())

    def _rlix_engine_request_ids(self) -> set[str]:
        # External request ids the engine knows (vLLM internal state: 0.32 maps external ids
        # to internal ones; older releases key request_states by the external id). A moved
        # attribute degrades to "none known", i.e. nothing is migrated.
        processor = getattr(self.engine, "output_processor", None)
        try:
            external = getattr(processor, "external_req_ids", None)
            if external is not None:
                return set(external)
            return set(processor.request_states)  # type: ignore[union-attr]
        except Exception:
            logger.debug("engine request ids unavailable", exc_info=True)
            return set()

    async def rlix_abort_requests(self, request_ids: list[str]) -> list[str]:
        """Abort those of ``request_ids`` the engine is running now; returns them.

        The submission gate stays open (the server keeps serving). An id not registered in the
        engine (still being admitted, or already finished) is skipped and completes here.
        """
        if self.node_rank != 0 or self.engine is None:
            return []
        known = self._rlix_engine_request_ids()
        ids = [i for i in dict.fromkeys(request_ids) if i in known]
        if ids:
            await self.engine.abort(ids)
            logger.debug("aborted %d request(s) for migration", len(ids))
        return ids

    async def rlix_request_progress(self, request_ids: list[str]) -> dict[str, int]:
        """Tokens generated so far per id the engine knows (best effort: ``{}`` when vLLM's
        internal layout differs)."""
        if self.node_rank != 0 or self.engine is None:
            return {}
        processor = getattr(self.engine, "output_processor", None)
        try:
            states = processor.request_states  # type: ignore[union-attr]
            mapping = getattr(processor, "external_req_ids", None)
            progress: dict[str, int] = {}
            for rid in request_ids:
                # .get: never insert into vLLM's defaultdict.
                internal = mapping.get(rid, ()) if mapping is not None else (rid,)
                counts = [int(states[i].detokenizer.num_output_tokens())
                          for i in internal if i in states]
                if counts:
                    progress[rid] = max(counts)
            return progress
        except Exception:
            logger.debug("request progress unavailable", exc_info=True)
            return {}

    async def rlix_sleep(self, level: int | None = None,
                         refresh_wait_s: float = REFRESH_WAIT_S) -> int | None:
        """Sleep the engine at ``level`` (default: veRL's resolved level, 2 for full weights;
        never deeper than that level); returns the level used (None off node rank 0).

        Waits up to ``refresh_wait_s`` for an in-place refresh holding the server (its weight
        load must not land in a sleeping engine).

        Raises:
            SettingsError: ``level`` is not None, 0, 1 or 2 (nothing changed).
            PreemptionError: a refresh still held the server after ``refresh_wait_s`` (the
                engine was not put to sleep).
        """
        if level is not None and not (is_int(level) and level in SLEEP_LEVELS):
            raise SettingsError(f"sleep level {level!r} is not valid; expected None, 0, 1 or 2")
        if not (is_number(refresh_wait_s) and refresh_wait_s > 0):
            raise SettingsError(f"refresh_wait_s={refresh_wait_s!r} is not valid; expected "
                                "seconds > 0")
        self._rlix_down = True
        if self.node_rank != 0:
            return None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + refresh_wait_s
        # Re-checked after every wake-up: another refresh may start before this task runs.
        while self._rlix_refreshes > 0:
            try:
                await asyncio.wait_for(self._rlix_refresh_event().wait(),
                                       max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                raise PreemptionError(
                    f"an in-place weight refresh still holds replica {self.replica_rank} "
                    f"after {refresh_wait_s:g}s; not put to sleep (the resize fails)"
                ) from None
        restorable = int(self._resolve_sleep_level())
        lvl = restorable if level is None else min(level, restorable)
        if level is not None and lvl != level:
            logger.warning("sleep level %d would discard state the weight sync cannot restore "
                           "on this replica (LoRA / MTP / NPU); sleeping at level %d",
                           level, lvl)
        # Set before the await: a refresh arriving while the engine goes to sleep must not
        # pause it or be recorded as loaded.
        self._rlix_asleep = True
        try:
            await self.engine.sleep(level=lvl)
        except BaseException:
            self._rlix_asleep = False
            raise
        if lvl >= 2:
            # Level 2 discards the weights: the engine no longer holds any version.
            self._rlix_version = None
        return lvl

    async def rlix_wake_up(self, tags: list[str] | None = None) -> None:
        """Wake the engine (all tags by default); the prefix cache is stale, so reset it.
        The server stays taken down (unrouted, veRL's resume ignored) until
        :meth:`rlix_open_gate`."""
        if self.node_rank != 0:
            return
        await self.engine.wake_up(tags=tags or self._get_wake_up_tags())
        self._rlix_asleep = False
        await self.engine.reset_prefix_cache(reset_connector=True)

    async def rlix_is_sleeping(self) -> bool:
        """Whether the engine is asleep."""
        if self.node_rank != 0:
            return False
        return bool(await self.engine.is_sleeping())


class RLixvLLMReplica(vLLMReplica):  # type: ignore[misc]
    """veRL's vLLM replica whose servers are :class:`RLixvLLMHttpServer` actors."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        import ray

        self.server_class = ray.remote(RLixvLLMHttpServer)


def load_rlix_vllm_replica() -> type[RLixvLLMReplica]:
    """``RolloutReplicaRegistry`` loader for ``"vllm"`` under RLix."""
    return RLixvLLMReplica
