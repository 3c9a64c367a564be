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
  sample, which NeMo RL's ``generate_async`` would otherwise buffer. The error carries the
  aborted run's partial output (the tokens vLLM produced before the abort and the logprob of
  each, :mod:`~rlix_plugins.adapters.nemo_rl_partial`), so the router can continue the request
  from there (``RedispatchMode.CONTINUE``, migration).
* ``generate_async`` honours a continuation: the router side sends prompt + partial tokens as
  the prompt and the remaining token budget (a data key popped before NeMo RL's own
  ``generate_async`` runs; ``_build_sampling_params`` caps ``max_tokens`` to it), and the
  router's attempt id, so ``rlix_abort_requests`` / ``rlix_request_progress`` can address
  single requests.
* ``rlix_abort_all`` / ``rlix_num_running`` / ``rlix_is_idle`` / ``rlix_sleep`` /
  ``rlix_wake_up`` / ``rlix_resume``: the lifecycle the adapter drives;
  ``rlix_abort_requests`` / ``rlix_request_progress``: per-request abort and progress for
  migration.
* ``sleep_async`` sleeps at the configured level (``policy.generation.rlix.sleep_level``,
  default 2) instead of NeMo RL's hard-coded 1.
* ``rlix_receive_weights`` / ``rlix_receiver_location`` / ``rlix_weight_version``: receiver side
  of the training module's selective sync. The engine's worker extension is NeMo RL's own plus
  :class:`~rlix_plugins.training.vllm_receiver.RlixWeightReceiverExtension`
  (:data:`RLIX_VLLM_EXTENSION_FQN`, swapped in by ``_create_engine``): the engine pulls the
  buckets from the sender's transport; no tensor passes through ``collective_rpc``.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import ray
from nemo_rl.models.generation.vllm.vllm_worker_async import VllmAsyncGenerationWorkerImpl

from rlix_plugins.adapters.nemo_rl_partial import (
    ATTEMPT_ID_KEY,
    MAX_NEW_TOKENS_KEY,
    RLIX_DATA_KEYS,
    PartialOutput,
    attach_partial,
    sampled_logprobs,
)
from rlix_plugins.errors import (
    SettingsError,
    ShardPreemptedError,
    ShardStateError,
    WeightSyncError,
)
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
    mixed in (:mod:`rlix_plugins.adapters.nemo_rl_vllm_ext`).

    Raises:
        SettingsError: an extension we have no combined class for (the selective sync would
            be missing); the supported ones are named.
    """
    try:
        return _RLIX_EXTENSIONS[stock or ""]
    except KeyError:
        raise SettingsError(
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
    """``cfg["rlix"]["sleep_level"]`` of a NeMo RL generation config (default 2), validated.

    Raises:
        SettingsError: ``rlix`` is not a mapping, or the level is not 0, 1 or 2.
    """
    section = (cfg.get("rlix") or {}) if cfg else {}
    if not isinstance(section, Mapping):
        raise SettingsError(
            f"policy.generation.rlix={section!r} is not valid; expected a mapping such as "
            "{'sleep_level': 2}"
        )
    raw = section.get("sleep_level", DEFAULT_SLEEP_LEVEL)
    level = DEFAULT_SLEEP_LEVEL if raw is None else raw
    if isinstance(level, bool) or level not in (0, 1, 2):
        raise SettingsError(
            f"policy.generation.rlix.sleep_level={raw!r} is not valid; expected 0, 1 or 2"
        )
    return int(level)


@dataclass(frozen=True, slots=True)
class _RequestOptions:
    """What the router side asked of one NeMo RL ``generate_async`` call (see module doc)."""

    max_new_tokens: int | None
    attempt_id: str | None


#: Options of the ``generate_async`` call running in this context: NeMo RL creates the sample's
#: task inside that call (``asyncio.create_task`` copies the context), so the engine call and
#: ``_build_sampling_params`` in that task see them.
_OPTIONS: contextvars.ContextVar[_RequestOptions | None] = contextvars.ContextVar(
    "rlix_nemo_rl_request_options", default=None)


def split_request_options(data: Any) -> tuple[_RequestOptions | None, Any]:
    """``(options, data without our keys)`` of a NeMo RL single-sample batch."""
    if not any(k in data for k in RLIX_DATA_KEYS):
        return None, data
    raw_max = data.get(MAX_NEW_TOKENS_KEY)
    raw_id = data.get(ATTEMPT_ID_KEY)
    max_new = None if raw_max is None else int(raw_max[0])
    if max_new is not None and max_new < 0:
        raise ValueError(f"{MAX_NEW_TOKENS_KEY}={max_new} must be >= 0")
    rest = type(data)({k: v for k, v in data.items() if k not in RLIX_DATA_KEYS})
    return _RequestOptions(max_new, None if raw_id is None else str(raw_id[0])), rest


class _Accumulator:
    """The tokens (and their logprobs) a request's stream has delivered so far."""

    __slots__ = ("delta", "logprobs", "token_ids")

    def __init__(self, delta: bool) -> None:
        self.delta = delta
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []

    def add(self, out: Any) -> None:
        outputs = getattr(out, "outputs", None) or ()
        if not outputs:
            return
        completion = outputs[0]
        ids = [int(t) for t in completion.token_ids]
        lps = list(sampled_logprobs(ids, completion.logprobs))
        if self.delta:
            self.token_ids += ids
            self.logprobs += lps
        elif len(ids) >= len(self.token_ids):
            # Cumulative / final-only outputs: the newest holds every token so far (vLLM's
            # abort output is built from the request's state, new_token_ids=[]).
            self.token_ids, self.logprobs = ids, lps

    def partial(self) -> PartialOutput:
        return PartialOutput(tuple(self.token_ids), tuple(self.logprobs))


class GatedEngine:
    """Proxy of a worker's ``AsyncLLM``: ``generate`` passes the shard's gate, aborts raise.

    Everything but ``generate`` is delegated unchanged, so NeMo RL's own calls (sleep,
    collective_rpc, reset_prefix_cache, ...) reach the real engine. Streams started under a
    router attempt id (see :func:`split_request_options`) are indexed by it for
    :meth:`abort_attempts` / :meth:`attempt_progress`.
    """

    def __init__(self, engine: Any, shard: VllmAsyncShard) -> None:
        self._engine = engine
        self._shard = shard
        # router attempt id -> vLLM request id, while the stream runs
        self._attempts: dict[str, str] = {}
        # vLLM request ids of streams past the gate that have not ended (some may still be
        # in vLLM's input processing, not yet registered in the engine)
        self._open: set[str] = set()

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
        params = kwargs.get("sampling_params", args[1] if len(args) > 1 else None)
        kind = getattr(getattr(params, "output_kind", None), "name", "CUMULATIVE")
        opts = _OPTIONS.get()
        attempt = opts.attempt_id if opts is not None else None
        return self._stream(request_id, attempt, self._engine.generate(*args, **kwargs),
                            _Accumulator(delta=kind == "DELTA"))

    async def _stream(
        self, request_id: str, attempt: str | None, stream: AsyncIterator[Any],
        acc: _Accumulator,
    ) -> AsyncIterator[Any]:
        if not self._shard.accepting:
            # The gate closed between generate() and the stream's start: still rejected.
            raise ShardPreemptedError(
                f"request {request_id}: shard is preempted (dispatch gate closed)"
            )
        # Counted from here, the same step as the gate check (no await in between), so
        # the shard never looks idle while vLLM is still processing the request's inputs.
        self._open.add(request_id)
        if attempt is not None:
            self._attempts[attempt] = request_id
        try:
            async for out in stream:
                acc.add(out)
                outputs = getattr(out, "outputs", None) or ()
                if getattr(out, "finished", False) and any(
                    getattr(o, "finish_reason", None) == ABORTED for o in outputs
                ):
                    # vLLM ends an aborted stream normally; it is preemption (or a migration),
                    # never a sample. What it produced so far rides on the error.
                    raise attach_partial(ShardPreemptedError(
                        f"request {request_id} was aborted after {len(acc.token_ids)} "
                        "token(s) (shard preempted or request migrated); re-dispatch it"
                    ), acc.partial())
                yield out
        except ShardPreemptedError:
            raise
        except Exception as exc:
            if not self._shard.accepting:
                raise attach_partial(ShardPreemptedError(
                    f"request {request_id} failed while its shard was being preempted: {exc!r}"
                ), acc.partial()) from exc
            raise
        finally:
            self._open.discard(request_id)
            if attempt is not None and self._attempts.get(attempt) == request_id:
                del self._attempts[attempt]

    @property
    def open_streams(self) -> int:
        """Streams that passed the gate and have not ended."""
        return len(self._open)

    def unregistered_streams(self) -> int | None:
        """Open streams vLLM has not registered yet (still in its input processing, so not
        in its unfinished count), or None when the engine's request map is unavailable."""
        processor = getattr(self._engine, "output_processor", None)
        external = getattr(processor, "external_req_ids", None)
        if external is None:
            return None
        try:
            return len(self._open - set(external))
        except Exception:
            return None

    async def abort_attempts(self, attempt_ids: Sequence[str]) -> tuple[str, ...]:
        """Abort the running streams of those router attempt ids that are registered in the
        engine; returns them (the gate stays open). Each one's stream then raises its partial
        output, as for a preemption."""
        known = self._registered()
        pairs = [(a, self._attempts[a]) for a in dict.fromkeys(attempt_ids)
                 if a in self._attempts and self._attempts[a] in known]
        if pairs:
            await self._engine.abort([rid for _, rid in pairs])
        return tuple(a for a, _ in pairs)

    def attempt_progress(self, attempt_ids: Sequence[str]) -> dict[str, int]:
        """Tokens generated so far per router attempt id (unknown ids left out; ``{}`` if
        vLLM's output processor layout moved)."""
        processor = getattr(self._engine, "output_processor", None)
        try:
            mapping = processor.external_req_ids  # type: ignore[union-attr]
            states = processor.request_states  # type: ignore[union-attr]
            progress: dict[str, int] = {}
            for a in attempt_ids:
                rid = self._attempts.get(a)
                if rid is None:
                    continue
                # .get: never insert into vLLM's defaultdict.
                counts = [int(states[i].detokenizer.num_output_tokens())
                          for i in mapping.get(rid, ()) if i in states]
                if counts:
                    progress[a] = max(counts)
            return progress
        except Exception:
            logger.debug("request progress unavailable", exc_info=True)
            return {}

    def _registered(self) -> set[str]:
        processor = getattr(self._engine, "output_processor", None)
        try:
            return set(getattr(processor, "external_req_ids", None) or ())
        except Exception:
            return set()


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

    async def rlix_abort_requests(self, attempt_ids: Sequence[str]) -> list[str]:
        """Abort single requests by router attempt id (migration; the gate stays open);
        returns the ids actually aborted."""
        self._rlix()
        assert isinstance(self.llm, GatedEngine)
        return list(await self.llm.abort_attempts(list(attempt_ids)))

    async def rlix_request_progress(self, attempt_ids: Sequence[str]) -> dict[str, int]:
        """Tokens generated so far per running router attempt id (best effort)."""
        self._rlix()
        assert isinstance(self.llm, GatedEngine)
        return self.llm.attempt_progress(list(attempt_ids))

    async def rlix_num_running(self) -> int:
        """Unfinished requests: the engine's count plus requests past the dispatch gate that
        vLLM has not registered yet (0 = idle). Without the engine's request map, the larger
        of the engine's count and the open streams."""
        running = await self._rlix().num_running()
        llm = self.llm
        if not isinstance(llm, GatedEngine):
            return running
        pending = llm.unregistered_streams()
        if pending is None:
            return max(running, llm.open_streams)
        return running + pending

    async def rlix_is_idle(self) -> bool:
        """True when the engine has no unfinished request (none still being submitted)."""
        return await self.rlix_num_running() == 0

    def _rlix_sleep_lock(self) -> asyncio.Lock:
        """Orders sleeps and weight receives on this actor's loop (created on it)."""
        lock: asyncio.Lock | None = getattr(self, "_rlix_lock", None)
        if lock is None:
            lock = self._rlix_lock = asyncio.Lock()
        return lock

    async def rlix_sleep(self, level: int | None = None) -> None:
        """Sleep at ``level`` (default: the configured level), aborting any straggler.
        Waits for a weight receive under way (the engine would run it after the sleep)."""
        shard = self._rlix()
        async with self._rlix_sleep_lock():
            self._rlix_before_sleep(shard.sleep_level if level is None else level)
            await shard.sleep(level)

    def _rlix_before_sleep(self, level: int) -> None:
        if level == 2:
            # Level 2 discards the weights: no version is held until the next complete sync.
            # Marked before sleeping: a sleep that fails part-way may have discarded them.
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

        # NeMo RL's own attributes (VllmGenerationWorker.__init__): the engine's vLLM workers,
        # each a receiver of its own in the sync
        workers = int(getattr(self, "tensor_parallel_size", 1) or 1) * int(
            getattr(self, "pipeline_parallel_size", 1) or 1)
        return {"host": local_host_id(), "workers": workers}

    async def rlix_receive_weights(
        self, offer: dict[str, Any] | list[dict[str, Any]]
    ) -> dict[str, Any] | list[dict[str, Any]]:
        """Receiver side of the selective sync: the engine's workers run the receiver
        extension (``rlix_receive_weights``), which pulls the offered version bucket by bucket
        from the sender's transport. Only the offers (plain data) cross the engine's RPC: one
        offer for a one-worker engine, a list (one per worker, rank order) otherwise, answered
        with the workers' results in that order (a failed worker's as a ``failed`` record)."""
        async with self._rlix_sleep_lock():  # a sleep waits, and cannot slip in between
            if await self._rlix().is_sleeping():
                # The driver's refresh raced the coordinator's shrink: a level-2 sleep has
                # released the weight memory a receive would write into. Refused (the shard's
                # next wake syncs the newest version before it serves).
                refused = {"failed": True, "error_type": ShardStateError.__name__,
                           "error": "the engine is asleep; its next wake syncs it"}
                return refused if isinstance(offer, Mapping) else [refused for _ in offer]
            replies = await self._rlix().engine.collective_rpc("rlix_receive_weights",
                                                               args=(offer,))
            expected = 1 if isinstance(offer, Mapping) else len(offer)
            if len(replies) != expected:
                raise WeightSyncError(
                    f"{len(replies)} vLLM workers answered {expected} offer(s): send one "
                    "offer per worker of the engine"
                )
            if all(not (isinstance(r, Mapping) and r.get("failed")) for r in replies):
                self._rlix_weights_discarded = False
        if isinstance(offer, Mapping):
            result: dict[str, Any] = replies[0]
            return result
        return list(replies)

    async def rlix_weight_version(self) -> int | None:
        """The version every worker of the engine holds (applied completely), or None: never
        synced, a sync failed, or a level-2 sleep discarded the weights since the last
        complete sync."""
        from rlix_plugins.training.vllm_receiver import common_version

        if getattr(self, "_rlix_weights_discarded", False):
            return None
        return common_version(await self._rlix().engine.collective_rpc("rlix_weight_version"))


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

    async def generate_async(
        self, data: Any, greedy: bool = False
    ) -> AsyncIterator[tuple[int, Any]]:
        """NeMo RL's ``generate_async``; a router continuation's budget and attempt id (data
        keys, removed here) apply to the request it makes."""
        opts, data = split_request_options(data)
        token = _OPTIONS.set(opts)
        try:
            async for item in super().generate_async(data, greedy=greedy):
                yield item
        finally:
            # Finalisation may run in another context (generator closed elsewhere); the
            # variable then dies with the call's own context anyway.
            with contextlib.suppress(ValueError):
                _OPTIONS.reset(token)

    def _build_sampling_params(
        self, *, greedy: bool, stop_strings: Any, max_new_tokens: int | None = None
    ) -> Any:
        """NeMo RL's sampling parameters, ``max_tokens`` capped by a continuation's budget
        (the tokens the request has left, so a continued sample is never longer than an
        uninterrupted one)."""
        opts = _OPTIONS.get()
        if opts is not None and opts.max_new_tokens is not None:
            base = self.cfg["max_new_tokens"] if max_new_tokens is None else max_new_tokens
            max_new_tokens = min(int(base), opts.max_new_tokens)
        return super()._build_sampling_params(
            greedy=greedy, stop_strings=stop_strings, max_new_tokens=max_new_tokens)

    async def sleep_async(self) -> None:
        """NeMo RL's sleep, at the configured level instead of the hard-coded level 1."""
        shard = self._rlix()
        async with self._rlix_sleep_lock():
            self._rlix_before_sleep(shard.sleep_level)
            await shard.engine.reset_prefix_cache()
            if hasattr(shard.engine, "reset_mm_cache"):
                await shard.engine.reset_mm_cache()
            await shard.engine.sleep(level=shard.sleep_level)


# Decorated here, on our own subclass: Ray copies methods at decoration time.
RLixVllmAsyncGenerationWorker = ray.remote(RLixVllmAsyncGenerationWorkerImpl)
