"""NeMo RL vLLM worker classes with the engine side of time-sharing (they run in worker venvs).

NeMo RL builds its vLLM workers from a class FQN (``RayWorkerBuilder``) looked up in
``ACTOR_ENVIRONMENT_REGISTRY``; :mod:`rlix_plugins.patches.nemo_rl` points both at
:data:`RLIX_ASYNC_WORKER_FQN`. Ray freezes a decorated actor class, so the methods are added by
subclassing NeMo RL's undecorated ``VllmAsyncGenerationWorkerImpl`` and decorating our own.

What the subclass adds, all on top of :class:`~rlix_plugins.generation.vllm_engine.VllmAsyncShard`
(the generation module's engine-side gate, abort-all, running count and sleep level):

* ``self.llm`` is wrapped by :class:`GatedEngine`: a request arriving while the shard is being
  preempted is rejected at once, and a stream that ends with ``finish_reason == "abort"`` raises
  :class:`~rlix_plugins.errors.ShardPreemptedError` instead of being returned as a (truncated)
  sample, which NeMo RL's ``generate_async`` would otherwise buffer.
* ``rlix_abort_all`` / ``rlix_num_running`` / ``rlix_is_idle`` / ``rlix_sleep`` /
  ``rlix_wake_up`` / ``rlix_resume``: the lifecycle the adapter drives.
* ``sleep_async`` sleeps at the configured level (``policy.generation.rlix.sleep_level``,
  default 2) instead of NeMo RL's hard-coded 1.
* ``rlix_receive_weights`` / ``rlix_receiver_location`` / ``rlix_weight_version``: receiver side
  of the training module's selective sync. The engine's worker extension is NeMo RL's own plus
  :class:`~rlix_plugins.training.vllm_receiver.RlixWeightReceiverExtension`
  (:data:`RLIX_VLLM_EXTENSION_FQN`, swapped in by ``_create_engine``): the engine pulls the
  buckets from the sender's transport; no tensor passes through ``collective_rpc``.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import ray
from nemo_rl.models.generation.vllm.vllm_worker_async import VllmAsyncGenerationWorkerImpl

from rlix_plugins.errors import ShardPreemptedError, WeightSyncError
from rlix_plugins.generation.engine import ABORTED
from rlix_plugins.generation.vllm_engine import DEFAULT_SLEEP_LEVEL, VllmAsyncShard

logger = logging.getLogger(__name__)

#: FQN NeMo RL's worker builder imports (``module.attr``), registered in its venv registry.
RLIX_ASYNC_WORKER_FQN = "rlix_plugins.adapters.nemo_rl_workers.RLixVllmAsyncGenerationWorker"
#: The stock FQN it replaces.
STOCK_ASYNC_WORKER_FQN = (
    "nemo_rl.models.generation.vllm.vllm_worker_async.VllmAsyncGenerationWorker"
)


def rlix_extension_fqn(stock: str | None) -> str:
    """The engine's worker extension under RLix: NeMo RL's ``stock`` one with the receiver
    mixed in (:mod:`rlix_plugins.adapters.nemo_rl_vllm_ext`). Raises ValueError for an
    extension we have no combined class for (the selective sync would be missing)."""
    try:
        return _RLIX_EXTENSIONS[stock or ""]
    except KeyError:
        raise ValueError(
            f"vLLM worker_extension_cls={stock!r} has no RLix counterpart; supported: "
            f"{sorted(k for k in _RLIX_EXTENSIONS if k)}"
        ) from None


_NEMO_EXT = "nemo_rl.models.generation.vllm.vllm_backend."
_RLIX_EXT = "rlix_plugins.adapters.nemo_rl_vllm_ext."
#: NeMo RL's extension FQN -> ours (its subclass with the receiver mixed in).
_RLIX_EXTENSIONS = {
    _NEMO_EXT + "VllmInternalWorkerExtension": _RLIX_EXT + "RLixVllmInternalWorkerExtension",
    _NEMO_EXT + "VllmInternalWorkerExtensionWithCheckpointEngine":
        _RLIX_EXT + "RLixVllmInternalWorkerExtensionWithCheckpointEngine",
}
#: The default (NeMo RL without a checkpoint engine).
RLIX_VLLM_EXTENSION_FQN = _RLIX_EXTENSIONS[_NEMO_EXT + "VllmInternalWorkerExtension"]


def configured_sleep_level(cfg: Any) -> int:
    """``cfg["rlix"]["sleep_level"]`` of a NeMo RL generation config (default 2), validated."""
    raw = (cfg.get("rlix") or {}).get("sleep_level", DEFAULT_SLEEP_LEVEL) if cfg else None
    level = DEFAULT_SLEEP_LEVEL if raw is None else raw
    if isinstance(level, bool) or level not in (0, 1, 2):
        raise ValueError(
            f"policy.generation.rlix.sleep_level={raw!r} is not valid; expected 0, 1 or 2"
        )
    return int(level)


class GatedEngine:
    """Proxy of a worker's ``AsyncLLM``: ``generate`` passes the shard's gate, aborts raise.

    Everything but ``generate`` is delegated unchanged, so NeMo RL's own calls (sleep,
    collective_rpc, reset_prefix_cache, ...) reach the real engine.
    """

    def __init__(self, engine: Any, shard: VllmAsyncShard) -> None:
        self._engine = engine
        self._shard = shard

    @property
    def rlix_engine(self) -> Any:
        """The wrapped engine."""
        return self._engine

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def generate(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        """``AsyncLLM.generate`` behind the dispatch gate; an aborted stream raises."""
        request_id = kwargs.get("request_id", args[2] if len(args) > 2 else "?")
        if not self._shard.accepting:
            # Rejected before reaching the engine: a request added to an engine that is
            # about to sleep would wait for the wake-up, i.e. hang.
            raise ShardPreemptedError(
                f"request {request_id}: shard is preempted (dispatch gate closed)"
            )
        return self._stream(request_id, self._engine.generate(*args, **kwargs))

    async def _stream(self, request_id: str, stream: AsyncIterator[Any]) -> AsyncIterator[Any]:
        try:
            async for out in stream:
                outputs = getattr(out, "outputs", None) or ()
                if getattr(out, "finished", False) and any(
                    getattr(o, "finish_reason", None) == ABORTED for o in outputs
                ):
                    # vLLM ends an aborted stream normally; it is preemption, never a sample.
                    raise ShardPreemptedError(
                        f"request {request_id} was aborted (shard preempted); re-dispatch it"
                    )
                yield out
        except ShardPreemptedError:
            raise
        except Exception as exc:
            if not self._shard.accepting:
                raise ShardPreemptedError(
                    f"request {request_id} failed while its shard was being preempted: {exc!r}"
                ) from exc
            raise


class RLixVllmWorkerMixin:
    """Time-sharing methods of a NeMo RL async vLLM worker (see module docstring)."""

    llm: Any
    cfg: Any

    def rlix_install(self) -> VllmAsyncShard:
        """Wrap ``self.llm`` (idempotent); called after the engine is created."""
        shard: VllmAsyncShard | None = getattr(self, "_rlix_shard", None)
        engine = self.llm
        if engine is None:
            raise RuntimeError("rlix: the vLLM engine is not created yet (deferred model load?)")
        if isinstance(engine, GatedEngine):
            assert shard is not None
            return shard
        shard = VllmAsyncShard(engine, sleep_level=configured_sleep_level(self.cfg))
        self._rlix_shard = shard
        self.llm = GatedEngine(engine, shard)
        return shard

    def _rlix(self) -> VllmAsyncShard:
        shard: VllmAsyncShard | None = getattr(self, "_rlix_shard", None)
        return shard if shard is not None else self.rlix_install()

    async def rlix_abort_all(self) -> int:
        """Close the dispatch gate and abort every running request; returns how many."""
        return await self._rlix().abort_all()

    async def rlix_num_running(self) -> int:
        """Unfinished requests in the engine (0 = idle)."""
        return await self._rlix().num_running()

    async def rlix_is_idle(self) -> bool:
        """True when the engine has no unfinished request."""
        return await self._rlix().num_running() == 0

    async def rlix_sleep(self, level: int | None = None) -> None:
        """Sleep at ``level`` (default: the configured level), aborting any straggler."""
        shard = self._rlix()
        await shard.sleep(level)
        await self._rlix_after_sleep(shard.sleep_level if level is None else level)

    async def _rlix_after_sleep(self, level: int) -> None:
        if level == 2:
            # Level 2 discards the weights: no version is held until the next complete sync.
            # Kept here, not in the engine: an engine without the receiver can still sleep.
            self._rlix_weights_discarded = True

    async def rlix_wake_up(self) -> None:
        """Wake the engine; it stays out of routing (gate closed) until :meth:`rlix_resume`."""
        await self._rlix().wake_up()

    async def rlix_resume(self) -> None:
        """Reopen the dispatch gate (after the shard's weights are current)."""
        await self._rlix().resume()

    def rlix_receiver_location(self) -> dict[str, Any]:
        """Where this shard receives weights (the sender picks the transport from it).

        The engine receives into host memory (shared memory on the sender's host, else ZMQ);
        GPU-direct transports (CUDA IPC, NCCL) are not wired for NeMo RL.
        """
        from rlix_plugins.training.transports.selection import local_host_id

        return {"host": local_host_id()}

    async def rlix_receive_weights(self, offer: dict[str, Any]) -> dict[str, Any]:
        """Receiver side of the selective sync: the engine's worker runs the receiver extension
        (``rlix_receive_weights``), which pulls the offered version bucket by bucket from the
        sender's transport. Only the offer (plain data) crosses the engine's RPC."""
        replies = await self._rlix().engine.collective_rpc("rlix_receive_weights",
                                                           args=(offer,))
        if len(replies) != 1:
            raise WeightSyncError(
                f"{len(replies)} vLLM workers answered one offer; the receiver supports one "
                "worker per engine (tensor parallel size 1)"
            )
        result: dict[str, Any] = replies[0]
        self._rlix_weights_discarded = False
        return result

    async def rlix_weight_version(self) -> int | None:
        """The version the engine holds (applied completely), or None: never synced, a sync
        failed, or a level-2 sleep discarded the weights since the last complete sync."""
        if getattr(self, "_rlix_weights_discarded", False):
            return None
        replies = await self._rlix().engine.collective_rpc("rlix_weight_version")
        return None if replies[0] is None else int(replies[0])


class RLixVllmAsyncGenerationWorkerImpl(
    RLixVllmWorkerMixin, VllmAsyncGenerationWorkerImpl  # type: ignore[misc]
):
    """NeMo RL's async vLLM worker with the time-sharing methods (undecorated, subclassable)."""

    def _create_engine(self, llm_kwargs: dict[str, Any]) -> None:
        llm_kwargs = dict(llm_kwargs)
        llm_kwargs["worker_extension_cls"] = rlix_extension_fqn(
            llm_kwargs.get("worker_extension_cls"))
        super()._create_engine(llm_kwargs)
        self.rlix_install()

    async def sleep_async(self) -> None:
        """NeMo RL's sleep, at the configured level instead of the hard-coded level 1."""
        shard = self._rlix()
        await shard.engine.reset_prefix_cache()
        if hasattr(shard.engine, "reset_mm_cache"):
            await shard.engine.reset_mm_cache()
        await shard.engine.sleep(level=shard.sleep_level)
        await self._rlix_after_sleep(shard.sleep_level)


# Decorated here, on our own subclass: Ray copies methods at decoration time.
RLixVllmAsyncGenerationWorker = ray.remote(RLixVllmAsyncGenerationWorkerImpl)
