"""Engine-side preemption pieces for vLLM's ``vllm.v1.engine.async_llm.AsyncLLM``.

:class:`VllmAsyncShard` wraps one in-process ``AsyncLLM`` and implements
:class:`~.engine.ShardEngine`: a dispatch gate, abort-all, running-request count and sleep at a
configured level. vLLM is imported lazily (only when a request is built), so this module
imports without vLLM.

Why a gate: a router copy may still hold an active set from before a preempt. The gate is
closed in the engine's own process, in the same synchronous step that collects the ids to
abort, so any request arriving later is rejected at once and re-dispatched, instead of
queueing on an engine that is about to sleep (a request added to a sleeping vLLM engine waits
until wake-up, i.e. hangs).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

from rlix_plugins.errors import ProtocolError, SettingsError, ShardPreemptedError
from rlix_plugins.generation.engine import ABORTED, EngineOutput, GenerationRequest
from rlix_plugins.values import is_int

logger = logging.getLogger(__name__)

#: vLLM sleep level used when none is configured: level 2 drops weights and KV cache (the
#: weights are re-sent by the selective sync after wake-up anyway).
DEFAULT_SLEEP_LEVEL = 2

#: ``SamplingParams`` fields the wrapper sets itself (a request may not set them too).
_WRAPPER_SET = frozenset({"max_tokens", "output_kind"})
#: sampling options that ask for more than one sample per request (must be 1 or absent)
_ONE_SAMPLE = ("n", "best_of")


class VllmAsyncShard:
    """:class:`~.engine.ShardEngine` over an in-process vLLM ``AsyncLLM``.

    Args:
        engine: a ``vllm.v1.engine.async_llm.AsyncLLM`` (any object with its async
            ``generate/abort/sleep/wake_up`` and ``get_num_unfinished_requests``).
        sleep_level: level passed to ``engine.sleep`` when the caller gives none (0, 1 or 2).
        name: label for logs.

    All methods must run on the event loop the engine's output handler runs on.
    """

    def __init__(
        self, engine: Any, *, sleep_level: int = DEFAULT_SLEEP_LEVEL, name: str = "shard"
    ) -> None:
        if not (is_int(sleep_level) and sleep_level in (0, 1, 2)):
            raise SettingsError(f"sleep_level must be 0, 1 or 2, got {sleep_level!r}")
        self._engine = engine
        self._sleep_level = sleep_level
        self._name = name
        self._accepting = True
        self._tracked: set[str] = set()
        # Ids already aborted since the gate closed (abort_all is called repeatedly).
        self._abort_seen: set[str] = set()
        self._aborted_total = 0
        self._submitted_total = 0
        self._completed_total = 0
        self._rejected_total = 0
        self._request_aborts_total = 0
        # Sleeps so far: an attempt that lived across one is never a sample (see generate).
        self._sleeps = 0
        self._sampling_cls: Any = None
        self._prompt_cls: Any = None
        self._final_only: Any = None

    @property
    def engine(self) -> Any:
        """The wrapped ``AsyncLLM``."""
        return self._engine

    @property
    def accepting(self) -> bool:
        """True while the dispatch gate is open."""
        return self._accepting

    @property
    def sleep_level(self) -> int:
        return self._sleep_level

    @property
    def aborted_total(self) -> int:
        """Requests aborted by :meth:`abort_all` over this wrapper's life."""
        return self._aborted_total

    @property
    def submitted_total(self) -> int:
        """Requests that passed the gate and were submitted to the engine."""
        return self._submitted_total

    @property
    def completed_total(self) -> int:
        """Requests that finished normally (not aborted) on this engine."""
        return self._completed_total

    @property
    def request_aborts_total(self) -> int:
        """Requests aborted one by one by :meth:`abort_requests` (migrations), gate open."""
        return self._request_aborts_total

    @property
    def rejected_total(self) -> int:
        """Requests refused at the closed gate."""
        return self._rejected_total

    def _vllm_types(self) -> tuple[Any, Any, Any]:
        if self._sampling_cls is None:
            from vllm import SamplingParams
            from vllm.inputs import TokensPrompt
            from vllm.sampling_params import RequestOutputKind

            self._sampling_cls = SamplingParams
            self._prompt_cls = TokensPrompt
            self._final_only = RequestOutputKind.FINAL_ONLY
        return self._sampling_cls, self._prompt_cls, self._final_only

    def _rejected(self, request_id: str) -> NoReturn:
        self._rejected_total += 1
        raise ShardPreemptedError(
            f"shard {self._name} is preempted (dispatch gate closed); request {request_id} "
            "must be re-dispatched to an active shard"
        )

    async def generate(self, request: GenerationRequest) -> EngineOutput:
        """Run ``request`` to completion; an aborted request returns ``finish_reason="abort"``.

        Raises:
            ProtocolError: ``request.sampling`` sets what this wrapper sets
                (``max_tokens``: the request's own field; ``output_kind``).
            ShardPreemptedError: the gate is closed (the shard is being preempted).
        """
        clash = sorted(_WRAPPER_SET.intersection(request.sampling))
        if clash:
            raise ProtocolError(
                f"request {request.request_id}: sampling option(s) {clash} are set by the "
                "engine wrapper (max_tokens comes from GenerationRequest.max_tokens); remove "
                "them from GenerationRequest.sampling"
            )
        several = {k: request.sampling[k] for k in _ONE_SAMPLE if request.sampling.get(k, 1) != 1}
        if several:
            # One request id is one sample: the router continues, migrates and accounts a
            # request as one completion, so the others would be dropped without a word.
            raise ProtocolError(
                f"request {request.request_id}: sampling {several} asks for several samples; "
                "one GenerationRequest is one sample (n=1): send k requests for k samples"
            )
        if not self._accepting:
            self._rejected(request.request_id)
        sampling_cls, prompt_cls, final_only = self._vllm_types()
        params = sampling_cls(
            max_tokens=request.max_tokens, output_kind=final_only, **dict(request.sampling)
        )
        rid = request.request_id
        # Tracked before the first await: abort_all (same loop) then always sees it.
        self._tracked.add(rid)
        self._submitted_total += 1
        sleeps = self._sleeps
        final: Any = None
        try:
            prompt = prompt_cls(prompt_token_ids=list(request.prompt_token_ids))
            async for out in self._engine.generate(prompt, params, rid):
                final = out
        except Exception as exc:
            if not self._accepting:
                # The engine failed the request because we are tearing the shard down
                # (abort, sleep): that is preemption, not a generation error.
                raise ShardPreemptedError(
                    f"request {rid} failed on shard {self._name} while it was being "
                    f"preempted: {exc!r}"
                ) from exc
            raise
        finally:
            self._tracked.discard(rid)
        if self._sleeps != sleeps:
            # Only a forced sleep (drain timed out) leaves an attempt open across a sleep:
            # it registered after sleep(mode="abort") and ran after wake_up, before the weight
            # sync (level 2 dropped the weights). Which of its tokens predate the sleep is
            # unknown: none is kept, and it is never returned as a sample.
            logger.warning("shard %s: request %s outlived a sleep of its engine; returned as "
                           "aborted with no tokens", self._name, rid)
            return EngineOutput((), ABORTED)
        if final is None or not final.outputs:
            return EngineOutput((), ABORTED)
        completion = final.outputs[0]
        reason = completion.finish_reason if final.finished else None
        token_ids = tuple(completion.token_ids)
        logprobs: tuple[float, ...] | None = None
        if completion.logprobs is not None:
            if len(completion.logprobs) != len(token_ids):
                raise ProtocolError(
                    f"request {rid} on shard {self._name}: vLLM returned "
                    f"{len(completion.logprobs)} logprob steps for {len(token_ids)} tokens"
                )
            logprobs = tuple(
                step[tok].logprob for step, tok in zip(completion.logprobs, token_ids, strict=True)
            )
        if reason is not None and reason != ABORTED:
            self._completed_total += 1
        return EngineOutput(token_ids, reason or ABORTED, logprobs)

    def _engine_request_ids(self) -> set[str] | None:
        """Request ids registered in the engine (ours and those host code submitted straight
        to it), or None when vLLM's internal map is unavailable (an engine that is not an
        ``AsyncLLM``, or a vLLM whose output processor moved the attribute)."""
        processor = getattr(self._engine, "output_processor", None)
        external = getattr(processor, "external_req_ids", None)
        if external is None:
            return None
        try:
            return set(external)
        except Exception:
            return None

    async def abort_all(self) -> int:
        """Close the gate and abort every request on the engine; returns how many.

        Idempotent; the drain loop calls it again while requests remain, which catches a
        request whose submission was still in flight (not yet registered in the engine, so
        unknown to the first abort) when the gate closed.

        Without the engine's request map only our own requests are aborted (the final
        ``sleep(mode="abort")`` aborts the rest). As registration cannot be seen then, every
        call re-sends the abort for our requests whose streams have not ended (vLLM ignores
        an abort of an unknown or finished id); only first aborts are counted.
        """
        self._accepting = False
        known = self._engine_request_ids()
        if known is None:
            to_abort = sorted(self._tracked)
            new = [i for i in to_abort if i not in self._abort_seen]
            pending = 0
        else:
            ids = sorted((self._tracked | known) - self._abort_seen)
            # An id seen but not yet registered is aborted by a later call, once it registers.
            to_abort = new = [i for i in ids if i in known]
            pending = len(ids) - len(new)
        if to_abort:
            await self._engine.abort(to_abort)
        self._abort_seen.update(new)
        self._aborted_total += len(new)
        if new or pending:
            logger.debug("shard %s: gate closed, aborted %d request(s), %d still submitting",
                         self._name, len(new), pending)
        return len(new)

    async def abort_requests(self, request_ids: Sequence[str]) -> tuple[str, ...]:
        """Abort those of ``request_ids`` submitted through this wrapper and registered in the
        engine; returns them. The gate stays open (the shard keeps serving).

        Each aborted request's :meth:`generate` returns its partial tokens with
        ``finish_reason="abort"``. An id still being submitted (not registered yet) or already
        finished is skipped: it completes normally here, which the caller sees.
        """
        known = self._engine_request_ids()
        if known is None:
            # The contract is to return exactly the ids aborted, and without the map we
            # cannot tell whether an abort reached a request still submitting: migrate none.
            return ()
        ids = tuple(i for i in dict.fromkeys(request_ids) if i in self._tracked and i in known)
        if ids:
            await self._engine.abort(list(ids))
            self._request_aborts_total += len(ids)
            logger.debug("shard %s: aborted %d request(s) for migration", self._name, len(ids))
        return ids

    async def request_progress(self, request_ids: Sequence[str]) -> Mapping[str, int]:
        """Tokens generated so far per id (ids the engine does not know are left out).

        Reads vLLM's output processor (internal): if its layout changed this returns ``{}``
        and the migration policy falls back to each attempt's token budget.
        """
        processor = getattr(self._engine, "output_processor", None)
        try:
            mapping = processor.external_req_ids  # type: ignore[union-attr]
            states = processor.request_states  # type: ignore[union-attr]
            progress: dict[str, int] = {}
            for rid in request_ids:
                # .get: never insert into vLLM's defaultdict.
                counts = [int(states[i].detokenizer.num_output_tokens())
                          for i in mapping.get(rid, ()) if i in states]
                if counts:
                    progress[rid] = max(counts)
            return progress
        except Exception:
            logger.debug("shard %s: request progress unavailable", self._name, exc_info=True)
            return {}

    async def num_running(self) -> int:
        """Unfinished requests: the engine's count plus requests of ours still being
        submitted or still delivering their final output (0 = idle and every stream ended).

        Without the engine's request map ours cannot be split into registered (already in
        the engine's count) and in transit, so this is the larger of the engine's count and
        our open streams: never counting one request twice, never 0 while a stream is open.
        """
        running = int(self._engine.get_num_unfinished_requests())
        known = self._engine_request_ids()
        if known is None:
            return max(running, len(self._tracked))
        return running + len(self._tracked - known)

    async def sleep(self, level: int | None = None) -> None:
        """Sleep at ``level`` (default: the configured level); in-flight requests are aborted.

        Raises:
            SettingsError: ``level`` is not None, 0, 1 or 2 (the engine is not touched).
        """
        # Checked as the constructor checks sleep_level: vLLM passes any level on to its
        # workers (``AsyncLLM.rlix_sleep(3)`` reached them).
        if level is not None and not (is_int(level) and level in (0, 1, 2)):
            raise SettingsError(f"sleep level must be None, 0, 1 or 2, got {level!r}")
        lvl = self._sleep_level if level is None else level
        self._sleeps += 1
        # mode="abort": anything that slipped in after abort_all is aborted, never kept.
        await self._engine.sleep(level=lvl, mode="abort")

    async def wake_up(self) -> None:
        """Wake the engine; the gate stays closed until :meth:`resume` (weights not synced)."""
        await self._engine.wake_up()

    async def resume(self) -> None:
        """Reopen the dispatch gate (call once the shard's weights are current)."""
        self._abort_seen.clear()
        self._accepting = True

    async def is_sleeping(self) -> bool:
        return bool(await self._engine.is_sleeping())

    def __reduce__(self) -> NoReturn:
        raise TypeError(
            "VllmAsyncShard wraps an in-process AsyncLLM and cannot be pickled; routers in "
            "other processes need a ShardEngine that calls the engine's process remotely"
        )
