"""A receiver that starts after its sync gave up never applies another sync's buckets.

A remote receiver's control channel is ``tcp://host:port`` with a random port. A receive that
started late (queued behind another on its handle's single thread) keeps trying to connect to
that address for its offer's timeout; when a later sync bound the same port, the late receiver
connected to that sync's PAIR socket, applied that sync's buckets (checksums pass: they are the
other sync's own) and recorded its own offer's version over them. The port collision is the
one FAKE here (``bind_to_random_port`` returns a fixed port; a real collision is random): the
cache, the sender, the ZMQ sockets and the receive loop are real.
"""

from __future__ import annotations

import concurrent.futures
import socket
import threading
import time
from typing import Any

import pytest
import torch
import zmq

from rlix_plugins.training.bucket_cache import BucketCache, CacheConfig, StorageKind
from rlix_plugins.training.receiver import StateDictTarget, ThreadReceiver
from rlix_plugins.training.sync import SyncOptions, sync_version
from rlix_plugins.training.transports.selection import ReceiverLocation
from rlix_plugins.training.wire import SyncOffer, TransportKind
from tests.unit.test_training_receiver_partial import WEIGHTS

REMOTE = ReceiverLocation(host="another-host")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Gated:
    """A real ThreadReceiver whose one thread is first held busy (a receive queued behind
    another); ``offered`` is set once the sync asked it to receive."""

    def __init__(self, shard_id: str, target: StateDictTarget) -> None:
        self.inner = ThreadReceiver(shard_id, target.load_weights, REMOTE,
                                    destination=target.destination)
        self.gate = threading.Event()
        self.offered = threading.Event()
        self.inner._pool.submit(self.gate.wait)
        self.future: concurrent.futures.Future[Any] | None = None

    @property
    def shard_id(self) -> str:
        return self.inner.shard_id

    @property
    def location(self) -> ReceiverLocation:
        return self.inner.location

    def begin_receive(self, offer: SyncOffer) -> concurrent.futures.Future[Any]:
        self.future = self.inner.begin_receive(offer)
        self.offered.set()
        return self.future


def test_a_late_receiver_never_applies_a_later_syncs_buckets_on_a_reused_port(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    port = _free_port()

    def fixed_port(self: zmq.Socket[bytes], addr: str, *args: Any, **kwargs: Any) -> int:
        # FAKE: the random port collides. ZMQ closes the earlier listener on its I/O thread,
        # so the port may still be taken for a moment.
        deadline = time.monotonic() + 10
        while True:
            try:
                self.bind(f"{addr}:{port}")
                return port
            except zmq.ZMQError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    monkeypatch.setattr(zmq.Socket, "bind_to_random_port", fixed_port)
    cfg = CacheConfig(bucket_bytes=1 << 16, storage=StorageKind.PAGEABLE, ram_reserve_bytes=0)
    first, second = BucketCache("p1", cfg), BucketCache("p2", cfg)
    later = {k: v + 100 for k, v in WEIGHTS.items()}  # another version, same layout
    first.build(7, iter(WEIGHTS.items()))
    second.build(8, iter(later.items()))
    x_target = StateDictTarget({k: torch.zeros_like(v) for k, v in WEIGHTS.items()})
    y_target = StateDictTarget({k: torch.zeros_like(v) for k, v in WEIGHTS.items()})
    x, y = _Gated("x", x_target), _Gated("y", y_target)
    opts = SyncOptions(ack_timeout_s=1.0, advertise_host="127.0.0.1", raise_on_error=False,
                       transports={"x": TransportKind.ZMQ, "y": TransportKind.ZMQ})
    try:
        # sync 1 gives up on x, whose receive is still queued
        report1 = sync_version(first, 7, [x], options=opts)
        assert report1.failed == ("x",)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            sync2 = pool.submit(sync_version, second, 8, [y], options=opts)
            assert y.offered.wait(10)  # sync 2 has bound the port sync 1 used
            x.gate.set()  # x's late receive starts and connects to that port
            assert x.future is not None
            concurrent.futures.wait([x.future], timeout=10)
            y.gate.set()
            report2 = sync2.result(timeout=30)
        # x was offered version 7: it must not have applied sync 2's bytes (version 8) ...
        assert not any(torch.equal(x_target.tensors[k], later[k]) for k in later), (
            "x applied another sync's buckets"
        )
        # ... nor recorded version 7 over them
        assert x.inner.versions == []
        assert "y" in report2.failed or "y" in report2.succeeded
    finally:
        x.gate.set()
        y.gate.set()
        x.inner.close()
        y.inner.close()
        first.close()
        second.close()
