"""Forced transports may be given as strings; an unknown one is a clear typed error."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from rlix_plugins.errors import TransportUnavailableError
from rlix_plugins.training.bucket_cache import BucketCache, CacheConfig, StorageKind
from rlix_plugins.training.receiver import StateDictTarget, ThreadReceiver
from rlix_plugins.training.sync import SyncOptions, sync_version
from rlix_plugins.training.wire import TransportKind


@pytest.fixture
def pageable_cache() -> Iterator[BucketCache]:
    cache = BucketCache(
        "p", CacheConfig(bucket_bytes=1 << 16, storage=StorageKind.PAGEABLE, ram_reserve_bytes=0)
    )
    cache.build(1, iter([("w", torch.arange(100, dtype=torch.float32))]))
    yield cache
    cache.close()


def test_a_transport_forced_by_its_name_is_used(pageable_cache: BucketCache) -> None:
    opts = SyncOptions(ack_timeout_s=10, transports={"s0": "zmq"})
    assert opts.transports == {"s0": TransportKind.ZMQ}
    assert opts.transports["s0"] is TransportKind.ZMQ
    target = StateDictTarget(allocate_missing=True)
    receiver = ThreadReceiver("s0", target.load_weights)
    try:
        report = sync_version(pageable_cache, 1, [receiver], options=opts)
    finally:
        receiver.close()
    assert report.succeeded == ("s0",)
    assert report.outcomes[0].transport is TransportKind.ZMQ
    assert torch.equal(target.tensors["w"], torch.arange(100, dtype=torch.float32))


def test_shm_by_name_still_needs_a_cache_in_shared_memory(pageable_cache: BucketCache) -> None:
    receiver = ThreadReceiver("s0", StateDictTarget(allocate_missing=True).load_weights)
    try:
        with pytest.raises(TransportUnavailableError, match="'shm' needs a cache in shared"):
            sync_version(
                pageable_cache, 1, [receiver], options=SyncOptions(transports={"s0": "shm"})
            )
    finally:
        receiver.close()


def test_an_unknown_transport_name_lists_the_valid_ones() -> None:
    with pytest.raises(TransportUnavailableError) as ei:
        SyncOptions(transports={"s0": TransportKind.ZMQ, "s1": "tcp"})
    msg = str(ei.value)
    assert "transports['s1'] = 'tcp' is not a transport" in msg
    for kind in TransportKind:
        assert repr(kind.value) in msg
