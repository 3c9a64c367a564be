"""A broadcast sync's rendezvous is announced at ``SyncOptions.advertise_host``.

``advertise_host`` is the address remote receivers reach the sender at; the control sockets
used it, but the broadcast transports' TCPStore was announced at ``_node_address()`` (nccl:
the hostname's address, 127.0.1.1 under Debian's default /etc/hosts) or 127.0.0.1 (gloo), so
a receiver on another node could not join the group whatever the option said, and its sync
failed after the ack timeout. Real gloo broadcast, real receiver thread; 127.0.0.2 (loopback
too, but not the default) stands in for the node's routable address.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator

import pytest
import torch

from rlix_plugins.training.bucket_cache import BucketCache, CacheConfig, StorageKind
from rlix_plugins.training.receiver import StateDictTarget, ThreadReceiver
from rlix_plugins.training.sync import SyncOptions, sync_version
from rlix_plugins.training.wire import ReceiveResult, SyncOffer, TransportKind


class _OfferKeeper(ThreadReceiver):
    """A real in-process receiver that also keeps the offers it was sent."""

    offers: list[SyncOffer]

    def begin_receive(self, offer: SyncOffer) -> concurrent.futures.Future[ReceiveResult]:
        self.offers.append(offer)
        return super().begin_receive(offer)


@pytest.fixture
def cache() -> Iterator[BucketCache]:
    c = BucketCache(
        "bcast", CacheConfig(bucket_bytes=1 << 16, storage=StorageKind.PAGEABLE,
                             ram_reserve_bytes=0)
    )
    c.build(1, iter([("w", torch.arange(100, dtype=torch.float32))]))
    yield c
    c.close()


def test_the_broadcast_rendezvous_is_announced_at_the_advertised_host(
    cache: BucketCache,
) -> None:
    target = StateDictTarget(allocate_missing=True)
    receiver = _OfferKeeper("s0", target.load_weights)
    receiver.offers = []
    opts = SyncOptions(ack_timeout_s=30, transports={"s0": "gloo"},
                       advertise_host="127.0.0.2")
    try:
        report = sync_version(cache, 1, [receiver], options=opts)
    finally:
        receiver.close()
    assert report.succeeded == ("s0",)
    assert report.outcomes[0].transport is TransportKind.GLOO
    (offer,) = receiver.offers
    assert offer.details["store_host"] == "127.0.0.2"
    assert torch.equal(target.tensors["w"], torch.arange(100, dtype=torch.float32))
