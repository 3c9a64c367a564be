"""What the NeMo RL router side and the vLLM worker side agree on for continued requests.

Imported by both the driver/collector (:mod:`~rlix_plugins.adapters.nemo_rl_generation`) and the
vLLM worker venv (:mod:`~rlix_plugins.adapters.nemo_rl_workers`), so it imports nothing heavy.

* A preempted (or migrated) request's partial output travels back from the worker on the
  :class:`~rlix_plugins.errors.ShardPreemptedError` the worker raises, as the plain-data
  attribute :data:`PARTIAL_ATTR` (``{"token_ids": [...], "logprobs": [...]}``). Plain data in
  the exception's ``__dict__`` survives pickling (``BaseException.__reduce__`` carries it), so
  Ray's ``RayTaskError`` and NeMo RL's ``GenerationUnavailable`` wrapping keep it.
* A continuation's remaining token budget and the router's attempt id travel to the worker as
  extra keys of NeMo RL's single-sample ``BatchedDataDict`` (:data:`MAX_NEW_TOKENS_KEY`,
  :data:`ATTEMPT_ID_KEY`); the worker pops them before NeMo RL's ``generate_async`` sees the
  data.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

#: Attribute of a ShardPreemptedError carrying the aborted run's partial output (plain data).
PARTIAL_ATTR = "rlix_partial"
#: Data key: the continuation's remaining token budget (a one-element list of int).
MAX_NEW_TOKENS_KEY = "_rlix_max_new_tokens"
#: Data key: the router's attempt id (a one-element list of str), for per-request abort.
ATTEMPT_ID_KEY = "_rlix_attempt_id"
#: Every key the router side may add to NeMo RL's data.
RLIX_DATA_KEYS = (MAX_NEW_TOKENS_KEY, ATTEMPT_ID_KEY)


@dataclass(frozen=True, slots=True)
class PartialOutput:
    """Tokens an aborted engine run produced, with the logprob of each (NeMo RL's rule: the
    sampled token's logprob, 0.0 where vLLM returned none)."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(
                f"partial output has {len(self.token_ids)} tokens but {len(self.logprobs)} "
                "logprobs; they must be aligned one to one"
            )


def attach_partial(exc: BaseException, partial: PartialOutput) -> BaseException:
    """Put ``partial`` on ``exc`` as plain data (pickle- and Ray-safe); returns ``exc``."""
    setattr(exc, PARTIAL_ATTR,
            {"token_ids": list(partial.token_ids), "logprobs": list(partial.logprobs)})
    return exc


def partial_from(exc: BaseException) -> PartialOutput | None:
    """The partial output carried by ``exc`` or anything in its cause chain (Ray's
    ``RayTaskError.cause``, ``__cause__``, ``__context__``), or None."""
    seen: set[int] = set()
    stack: list[Any] = [exc]
    while stack:
        cur = stack.pop()
        if cur is None or id(cur) in seen:
            continue
        seen.add(id(cur))
        raw = getattr(cur, "__dict__", {}).get(PARTIAL_ATTR)
        if isinstance(raw, dict):
            return PartialOutput(tuple(int(t) for t in raw["token_ids"]),
                                 tuple(float(x) for x in raw["logprobs"]))
        stack.extend([getattr(cur, "__cause__", None), getattr(cur, "__context__", None),
                      getattr(cur, "cause", None)])
    return None


def sampled_logprobs(token_ids: Sequence[int], logprobs: Any) -> tuple[float, ...]:
    """Per-token logprob of each sampled token from vLLM's ``CompletionOutput.logprobs``,
    exactly as NeMo RL's ``generate_async`` fills its ``logprobs`` tensor (0.0 where a step
    has no entry for its token, or where no logprobs were returned at all)."""
    out: list[float] = []
    steps = logprobs if logprobs else ()
    for idx, tok in enumerate(token_ids):
        value = 0.0
        if idx < len(steps):
            step = steps[idx]
            if step and tok in step:
                value = float(step[tok].logprob)
        out.append(value)
    return tuple(out)
