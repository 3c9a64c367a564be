"""Selective chunked weight sync over real transports (shm, zmq, gloo) to real receivers.

Receivers are the library's real receive loop: on threads of this process (ThreadReceiver) or
in spawned child processes (SpawnedReceiver). GPU transports are at the end, marked ``gpu``.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch

from rlix_plugins.errors import (
    ChecksumMismatchError,
    ReceiverGoneError,
    UnknownWeightVersionError,
    WeightSyncError,
)
from rlix_plugins.training.bucket_cache import BucketCache, CacheConfig, StorageKind
from rlix_plugins.training.checksum import ChecksumKind, tensor_fingerprint
from rlix_plugins.training.process_receiver import SpawnedReceiver
from rlix_plugins.training.receiver import (
    StateDictTarget,
    ThreadReceiver,
    receive_weights_streaming,
)
from rlix_plugins.training.sync import SyncOptions, sync_version
from rlix_plugins.training.transports.selection import ReceiverLocation, SenderLocation
from rlix_plugins.training.wire import SyncOffer, TransportKind

pytestmark = pytest.mark.integration

BUCKET = 64 << 10


def _weights(seed: int, n: int = 12, size: int = 5000) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for i in range(n):
        dtype = (torch.bfloat16, torch.float32, torch.float16)[i % 3]
        out[f"layers.{i}.weight"] = torch.randn(size, generator=g).to(dtype)
    return out


def _zeros_like(w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in w.items()}


def _cache(pipeline: str, version: int, w: dict[str, torch.Tensor]) -> BucketCache:
    cache = BucketCache(
        pipeline, CacheConfig(bucket_bytes=BUCKET, storage=StorageKind.SHARED, ram_reserve_bytes=0)
    )
    cache.build(version, w.items())
    return cache


@pytest.mark.parametrize("kind", [TransportKind.SHM, TransportKind.ZMQ, TransportKind.GLOO])
def test_sync_reaches_exactly_the_chosen_receivers(kind: TransportKind) -> None:
    w = _weights(1)
    cache = _cache("ft_a", 3, w)
    targets = [StateDictTarget(_zeros_like(w)) for _ in range(4)]
    receivers = [ThreadReceiver(f"shard{i}", t.load_weights) for i, t in enumerate(targets)]
    chosen = [receivers[1], receivers[3]]
    report = sync_version(
        cache,
        3,
        chosen,
        options=SyncOptions(transports={r.shard_id: kind for r in chosen}, ack_timeout_s=30),
    )
    assert report.succeeded == ("shard1", "shard3") and report.failed == ()
    assert report.num_buckets > 1
    for o in report.outcomes:
        assert o.transport is kind and o.result is not None
        assert o.result.buckets == report.num_buckets and o.result.version == 3
        assert o.result.max_bucket_bytes <= BUCKET
    for i, t in enumerate(targets):
        for name, ref in w.items():
            if i in (1, 3):
                assert torch.equal(t.tensors[name], ref), (i, name)
            else:
                assert not t.tensors[name].any(), (i, name)  # never touched
    assert receivers[0].versions == [] and receivers[2].versions == []
    assert receivers[1].versions == [3]
    for r in receivers:
        r.close()
    cache.close()


def test_transport_is_selected_by_capability() -> None:
    w = _weights(2, n=3)
    cache = _cache("ft_sel", 1, w)
    here = ReceiverLocation()
    other_host = ReceiverLocation(host="elsewhere:boot")
    t1, t2 = StateDictTarget(_zeros_like(w)), StateDictTarget(_zeros_like(w))
    r1 = ThreadReceiver("local", t1.load_weights, here)
    r2 = ThreadReceiver("remote", t2.load_weights, other_host)
    report = sync_version(
        cache, 1, [r1, r2], sender=SenderLocation(), options=SyncOptions(advertise_host="127.0.0.1")
    )
    kinds = {o.shard_id: o.transport for o in report.outcomes}
    assert kinds == {"local": TransportKind.SHM, "remote": TransportKind.ZMQ}
    assert all(torch.equal(t2.tensors[k], v) for k, v in w.items())
    r1.close()
    r2.close()
    cache.close()


@pytest.mark.parametrize("kind", [TransportKind.ZMQ, TransportKind.GLOO])
def test_remote_receivers_are_admitted_by_their_hello(kind: TransportKind) -> None:
    # A remote receiver's control socket is a tcp ROUTER that admits it by its hello (control
    # protocol 2). A broadcast group's receivers hello before they join the rendezvous: the
    # sender admits them all first, then forms the group.
    w = _weights(3, n=4)
    cache = _cache("ft_hello", 1, w)
    far = ReceiverLocation(host="elsewhere:boot")
    targets = [StateDictTarget(_zeros_like(w)) for _ in range(2)]
    receivers = [ThreadReceiver(f"far{i}", t.load_weights, far) for i, t in enumerate(targets)]
    try:
        report = sync_version(
            cache, 1, receivers,
            options=SyncOptions(advertise_host="127.0.0.1", ack_timeout_s=30,
                                transports={r.shard_id: kind for r in receivers}),
        )
        assert report.succeeded == ("far0", "far1") and report.failed == ()
        for t in targets:
            assert all(torch.equal(t.tensors[k], v) for k, v in w.items())
    finally:
        for r in receivers:
            r.close()
        cache.close()


def test_two_pipelines_sync_concurrently() -> None:
    # Each receiver waits inside its first load_weights until the OTHER pipeline's receiver is
    # also inside one: this passes only if neither sync waits for the other (no global lock).
    barrier = threading.Barrier(2, timeout=20)
    caches, targets, receivers = [], [], []
    for p in range(2):
        w = _weights(10 + p)
        caches.append(_cache(f"ft_p{p}", 1, w))
        target = StateDictTarget(_zeros_like(w))
        seen = {"first": True}

        def load(
            ts: list[tuple[str, torch.Tensor]],
            target: StateDictTarget = target,
            seen: dict[str, bool] = seen,
        ) -> None:
            if seen["first"]:
                seen["first"] = False
                barrier.wait()
            target.load_weights(ts)

        targets.append((target, w))
        receivers.append(ThreadReceiver(f"p{p}-shard0", load))
    results: dict[int, object] = {}

    def run(p: int) -> None:
        try:
            results[p] = sync_version(caches[p], 1, [receivers[p]])
        except Exception as exc:
            results[p] = exc

    threads = [threading.Thread(target=run, args=(p,)) for p in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert all(not isinstance(r, Exception) for r in results.values()), results
    for target, w in targets:
        assert all(torch.equal(target.tensors[k], v) for k, v in w.items())
    for r in receivers:
        r.close()
    for c in caches:
        c.close()


def test_unknown_version_fails_before_contacting_anyone() -> None:
    cache = _cache("ft_u", 1, _weights(3, n=2))
    called: list[SyncOffer] = []

    class Recording(ThreadReceiver):
        def begin_receive(self, offer: SyncOffer):  # type: ignore[no-untyped-def]
            called.append(offer)
            return super().begin_receive(offer)

    r = Recording("s", StateDictTarget(allocate_missing=True).load_weights)
    with pytest.raises(UnknownWeightVersionError, match="weight version 2 is not cached"):
        sync_version(cache, 2, [r])
    assert called == []
    r.close()
    cache.close()


def test_corrupted_bucket_is_detected_and_not_applied() -> None:
    w = _weights(4)
    cache = _cache("ft_c", 1, w)
    with cache.pinned(1) as cv:
        cv.buckets[0].storage[100] ^= 0xFF  # bytes change after the checksum was taken
    good_target = StateDictTarget(_zeros_like(w))
    bad = ThreadReceiver("s0", good_target.load_weights)
    with pytest.raises(ChecksumMismatchError, match=r"failed for \['s0'\].*bucket 0"):
        sync_version(cache, 1, [bad], options=SyncOptions(ack_timeout_s=10))
    assert all(not t.any() for t in good_target.tensors.values())  # nothing applied
    bad.close()
    cache.close()


class _StreamingReceiver:
    """The library's streaming receive loop (the vLLM path) on a thread; keeps copies."""

    def __init__(self, shard_id: str) -> None:
        self.shard_id = shard_id
        self.location = ReceiverLocation()
        self.got: dict[str, torch.Tensor] = {}
        self.versions: list[int] = []
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)

    def begin_receive(self, offer: SyncOffer) -> concurrent.futures.Future[object]:
        def consume(weights: Iterator[tuple[str, torch.Tensor]]) -> None:
            for name, t in weights:
                self.got[name] = t.clone()

        def run() -> object:
            result = receive_weights_streaming(offer, consume)
            self.versions.append(result.version)
            return result

        return self._pool.submit(run)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


@pytest.mark.parametrize("kind", [TransportKind.SHM, TransportKind.ZMQ])
@pytest.mark.parametrize("path", ["destination", "load_weights", "streaming"])
def test_corrupted_segment_is_detected_and_never_applied(kind: TransportKind, path: str) -> None:
    # 32 KiB segments, 256 KiB buckets: the corruption sits in a later segment of bucket 1,
    # so earlier segments are applied (the documented guarantee) and the bad one never is.
    seg = 32 << 10
    w = _weights(9, n=40, size=6000)
    cache = BucketCache(
        "ft_seg",
        CacheConfig(bucket_bytes=256 << 10, storage=StorageKind.SHARED, ram_reserve_bytes=0,
                    segment_bytes=seg),
    )
    cache.build(1, w.items())
    with cache.pinned(1) as cv:
        assert len(cv.buckets) >= 3 and cv.buckets[1].layout.segment_bytes == seg
        first_names = {e.name for e in cv.buckets[0].layout.entries}
        hit = next(e for e in cv.buckets[1].layout.entries if e.offset >= 2 * seg)
        bad_segment = (hit.offset + 8) // seg
        cv.buckets[1].storage[hit.offset + 8] ^= 0x5A  # after the checksums were taken
    target = StateDictTarget(_zeros_like(w))
    receiver: ThreadReceiver | _StreamingReceiver
    if path == "streaming":
        receiver = _StreamingReceiver("s0")
    else:
        receiver = ThreadReceiver(
            "s0", target.load_weights,
            destination=target.destination if path == "destination" else None,
        )
    try:
        with pytest.raises(
            ChecksumMismatchError, match=rf"failed for \['s0'\].*bucket 1 .*segment {bad_segment} "
        ):
            sync_version(cache, 1, [receiver], options=SyncOptions(
                transports={"s0": kind}, ack_timeout_s=20))
        assert receiver.versions == []  # the version is not reported applied
        got = receiver.got if isinstance(receiver, _StreamingReceiver) else target.tensors
        assert hit.name not in got or not got[hit.name].any()  # its bytes never arrived
        for name in first_names:  # bucket 0 verified and applied before bucket 1 arrived
            assert torch.equal(got[name], w[name]), name
        with cache.pinned(1) as cv:
            later = [e.name for b in cv.buckets[2:] for e in b.layout.entries]
        assert all(n not in got or not got[n].any() for n in later)
    finally:
        receiver.close()
        cache.close()


def test_receiver_failing_mid_sync_fails_only_itself() -> None:
    w = _weights(5)
    cache = _cache("ft_f", 1, w)
    calls = {"n": 0}
    ok_target = StateDictTarget(_zeros_like(w))

    def crash(ts: list[tuple[str, torch.Tensor]]) -> None:
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("worker crashed")

    crashing = ThreadReceiver("bad", crash)
    healthy = ThreadReceiver("good", ok_target.load_weights)
    report = sync_version(
        cache, 1, [crashing, healthy], options=SyncOptions(raise_on_error=False, ack_timeout_s=10)
    )
    assert report.succeeded == ("good",) and report.failed == ("bad",)
    assert "worker crashed" in (report.outcomes[0].error or "")
    assert all(torch.equal(ok_target.tensors[k], v) for k, v in w.items())
    with pytest.raises(WeightSyncError, match=r"failed for \['bad'\] \(succeeded: \['good'\]\)"):
        calls["n"] = 0
        sync_version(cache, 1, [crashing, healthy], options=SyncOptions(ack_timeout_s=10))
    crashing.close()
    healthy.close()
    cache.close()


def _layout(w: dict[str, torch.Tensor]) -> dict[str, tuple[str, tuple[int, ...]]]:
    return {k: (str(v.dtype).removeprefix("torch."), tuple(v.shape)) for k, v in w.items()}


def test_spawned_receivers_get_the_version_with_one_bucket_of_extra_memory() -> None:
    # 16 tensors of 1 MiB = 16 MiB per version, 2 MiB buckets: a receiver that buffered the
    # version would rise by >= 16 MiB; one bucket at a time stays far below.
    g = torch.Generator().manual_seed(7)
    w = {f"w{i}": torch.randn(512, 512, generator=g).to(torch.float32) for i in range(16)}
    bucket = 2 << 20
    cache = BucketCache(
        "ft_mp",
        CacheConfig(bucket_bytes=bucket + 4096, storage=StorageKind.SHARED, ram_reserve_bytes=0),
    )
    cache.build(1, w.items())
    receivers = [
        SpawnedReceiver("zmq0", _layout(w)),
        SpawnedReceiver("shm0", _layout(w)),
        SpawnedReceiver("idle", _layout(w)),
    ]
    try:
        opts = SyncOptions(transports={"zmq0": TransportKind.ZMQ, "shm0": TransportKind.SHM})
        # the first sync in a process also pays one-time costs (imports, ZMQ context, heap
        # growth: ~6 MiB measured); the bound is asserted on the second, steady-state sync
        sync_version(cache, 1, receivers[:2], options=opts)
        report = sync_version(cache, 1, receivers[:2], options=opts)
        assert report.succeeded == ("zmq0", "shm0")
        expected = {k: tensor_fingerprint(v) for k, v in w.items()}
        for r in receivers[:2]:
            stats = r.last_stats
            assert stats is not None and r.param_checksums() == expected
            assert stats.peak_extra_bytes < 2 * bucket, (r.shard_id, stats.peak_extra_bytes)
            # steady state: the mapped shared size did not change, so the rise is private
            assert stats.private_peak_is_exact, stats
        shm_stats = receivers[1].last_stats
        assert shm_stats is not None
        # the shm receiver keeps the cache's files mapped (shared pages, not its own memory)
        # and copies from them straight into its tensors: no private bucket-sized buffer
        assert shm_stats.shared_mapped_bytes >= 16 << 20
        assert shm_stats.private_peak_extra_bytes < bucket
        assert receivers[2].syncs == 0
    finally:
        for r in receivers:
            r.close()
        cache.close()


def test_dead_receiver_process_is_reported_gone_quickly() -> None:
    w = _weights(6, n=4)
    cache = _cache("ft_d", 1, w)
    dead = SpawnedReceiver("dead", _layout(w))
    alive = SpawnedReceiver("alive", _layout(w))
    dead.kill()
    try:
        started = time.monotonic()
        with pytest.raises(ReceiverGoneError, match=r"failed for \['dead'\]"):
            sync_version(cache, 1, [dead, alive], options=SyncOptions(ack_timeout_s=60))
        assert time.monotonic() - started < 20  # detected from the dead process, not a timeout
        assert alive.syncs == 1
    finally:
        dead.close()
        alive.close()
        cache.close()


def _gpu_uuid(index: int) -> str:
    props = torch.cuda.get_device_properties(index)
    return str(getattr(props, "uuid", f"gpu{index}"))


def _sync_to_gpu_receiver(
    kind: TransportKind, receiver_device: str, receiver_gpu: int, sender_gpu: int = 0
) -> None:
    w = _weights(8)
    cache = BucketCache("ft_gpu", CacheConfig(bucket_bytes=BUCKET, ram_reserve_bytes=0))
    assert cache.resolve_storage() is StorageKind.PINNED  # a CUDA device: pinned buckets
    # from GPU tensors, as a trainer's
    cache.build(1, ((k, v.to(f"cuda:{sender_gpu}")) for k, v in w.items()))
    location = ReceiverLocation(gpu_uuid=_gpu_uuid(receiver_gpu))
    receiver = SpawnedReceiver("g0", _layout(w), location, device=receiver_device)
    before = torch.cuda.current_device()
    try:
        torch.cuda.set_device(sender_gpu)  # the trainer's device: the sync stages there
        report = sync_version(
            cache,
            1,
            [receiver],
            sender=SenderLocation(gpu_uuid=_gpu_uuid(sender_gpu), cuda=True),
            options=SyncOptions(transports={"g0": kind}),
        )
        assert report.succeeded == ("g0",)
        assert report.outcomes[0].transport is kind
        # fingerprints computed in the child on its own device (GPU checksum for cuda)
        assert receiver.param_checksums() == {k: tensor_fingerprint(v) for k, v in w.items()}
    finally:
        torch.cuda.set_device(before)
        receiver.close()
        cache.close()


def test_spawned_receiver_rejects_an_unknown_device_before_starting() -> None:
    with pytest.raises(WeightSyncError, match="'cpu', 'cuda' or 'cuda:N', got 'gpu0'"):
        SpawnedReceiver("bad", {}, device="gpu0")


@pytest.mark.gpu
@pytest.mark.parametrize("receiver_device", ["cuda", "cpu"])
def test_cuda_ipc_to_a_process_on_the_same_gpu(receiver_device: str) -> None:
    """CUDA IPC of the sender's staging buffer into another process on the same GPU; the
    receiver's tensors on the GPU (an engine's weights) or on the host."""
    _sync_to_gpu_receiver(TransportKind.CUDA_IPC, receiver_device, 0)


@pytest.mark.gpu
@pytest.mark.parametrize("stage_on_gpu", [True, False])
def test_cache_built_from_gpu_weights_serves_host_receivers(stage_on_gpu: bool) -> None:
    """Buckets of CUDA weights packed and checksummed on the GPU (or on the host) have the
    layout and checksums of a cache built from the same weights on the host, and a host
    receiver verifies every segment of them."""
    w = _weights(9)
    cfg = CacheConfig(bucket_bytes=BUCKET, ram_reserve_bytes=0, stage_on_gpu=stage_on_gpu)
    cache = BucketCache("ft_gpu_stage", cfg)
    cache.build(1, ((k, v.cuda()) for k, v in w.items()))
    ref = BucketCache(
        "ft_gpu_ref",
        CacheConfig(bucket_bytes=BUCKET, storage=StorageKind.PAGEABLE, ram_reserve_bytes=0),
    )
    ref.build(1, w.items())
    target = StateDictTarget(_zeros_like(w))
    receiver = ThreadReceiver("h0", target.load_weights)
    try:
        with cache.pinned(1) as built, ref.pinned(1) as expected:
            assert built.storage is StorageKind.PINNED
            assert [b.layout for b in built.buckets] == [b.layout for b in expected.buckets]
        report = sync_version(
            cache, 1, [receiver], options=SyncOptions(transports={"h0": TransportKind.ZMQ})
        )
        assert report.succeeded == ("h0",)
        assert all(torch.equal(target.tensors[k], v) for k, v in w.items())
    finally:
        receiver.close()
        cache.close()
        ref.close()


@pytest.mark.gpu
def test_cache_build_falls_back_to_host_checksums_when_the_gpu_is_full(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """No room for the staging bucket (right after a train step): the build still succeeds,
    checksummed on the host, with the same layout as a host-built cache."""
    w = _weights(10)
    on_gpu = [(k, v.cuda()) for k, v in w.items()]
    big = 64 << 20
    cfg = CacheConfig(bucket_bytes=big, ram_reserve_bytes=0)
    torch.cuda.empty_cache()
    hog: list[torch.Tensor] = []
    free, _ = torch.cuda.mem_get_info()
    while free > big // 2:  # leave less than one staging bucket free
        hog.append(torch.empty(max(free - big // 4, 1 << 20), dtype=torch.uint8, device="cuda"))
        free, _ = torch.cuda.mem_get_info()
    cache = BucketCache("ft_gpu_full", cfg)
    ref = BucketCache("ft_gpu_full_ref", replace(cfg, storage=StorageKind.PAGEABLE))
    try:
        with caplog.at_level("WARNING"):
            cache.build(1, on_gpu)
        assert "no GPU memory for a" in caplog.text
        ref.build(1, w.items())
        with cache.pinned(1) as built, ref.pinned(1) as expected:
            assert [b.layout for b in built.buckets] == [b.layout for b in expected.buckets]
    finally:
        hog.clear()
        # give the hog back to the driver, not only to torch's caching allocator: a process
        # started after this test (an NCCL rank) could not create its CUDA context otherwise
        # (seen on an H200: cudaSetDevice failed with out of memory)
        torch.cuda.empty_cache()
        cache.close()
        ref.close()


@pytest.mark.gpu
def test_nccl_broadcast_to_a_process_on_another_gpu() -> None:
    """NCCL refuses two ranks of one communicator on the same GPU: needs a second GPU."""
    if torch.cuda.device_count() < 2:
        pytest.skip("NCCL to another process needs a second GPU; this machine has one")
    _sync_to_gpu_receiver(TransportKind.NCCL, "cuda:1", 1)


@pytest.mark.gpu
def test_cuda_ipc_from_a_trainer_on_its_second_gpu() -> None:
    """The sync's threads start on device 0; a trainer on GPU 1 must still stage on GPU 1,
    where its same-GPU receiver maps the handle."""
    if torch.cuda.device_count() < 2:
        pytest.skip("a trainer on a second GPU needs a second GPU; this machine has one")
    _sync_to_gpu_receiver(TransportKind.CUDA_IPC, "cuda:1", 1, sender_gpu=1)


def _listening(port: int) -> bool:
    import socket

    with socket.socket() as c:
        c.settimeout(1.0)
        return c.connect_ex(("127.0.0.1", port)) == 0


def test_broadcast_close_stops_the_rendezvous_server() -> None:
    """A sync's sender closes its TCPStore server itself (not when garbage collected): a
    trainer syncing every step would otherwise keep one listening port per sync."""
    from rlix_plugins.training.transports.collective import BroadcastReceiver, BroadcastSender

    cache = _cache("ft_b", 1, _weights(2, n=2, size=64))
    with cache.pinned(1) as version:
        sender = BroadcastSender(TransportKind.GLOO, version, group_size=1, timeout_s=30)
    details = sender.details(1)
    port = int(details["store_port"])
    offer = SyncOffer(
        pipeline_id="ft_b", sync_id="s1", shard_id="shard0", version=1,
        transport=TransportKind.GLOO, control_address="", num_buckets=0, total_bytes=0,
        max_bucket_bytes=16, checksum=ChecksumKind.CRC32, timeout_s=30.0, details=details,
    )
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        joined = pool.submit(BroadcastReceiver, offer)
        sender.prepare()
        receiver = joined.result(timeout=30)
    assert _listening(port)
    receiver.close()
    sender.close()
    deadline = time.monotonic() + 5.0
    while _listening(port) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _listening(port)
    sender.close()  # idempotent
    receiver.close()
    with pytest.raises(WeightSyncError, match="closed"):
        sender.prepare()
    cache.close()
