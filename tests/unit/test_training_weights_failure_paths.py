"""Weight path failures (cache, sync, receiver, wire): each test failed before its fix.

Everything is real: the cache (shared-memory files), the sender, ZMQ control sockets, the
receive loop on threads of this process.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import zmq

from rlix_plugins.errors import ReceiverGoneError, WeightCacheError, WeightSyncError
from rlix_plugins.training.bucket_cache import BucketCache, CacheConfig, StorageKind
from rlix_plugins.training.checksum import ChecksumKind, segment_checksums
from rlix_plugins.training.receiver import StateDictTarget, ThreadReceiver, receive_weights
from rlix_plugins.training.sync import SyncOptions, SyncReport, sync_version
from rlix_plugins.training.wire import SyncOffer, TransportKind, decode, encode

BUCKET = 64 << 10


def _weights(seed: int, n: int = 4, size: int = 4000) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(size, generator=g) for i in range(n)}


def _shared_cache(pipeline: str) -> BucketCache:
    return BucketCache(
        pipeline,
        CacheConfig(bucket_bytes=BUCKET, storage=StorageKind.SHARED, ram_reserve_bytes=0),
    )


# --- sync.py: a straggling receiver of a version retired during its sync ----------------------


def _blocking_receiver() -> tuple[ThreadReceiver, threading.Event, threading.Event]:
    """Receiver ``s0`` whose load signals ``entered`` and then blocks until ``release``: a
    receiver still applying a version after the sync gave up on it."""
    entered, release = threading.Event(), threading.Event()

    def load(weights: list[tuple[str, torch.Tensor]]) -> None:
        del weights
        entered.set()
        release.wait()

    return ThreadReceiver("s0", load), entered, release


def test_straggler_keeps_a_version_retired_during_the_sync() -> None:
    """A version retired while its sync runs (a newer one built and activated) is still pinned
    by the sync; when the sync gives up on a receiver that is still applying it, the version
    must stay held for that receiver. Before the fix ``cache.hold(version)`` refused the retired
    version: ``sync_version`` raised UnknownWeightVersionError instead of reporting the failed
    shard, and the version's files went back to the pool (to be rewritten under the receiver)."""
    cache = _shared_cache("review_hold")
    cache.build(1, _weights(1).items())
    receiver, entered, release = _blocking_receiver()
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["report"] = sync_version(
                cache, 1, [receiver],
                options=SyncOptions(
                    ack_timeout_s=0.5, raise_on_error=False,
                    transports={"s0": TransportKind.ZMQ},
                ),
            )
        except BaseException as exc:  # the test inspects it
            out["error"] = exc

    sender = threading.Thread(target=run)
    sender.start()
    try:
        assert entered.wait(60)
        # the trainer moves on while the receiver is still applying version 1
        cache.build(2, _weights(2).items())
        cache.activate(2)
        assert cache.versions() == (2,)
        sender.join(120)
        assert not sender.is_alive()
        assert "error" not in out, repr(out.get("error"))
        report: SyncReport = out["report"]
        assert report.failed == ("s0",)
        # version 1's files are still the receiver's: none went to the pool yet
        assert cache.pooled_bytes() == 0
    finally:
        release.set()
        receiver.close()
    # the receiver ended (aborted by the sender): version 1 is released now
    assert cache.pooled_bytes() > 0
    cache.close()


def test_straggler_failure_is_reported_as_gone_with_raise_on_error() -> None:
    cache = _shared_cache("review_hold_raise")
    cache.build(1, _weights(3).items())
    receiver, entered, release = _blocking_receiver()
    out: dict[str, BaseException] = {}

    def run() -> None:
        try:
            sync_version(cache, 1, [receiver], options=SyncOptions(ack_timeout_s=0.5))
        except BaseException as exc:  # the test inspects it
            out["error"] = exc

    sender = threading.Thread(target=run)
    sender.start()
    try:
        assert entered.wait(60)
        cache.free(1)  # dropped while the sync still uses it: freed when the sync ends
        sender.join(120)
        assert not sender.is_alive()
    finally:
        release.set()
        receiver.close()
    assert isinstance(out.get("error"), ReceiverGoneError), repr(out.get("error"))
    cache.close()


# --- receiver.py / wire: a malformed bucket header fails typed instead of hanging ---------------


def _offer_dict(address: str, **over: Any) -> dict[str, Any]:
    d: dict[str, Any] = {
        "pipeline_id": "review", "sync_id": "s", "shard_id": "s0", "version": 1,
        "transport": "zmq", "control_address": address, "num_buckets": 1, "total_bytes": 100,
        "max_bucket_bytes": 100, "checksum": "fletcher64", "timeout_s": 30.0, "details": {},
    }
    d.update(over)
    return d


def _receive_from_raw_sender(
    tmp_path: Path, entries: list[Any], payload: bytes, header_over: dict[str, Any] | None = None
) -> tuple[BaseException | None, dict[str, Any]]:
    """Run the real receive loop against a real ZMQ socket that sends one hand-made bucket
    header (the bad input under test) with ``payload``; returns the receiver's error and the
    reply it sent."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.PAIR)
    sock.setsockopt(zmq.LINGER, 0)
    address = f"ipc://{tmp_path}/ctl.sock"
    sock.bind(address)
    offer = SyncOffer.from_dict(_offer_dict(address, total_bytes=len(payload),
                                            max_bucket_bytes=len(payload)))
    target = StateDictTarget(allocate_missing=True)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            receive_weights(offer, target.load_weights)
        except BaseException as exc:  # the test inspects it
            errors.append(exc)

    # daemon: before the fix a bad entry sent the receiver into an endless loop
    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        total, segs = segment_checksums(
            torch.frombuffer(bytearray(payload), dtype=torch.uint8).numpy(), 32 << 10,
            ChecksumKind.FLETCHER64,
        )
        header = {
            "kind": "bucket", "index": 0, "nbytes": len(payload), "checksum": total,
            "entries": entries, "segment_bytes": 32 << 10, "segment_checksums": list(segs),
        }
        header.update(header_over or {})
        header = {k: v for k, v in header.items() if v is not None}  # None: drop the field
        sock.send_multipart([encode(header), payload])
        assert sock.poll(60_000, zmq.POLLIN), "the receiver never answered"
        reply = decode(sock.recv())
        if reply.get("ok"):
            sock.send(encode({"kind": "end"}))
            assert sock.poll(60_000, zmq.POLLIN), "the receiver never finished"
            reply = decode(sock.recv())
        t.join(60)
        assert not t.is_alive()
    finally:
        sock.close(linger=0)
    return (errors[0] if errors else None), reply


PAYLOAD = torch.arange(25, dtype=torch.float32).numpy().tobytes()  # 100 bytes


@pytest.mark.parametrize(
    ("entries", "what"),
    [
        ([["w", "float32", [50], 0, 200]], "past the end"),  # was an endless verify loop
        ([["w", "float32", [25], 64, 100]], "past the end"),
        ([["w", "float32", [10], 0, 100]], "10 float32 elements"),  # size disagrees
        ([["w", "float32", [25], 2, 100]], "past the end"),
        ([["w", "float32", [24], 2, 96]], "not a multiple"),  # misaligned for the dtype
        ([["w", "float32", [25], -4, 100]], "offset"),
        ([["w", "float32", "25", 0, 100]], "malformed tensor entry"),  # was AssertionError
        ([["w", "float32", [25], 0]], "malformed tensor entry"),  # was ValueError (unpack)
        ([["w", "float32", [5, -5], 0, 100]], "malformed tensor entry"),
    ],
)
def test_a_bad_tensor_entry_fails_the_sync_with_a_typed_error(
    tmp_path: Path, entries: list[Any], what: str
) -> None:
    error, reply = _receive_from_raw_sender(tmp_path, entries, PAYLOAD)
    assert isinstance(error, WeightSyncError), repr(error)
    assert what in str(error) and "'w'" in str(error), str(error)
    assert reply["ok"] is False and what in reply["error"]


def test_a_good_hand_made_bucket_is_received(tmp_path: Path) -> None:
    # the helper above speaks the protocol correctly: only the bad entries fail
    error, reply = _receive_from_raw_sender(tmp_path, [["w", "float32", [25], 0, 100]], PAYLOAD)
    assert error is None and reply["ok"] is True and reply["kind"] == "done", (error, reply)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("timeout_s", -1.0),  # a negative ZMQ poll timeout waits forever
        ("timeout_s", 0.0),
        ("timeout_s", float("nan")),
        ("timeout_s", float("inf")),
        ("num_buckets", -1),
        ("total_bytes", -5),
        ("max_bucket_bytes", -1),
        ("version", 1.5),  # int() truncated it to 1 silently
        ("version", True),
        ("details", [1, 2]),
    ],
)
def test_a_bad_offer_field_is_refused_by_name(field: str, value: Any) -> None:
    raw = _offer_dict("ipc:///nowhere", **{field: value})
    with pytest.raises(WeightSyncError, match=field):
        SyncOffer.from_dict(raw)


@pytest.mark.parametrize("raw", ["not an offer", None, 7, [("pipeline_id", "p")]])
def test_an_offer_that_is_not_a_mapping_is_refused_typed(raw: Any) -> None:
    with pytest.raises(WeightSyncError, match="sync offer"):
        SyncOffer.from_dict(raw)


# --- bucket_cache.py: what the weight iterator yields is checked before it is packed -----------


@pytest.mark.parametrize(
    ("item", "what"),
    [
        ((3, torch.zeros(4)), "name"),  # was cached silently; every receiver then failed
        (("", torch.zeros(4)), "name"),
        (("w", [1.0, 2.0]), "torch.Tensor"),  # was AttributeError: 'list' has no 'detach'
        (("w", None), "torch.Tensor"),
        ("w", "(name, tensor)"),  # was ValueError: not enough values to unpack
        # each was a raw NotImplementedError / RuntimeError from the packing, naming nothing
        (("w", torch.empty(4, device="meta")), "meta tensor"),
        (("w", torch.zeros(4).to_sparse()), "sparse_coo"),
        (("w", torch.zeros(2, dtype=torch.complex64).conj()), "conjugated"),
        (("w", torch.quantize_per_tensor(torch.zeros(4), 0.1, 0, torch.qint8)), "quantized"),
    ],
)
def test_a_bad_weight_item_fails_the_build_typed_and_leaves_the_cache_unchanged(
    item: Any, what: str
) -> None:
    cache = BucketCache(
        "review_items",
        CacheConfig(bucket_bytes=BUCKET, storage=StorageKind.PAGEABLE, ram_reserve_bytes=0),
    )
    drained: list[str] = []

    def items() -> Any:
        yield "a", torch.ones(8)
        yield item
        drained.append("rest")  # the collective iterator is still drained after the error
        yield "z", torch.ones(8)

    with pytest.raises(WeightCacheError, match="weight version 5") as info:
        cache.build(5, items())
    assert what in str(info.value)
    assert drained == ["rest"]
    assert cache.versions() == () and cache.latest_version is None
    assert cache.resident_bytes() == 0
    # the number was not left claimed: a good build under it works
    assert cache.build(5, iter([("a", torch.ones(8))])) is not None
    cache.close()


# --- process_receiver.py: a child that cannot start fails typed and is reaped ---------------------


def _receiver_children(shard_id: str) -> list[Any]:
    import multiprocessing

    return [p for p in multiprocessing.active_children() if p.name == f"rlix-receiver-{shard_id}"]


@pytest.mark.parametrize(
    ("layout", "what"),
    [
        ({"w": ("float33", (4,))}, "float33"),  # the child died on it: EOFError('')
        ({"w": ("float32", (4, -1))}, "shape"),
        ({"w": ("float32", "4")}, "shape"),
    ],
)
def test_a_bad_receiver_layout_is_refused_before_a_child_starts(
    layout: dict[str, Any], what: str
) -> None:
    from rlix_plugins.training.process_receiver import SpawnedReceiver

    with pytest.raises(WeightSyncError, match=what):
        SpawnedReceiver("review_layout", layout, start_timeout_s=120)
    assert _receiver_children("review_layout") == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_receiver_child_that_dies_at_start_is_reported_gone_and_reaped() -> None:
    from rlix_plugins.training.process_receiver import SpawnedReceiver

    # a real child process that really fails at start: CUDA tensors on a machine without CUDA
    with pytest.raises(ReceiverGoneError, match=r"review_dead.*exited"):
        SpawnedReceiver("review_dead", {"w": ("float32", (4,))}, start_timeout_s=120,
                        device="cuda")
    assert _receiver_children("review_dead") == []


# --- receiver.py: an unusable control address fails typed --------------------------------------


@pytest.mark.parametrize("address", ["not-an-address", "tcp://", "nosuch://x"])
def test_an_unusable_control_address_is_a_typed_error(address: str) -> None:
    offer = SyncOffer.from_dict(_offer_dict(address))
    with pytest.raises(WeightSyncError, match="control address"):
        receive_weights(offer, StateDictTarget(allocate_missing=True).load_weights)


GOOD_ENTRY = [["w", "float32", [25], 0, 100]]


@pytest.mark.parametrize(
    ("over", "what"),
    [
        ({"index": 1}, "bucket 1 arrived as bucket 0"),  # was applied and reported complete
        ({"index": -1}, "bucket -1 arrived as bucket 0"),
        ({"entries": None}, "malformed bucket header"),  # was KeyError('entries')
        ({"nbytes": "many"}, "malformed bucket header"),  # was ValueError from int()
        ({"entries": 5}, "malformed bucket header"),  # was TypeError: not iterable
    ],
)
def test_a_bad_bucket_header_is_refused_typed(
    tmp_path: Path, over: dict[str, Any], what: str
) -> None:
    error, reply = _receive_from_raw_sender(tmp_path, GOOD_ENTRY, PAYLOAD, over)
    assert isinstance(error, WeightSyncError), repr(error)
    assert what in str(error)
    assert reply["ok"] is False


# --- sync.py: a control socket that cannot be bound is a typed error before anyone is contacted --


@pytest.mark.parametrize("sub", ["missing/dir", "x" * 200])
def test_an_unusable_socket_dir_is_a_typed_error(tmp_path: Path, sub: str) -> None:
    from rlix_plugins.errors import TransportUnavailableError

    cache = BucketCache(
        "review_sockdir",
        CacheConfig(bucket_bytes=BUCKET, storage=StorageKind.PAGEABLE, ram_reserve_bytes=0),
    )
    cache.build(1, _weights(4).items())
    started: list[str] = []
    receiver = ThreadReceiver("s0", lambda w: started.append("load"))
    bad = tmp_path / sub
    if len(sub) > 100:
        bad.mkdir()  # exists, but an ipc:// path under it is longer than a socket path may be
    try:
        with pytest.raises(TransportUnavailableError, match="socket_dir"):
            sync_version(cache, 1, [receiver], options=SyncOptions(socket_dir=str(bad)))
    finally:
        receiver.close()
    assert started == []
    cache.close()


# --- sync.py: a broadcast group that fails late still reports the members that finished -------


class FailsAfterReceiving(ThreadReceiver):
    """A real receiver whose handle fails after the receive loop finished (as
    VllmEngineReceiver does when an engine answers with more than one worker's reply)."""

    def begin_receive(self, offer: SyncOffer) -> Any:
        def run() -> Any:
            receive_weights(offer, self._load)
            raise WeightSyncError(f"shard {self.shard_id}: post-receive check failed")

        return self._pool.submit(run)


def test_a_late_failure_in_a_broadcast_group_keeps_the_finished_members_outcomes() -> None:
    cache = BucketCache(
        "review_group",
        CacheConfig(bucket_bytes=BUCKET, storage=StorageKind.PAGEABLE, ram_reserve_bytes=0),
    )
    w = _weights(5)
    cache.build(1, w.items())
    good = StateDictTarget({k: torch.zeros_like(v) for k, v in w.items()})
    receivers = [
        ThreadReceiver("s0", good.load_weights),
        FailsAfterReceiving("s1", StateDictTarget(allocate_missing=True).load_weights),
    ]
    try:
        report = sync_version(
            cache, 1, receivers,
            options=SyncOptions(
                ack_timeout_s=30, raise_on_error=False,
                transports={r.shard_id: TransportKind.GLOO for r in receivers},
            ),
        )
    finally:
        for r in receivers:
            r.close()
    # s0 applied the whole version: before the fix its outcome vanished from the report
    assert [o.shard_id for o in report.outcomes] == ["s0", "s1"], report.outcomes
    assert report.succeeded == ("s0",) and report.failed == ("s1",)
    assert all(torch.equal(good.tensors[k], v) for k, v in w.items())
    cache.close()


# --- transports/shm.py: many buckets ahead of the acks deadlocked the control channel ----------


def test_an_shm_sync_of_thousands_of_buckets_completes() -> None:
    """The shm sender sent every header before reading any ack. With more buckets than the
    control sockets' queues hold (5,000 here; ZMQ's default high-water mark is 1,000 messages
    per side) the receiver blocked sending acks the sender never read, the sender blocked
    sending headers the receiver could not take, and a healthy receiver was declared gone."""
    import shutil
    import tempfile

    n = 5000
    shm = Path(tempfile.mkdtemp(prefix="rlix-test-review-", dir="/dev/shm"))
    cache = BucketCache(
        "review_many",
        CacheConfig(bucket_bytes=64, storage=StorageKind.SHARED, shm_dir=shm,
                    ram_reserve_bytes=0),
    )
    target = StateDictTarget(allocate_missing=True)
    receiver = ThreadReceiver("s0", target.load_weights)
    try:
        cache.build(1, ((f"w{i}", torch.full((16,), float(i))) for i in range(n)))
        report = sync_version(
            cache, 1, [receiver],
            options=SyncOptions(ack_timeout_s=30, transports={"s0": TransportKind.SHM}),
        )
        assert report.succeeded == ("s0",) and report.num_buckets == n
        assert len(target.tensors) == n
        assert all(float(target.tensors[f"w{i}"][0]) == i for i in (0, n // 2, n - 1))
    finally:
        receiver.close()
        cache.close()
        shutil.rmtree(shm, ignore_errors=True)


# --- receiver.py: a sender that stops reading acks must not hang the receiver forever ----------


def test_a_receiver_whose_sender_stops_reading_acks_gives_up_typed(tmp_path: Path) -> None:
    """The receiver's acks were blocking sends on a PAIR socket: once the sender stopped
    reading them (hung, or gone without closing the connection) and the queue filled, the
    receiver thread blocked forever, holding its version pinned and its handle unclosable.
    The sender here is a real ZMQ socket that sends valid buckets and never reads an ack."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.PAIR)
    sock.setsockopt(zmq.LINGER, 0)
    address = f"ipc://{tmp_path}/ctl.sock"
    sock.bind(address)
    n = 20_000  # far more acks than the control sockets queue
    payload = torch.arange(2, dtype=torch.float32).numpy().tobytes()
    offer = SyncOffer.from_dict(
        _offer_dict(address, num_buckets=n, total_bytes=8 * n, max_bucket_bytes=8,
                    timeout_s=2.0)
    )
    errors: list[BaseException] = []

    def run() -> None:
        try:
            receive_weights(offer, StateDictTarget(allocate_missing=True).load_weights)
        except BaseException as exc:  # the test inspects it
            errors.append(exc)

    t = threading.Thread(target=run, daemon=True)  # daemon: before the fix it never ended
    t.start()
    total, segs = segment_checksums(
        torch.frombuffer(bytearray(payload), dtype=torch.uint8).numpy(), 32 << 10,
        ChecksumKind.FLETCHER64,
    )
    stalled = 0.0
    try:
        for i in range(n):
            header = {
                "kind": "bucket", "index": i, "nbytes": 8, "checksum": total,
                "entries": [[f"w{i}", "float32", [2], 0, 8]], "segment_bytes": 32 << 10,
                "segment_checksums": list(segs),
            }
            # the receiver stops reading once its acks are stuck; stop with it
            while t.is_alive() and not sock.poll(100, zmq.POLLOUT) and stalled < 60:
                stalled += 0.1
            if not t.is_alive() or stalled >= 60:
                break
            sock.send_multipart([encode(header), payload], flags=zmq.NOBLOCK)
        t.join(60)
        assert not t.is_alive(), "the receiver is stuck sending an ack nobody reads"
    finally:
        sock.close(linger=0)
    assert len(errors) == 1 and isinstance(errors[0], ReceiverGoneError), errors
    assert "ack" in str(errors[0])
