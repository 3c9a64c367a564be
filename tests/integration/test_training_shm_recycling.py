"""Recycled /dev/shm bucket files and receivers' kept mappings.

The cache rewrites a freed version's files for a later version, and same-host receivers keep
those files mapped across syncs. These tests check that a kept mapping only ever delivers the
announced version's bytes: across processes (a spawned receiver), and when a kept mapping no
longer shows what the sender announced (the file was replaced, or its header disagrees).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from rlix_plugins.errors import WeightSyncError
from rlix_plugins.training.bucket_cache import BucketCache, CacheConfig, StorageKind
from rlix_plugins.training.checksum import ChecksumKind, tensor_fingerprint
from rlix_plugins.training.process_receiver import SpawnedReceiver
from rlix_plugins.training.receiver import StateDictTarget, ThreadReceiver
from rlix_plugins.training.sync import SyncOptions, sync_version
from rlix_plugins.training.transports.shm import (
    ShmReceiver,
    kept_mapping_bytes,
    mappings_opened,
    release_shm_mappings,
)
from rlix_plugins.training.wire import (
    SHM_FILE_HEADER_BYTES,
    ShmFileHeader,
    SyncOffer,
    TransportKind,
)

pytestmark = pytest.mark.integration

BUCKET = 128 << 10


def _weights(seed: int, n: int = 10) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(8000, generator=g) for i in range(n)}


def _inverted(w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every bit flipped: a version that differs from ``w`` in every byte."""
    return {k: torch.bitwise_not(v.view(torch.int32)).view(v.dtype) for k, v in w.items()}


def _files(cache: BucketCache, version: int) -> list[tuple[Path, tuple[int, int] | None]]:
    with cache.pinned(version) as cv:
        return [(b.shm_path, b.file_id) for b in cv.buckets if b.shm_path is not None]


def _cache(pipeline: str) -> BucketCache:
    return BucketCache(
        pipeline,
        CacheConfig(bucket_bytes=BUCKET, storage=StorageKind.SHARED, ram_reserve_bytes=0),
    )


def test_recycled_files_deliver_each_new_version_to_a_receiver_process() -> None:
    a = _weights(1)
    versions = {1: a, 2: _inverted(a), 3: _weights(2)}
    versions[4] = _inverted(versions[3])
    cache = _cache("ft_recycle")
    layout = {k: ("float32", tuple(v.shape)) for k, v in a.items()}
    receiver = SpawnedReceiver("r0", layout)
    opts = SyncOptions(transports={"r0": TransportKind.SHM}, ack_timeout_s=60)
    try:
        seen: dict[int, list[tuple[Path, tuple[int, int] | None]]] = {}
        shared: dict[int, int] = {}
        for v, w in versions.items():
            cache.build(v, w.items())
            cache.activate(v)
            seen[v] = _files(cache, v)
            sync_version(cache, v, [receiver], options=opts)
            # the receiver holds exactly this version, though its mappings may be of files
            # that held another version when it mapped them
            assert receiver.param_checksums() == {k: tensor_fingerprint(t) for k, t in w.items()}, v
            stats = receiver.last_stats
            assert stats is not None
            shared[v] = stats.shared_mapped_bytes
        # versions 3 and 4 were written into the files of 1 and 2 (same names, same inodes)
        assert seen[3] == seen[1] and seen[4] == seen[2] and seen[1] != seen[2]
        # ... so the receiver mapped nothing new for them: its shared-mapped size stayed the
        # same and its peak rise during the sync was its own memory only, under one bucket
        assert shared[3] == shared[2] == shared[4] > 0
        assert stats.private_peak_is_exact and stats.private_peak_extra_bytes < BUCKET
    finally:
        receiver.close()
        cache.close()


def test_kept_mappings_are_reused_and_dropped_when_the_files_go() -> None:
    w = _weights(3)
    cache = _cache("ft_keep")
    target = StateDictTarget({k: torch.zeros_like(v) for k, v in w.items()})
    receiver = ThreadReceiver("k0", target.load_weights, destination=target.destination)
    try:
        cache.build(1, w.items())
        cache.activate(1)
        sync_version(cache, 1, [receiver])
        opened = mappings_opened()
        kept = kept_mapping_bytes("ft_keep")
        assert kept >= len(_files(cache, 1)) * BUCKET
        cache.build(2, _inverted(w).items())
        cache.activate(2)  # version 1's files go to the pool
        sync_version(cache, 2, [receiver])
        cache.build(3, w.items())  # rewrites version 1's files
        cache.activate(3)
        target.tensors = {k: torch.zeros_like(v) for k, v in w.items()}
        sync_version(cache, 3, [receiver])
        assert all(torch.equal(target.tensors[k], v) for k, v in w.items())
        n_files = len(_files(cache, 3))
        assert mappings_opened() - opened == n_files  # version 2's new files only
        cache.close()  # unlinks every file; the receiver notices at its next sync
        other = _cache("ft_keep")
        other.build(1, w.items())
        sync_version(other, 1, [receiver])
        # the closed cache's mappings were dropped; only the new cache's files are mapped
        assert kept_mapping_bytes("ft_keep") == len(_files(other, 1)) * (
            BUCKET + SHM_FILE_HEADER_BYTES
        )
        assert release_shm_mappings("ft_keep") == len(_files(other, 1))
        assert kept_mapping_bytes("ft_keep") == 0
        other.close()
    finally:
        receiver.close()
        cache.close()


def _write_bucket(path: Path, header: ShmFileHeader, payload: np.ndarray) -> tuple[int, int]:
    with open(path, "wb") as f:
        f.write(header.to_words().tobytes().ljust(SHM_FILE_HEADER_BYTES, b"\0"))
        f.write(payload.tobytes())
    st = os.stat(path)
    return int(st.st_dev), int(st.st_ino)


def _offer(pipeline: str, version: int) -> SyncOffer:
    return SyncOffer(
        pipeline_id=pipeline, sync_id="t", shard_id="s", version=version,
        transport=TransportKind.SHM, control_address="ipc:///nonexistent", num_buckets=1,
        total_bytes=4096, max_bucket_bytes=4096, checksum=ChecksumKind.FLETCHER64,
        timeout_s=5, details={"keep_mappings": True},
    )


def _header(path: Path, file_id: tuple[int, int], fh: ShmFileHeader) -> dict[str, object]:
    return {
        "kind": "bucket", "index": fh.index, "nbytes": fh.nbytes, "checksum": fh.checksum,
        "path": str(path), "file_id": list(file_id), "data_offset": SHM_FILE_HEADER_BYTES,
        "file_header": fh.to_wire(),
    }


def test_a_stale_kept_mapping_never_delivers_the_old_bytes(tmp_path: Path) -> None:
    pipeline = "ft_stale"
    path = tmp_path / "bucket"
    old = np.full(4096, 0x11, dtype=np.uint8)
    new = np.full(4096, 0x22, dtype=np.uint8)
    h_old = ShmFileHeader(token=7, generation=1, version=1, index=0, nbytes=4096, checksum=5)
    old_id = _write_bucket(path, h_old, old)
    rx = ShmReceiver(_offer(pipeline, 1))
    assert bytes(rx.fetch(_header(path, old_id, h_old), []).numpy()) == old.tobytes()
    rx.close()  # the mapping of the old file is kept
    assert kept_mapping_bytes(pipeline) > 0
    # The path now names another file holding version 2. Suppose the sender announced it with
    # the OLD file identity (inode numbers can be reused): the kept mapping still matches that
    # identity but shows generation 1, so it is dropped; the file at the path is not the one
    # announced, so the fetch fails rather than return either file's bytes.
    path.unlink()
    h_new = ShmFileHeader(token=7, generation=2, version=2, index=0, nbytes=4096, checksum=6)
    tmp = tmp_path / "next"
    new_id = _write_bucket(tmp, h_new, new)
    os.replace(tmp, path)
    rx = ShmReceiver(_offer(pipeline, 2))
    with pytest.raises(WeightSyncError, match="was replaced"):
        rx.fetch(_header(path, old_id, h_new), [])
    # announced correctly, the new file is mapped and its bytes delivered
    assert bytes(rx.fetch(_header(path, new_id, h_new), []).numpy()) == new.tobytes()
    # a header that disagrees with the file (another generation) is refused, even freshly mapped
    h_wrong = ShmFileHeader(token=7, generation=3, version=2, index=0, nbytes=4096, checksum=6)
    with pytest.raises(WeightSyncError, match="stale or foreign bucket file"):
        rx.fetch(_header(path, new_id, h_wrong), [])
    # an announcement for another version than the offer's is refused before mapping anything
    with pytest.raises(WeightSyncError, match="does not match the offer"):
        rx.fetch(_header(path, new_id, h_old), [])
    rx.close()
    release_shm_mappings(pipeline)
    assert kept_mapping_bytes(pipeline) == 0


def test_a_tampered_file_header_fails_the_sync_and_applies_nothing() -> None:
    w = _weights(4)
    cache = _cache("ft_tamper")
    cache.build(1, w.items())
    with cache.pinned(1) as cv:
        header = cv.buckets[0]._header
        assert header is not None
        header[2] += 1  # the file now claims another generation than the sender announces
    target = StateDictTarget({k: torch.zeros_like(v) for k, v in w.items()})
    receiver = ThreadReceiver("t0", target.load_weights, destination=target.destination)
    try:
        with pytest.raises(WeightSyncError, match="stale or foreign bucket file"):
            sync_version(cache, 1, [receiver], options=SyncOptions(ack_timeout_s=20))
        assert receiver.versions == []
        assert all(not t.any() for t in target.tensors.values())
    finally:
        receiver.close()
        cache.close()
        release_shm_mappings("ft_tamper")
