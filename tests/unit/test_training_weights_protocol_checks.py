"""Weight path protocol checks (spawned receiver, broadcast, control channel, wire,
cache lookups): each test failed before its fix (the gpu-marked one needs two GPUs; see it).

Everything is real: child processes, ZMQ sockets, gloo groups, the shared-memory cache.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import zmq

from rlix_plugins.errors import (
    ReceiverGoneError,
    UnknownWeightVersionError,
    WeightCacheError,
    WeightSyncError,
)
from rlix_plugins.training.bucket_cache import BucketCache, CacheConfig, StorageKind
from rlix_plugins.training.checksum import ChecksumKind
from rlix_plugins.training.sync import SyncOptions, SyncReport, sync_version
from rlix_plugins.training.transports.selection import AddressedReceiver
from rlix_plugins.training.wire import (
    ReceiveResult,
    SyncOffer,
    TransportKind,
    decode,
    encode,
)

BUCKET = 64 << 10
LAYOUT = {"w0": ("float32", (64,)), "w1": ("float32", (64,))}


def _weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g) for name, (_, shape) in LAYOUT.items()}


def _cache(pipeline: str, storage: StorageKind = StorageKind.SHARED) -> BucketCache:
    return BucketCache(
        pipeline, CacheConfig(bucket_bytes=BUCKET, storage=storage, ram_reserve_bytes=0)
    )


def _wait_until(cond: Callable[[], bool], limit_s: float = 90.0) -> bool:
    """Hang detector: True once ``cond()`` holds, False after ``limit_s`` (a generous bound)."""
    deadline = time.monotonic() + limit_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


# --- process_receiver.py: a hung child must not pin its version forever ------------------------


def test_a_hung_receiver_child_is_killed_and_its_version_released() -> None:
    """A child that is alive but makes no progress (really stopped here, SIGSTOP) was waited
    for without end: its future never completed, so the version the sync held for it (a
    straggler) stayed pinned forever and the handle's lock stayed taken. Now the child is
    killed once it has been silent longer than the offer allows, its future fails as gone and
    the version is released."""
    from rlix_plugins.training.process_receiver import SpawnedReceiver

    cache = _cache("review2_hung")
    cache.build(1, _weights(1).items())
    receiver = SpawnedReceiver("s0", LAYOUT, start_timeout_s=120)
    try:
        os.kill(receiver.process.pid, signal.SIGSTOP)
        report = sync_version(
            cache, 1, [receiver],
            options=SyncOptions(ack_timeout_s=0.5, raise_on_error=False,
                                transports={"s0": TransportKind.ZMQ}),
        )
        assert report.failed == ("s0",)
        cache.free(1)  # the straggler still holds version 1: its files are not pooled yet
        assert cache.pooled_bytes() == 0
        # before the fix: never (the child is stopped, the handle waited for it forever)
        assert _wait_until(lambda: cache.pooled_bytes() > 0), "the hung child pins version 1"
        assert not receiver.process.is_alive()
        # the handle is dead, and says so promptly
        offer = SyncOffer(
            pipeline_id="review2_hung", sync_id="s2", shard_id="s0", version=1,
            transport=TransportKind.ZMQ, control_address="ipc:///nowhere", num_buckets=1,
            total_bytes=1, max_bucket_bytes=1, checksum=ChecksumKind.FLETCHER64, timeout_s=0.5,
        )
        error = receiver.begin_receive(offer).exception(timeout=60)
        assert isinstance(error, ReceiverGoneError), repr(error)
    finally:
        receiver.close()
        cache.close()


def test_a_malformed_offer_does_not_kill_the_receiver_child() -> None:
    """The child parsed an offer outside its error handling: a malformed one killed the child
    loop (the next call then failed with an EOFError naming nothing). Now it is answered with
    a typed error and the child serves the next sync."""
    from rlix_plugins.training.process_receiver import SpawnedReceiver

    cache = _cache("review2_offer")
    w = _weights(2)
    cache.build(1, w.items())
    receiver = SpawnedReceiver("s0", LAYOUT, start_timeout_s=120)
    try:
        # the handle's own pipe: how an offer that bypassed SyncOffer reaches the child
        receiver._conn.send({"pipeline_id": "review2_offer", "version": "one"})
        assert receiver._conn.poll(60), "the child never answered"
        reply = receiver._conn.recv()  # before the fix: EOFError (the child had died)
        assert reply[0] == "error" and "malformed sync offer" in reply[1], reply
        assert receiver.process.is_alive()
        report = sync_version(
            cache, 1, [receiver],
            options=SyncOptions(ack_timeout_s=60, transports={"s0": TransportKind.ZMQ}),
        )
        assert report.succeeded == ("s0",)
        sums = receiver.param_checksums()
        assert set(sums) == set(LAYOUT)
    finally:
        receiver.close()
        cache.close()


# --- transports/collective.py: an oversized broadcast header is refused before the broadcast ------


@pytest.mark.parametrize("nbytes", [256, -8])
def test_an_oversized_broadcast_header_is_refused_before_broadcasting(nbytes: int) -> None:
    """The receive buffer holds ``max_bucket_bytes``; a header announcing more was broadcast
    into a shorter view. With the sender broadcasting its real size gloo aborted the whole
    receiver process ("Received data size doesn't match expected size"); here the sender does
    not broadcast, and the receiver waited for the group timeout and failed untyped."""
    from rlix_plugins.training.transports.collective import BroadcastReceiver, BroadcastSender

    cache = _cache("review2_bcast", StorageKind.PAGEABLE)
    cache.build(1, [("w", torch.arange(64, dtype=torch.float32))])
    try:
        with cache.pinned(1) as version:
            sender = BroadcastSender(TransportKind.GLOO, version, group_size=1, timeout_s=60)
            offer = SyncOffer(
                pipeline_id="review2_bcast", sync_id="s", shard_id="s0", version=1,
                transport=TransportKind.GLOO, control_address="", num_buckets=1,
                total_bytes=256, max_bucket_bytes=16, checksum=ChecksumKind.FLETCHER64,
                timeout_s=60.0, details=sender.details(1),
            )
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                joined = pool.submit(BroadcastReceiver, offer)
                sender.prepare()
                receiver = joined.result(timeout=60)
                try:
                    fetch = pool.submit(receiver.fetch, {"index": 0, "nbytes": nbytes}, [])
                    # before the fix: a broadcast nobody answers (the group timeout, 60 s)
                    error = fetch.exception(timeout=30)
                finally:
                    receiver.close()
                    sender.close()
        assert isinstance(error, WeightSyncError), repr(error)
        assert "max_bucket_bytes" in str(error) and str(nbytes) in str(error)
    finally:
        cache.close()


# --- sync.py: the sender checks each ack's kind and index -----------------------------------------


class ScriptedReceiver(AddressedReceiver):
    """A real receiver on a real ZMQ socket that answers each control message with
    ``answer(header)`` (the protocol is spoken by hand, so its acks can be wrong)."""

    def __init__(self, shard_id: str, answer: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
        super().__init__(shard_id)
        self._answer = answer
        self._pool = concurrent.futures.ThreadPoolExecutor(1)

    def begin_receive(self, offer: SyncOffer) -> concurrent.futures.Future[Any]:
        def run() -> dict[str, Any]:
            sock = zmq.Context.instance().socket(zmq.PAIR)
            sock.connect(offer.control_address)
            try:
                while True:
                    if not sock.poll(60_000, zmq.POLLIN):
                        raise ReceiverGoneError("sender went silent")
                    header = decode(sock.recv_multipart()[0])
                    if header["kind"] == "abort":
                        raise WeightSyncError(header["reason"])
                    reply = self._answer(header)
                    sock.send(encode(reply))
                    if header["kind"] == "end":
                        return dict(reply.get("result") or _result(offer))
            finally:
                sock.close(linger=1000)

        return self._pool.submit(run)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _result(offer: SyncOffer) -> dict[str, Any]:
    return ReceiveResult(offer.shard_id, offer.version, offer.num_buckets, offer.total_bytes,
                         0.0, offer.max_bucket_bytes).to_dict()


def _good_answer(header: dict[str, Any]) -> dict[str, Any]:
    if header["kind"] == "end":
        return {"ok": True, "kind": "done"}
    return {"ok": True, "kind": "ack", "index": header["index"]}


def _sync_to_scripted(
    pipeline: str, seed: int, answer: Callable[[dict[str, Any]], dict[str, Any]]
) -> SyncReport:
    """Version 1 of a fresh cache synced over ZMQ to one ``ScriptedReceiver`` answering with
    ``answer`` (failures are reported, not raised); both are closed after."""
    cache = _cache(pipeline, StorageKind.PAGEABLE)
    cache.build(1, _weights(seed).items())
    receiver = ScriptedReceiver("s0", answer)
    try:
        return sync_version(
            cache, 1, [receiver],
            options=SyncOptions(ack_timeout_s=30, raise_on_error=False,
                                transports={"s0": TransportKind.ZMQ}),
        )
    finally:
        receiver.close()
        cache.close()


@pytest.mark.parametrize(
    ("bad", "what"),
    [
        # acks bucket 0 as bucket 1: was taken as bucket 0's ack
        (lambda h: {"ok": True, "kind": "ack", "index": h["index"] + 1}, "ack of bucket 0"),
        (lambda h: {"ok": True, "kind": "ack"}, "ack of bucket 0"),  # no index
        (lambda h: {"ok": True, "kind": "done"}, "ack of bucket 0"),  # "done" before any bucket
    ],
)
def test_a_wrong_bucket_ack_fails_the_shard(
    bad: Callable[[dict[str, Any]], dict[str, Any]], what: str
) -> None:
    def answer(header: dict[str, Any]) -> dict[str, Any]:
        return bad(header) if header["kind"] == "bucket" else _good_answer(header)

    report = _sync_to_scripted("review2_ack", 3, answer)
    # before the fix: succeeded
    assert report.failed == ("s0",), report
    error = report.outcomes[0].error or ""
    assert what in error and "got" in error, error


def test_a_bucket_ack_in_place_of_the_final_ack_fails_the_shard() -> None:
    def answer(header: dict[str, Any]) -> dict[str, Any]:
        if header["kind"] == "end":
            return {"ok": True, "kind": "ack", "index": 0}
        return _good_answer(header)

    report = _sync_to_scripted("review2_final", 4, answer)
    assert report.failed == ("s0",), report
    assert "final ack" in (report.outcomes[0].error or "")


def test_the_scripted_receiver_speaks_the_protocol() -> None:
    # the helper above is a correct receiver: only the wrong acks fail
    report = _sync_to_scripted("review2_script", 5, _good_answer)
    assert report.succeeded == ("s0",) and report.failed == ()


# --- wire.py: a malformed receive result is a typed error naming the field ------------------------


GOOD_RESULT = {"shard_id": "s0", "version": 1, "buckets": 2, "bytes": 100, "seconds": 0.5,
               "max_bucket_bytes": 64}


@pytest.mark.parametrize(
    ("raw", "what"),
    [
        ({k: v for k, v in GOOD_RESULT.items() if k != "buckets"}, "buckets"),  # was KeyError
        ({**GOOD_RESULT, "version": True}, "version"),  # was read as 1
        ({**GOOD_RESULT, "bytes": 1.5}, "bytes"),  # was truncated to 1
        ({**GOOD_RESULT, "seconds": "fast"}, "seconds"),  # was ValueError from float()
        ({**GOOD_RESULT, "seconds": float("nan")}, "seconds"),
        ({**GOOD_RESULT, "shard_id": None}, "shard_id"),  # was the str 'None'
        (None, "receive result"),  # was TypeError
        ([("shard_id", "s0")], "receive result"),
    ],
)
def test_a_malformed_receive_result_is_refused_by_name(raw: Any, what: str) -> None:
    with pytest.raises(WeightSyncError, match="receive result") as info:
        ReceiveResult.from_dict(raw)
    assert what in str(info.value)


def test_a_good_receive_result_round_trips() -> None:
    assert ReceiveResult.from_dict(GOOD_RESULT).to_dict() == GOOD_RESULT


# --- bucket_cache.py: pipeline id and version lookups -------------------------------------------


@pytest.mark.parametrize("pipeline_id", ["a/b", "", "x\0y", None, 7, "p" * 300])
def test_an_unusable_pipeline_id_is_refused_when_the_cache_is_made(pipeline_id: Any) -> None:
    # "a/b" built nothing: FileNotFoundError at the first shared-memory bucket
    with pytest.raises(WeightCacheError, match="pipeline_id"):
        BucketCache(pipeline_id, CacheConfig(bucket_bytes=BUCKET, storage=StorageKind.SHARED,
                                             ram_reserve_bytes=0))


def test_a_usable_pipeline_id_builds_in_shared_memory() -> None:
    cache = _cache("ft_0123456789ab.v-2")
    try:
        assert cache.build(1, _weights(6).items()) is not None
    finally:
        cache.close()


@pytest.mark.parametrize("version", [True, 1.0])
def test_a_version_that_is_not_an_int_is_not_found(version: Any) -> None:
    cache = _cache("review2_get", StorageKind.PAGEABLE)
    cache.build(1, _weights(7).items())
    try:
        # True == 1 and hash(True) == hash(1): version 1 was found, pinned, synced, freed
        with pytest.raises(UnknownWeightVersionError, match="not an int"):
            cache.info(version)
        with pytest.raises(UnknownWeightVersionError, match="not an int"):
            cache.free(version)
        assert cache.versions() == (1,)
    finally:
        cache.close()


# --- sync.py: SyncOptions refuses a bool timeout -------------------------------------------------


@pytest.mark.parametrize("value", [True, False, "30"])
def test_a_bool_ack_timeout_is_refused(value: Any) -> None:
    with pytest.raises(WeightSyncError, match="ack_timeout_s"):
        SyncOptions(ack_timeout_s=value)


# --- bucket_cache.py: pinned build of weights on a GPU that is not the current one --------------


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs"
)
def test_a_pinned_build_of_weights_on_another_gpu_checksums_the_copied_bytes() -> None:
    """Without GPU staging the D2H copies into pinned memory are asynchronous on the weights'
    device; ``torch.cuda.synchronize()`` waited only for the current device, so weights on
    another one could be checksummed before their copy landed (UNVERIFIED here: no 2-GPU
    machine; the check below is what would catch it)."""
    from rlix_plugins.training.checksum import segment_checksums

    torch.cuda.set_device(0)
    big = torch.randn(8 << 20, device="cuda:1")  # 32 MiB: a long copy
    cache = BucketCache(
        "review2_gpu",
        CacheConfig(bucket_bytes=64 << 20, storage=StorageKind.PINNED, ram_reserve_bytes=0,
                    stage_on_gpu=False),
    )
    try:
        cv = cache.build(1, [("w", big)])
        assert cv is not None
        with cache.pinned(1) as pinned:
            for b in pinned.buckets:
                total, _ = segment_checksums(b.data.numpy(), cache.config.segment_bytes,
                                             cache.config.checksum)
                assert total == b.layout.checksum
        assert torch.equal(dict(cache.named_tensors(1))["w"], big.cpu())
    finally:
        cache.close()



def test_a_timed_out_checksum_request_leaves_no_stale_reply_for_later_syncs() -> None:
    """``param_checksums`` gave up on a slow child (really stopped here, SIGSTOP) but left
    the request with it: once the child went on, its late checksums were read as the next
    sync's reply (that sync failed with "KeyError(0)"), and each later sync got the reply of
    the one before, reporting an old version as applied. A child that misses the deadline is
    now killed, so no late answer can be taken for another."""
    from rlix_plugins.training.process_receiver import SpawnedReceiver

    cache = _cache("review2_stale")
    receiver = SpawnedReceiver("s0", LAYOUT, start_timeout_s=120)
    try:
        pid = receiver.process.pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        with pytest.raises(ReceiverGoneError, match="checksums"):
            receiver.param_checksums(timeout_s=1.0)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
        for version in (1, 2):
            cache.build(version, _weights(10 + version).items())
            report = sync_version(
                cache, version, [receiver],
                options=SyncOptions(ack_timeout_s=30, raise_on_error=False,
                                    transports={"s0": TransportKind.ZMQ}),
            )
            outcome = report.outcomes[0]
            if outcome.ok:
                # before the fix: version 2's sync could report version 1's result
                assert outcome.result is not None and outcome.result.version == version
            else:
                # before the fix: version 1's sync failed on the late checksums: "KeyError(0)"
                assert outcome.error_type == "ReceiverGoneError", outcome
                assert "exited" in (outcome.error or ""), outcome
    finally:
        receiver.close()
        cache.close()
