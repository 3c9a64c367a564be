"""The streaming receiver feeding vLLM 0.32's OWN layerwise reload (the code path of
``reload_weights``), with a fused q/k/v parameter whose parts land in different buckets.

vLLM keeps the tensors of a layer until the layer is complete. Over a transport that reuses one
buffer for every bucket (gloo here; NCCL and CUDA IPC alike) the receiver used to yield views
of that buffer, so the q part was read after the next bucket had overwritten it, while the sync
succeeded and the version was recorded. Only the engine is missing: the model is a toy module
with vLLM's ``weight_loader`` convention, reloaded by vLLM's own layerwise functions.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from rlix_plugins.training.bucket_cache import BucketCache, CacheConfig, StorageKind
from rlix_plugins.training.receiver import ReceiveResult, receive_weights_streaming
from rlix_plugins.training.sync import SyncOptions, sync_version
from rlix_plugins.training.transports.selection import ReceiverLocation
from rlix_plugins.training.wire import SyncOffer, TransportKind

pytestmark = pytest.mark.vllm

#: rows of the fused parameter each checkpoint tensor fills (as QKVParallelLinear's shards)
ROWS = {"q": (0, 4), "k": (4, 5), "v": (5, 6)}


class FusedQkv(nn.Module):
    """A toy layer with one fused parameter loaded shard by shard (vLLM's convention)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(6, 4), requires_grad=False)
        self.weight.weight_loader = self._load  # type: ignore[attr-defined]

    @staticmethod
    def _load(param: torch.Tensor, loaded: torch.Tensor, shard: str) -> None:
        first, end = ROWS[shard]
        param.data[first:end].copy_(loaded)


class ToyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = FusedQkv()

    def load_weights(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in weights:
            param = self.qkv.weight
            param.weight_loader(param, tensor, name)  # type: ignore[attr-defined]


class LayerwiseReceiver:
    """A receiver whose loader is vLLM's layerwise reload of ``model``."""

    shard_id = "s0"
    location = ReceiverLocation()

    def __init__(self, model: ToyModel) -> None:
        from vllm.model_executor.model_loader.reload import layerwise

        self._layerwise = layerwise
        self.model = model
        layerwise.record_metadata_for_reloading(model)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)

    def _reload(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        self._layerwise.initialize_layerwise_reload(self.model)
        self.model.load_weights(weights)
        self._layerwise.finalize_layerwise_reload(self.model, None)

    def begin_receive(self, offer: SyncOffer) -> Future[ReceiveResult]:
        return self._pool.submit(receive_weights_streaming, offer, self._reload)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


@pytest.mark.parametrize("transport", [TransportKind.GLOO, TransportKind.ZMQ, TransportKind.SHM])
def test_a_fused_layer_spanning_two_buckets_gets_the_trainers_bytes(
    transport: TransportKind, tmp_path: Path
) -> None:
    weights: dict[str, Any] = {
        "q": torch.arange(16.0).reshape(4, 4),
        "k": torch.full((1, 4), 7.0),
        "v": torch.full((1, 4), 9.0),
    }
    storage = StorageKind.SHARED if transport is TransportKind.SHM else StorageKind.PAGEABLE
    cache = BucketCache("layerwise", CacheConfig(bucket_bytes=128, storage=storage,
                                                 ram_reserve_bytes=0, shm_dir=tmp_path))
    receiver = LayerwiseReceiver(ToyModel())
    try:
        cache.build(1, weights.items())
        assert cache.info(1).num_buckets >= 2  # q in one bucket, k and v in the next
        report = sync_version(cache, 1, [receiver], options=SyncOptions(
            ack_timeout_s=30, transports={"s0": transport}))
    finally:
        receiver.close()
        cache.close()
    assert report.succeeded == ("s0",)
    expected = torch.cat([weights["q"], weights["k"], weights["v"]])
    assert torch.equal(receiver.model.qkv.weight, expected), receiver.model.qkv.weight[:, 0]
