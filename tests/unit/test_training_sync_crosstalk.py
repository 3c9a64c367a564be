"""A receiver that starts after its sync gave up never applies another sync's buckets.

A remote receiver's control channel is ``tcp://host:port`` with a random port. A receive that
started late (queued behind another on its handle's single thread) keeps trying to connect to
that address for its offer's timeout; when a later sync bound the same port, the late receiver
connected to that sync's PAIR socket, applied that sync's buckets (checksums pass: they are the
other sync's own) and recorded its own offer's version over them; and, in that sync's place on
the socket, it failed the later sync's own receiver. The port collision is the
one FAKE here (``bind_to_random_port`` returns a fixed port; a real collision is random): the
cache, the sender, the ZMQ sockets and the receive loop are real.
"""

from __future__ import annotations

import concurrent.futures
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import pytest
import torch
import zmq

from rlix_plugins.errors import WeightSyncError
from rlix_plugins.training.bucket_cache import BucketCache, CacheConfig, StorageKind
from rlix_plugins.training.checksum import ChecksumKind
from rlix_plugins.training.receiver import StateDictTarget, ThreadReceiver
from rlix_plugins.training.sync import SyncOptions, sync_version
from rlix_plugins.training.transports.selection import ReceiverLocation
from rlix_plugins.training.wire import StaleSyncError, SyncOffer, TransportKind
from rlix_plugins.training.wire import decode as _decode
from rlix_plugins.training.wire import encode as _encode
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


@pytest.fixture
def reused_port(monkeypatch: pytest.MonkeyPatch) -> int:
    """Every tcp control socket of the test binds this one port (a sync after another reuses
    the port the earlier one had)."""
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
    return port


@dataclass(frozen=True, slots=True)
class _TwoSyncs:
    """Two pipelines on one host: ``first`` caches version 7 for ``x``, ``second`` version 8
    (``later``) for ``y``; both receivers are remote (tcp control channel) and gated."""

    first: BucketCache
    second: BucketCache
    later: dict[str, torch.Tensor]
    x_target: StateDictTarget
    y_target: StateDictTarget
    x: _Gated
    y: _Gated
    #: a short ack timeout: sync 1 gives up on x, whose receive is still queued
    opts: SyncOptions


@pytest.fixture
def two_syncs(reused_port: int) -> Iterator[_TwoSyncs]:
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
        yield _TwoSyncs(first, second, later, x_target, y_target, x, y, opts)
    finally:
        x.gate.set()
        y.gate.set()
        x.inner.close()
        y.inner.close()
        first.close()
        second.close()


def test_a_late_receiver_never_applies_a_later_syncs_buckets_on_a_reused_port(
    two_syncs: _TwoSyncs,
) -> None:
    t = two_syncs
    x, y, later = t.x, t.y, t.later
    # sync 1 gives up on x, whose receive is still queued
    report1 = sync_version(t.first, 7, [x], options=t.opts)
    assert report1.failed == ("x",)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        sync2 = pool.submit(sync_version, t.second, 8, [y], options=t.opts)
        assert y.offered.wait(10)  # sync 2 has bound the port sync 1 used
        x.gate.set()  # x's late receive starts and connects to that port
        assert x.future is not None
        concurrent.futures.wait([x.future], timeout=10)
        y.gate.set()
        report2 = sync2.result(timeout=30)
    # x was offered version 7: it must not have applied sync 2's bytes (version 8) ...
    assert not any(torch.equal(t.x_target.tensors[k], later[k]) for k in later), (
        "x applied another sync's buckets"
    )
    # ... nor recorded version 7 over them
    assert x.inner.versions == []
    assert "y" in report2.failed or "y" in report2.succeeded


def test_a_later_sync_completes_on_its_own_receiver_while_a_stale_one_takes_its_port(
    two_syncs: _TwoSyncs,
) -> None:
    """The stale receiver x (of sync 1) reaches sync 2's port before sync 2's own receiver y.
    It used to take y's place on the socket: x refused sync 2's first bucket, the sender read
    that refusal as y's and failed y, whose shard then needed a resync. Now the sender admits
    only a receiver that names its sync on connect: x is refused at once (naming both syncs)
    and y, connecting after it, receives version 8."""
    t = two_syncs
    x, y, later = t.x, t.y, t.later
    report1 = sync_version(t.first, 7, [x], options=t.opts)
    assert report1.failed == ("x",)
    # sync 2 waits for y as long as a real one would: y starts only after x was turned away
    patient = replace(t.opts, ack_timeout_s=30.0)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        sync2 = pool.submit(sync_version, t.second, 8, [y], options=patient)
        assert y.offered.wait(10)  # sync 2 has bound the port sync 1 used
        x.gate.set()  # x's late receive starts and connects to that port first
        assert x.future is not None
        stale = x.future.exception(timeout=20)
        y.gate.set()  # now sync 2's own receiver connects
        report2 = sync2.result(timeout=60)
    assert report2.succeeded == ("y",), report2
    (outcome,) = report2.outcomes
    assert outcome.result is not None and outcome.result.version == 8
    assert y.inner.versions == [8]
    assert all(torch.equal(t.y_target.tensors[k], later[k]) for k in later)
    # the stale side was refused, by a typed error naming its sync and the one it reached
    assert isinstance(stale, StaleSyncError), repr(stale)
    assert report1.sync_id in str(stale) and report2.sync_id in str(stale), str(stale)
    assert x.inner.versions == []
    assert not any(torch.equal(t.x_target.tensors[k], later[k]) for k in later)


class _HeldTarget(StateDictTarget):
    """A real target whose first tensor waits for ``release``: the transfer is under way
    (``entered`` is set) until the test lets it go on."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__(tensors)
        self.entered = threading.Event()
        self.release = threading.Event()

    def destination(
        self, name: str, dtype: torch.dtype, shape: tuple[int, ...]
    ) -> torch.Tensor | None:
        self.entered.set()
        assert self.release.wait(30)
        return super().destination(name, dtype, shape)


def test_a_stale_receiver_arriving_mid_transfer_is_refused_and_the_transfer_goes_on(
    two_syncs: _TwoSyncs,
) -> None:
    """The stale receiver x (of sync 1) reaches sync 2's port while sync 2's own receiver is
    halfway through its first bucket: the sender, waiting for that bucket's ack, refuses x
    (typed, naming both syncs) and the transfer completes on its own receiver."""
    t = two_syncs
    x, later = t.x, t.later
    report1 = sync_version(t.first, 7, [x], options=t.opts)
    assert report1.failed == ("x",)
    held = _HeldTarget({k: torch.zeros_like(v) for k, v in WEIGHTS.items()})
    y = _Gated("y", held)
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            sync2 = pool.submit(sync_version, t.second, 8, [y],
                                options=replace(t.opts, ack_timeout_s=30.0))
            assert y.offered.wait(10)
            y.gate.set()  # y is admitted and starts on bucket 0 ...
            assert held.entered.wait(20)
            x.gate.set()  # ... when x's late receive reaches the same port
            assert x.future is not None
            stale = x.future.exception(timeout=20)
            held.release.set()
            report2 = sync2.result(timeout=60)
    finally:
        held.release.set()
        y.gate.set()
        y.inner.close()
    assert isinstance(stale, StaleSyncError), repr(stale)
    assert report1.sync_id in str(stale) and report2.sync_id in str(stale), str(stale)
    assert report2.succeeded == ("y",), report2
    assert y.inner.versions == [8]
    assert all(torch.equal(held.tensors[k], later[k]) for k in later)
    assert x.inner.versions == []


def test_a_bucket_header_of_another_sync_is_refused_before_any_transport_reads_it(
    tmp_path: Any,
) -> None:
    """The second guard behind the handshake, for every transport (it is checked where the
    receive loop reads a header, not in each transport): a scripted sender on the receiver's
    own control socket (real ZMQ, control protocol 1) sends bucket 0 of another sync; the
    receiver refuses it by name, applies nothing and answers with the error."""
    from rlix_plugins.training.receiver import receive_weights

    address = f"ipc://{tmp_path}/control"
    sender = zmq.Context.instance().socket(zmq.PAIR)
    sender.setsockopt(zmq.LINGER, 0)
    sender.bind(address)
    offer = SyncOffer(pipeline_id="p", sync_id="mine", shard_id="x", version=1,
                      transport=TransportKind.ZMQ, control_address=address, num_buckets=1,
                      total_bytes=4, max_bucket_bytes=4, checksum=ChecksumKind.FLETCHER64,
                      timeout_s=10.0)
    target = StateDictTarget({"w": torch.zeros(1)})
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            receiving = pool.submit(receive_weights, offer, target.load_weights,
                                    destination=target.destination)
            sender.send_multipart([
                _encode({"kind": "bucket", "index": 0, "nbytes": 4, "sync_id": "theirs",
                         "entries": [["w", "float32", [1], 0, 4]]}),
                torch.ones(1).numpy().tobytes(),
            ])
            with pytest.raises(WeightSyncError, match=r"bucket 0 belongs to sync theirs, not "
                                                      r"to this receiver's sync mine"):
                receiving.result(timeout=30)
        assert sender.poll(10_000), "the receiver sent no error reply"
        reply = _decode(sender.recv())
        assert reply.get("ok") is False and "belongs to sync theirs" in str(reply), reply
        assert target.loaded == [] and torch.equal(target.tensors["w"], torch.zeros(1))
    finally:
        sender.close()


def test_the_offer_names_its_control_protocol_and_an_unknown_one_is_refused() -> None:
    """The handshake is versioned in the offer: an offer without the field (a sender before
    the handshake) is protocol 1, the PAIR socket without a hello; one this receiver does not
    speak is refused by name instead of both ends waiting out the timeout."""
    offer = SyncOffer(pipeline_id="p", sync_id="s", shard_id="x", version=1,
                      transport=TransportKind.ZMQ, control_address="tcp://127.0.0.1:1",
                      num_buckets=1, total_bytes=1, max_bucket_bytes=1,
                      checksum=ChecksumKind.FLETCHER64, timeout_s=1.0, control_protocol=2)
    assert SyncOffer.from_dict(offer.to_dict()).control_protocol == 2
    legacy = {k: v for k, v in offer.to_dict().items() if k != "control_protocol"}
    assert SyncOffer.from_dict(legacy).control_protocol == 1
    with pytest.raises(WeightSyncError, match=r"control_protocol=3 .*valid: 1, 2"):
        SyncOffer.from_dict({**offer.to_dict(), "control_protocol": 3})
