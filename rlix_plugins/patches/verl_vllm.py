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

:func:`load_rlix_vllm_replica` is the loader registered in veRL's ``RolloutReplicaRegistry``
under ``"vllm"`` (the official seam), so ``LLMServerManager`` builds RLix replicas. It imports
vLLM lazily, like veRL's own loader.
"""

from __future__ import annotations

import logging
from typing import Any

from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer, vLLMReplica

logger = logging.getLogger(__name__)


class RLixvLLMHttpServer(vLLMHttpServer):  # type: ignore[misc]
    """veRL's vLLM server plus engine-level sleep/wake/count usable in every rollout mode,
    and the weight version its engine holds."""

    #: version set by the last complete weight load (None: none yet, or discarded by sleep)
    _rlix_version: int | None = None

    async def set_global_steps(self, global_steps: int) -> None:
        """veRL's call after a complete weight load; also recorded as the engine's version."""
        await super().set_global_steps(global_steps)
        self._rlix_version = None if global_steps is None else int(global_steps)

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

    async def rlix_sleep(self, level: int | None = None) -> None:
        """Sleep the engine at ``level`` (default: veRL's resolved level, 2 for full weights)."""
        if self.node_rank != 0:
            return
        lvl = self._resolve_sleep_level() if level is None else level
        await self.engine.sleep(level=lvl)
        if lvl >= 2:
            # Level 2 discards the weights: the engine no longer holds any version.
            self._rlix_version = None

    async def rlix_wake_up(self, tags: list[str] | None = None) -> None:
        """Wake the engine (all tags by default); the prefix cache is stale, so reset it."""
        if self.node_rank != 0:
            return
        await self.engine.wake_up(tags=tags or self._get_wake_up_tags())
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
