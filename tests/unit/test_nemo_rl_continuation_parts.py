"""Pure parts of NeMo RL request continuation: the partial output on the worker's error, and
its extraction from vLLM's logprobs the way NeMo RL fills its tensor (no NeMo RL import)."""

from __future__ import annotations

import pickle
from types import SimpleNamespace

import pytest

from rlix_plugins.adapters.nemo_rl_partial import (
    PartialOutput,
    attach_partial,
    partial_from,
    sampled_logprobs,
)
from rlix_plugins.errors import ShardPreemptedError

pytestmark = pytest.mark.nemo_rl


def test_partial_survives_pickling_and_wrapping() -> None:
    err = attach_partial(ShardPreemptedError("aborted"), PartialOutput((4, 5), (-0.1, -2.0)))
    back = pickle.loads(pickle.dumps(err))  # what Ray does to a worker's exception
    assert isinstance(back, ShardPreemptedError)
    try:
        try:
            raise back
        except ShardPreemptedError as inner:
            raise RuntimeError("generation shard 1 is unavailable") from inner
    except RuntimeError as outer:
        assert partial_from(outer) == PartialOutput((4, 5), (-0.1, -2.0))
    # Ray's RayTaskError keeps the original as ``.cause``.
    assert partial_from(SimpleNamespace(cause=back)) == PartialOutput((4, 5), (-0.1, -2.0))  # type: ignore[arg-type]
    assert partial_from(ShardPreemptedError("gate closed")) is None


def test_partial_requires_one_logprob_per_token() -> None:
    with pytest.raises(ValueError, match="aligned one to one"):
        PartialOutput((1, 2, 3), (-0.5,))


def test_sampled_logprobs_as_nemo_rl_fills_them() -> None:
    lp = SimpleNamespace
    steps = [{7: lp(logprob=-0.25)}, {9: lp(logprob=-1.0), 8: lp(logprob=-3.0)}, {}]
    # Third step has no entry for its token, fourth none at all: 0.0, as NeMo RL's tensor.
    assert sampled_logprobs([7, 8, 5, 6], steps) == (-0.25, -3.0, 0.0, 0.0)
    assert sampled_logprobs([1, 2], None) == (0.0, 0.0)
