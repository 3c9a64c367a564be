"""NeMo RL's ``VllmGeneration`` with the generation module's shard router in place of its
round-robin shard selection.

NeMo RL's real ``_async_generate_base`` still runs (validation, single-sample check, payload
metrics); it asks ``_next_dp_shard_idx`` for a shard and calls ``_generate_on_shard``. This
subclass overrides exactly those two: ``_generate_on_shard`` hands the request to a
:class:`~rlix_plugins.generation.router.ShardRouter`, whose engines (:class:`NemoRlShard`, one
per dp rank) run NeMo RL's own ``_generate_on_shard`` on the rank the router picked. The router
skips preempted and sleeping shards, waits (bounded) when none is active, and re-dispatches a
request whose shard was preempted (the worker raised :class:`ShardPreemptedError`, possibly
wrapped by Ray and by NeMo RL's ``GenerationUnavailable``), at most ``max_attempts`` times.

Routing state has one owner: the router reads a
:class:`~rlix_plugins.generation.state_store.ShardStateView` (a
:class:`~rlix_plugins.generation.ray_state.RayShardState` in a real job). The object is
picklable, so NeMo RL's pickled copy in the trajectory collector routes from the same state
as the driver's.

Observation: with ``RLIX_OBSERVE_DIR`` set, the attached router (and each pickled copy) writes
its request counters there (:mod:`rlix_plugins.adapters.observability`), and
:meth:`NemoRlShard.weight_version` lets the shard controller record the version each engine
reports after a sync.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from nemo_rl.models.generation.vllm.vllm_generation import VllmGeneration

from rlix_plugins.adapters.observability import router_counters_emitter
from rlix_plugins.errors import ShardPreemptedError
from rlix_plugins.generation.engine import EngineOutput, GenerationRequest
from rlix_plugins.generation.migration import MigrationConfig
from rlix_plugins.generation.router import RedispatchMode, RouterConfig, ShardRouter
from rlix_plugins.generation.state_store import ShardStateView

logger = logging.getLogger(__name__)

#: Key of the per-request call context in ``GenerationRequest.sampling`` (travels unchanged
#: through the router's RESTART re-dispatch).
CALL_KEY = "_rlix_nemo_rl_call"


def is_preemption(exc: BaseException) -> bool:
    """True if ``exc`` or anything in its cause chain is a :class:`ShardPreemptedError`.

    Ray re-raises a worker's ``ShardPreemptedError`` as a ``RayTaskError`` subclass of it, and
    NeMo RL wraps Ray errors in ``GenerationUnavailable`` (``raise ... from error``).
    """
    seen: set[int] = set()
    stack: list[BaseException | None] = [exc]
    while stack:
        cur = stack.pop()
        if cur is None or id(cur) in seen:
            continue
        seen.add(id(cur))
        if isinstance(cur, ShardPreemptedError):
            return True
        stack.extend([cur.__cause__, cur.__context__, getattr(cur, "cause", None)])
    return False


class WorkerCaller(Protocol):
    """Calls a method of one dp rank's leader worker (remote in a job, local in tests)."""

    async def call(self, method: str, *args: Any) -> Any: ...


class RayWorkerCaller:
    """:class:`WorkerCaller` over a Ray actor handle (picklable)."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    async def call(self, method: str, *args: Any) -> Any:
        return await getattr(self.handle, method).remote(*args)


class InProcessWorkerCaller:
    """:class:`WorkerCaller` over a worker object in this process (CPU tests, one-process runs)."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker

    async def call(self, method: str, *args: Any) -> Any:
        result = getattr(self.worker, method)(*args)
        if isinstance(result, Awaitable):
            return await result
        return result


@dataclass(slots=True)
class _Call:
    """One NeMo RL generation call while the router handles it (holds the winning result)."""

    run_on_shard: Callable[[int], AsyncIterator[tuple[int, Any]]]
    result: tuple[int, Any] | None = None

    async def run(self, dp_rank: int) -> EngineOutput:
        got: tuple[int, Any] | None = None
        try:
            async for item in self.run_on_shard(dp_rank):
                got = item
        except Exception as exc:
            if is_preemption(exc):
                raise ShardPreemptedError(f"shard {dp_rank} preempted the request") from exc
            raise
        if got is None:
            raise RuntimeError(f"shard {dp_rank} produced no output")
        self.result = got
        return _engine_output(got[1])


def _engine_output(batch: Any) -> EngineOutput:
    """Summarise a NeMo RL single-sample result batch for the router (tokens, reason)."""
    try:
        truncated = bool(batch["truncated"][0])
        n = int(batch["generation_lengths"][0])
        total = int(batch["unpadded_sequence_lengths"][0])
        ids = tuple(int(t) for t in batch["output_ids"][0][total - n : total])
    except (KeyError, TypeError, IndexError):  # generate_text_async results carry text only
        return EngineOutput((), "stop")
    return EngineOutput(ids, "length" if truncated else "stop")


class NemoRlShard:
    """:class:`~rlix_plugins.generation.engine.ShardEngine` for one dp rank of NeMo RL's vLLM.

    ``generate`` runs the request's NeMo RL call on this rank (router side); the lifecycle
    methods call the rank's leader worker (``rlix_*`` methods of
    :mod:`rlix_plugins.adapters.nemo_rl_workers`) for the preemption controller.
    """

    def __init__(self, dp_rank: int, worker: WorkerCaller | None) -> None:
        self.dp_rank = dp_rank
        self.worker = worker

    async def generate(self, request: GenerationRequest) -> EngineOutput:
        call = request.sampling[CALL_KEY]
        assert isinstance(call, _Call)
        return await call.run(self.dp_rank)

    def _caller(self) -> WorkerCaller:
        if self.worker is None:
            raise RuntimeError(f"shard {self.dp_rank} has no worker caller (router-only copy)")
        return self.worker

    async def abort_all(self) -> int:
        return int(await self._caller().call("rlix_abort_all"))

    async def num_running(self) -> int:
        return int(await self._caller().call("rlix_num_running"))

    async def sleep(self, level: int | None = None) -> None:
        await self._caller().call("rlix_sleep", level)

    async def wake_up(self) -> None:
        await self._caller().call("rlix_wake_up")

    async def resume(self) -> None:
        await self._caller().call("rlix_resume")

    async def weight_version(self) -> int | None:
        """The weight version the rank's leader worker reports as applied completely, or None
        (never synced, or a worker class without ``rlix_weight_version``: then the gate's
        weights criterion fails rather than trusting the sender)."""
        try:
            version = await self._caller().call("rlix_weight_version")
        except AttributeError:
            return None
        return None if version is None else int(version)


def default_router_config() -> RouterConfig:
    """RESTART re-dispatch: NeMo RL keeps per-token logprobs, so a sample must come from one
    engine run, never be stitched from two. For the same reason no migration: a migrated
    request continues from its partial tokens on another engine (a stitched sample)."""
    return RouterConfig(
        redispatch=RedispatchMode.RESTART, migration=MigrationConfig(enabled=False)
    )


class RLixVllmGeneration(VllmGeneration):  # type: ignore[misc]
    """``VllmGeneration`` routed by the shard router once :meth:`rlix_attach` was called.

    Without a router attached it is NeMo RL's class unchanged. The pipeline adapter attaches
    it when the job runs under the coordinator (see :mod:`rlix_plugins.adapters.nemo_rl`).
    """

    _rlix_router: ShardRouter | None = None
    _rlix_on_init: Callable[[RLixVllmGeneration], None] | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._rlix_router = None
        hook = type(self)._rlix_on_init
        if hook is not None:
            hook(self)

    # --- wiring -----------------------------------------------------------------------------

    def rlix_shards(self) -> list[NemoRlShard]:
        """One shard engine per dp rank, talking to the rank's leader worker over Ray."""
        wg = self.worker_group
        return [
            NemoRlShard(r, RayWorkerCaller(wg.workers[wg.get_dp_leader_worker_idx(r)]))
            for r in range(wg.dp_size)
        ]

    def rlix_attach(
        self,
        state: ShardStateView,
        shards: list[NemoRlShard] | None = None,
        config: RouterConfig | None = None,
        pipeline_id: str | None = None,
    ) -> ShardRouter:
        """Route from now on over ``state`` (one owner per pipeline); returns the router.

        With ``RLIX_OBSERVE_DIR`` set the router records its counters for ``pipeline_id``
        (default: ``PIPELINE_ID`` of this process, exported by the pipeline adapter).
        """
        engines = shards if shards is not None else self.rlix_shards()
        self._rlix_router = ShardRouter(state, engines, config or default_router_config(),
                                        on_counters=router_counters_emitter(pipeline_id))
        return self._rlix_router

    @property
    def rlix_router(self) -> ShardRouter | None:
        """The attached router, or None (NeMo RL's own selection)."""
        return self._rlix_router

    # --- NeMo RL seams ------------------------------------------------------------------------

    def _next_dp_shard_idx(self) -> int:
        router = self._rlix_router
        if router is None:
            return int(super()._next_dp_shard_idx())
        # Only a hint for NeMo RL's bookkeeping: the router picks the shard when it dispatches.
        active = router.state.snapshot().active
        return active[0] if active else 0

    async def _generate_on_shard(
        self,
        *,
        data: Any,
        method_name: str,
        greedy: bool,
        dp_shard_idx: int,
        leader_worker_idx: int,
    ) -> AsyncIterator[tuple[int, Any]]:
        router = self._rlix_router
        if router is None:
            async for item in super()._generate_on_shard(
                data=data,
                method_name=method_name,
                greedy=greedy,
                dp_shard_idx=dp_shard_idx,
                leader_worker_idx=leader_worker_idx,
            ):
                yield item
            return

        def run_on_shard(rank: int) -> AsyncIterator[tuple[int, Any]]:
            return VllmGeneration._generate_on_shard(  # type: ignore[no-any-return]
                self,
                data=data,
                method_name=method_name,
                greedy=greedy,
                dp_shard_idx=rank,
                leader_worker_idx=self.worker_group.get_dp_leader_worker_idx(rank),
            )

        call = _Call(run_on_shard)
        request = GenerationRequest(uuid.uuid4().hex, (), 1, {CALL_KEY: call})
        result = await router.generate(request)
        assert call.result is not None
        if result.attempts > 1:
            logger.debug("request re-dispatched %d time(s), served by shard %d",
                         result.attempts - 1, result.dp_rank)
        yield call.result

    def init_collective(
        self, ip: str, port: int, world_size: int, *, train_world_size: int
    ) -> list[Any]:
        """No trainer<->inference NCCL world under RLix: weights come from the CPU cache by
        selective sync, and with partial overlap one GPU would be two ranks of that world."""
        if self._rlix_router is not None or type(self)._rlix_on_init is not None:
            return []
        return list(
            super().init_collective(ip, port, world_size, train_world_size=train_world_size)
        )
