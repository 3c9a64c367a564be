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

Re-dispatch continues by default (``RedispatchMode.CONTINUE``; ``RLIX_NEMO_RL_REDISPATCH=
restart`` selects RESTART): the worker's error carries the tokens and logprobs the aborted run
produced, the router sends prompt + those tokens with the remaining budget to the next shard,
and the caller gets ONE NeMo RL result whose ``output_ids`` / ``logprobs`` /
``generation_lengths`` / ``unpadded_sequence_lengths`` span every run
(:func:`stitch_result`). Each token's logprob is the one vLLM reported for the weights that
sampled it, which is the behaviour-policy logprob NeMo RL's loss and logprob-error metric use;
the sample's weight version stays the one NeMo RL's collector stamped before the call (the
first, oldest, weights). Migration (running requests moved to a newly activated shard) is on:
:class:`NemoRlShard` aborts single requests through the worker's ``rlix_abort_requests``.

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
import os
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.models.generation.vllm.vllm_generation import VllmGeneration

from rlix_plugins.adapters.nemo_rl_partial import (
    ATTEMPT_ID_KEY,
    MAX_NEW_TOKENS_KEY,
    partial_from,
)
from rlix_plugins.adapters.observability import recording_engines, router_counters_emitter
from rlix_plugins.errors import SettingsError, ShardPreemptedError
from rlix_plugins.generation.engine import (
    ABORTED,
    EngineOutput,
    GenerationRequest,
    GenerationResult,
)
from rlix_plugins.generation.migration import MigrationConfig
from rlix_plugins.generation.router import RedispatchMode, RouterConfig, ShardRouter
from rlix_plugins.generation.state_store import ShardStateView
from rlix_plugins.settings import load_settings

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


#: NeMo RL's output keys that :func:`stitch_result` rebuilds for a continued sample.
STITCHED_KEYS = ("output_ids", "logprobs", "generation_lengths", "unpadded_sequence_lengths",
                 "truncated")


@dataclass(frozen=True, slots=True)
class Segment:
    """One engine run of a request: the shard, the tokens it added, aborted or final."""

    dp_rank: int
    num_tokens: int
    aborted: bool


@dataclass(slots=True)
class _Call:
    """One NeMo RL generation call while the router handles it.

    ``prompt`` is the sample's unpadded prompt when the request can be continued (token
    prompt, ``generate_async``), else None: a preempted run then reports no partial tokens and
    the router reruns it from the prompt whatever its mode. ``result`` holds the last
    completed run's NeMo RL result; ``segments`` every run of the current sample (a restart
    from the prompt clears them).
    """

    run_on_shard: Callable[[int, Any], AsyncIterator[tuple[int, Any]]]
    data: Any
    prompt: tuple[int, ...] | None = None
    result: tuple[int, Any] | None = None
    segments: list[Segment] = field(default_factory=list)

    def _data_for(self, attempt: GenerationRequest) -> tuple[Any, int]:
        """NeMo RL data for ``attempt`` and the number of carried (already generated) tokens."""
        if self.prompt is None:
            return self.data, 0
        carried = attempt.prompt_token_ids[len(self.prompt):]
        if attempt.prompt_token_ids[:len(self.prompt)] != self.prompt:
            raise RuntimeError(f"attempt {attempt.request_id} does not extend its prompt")
        data = self.data
        if carried:
            ids = data["input_ids"]
            row = torch.tensor([list(attempt.prompt_token_ids)], dtype=ids.dtype,
                               device=ids.device)
            lengths = data["input_lengths"]
            data = BatchedDataDict({
                **data, "input_ids": row,
                "input_lengths": torch.tensor([row.shape[1]], dtype=lengths.dtype,
                                              device=lengths.device),
            })
        else:
            data = BatchedDataDict(dict(data))
        data[MAX_NEW_TOKENS_KEY] = [int(attempt.max_tokens)]
        data[ATTEMPT_ID_KEY] = [attempt.request_id]
        return data, len(carried)

    async def run(self, dp_rank: int, attempt: GenerationRequest) -> EngineOutput:
        data, carried = self._data_for(attempt)
        if not carried:
            self.segments.clear()  # first run, or the router restarts from the prompt
        got: tuple[int, Any] | None = None
        try:
            async for item in self.run_on_shard(dp_rank, data):
                got = item
        except Exception as exc:
            if not is_preemption(exc):
                raise
            partial = partial_from(exc) if self.prompt is not None else None
            if partial is None:
                raise ShardPreemptedError(f"shard {dp_rank} preempted the request") from exc
            self.segments.append(Segment(dp_rank, len(partial.token_ids), True))
            # Aborted output: the router keeps these tokens (CONTINUE, migration) or drops
            # them (RESTART).
            return EngineOutput(partial.token_ids, ABORTED, partial.logprobs)
        if got is None:
            raise RuntimeError(f"shard {dp_rank} produced no output")
        self.result = got
        out = _engine_output(got[1])
        if carried and len(out.token_ids) > attempt.max_tokens:
            # The worker did not cap the continuation (a worker class without our
            # _build_sampling_params): keep the budget an uninterrupted run would have had.
            logger.warning("continuation on shard %d returned %d tokens for a budget of %d; "
                           "truncated (is the worker RLix's?)", dp_rank, len(out.token_ids),
                           attempt.max_tokens)
            lps = None if out.logprobs is None else out.logprobs[:attempt.max_tokens]
            out = EngineOutput(out.token_ids[:attempt.max_tokens], "length", lps)
        self.segments.append(Segment(dp_rank, len(out.token_ids), False))
        return out


def _engine_output(batch: Any) -> EngineOutput:
    """A NeMo RL single-sample result as the router sees it: this run's generated tokens,
    their logprobs and the finish reason."""
    try:
        truncated = bool(batch["truncated"][0])
        n = int(batch["generation_lengths"][0])
        total = int(batch["unpadded_sequence_lengths"][0])
        ids = tuple(int(t) for t in batch["output_ids"][0][total - n : total])
    except (KeyError, TypeError, IndexError):  # generate_text_async results carry text only
        return EngineOutput((), "stop")
    lps: tuple[float, ...] | None = None
    if "logprobs" in batch:
        lps = tuple(float(x) for x in batch["logprobs"][0][total - n : total])
    return EngineOutput(ids, "length" if truncated else "stop", lps)


def stitch_result(
    data: Mapping[str, Any],
    token_ids: Sequence[int],
    logprobs: Sequence[float],
    *,
    truncated: bool,
    template: Mapping[str, Any] | None = None,
    leader_worker_idx: int | None = None,
) -> BatchedDataDict[Any]:
    """One NeMo RL single-sample result (``GenerationOutputSpec``, the layout of
    ``VllmAsyncGenerationWorkerImpl.generate_async``) for a sample generated in several runs.

    ``data`` is the caller's original input; ``token_ids`` / ``logprobs`` every generated token
    and its logprob, in order, across the runs. As NeMo RL: ``output_ids`` = prompt +
    generated tokens (dtype of ``input_ids``), ``logprobs`` float32 zeros over the prompt then
    one value per generated token, ``generation_lengths`` / ``unpadded_sequence_lengths`` long,
    ``truncated`` bool. Other keys (``gen_leader_worker_idx``, routed experts) come from the
    last run's ``template`` when present; ``leader_worker_idx`` fills
    ``gen_leader_worker_idx`` otherwise.
    """
    if len(token_ids) != len(logprobs):
        raise ValueError(f"{len(token_ids)} tokens but {len(logprobs)} logprobs; a stitched "
                         "sample needs one logprob per generated token")
    ids = data["input_ids"]
    length = int(data["input_lengths"][0])
    total = length + len(token_ids)
    output_ids = torch.empty((1, total), dtype=ids.dtype, device=ids.device)
    output_ids[0, :length] = ids[0, :length]
    output_ids[0, length:] = torch.tensor(list(token_ids), dtype=ids.dtype, device=ids.device)
    lp = torch.zeros((1, total), dtype=torch.float32, device=ids.device)
    lp[0, length:] = torch.tensor(list(logprobs), dtype=torch.float32, device=ids.device)
    out: dict[str, Any] = {
        "output_ids": output_ids,
        "logprobs": lp,
        "generation_lengths": torch.tensor([len(token_ids)], dtype=torch.long,
                                           device=ids.device),
        "unpadded_sequence_lengths": torch.tensor([total], dtype=torch.long,
                                                  device=ids.device),
        "truncated": torch.tensor([truncated], dtype=torch.bool, device=ids.device),
    }
    if template is not None:
        for key, value in template.items():
            if key not in out:
                out[key] = value
    if "gen_leader_worker_idx" not in out and leader_worker_idx is not None:
        out["gen_leader_worker_idx"] = [int(leader_worker_idx)]
    return BatchedDataDict(out)


def continuable_prompt(data: Any, method_name: str) -> tuple[int, ...] | None:
    """The unpadded prompt of a NeMo RL single sample that can be continued from partial
    tokens, or None: only token prompts of ``generate_async`` (text prompts and multimodal
    samples, whose prompt is not the token ids alone, restart from the prompt)."""
    if method_name != "generate_async":
        return None
    try:
        ids = data["input_ids"]
        length = int(data["input_lengths"][0])
    except (KeyError, TypeError, IndexError):
        return None
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[0] != 1:
        return None
    if any(str(k).startswith("vllm_") for k in data):
        return None
    return tuple(int(t) for t in ids[0, :length].tolist())


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
        """Run the request's NeMo RL call on this rank; a continuation (``request`` extends
        the prompt with carried tokens) generates the remaining ``max_tokens`` only. A
        preempted run returns its partial tokens as an aborted output."""
        call = request.sampling[CALL_KEY]
        assert isinstance(call, _Call)
        return await call.run(self.dp_rank, request)

    async def abort_requests(self, request_ids: Sequence[str]) -> tuple[str, ...]:
        """Abort those router attempts running on this rank (migration); returns the ids the
        leader worker aborted. Their ``generate`` returns the partial output as aborted."""
        return tuple(await self._caller().call("rlix_abort_requests", list(request_ids)))

    async def request_progress(self, request_ids: Sequence[str]) -> Mapping[str, int]:
        """Tokens generated so far per running attempt id on this rank (best effort)."""
        return dict(await self._caller().call("rlix_request_progress", list(request_ids)))

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


#: Environment variable selecting how a preempted NeMo RL request is re-dispatched.
ENV_REDISPATCH = "RLIX_NEMO_RL_REDISPATCH"


def redispatch_mode(env: Mapping[str, str] | None = None) -> RedispatchMode:
    """``RLIX_NEMO_RL_REDISPATCH`` (``continue``, the default, or ``restart``) as a mode.

    Raises:
        SettingsError: any other value (the valid ones are named).
    """
    raw = (os.environ if env is None else env).get(ENV_REDISPATCH, "").strip().lower()
    if not raw:
        return RedispatchMode.CONTINUE
    try:
        return RedispatchMode(raw)
    except ValueError:
        raise SettingsError(
            f"{ENV_REDISPATCH}={raw!r} is not valid; expected one of "
            f"{[m.value for m in RedispatchMode]}"
        ) from None


def default_router_config(
    redispatch: RedispatchMode | str | None = None, env: Mapping[str, str] | None = None
) -> RouterConfig:
    """The router NeMo RL's generation uses under the coordinator.

    CONTINUE by default (``redispatch`` or ``RLIX_NEMO_RL_REDISPATCH`` may select RESTART): a
    preempted request continues from the tokens its aborted run produced, and the caller gets
    one stitched sample whose every token carries the logprob of the weights that produced
    it. With CONTINUE, migration is on (router defaults): it moves running requests to a
    newly activated shard the same way. RESTART turns migration off (a migrated request is
    always continued), so with RESTART every sample comes from one engine run.

    A request waits for an active shard as long as the coordinator lets a generation request
    wait for its GPUs (``RLIX_REQUEST_TIMEOUT_S``): when every shard overlaps the training
    GPUs, none is active for a whole training step.
    """
    mode = redispatch_mode(env) if redispatch is None else RedispatchMode(redispatch)
    wait = load_settings(env).request_timeout_s
    if mode is RedispatchMode.RESTART:
        return RouterConfig(redispatch=mode, wait_timeout_s=wait,
                            migration=MigrationConfig(enabled=False))
    return RouterConfig(redispatch=mode, wait_timeout_s=wait, migration=MigrationConfig())


class RLixVllmGeneration(VllmGeneration):  # type: ignore[misc]
    """``VllmGeneration`` routed by the shard router once :meth:`rlix_attach` was called.

    Without a router attached it is NeMo RL's class unchanged. The pipeline adapter attaches
    it when the job runs under the coordinator (see :mod:`rlix_plugins.adapters.nemo_rl`).
    """

    _rlix_router: ShardRouter | None = None
    _rlix_on_init: Callable[[RLixVllmGeneration], None] | None = None
    #: Called with (router result, the sample's runs) after each routed sample (observation,
    #: tests); must pickle when set, since the collector gets a pickled copy of this object.
    rlix_sample_observer: Callable[[GenerationResult, tuple[Segment, ...]], None] | None = None

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
        infer_gpus: Sequence[int] | None = None,
        infer_tp: int = 1,
    ) -> ShardRouter:
        """Route from now on over ``state`` (one owner per pipeline); returns the router.

        With ``RLIX_OBSERVE_DIR`` set the router records its counters for ``pipeline_id``
        (default: ``PIPELINE_ID`` of this process, exported by the pipeline adapter) and, given
        the inference cluster's ``infer_gpus`` and ``infer_tp``, each shard's busy intervals
        (:class:`~rlix_plugins.adapters.observability.BusyRecordingEngine`).
        """
        engines = shards if shards is not None else self.rlix_shards()
        engines = recording_engines(engines, pipeline_id, infer_gpus, infer_tp)
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

        def run_on_shard(rank: int, sample: Any) -> AsyncIterator[tuple[int, Any]]:
            return VllmGeneration._generate_on_shard(  # type: ignore[no-any-return]
                self,
                data=sample,
                method_name=method_name,
                greedy=greedy,
                dp_shard_idx=rank,
                leader_worker_idx=self.worker_group.get_dp_leader_worker_idx(rank),
            )

        prompt = continuable_prompt(data, method_name)
        budget = self._rlix_token_budget(len(prompt)) if prompt is not None else None
        if budget is None or budget < 1:
            prompt = None
        call = _Call(run_on_shard, data, prompt)
        request = GenerationRequest(uuid.uuid4().hex, prompt or (),
                                    budget if prompt is not None and budget else 1,
                                    {CALL_KEY: call})
        result = await router.generate(request)
        if result.attempts > 1:
            logger.debug("request re-dispatched %d time(s), served by shard %d; segments %s",
                         result.attempts - 1, result.dp_rank, call.segments)
        observer = self.rlix_sample_observer
        if observer is not None:
            observer(result, tuple(call.segments))
        yield self._rlix_result(call, result, data)

    def _rlix_token_budget(self, prompt_len: int) -> int | None:
        """Tokens NeMo RL's worker lets a sample generate (``generate_async``:
        ``min(max_new_tokens, max_model_len - input_length)``), or None if the config does
        not say (then the request is not continued: restarted from its prompt)."""
        try:
            max_new = int(self.cfg["max_new_tokens"])
            max_len = int(self.cfg["vllm_cfg"]["max_model_len"])
        except (KeyError, TypeError, ValueError):
            logger.warning("generation config lacks max_new_tokens / vllm_cfg.max_model_len; "
                           "preempted requests restart from the prompt")
            return None
        return max(0, min(max_new, max_len - prompt_len))

    def _rlix_result(self, call: _Call, result: GenerationResult, data: Any) -> tuple[int, Any]:
        """The caller's NeMo RL result: the winning run's unchanged when it generated the
        whole sample, else the runs stitched into one (:func:`stitch_result`)."""
        single = (len(call.segments) == 1 and not call.segments[0].aborted
                  and call.result is not None)
        if single or call.prompt is None:
            assert call.result is not None
            return call.result
        if result.logprobs is None or len(result.logprobs) != len(result.token_ids):
            raise RuntimeError(
                f"continued sample has {len(result.token_ids)} tokens but "
                f"{0 if result.logprobs is None else len(result.logprobs)} logprobs")
        last_done = call.segments[-1] if call.segments else None
        template = None
        if call.result is not None and last_done is not None and not last_done.aborted:
            template = call.result[1]
        batch = stitch_result(
            data, result.token_ids, result.logprobs,
            truncated=result.finish_reason == "length",
            template=None if template is None else {
                k: v for k, v in template.items() if k not in STITCHED_KEYS},
            leader_worker_idx=self.worker_group.get_dp_leader_worker_idx(result.dp_rank),
        )
        index = call.result[0] if call.result is not None else 0
        return index, batch

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
