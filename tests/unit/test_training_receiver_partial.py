"""A receiver whose loader stops before the end of the stream must not report the version.

The sender, the cache, the control channel and the receiver extension are real; only vLLM is
replaced: the engine and its model runner are FAKES (vLLM cannot run in a unit test), the
runner's ``reload_weights`` being the loader under test.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from rlix_plugins.training.bucket_cache import BucketCache, CacheConfig, StorageKind
from rlix_plugins.training.sync import SyncOptions, sync_version
from rlix_plugins.training.vllm_receiver import RlixWeightReceiverExtension, VllmEngineReceiver
from rlix_plugins.training.wire import TransportKind

Loader = Callable[[Iterator[tuple[str, torch.Tensor]]], dict[str, torch.Tensor]]
WEIGHTS = {f"w{i}": torch.full((8000,), float(i)) for i in range(3)}  # 32 KB each


class FakeModelRunner:
    """FAKE vLLM model runner: ``reload_weights`` hands the iterator to ``loader``."""

    def __init__(self, loader: Loader) -> None:
        self.loader = loader
        self.loaded: dict[str, torch.Tensor] = {}

    def reload_weights(
        self, *, weights_iterator: Iterator[tuple[str, torch.Tensor]], is_checkpoint_format: bool
    ) -> None:
        assert is_checkpoint_format
        self.loaded = self.loader(weights_iterator)


class Worker(RlixWeightReceiverExtension):
    """The real extension mixed into a FAKE worker (vLLM does this mixing at engine start)."""

    def __init__(self, runner: FakeModelRunner) -> None:
        self.model_runner = runner


class FakeEngine:
    """FAKE ``vllm.LLM``: ``collective_rpc`` calls the single worker in this process."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker

    def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        return [getattr(self.worker, method)(*args)]


def _sync(
    loader: Loader, transport: TransportKind | None = None
) -> tuple[Any, FakeModelRunner, VllmEngineReceiver]:
    # 64 KiB buckets: two tensors in the first bucket, one in the second
    # shm maps the cache's own pages: it needs them in shared memory
    storage = StorageKind.SHARED if transport is TransportKind.SHM else StorageKind.PAGEABLE
    cache = BucketCache(
        "p", CacheConfig(bucket_bytes=1 << 16, storage=storage, ram_reserve_bytes=0)
    )
    cache.build(7, iter(WEIGHTS.items()))
    runner = FakeModelRunner(loader)
    receiver = VllmEngineReceiver("s0", FakeEngine(Worker(runner)))
    try:
        transports = {"s0": transport} if transport is not None else {}
        report = sync_version(cache, 7, [receiver], options=SyncOptions(
            ack_timeout_s=10, raise_on_error=False, transports=transports))
    finally:
        receiver.close()
        cache.close()
    return report, runner, receiver


def _take(n: int) -> Loader:
    def load(it: Iterator[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return {name: t.clone() for name, t in itertools.islice(it, n)}

    return load


def test_a_loader_that_stops_early_fails_the_sync_and_records_no_version() -> None:
    report, runner, receiver = _sync(_take(1))
    (outcome,) = report.outcomes
    assert not outcome.ok and outcome.error is not None
    assert "stopped after 0 of 2 buckets of weight version 7" in outcome.error
    assert list(runner.loaded) == ["w0"]  # only part of the version was applied ...
    assert receiver.weight_version() is None  # ... so it is not recorded as applied


def test_a_loader_that_takes_every_tensor_but_not_the_end_records_the_version() -> None:
    # islice(it, 3) never asks past the last tensor: the receiver finishes the stream itself
    report, runner, receiver = _sync(_take(len(WEIGHTS)))
    assert report.succeeded == ("s0",), report.outcomes
    assert receiver.weight_version() == 7
    assert {n: t.tolist() for n, t in runner.loaded.items()} == {
        n: t.tolist() for n, t in WEIGHTS.items()
    }


def _keep_views(it: Iterator[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """As vLLM 0.32's layerwise reload does: keep the tensors as given (no copy) until the
    whole stream is read, then load them."""
    kept = dict(it)
    return {name: t.clone() for name, t in kept.items()}


@pytest.mark.parametrize("transport", [TransportKind.GLOO, TransportKind.ZMQ, TransportKind.SHM])
def test_a_loader_that_keeps_tensors_past_their_bucket_loads_the_right_bytes(
    transport: TransportKind,
) -> None:
    # Over gloo (and NCCL / CUDA IPC: one buffer for every bucket) the receiver yielded views
    # of its receive buffer; a loader keeping them (vLLM keeps a layer's tensors until the
    # layer is complete, and a layer can span two buckets) read the next bucket's bytes,
    # while the sync succeeded and version 7 was recorded.
    report, runner, receiver = _sync(_keep_views, transport)
    assert report.succeeded == ("s0",), report.outcomes
    assert receiver.weight_version() == 7
    assert {n: t.tolist() for n, t in runner.loaded.items()} == {
        n: t.tolist() for n, t in WEIGHTS.items()
    }
