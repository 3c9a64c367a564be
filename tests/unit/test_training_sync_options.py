"""Forced transports may be given as strings; an unknown one, or a GPU transport in a process
without CUDA, is a clear typed error; GPU transports stage on the caller's CUDA device."""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from rlix_plugins.errors import TransportUnavailableError, WeightSyncError
from rlix_plugins.training import sync as sync_module
from rlix_plugins.training import vllm_receiver
from rlix_plugins.training.bucket_cache import BucketCache, CacheConfig, StorageKind
from rlix_plugins.training.receiver import StateDictTarget, ThreadReceiver
from rlix_plugins.training.sync import SyncOptions, sync_version
from rlix_plugins.training.transports.base import SenderTransport
from rlix_plugins.training.transports.selection import AddressedReceiver
from rlix_plugins.training.wire import ReceiveResult, SyncOffer, TransportKind


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


class _OfferKeeper(ThreadReceiver):
    """A real in-process receiver that also keeps the offers it was sent."""

    def __init__(self, shard_id: str, load: Any) -> None:
        super().__init__(shard_id, load)
        self.offers: list[SyncOffer] = []

    def begin_receive(self, offer: SyncOffer) -> concurrent.futures.Future[ReceiveResult]:
        self.offers.append(offer)
        return super().begin_receive(offer)


def test_the_broadcast_rendezvous_is_announced_at_the_advertised_host(
    pageable_cache: BucketCache,
) -> None:
    """The control sockets used ``advertise_host``, but a broadcast group's TCPStore was
    announced at the hostname's address (nccl; 127.0.1.1 under Debian's default /etc/hosts)
    or 127.0.0.1 (gloo): a receiver on another node could never join. Real gloo broadcast;
    127.0.0.2 (loopback, not the default) stands in for the node's routable address."""
    target = StateDictTarget(allocate_missing=True)
    receiver = _OfferKeeper("s0", target.load_weights)
    opts = SyncOptions(ack_timeout_s=30, transports={"s0": "gloo"},
                       advertise_host="127.0.0.2")
    try:
        report = sync_version(pageable_cache, 1, [receiver], options=opts)
    finally:
        receiver.close()
    assert report.succeeded == ("s0",)
    assert report.outcomes[0].transport is TransportKind.GLOO
    (offer,) = receiver.offers
    assert offer.details["store_host"] == "127.0.0.2"
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


class _Recording(AddressedReceiver):
    """A receiver handle that records being contacted and fails if it is."""

    def __init__(self, shard_id: str) -> None:
        super().__init__(shard_id)
        self.offers: list[SyncOffer] = []

    def begin_receive(self, offer: SyncOffer) -> concurrent.futures.Future[ReceiveResult]:
        self.offers.append(offer)
        raise WeightSyncError("this receiver should not have been contacted")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a process without CUDA")
@pytest.mark.parametrize("kind", ["cuda_ipc", "nccl"])
def test_a_gpu_transport_forced_without_cuda_is_refused_before_contacting_anyone(
    pageable_cache: BucketCache, kind: str
) -> None:
    receiver = _Recording("s0")
    with pytest.raises(TransportUnavailableError) as ei:
        sync_version(pageable_cache, 1, [receiver], options=SyncOptions(transports={"s0": kind}))
    assert f"shard s0: transport {kind!r} needs a CUDA device in the sender's process" in str(
        ei.value
    )
    assert "valid without one: gloo, shm, zmq" in str(ei.value)
    assert receiver.offers == []


def test_a_gpu_transport_stages_on_the_callers_cuda_device_not_its_threads(
    pageable_cache: BucketCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    """FAKE CUDA (this machine has none): the caller is "on" device 3, and the transport
    opened on the sync's pool thread must see device 3 current, not the thread's default 0."""
    current = threading.local()
    seen: list[int] = []

    @contextlib.contextmanager
    def device(index: int) -> Iterator[None]:
        before = getattr(current, "index", 0)
        current.index = index
        try:
            yield
        finally:
            current.index = before

    def open_sender(kind: TransportKind, *args: object) -> SenderTransport:
        seen.append(getattr(current, "index", 0))
        raise TransportUnavailableError("FAKE CUDA: no real sender")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: getattr(current, "index", 0))
    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(sync_module, "open_sender_transport", open_sender)
    current.index = 3  # the trainer's torch.cuda.set_device(3)
    receiver = _Recording("s0")
    report = sync_version(
        pageable_cache,
        1,
        [receiver],
        options=SyncOptions(transports={"s0": "nccl"}, raise_on_error=False),
    )
    assert seen == [3]
    assert report.failed == ("s0",)


def test_a_vllm_worker_receives_on_its_own_cuda_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """FAKE CUDA: vLLM's in-process executor calls the extension on the caller's thread; the
    worker's ``device`` is made current for the receive, a CPU worker's changes nothing."""
    entered: list[object] = []

    @contextlib.contextmanager
    def device(d: object) -> Iterator[None]:
        entered.append(d)
        yield

    monkeypatch.setattr(torch.cuda, "device", device)
    with vllm_receiver._on_device(torch.device("cpu")), vllm_receiver._on_device(None):
        pass
    assert entered == []
    with vllm_receiver._on_device(torch.device("cuda", 2)):
        assert entered == [torch.device("cuda", 2)]
