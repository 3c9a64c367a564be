"""Host-agnostic request/result types and the :class:`ShardEngine` protocol the router drives.

A shard engine is one inference data-parallel rank. The router and the preemption controller
only see this protocol, so the same code drives an in-process vLLM ``AsyncLLM``
(:class:`~.vllm_engine.VllmAsyncShard`), a NeMo RL worker reached through its worker group, or
a veRL vLLM server handle; the host adapter supplies the implementation.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from rlix_plugins.errors import ProtocolError
from rlix_plugins.values import as_index, is_int

#: ``finish_reason`` of a stream that ended because its request was aborted (vLLM's value).
ABORTED = "abort"


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One generation request in token space.

    Attributes:
        request_id: caller's id (a non-empty string); must be unique among requests in flight
            on this router.
        prompt_token_ids: the prompt: any iterable of non-negative ints (a list, a tuple,
            numpy ints), stored as a tuple of ``int``. May be empty (a host whose request
            carries its prompt elsewhere, e.g. NeMo RL's non-token prompts).
        max_tokens: tokens to generate at most (>= 1).
        sampling: further sampling options, passed to the engine as keyword arguments (for
            vLLM: ``SamplingParams`` fields such as ``temperature``, ``seed``, ``ignore_eos``,
            ``logprobs``). ``max_tokens`` and ``output_kind`` are set by the engine wrapper.

    Raises:
        ProtocolError: a field is outside the domain above (the message names it).
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    sampling: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ProtocolError(
                f"GenerationRequest.request_id must be a non-empty str, got {self.request_id!r}"
            )
        # Stored as a tuple: the router continues a request by appending partial tokens
        # (tuple + tuple); a list here used to fail that and lose the request.
        object.__setattr__(self, "prompt_token_ids",
                           _token_ids(self.request_id, self.prompt_token_ids))
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise ProtocolError(
                f"GenerationRequest.max_tokens of {self.request_id} must be an int >= 1, got "
                f"{self.max_tokens!r}"
            )
        if not isinstance(self.sampling, Mapping):
            raise ProtocolError(
                f"GenerationRequest.sampling of {self.request_id} must be a mapping of "
                f"sampling options, got {type(self.sampling).__name__}"
            )


def _token_ids(request_id: str, tokens: Iterable[Any]) -> tuple[int, ...]:
    """``tokens`` as a tuple of non-negative ints, or :class:`ProtocolError` naming the field."""
    if isinstance(tokens, tuple) and all(type(t) is int and t >= 0 for t in tokens):
        return tokens  # the common case: already canonical, no copy
    where = f"GenerationRequest.prompt_token_ids of {request_id}"
    if isinstance(tokens, (str, bytes)) or not isinstance(tokens, Iterable):
        raise ProtocolError(
            f"{where} must be a sequence of token ids (non-negative ints), got "
            f"{type(tokens).__name__}"
        )
    out: list[int] = []
    for i, t in enumerate(tokens):
        tok = as_index(t)
        if tok is None or tok < 0:
            raise ProtocolError(
                f"{where} must hold non-negative int token ids; item {i} is {t!r}"
            )
        out.append(tok)
    return tuple(out)


@dataclass(frozen=True, slots=True)
class EngineOutput:
    """Final output of one attempt on one engine.

    ``finish_reason == "abort"`` means the attempt was cut short (its shard is being
    preempted); ``token_ids`` then holds the partial tokens and it is NOT a sample.
    ``logprobs`` holds the sampled tokens' logprobs when they were requested: exactly one per
    token, else :class:`~rlix_plugins.errors.ProtocolError` (the router concatenates the
    outputs of successive attempts, so a short list would shift every later logprob against
    its token without any error).
    """

    token_ids: tuple[int, ...]
    finish_reason: str
    logprobs: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        # Tuples whatever an engine hands back: the router concatenates partial outputs of
        # successive attempts (tuple + list would raise and lose the request).
        object.__setattr__(self, "token_ids", tuple(self.token_ids))
        if self.logprobs is not None:
            logprobs = tuple(self.logprobs)
            if len(logprobs) != len(self.token_ids):
                raise ProtocolError(
                    f"EngineOutput has {len(logprobs)} logprobs for {len(self.token_ids)} "
                    f"token(s) (finish_reason {self.finish_reason!r}); an engine must return "
                    "one logprob per generated token, or None"
                )
            object.__setattr__(self, "logprobs", logprobs)

    @property
    def aborted(self) -> bool:
        return self.finish_reason == ABORTED


@dataclass(frozen=True, slots=True)
class GenerationResult:
    """A complete sample returned by the router (never an aborted or truncated one).

    Attributes:
        request_id: the caller's request id.
        token_ids: all generated tokens (partial tokens of earlier attempts included when the
            router continued a preempted request).
        finish_reason: the engine's reason (``"length"``, ``"stop"``), never ``"abort"``.
        logprobs: sampled tokens' logprobs, aligned with ``token_ids``, when requested.
        dp_rank: the shard that produced the final tokens.
        attempts: dispatches it took (1 = never preempted).
    """

    request_id: str
    token_ids: tuple[int, ...]
    finish_reason: str
    logprobs: tuple[float, ...] | None
    dp_rank: int
    attempts: int


@runtime_checkable
class ShardEngine(Protocol):
    """Engine side of one generation shard, as the router and preemption controller use it.

    Contract:
      * ``generate`` returns the final output of one request; a request aborted by
        :meth:`abort_all` returns ``finish_reason == "abort"`` (or raises
        :class:`~rlix_plugins.errors.ShardPreemptedError`). While the gate is closed (after
        ``abort_all``, until ``resume``) ``generate`` must reject new requests at once
        (``ShardPreemptedError``) so a router holding a stale active set cannot queue work on a
        shard that is going to sleep.
      * ``abort_all`` closes the gate and aborts every request running on the engine, whether
        or not it came through this wrapper; it returns how many it aborted. Idempotent.
      * ``num_running`` is the engine's count of unfinished requests (0 = idle).
      * ``sleep(level)`` / ``wake_up()`` as vLLM's (``level=None``: the engine's configured
        level); ``resume`` reopens the gate.
    """

    async def generate(self, request: GenerationRequest) -> EngineOutput: ...

    async def abort_all(self) -> int: ...

    async def num_running(self) -> int: ...

    async def sleep(self, level: int | None = None) -> None: ...

    async def wake_up(self) -> None: ...

    async def resume(self) -> None: ...


@runtime_checkable
class RequestAbortable(Protocol):
    """Optional engine capability: abort SOME requests, leaving the shard open.

    The router uses it to migrate running requests to a newly activated shard. Engines
    without it still work; their requests are simply never migrated.

    Contract: ``abort_requests(ids)`` aborts those of ``ids`` that are running or queued on
    the engine and returns exactly those ids (unknown, finished or not yet registered ids are
    ignored and not returned). The dispatch gate stays open. Each aborted attempt's
    ``generate`` call returns its partial output as an aborted :class:`EngineOutput` (as for
    ``abort_all``), so the caller can continue it elsewhere from the partial tokens.
    """

    async def abort_requests(self, request_ids: Sequence[str]) -> tuple[str, ...]: ...


@runtime_checkable
class ProgressReporting(Protocol):
    """Optional engine capability: tokens generated so far by running requests.

    ``request_progress(ids)`` maps each id the engine knows to the number of tokens it has
    generated so far; unknown ids are left out. Best effort (a snapshot, may lag by one
    step). The migration policy uses it to skip requests that are nearly finished.
    """

    async def request_progress(self, request_ids: Sequence[str]) -> Mapping[str, int]: ...
