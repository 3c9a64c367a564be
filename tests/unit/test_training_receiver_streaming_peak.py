"""The streaming receiver holds one bucket at a time for a loader that copies as it goes.

The cache, the sender, the ZMQ transport and the receiver are real; only vLLM is replaced:
the engine and its model runner are FAKES from test_training_receiver_partial (vLLM cannot run
in a unit test). A spy on the receiver transport's ``fetch`` (the real transport underneath)
records, when each bucket arrives, which earlier buckets are still alive: it hands the receiver
the bucket's bytes in an array of its own, whose lifetime is the bucket's (a tensor's own
Python object is no such signal: torch drops it while views of its storage live on).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from rlix_plugins.training import receiver as receiver_mod
from rlix_plugins.training.transports import base as transports_base
from rlix_plugins.training.transports.base import ReceiverTransport
from rlix_plugins.training.wire import SyncOffer, TransportKind
from tests.unit.test_training_receiver_partial import WEIGHTS, _sync


def _copy_as_you_go(it: Iterator[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """A loader that copies each tensor and drops the one it was given right away."""
    out: dict[str, torch.Tensor] = {}
    for name, t in it:
        out[name] = t.clone()
        del t
    return out


def test_a_bucket_is_released_before_the_next_one_arrives(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The generator yielding the tensors kept its last view of bucket k in a local while
    # bucket k+1 was fetched: the whole of bucket k stayed alive, two buckets at the peak
    # for a loader that copies as it goes (the docstring promises one).
    alive_at_fetch: list[int] = []
    fetched: list[weakref.ref[np.ndarray]] = []
    real_open = transports_base.open_receiver_transport

    def spy_open(offer: SyncOffer) -> ReceiverTransport:
        transport = real_open(offer)
        real_fetch = transport.fetch

        def fetch(header: Any, frames: list[Any]) -> torch.Tensor:
            alive_at_fetch.append(sum(ref() is not None for ref in fetched))
            own = real_fetch(header, frames).numpy().copy()
            fetched.append(weakref.ref(own))
            return torch.from_numpy(own)

        monkeypatch.setattr(transport, "fetch", fetch)
        return transport

    monkeypatch.setattr(receiver_mod, "open_receiver_transport", spy_open)
    report, runner, receiver = _sync(_copy_as_you_go, TransportKind.ZMQ)
    assert report.succeeded == ("s0",), report.outcomes
    assert receiver.weight_version() == 7
    assert {n: t.tolist() for n, t in runner.loaded.items()} == {
        n: t.tolist() for n, t in WEIGHTS.items()}
    assert alive_at_fetch == [0, 0], "an earlier bucket was still held when the next arrived"
