"""Versioned CPU bucket cache: round trips, version lifetime, typed errors, checksums."""

from __future__ import annotations

import os
import types
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from rlix_plugins.errors import (
    InsufficientHostMemoryError,
    OversizeTensorError,
    RlixPluginsError,
    UnknownWeightVersionError,
    WeightCacheError,
)
from rlix_plugins.training.bucket_cache import SHM_PREFIX, BucketCache, CacheConfig, StorageKind
from rlix_plugins.training.checksum import (
    ChecksumKind,
    checksum_bytes,
    fletcher64_numpy,
    fletcher64_torch,
    segment_checksums,
    segment_checksums_torch,
)
from rlix_plugins.training.host_memory import HostMemory, available_host_memory


def _weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(64, 33, generator=g).to(torch.bfloat16),
        "layer.0.q.weight": torch.randn(17, 5, generator=g).to(torch.float16),
        "layer.0.norm": torch.randn(33, generator=g),
        "layer.0.scale": torch.randn(3, 3, generator=g, dtype=torch.float64),
        "counts": torch.randint(-(2**40), 2**40, (11,), generator=g, dtype=torch.int64),
        "mask": torch.randint(0, 2, (7, 3), generator=g).bool(),
        "scalar": torch.tensor(3.5, dtype=torch.bfloat16),
        "bytes": torch.randint(0, 255, (13,), generator=g, dtype=torch.uint8),
        "empty": torch.empty(0, 4),
        "noncontig": torch.randn(8, 6, generator=g).t(),
        "lm_head.weight": torch.randn(64, 33, generator=g).to(torch.bfloat16),
    }


def _shm_files() -> set[str]:
    """This process's bucket files: other processes (a test suite running alongside) make
    their own, named by their pid."""
    mine = f"{SHM_PREFIX}{os.getpid()}-"
    return {f for f in os.listdir("/dev/shm") if f.startswith(mine)}


@pytest.mark.parametrize("storage", [StorageKind.SHARED, StorageKind.PAGEABLE])
@pytest.mark.parametrize("checksum", list(ChecksumKind))
def test_round_trip_is_bit_exact_for_every_dtype(
    storage: StorageKind, checksum: ChecksumKind
) -> None:
    w = _weights(1)
    cache = BucketCache(
        "p", CacheConfig(bucket_bytes=8192, storage=storage, checksum=checksum, ram_reserve_bytes=0)
    )
    info = cache.build(7, w.items())
    assert info is not None and info.num_tensors == len(w) and info.storage is storage
    assert info.num_buckets > 1  # small buckets force packing across several
    out = dict(cache.named_tensors(7))
    assert list(out) == list(w)
    for name, t in w.items():
        assert out[name].dtype == t.dtype and out[name].shape == t.shape, name
        # bit-exact: compare raw bytes, not values (NaN-safe, -0.0-safe)
        assert out[name].contiguous().view(-1).view(torch.uint8).tolist() == (
            t.contiguous().view(-1).view(torch.uint8).tolist()
        ), name
    cache.close()


def test_buckets_respect_capacity_and_alignment() -> None:
    cache = BucketCache(
        "p", CacheConfig(bucket_bytes=1024, storage=StorageKind.PAGEABLE, ram_reserve_bytes=0)
    )
    w = {f"t{i}": torch.randn(50 + i) for i in range(20)}
    cache.build(1, w.items())
    with cache.pinned(1) as cv:
        for b in cv.buckets:
            assert b.layout.nbytes <= 1024
            for e in b.layout.entries:
                assert e.offset % 64 == 0
                assert e.offset + e.nbytes <= b.layout.nbytes
        assert sum(len(b.layout.entries) for b in cv.buckets) == 20
    cache.close()


def test_versions_keep_latest_and_active_and_free_the_rest() -> None:
    files0 = _shm_files()
    cache = BucketCache(
        "p", CacheConfig(bucket_bytes=8192, storage=StorageKind.SHARED, ram_reserve_bytes=0)
    )
    cache.build(1, _weights(1).items())
    cache.activate(1)
    cache.build(2, _weights(2).items())
    assert cache.versions() == (1, 2)
    assert (cache.latest_version, cache.active_version) == (2, 1)
    cache.build(3, _weights(3).items())  # 2 is neither latest nor active any more
    assert cache.versions() == (1, 3)
    cache.activate(3)
    assert cache.versions() == (3,)
    with pytest.raises(UnknownWeightVersionError, match="weight version 2 is not cached"):
        cache.info(2)
    got = dict(cache.named_tensors(3))
    assert torch.equal(got["embed.weight"], _weights(3)["embed.weight"])
    cache.close()
    assert cache.versions() == ()
    assert _shm_files() == files0  # every /dev/shm bucket file removed


def test_a_version_in_use_is_freed_only_when_its_sync_ends() -> None:
    cache = BucketCache("p", CacheConfig(bucket_bytes=8192, ram_reserve_bytes=0))
    cache.build(1, _weights(1).items())
    cache.activate(1)
    with cache.pinned(1) as cv:
        cache.build(2, _weights(2).items())
        cache.activate(2)  # retires 1 while a "sync" still holds it
        assert cache.versions() == (2,)
        assert not cv.freed and cv.buckets
        assert torch.equal(cv.buckets[0].data[:8], cv.buckets[0].storage[:8])  # still readable
    assert cv.freed and cv.buckets == []
    cache.close()


def test_unknown_version_and_duplicate_version_are_typed_errors() -> None:
    cache = BucketCache("p", CacheConfig(bucket_bytes=8192, ram_reserve_bytes=0))
    with pytest.raises(UnknownWeightVersionError) as ei, cache.pinned(5):
        pass
    assert isinstance(ei.value, RlixPluginsError) and "cached versions: []" in str(ei.value)
    cache.build(1, _weights(1).items())
    with pytest.raises(WeightCacheError, match="already cached"):
        cache.build(1, _weights(2).items())
    assert torch.equal(dict(cache.named_tensors(1))["layer.0.norm"], _weights(1)["layer.0.norm"])
    cache.close()


class _CountingIterator:
    """Wraps the weights so the test can see how far the (collective) iterator was consumed."""

    def __init__(self, items: list[tuple[str, torch.Tensor]]) -> None:
        self.items = items
        self.consumed = 0

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for item in self.items:
            self.consumed += 1
            yield item


def test_oversize_tensor_is_rejected_with_no_partial_state_and_iterator_drained() -> None:
    files0 = _shm_files()
    cache = BucketCache(
        "p", CacheConfig(bucket_bytes=1024, storage=StorageKind.SHARED, ram_reserve_bytes=0)
    )
    cache.build(1, {"a": torch.randn(10)}.items())
    items = [("small", torch.randn(10)), ("huge", torch.randn(1000)), ("after", torch.randn(3))]
    it = _CountingIterator(items)
    with pytest.raises(OversizeTensorError, match=r"'huge'.*4000 bytes.*bucket_bytes >= 4032"):
        cache.build(2, it)
    assert it.consumed == 3  # drained: other ranks in the collective gather are not left hanging
    assert cache.versions() == (1,) and cache.latest_version == 1
    assert cache.resident_bytes() == 1024  # only version 1's single bucket
    # the version number is free again: a retry with a bigger bucket is allowed elsewhere
    assert _shm_files() - files0 == {p.name for p in _bucket_paths(cache, 1)}
    cache.close()


def _bucket_paths(cache: BucketCache, version: int) -> list[Path]:
    with cache.pinned(version) as cv:
        return [b.shm_path for b in cv.buckets if b.shm_path is not None]


def test_ram_check_rejects_before_allocating_and_drains() -> None:
    cache = BucketCache("p", CacheConfig(bucket_bytes=8192, ram_reserve_bytes=1 << 20))
    tiny = HostMemory(available_bytes=512 << 10, source="test probe")
    it = _CountingIterator(list(_weights(1).items()))
    with pytest.raises(InsufficientHostMemoryError, match=r"only 0.5 MiB .*test probe"):
        cache.build(1, it, expected_bytes=10_000, memory_probe=tiny)
    assert (
        it.consumed == len(_weights(1)) and cache.versions() == () and cache.resident_bytes() == 0
    )
    with pytest.raises(InsufficientHostMemoryError):
        cache.check_capacity(1 << 20, probe=tiny)
    # without expected_bytes the per-bucket check still stops the build before allocation
    with pytest.raises(InsufficientHostMemoryError, match="bucket 0 of weight version 2"):
        cache.build(2, _weights(1).items(), memory_probe=tiny)
    assert cache.versions() == ()


def test_real_host_memory_probe_is_plausible() -> None:
    mem = available_host_memory()
    assert 0 < mem.available_bytes < 1 << 50 and mem.source


def test_non_owner_only_drains() -> None:
    cache = BucketCache("p", CacheConfig(bucket_bytes=8192, ram_reserve_bytes=0))
    it = _CountingIterator(list(_weights(1).items()))
    assert cache.build(1, it, is_owner=False) is None
    assert it.consumed == len(_weights(1)) and cache.versions() == ()


def test_shared_storage_needs_room_in_shm_dir(tmp_path: Path) -> None:
    cfg = CacheConfig(
        bucket_bytes=8192,
        storage=StorageKind.SHARED,
        ram_reserve_bytes=0,
        shm_dir=tmp_path / "missing",
    )
    cache = BucketCache("p", cfg)
    with pytest.raises(InsufficientHostMemoryError, match="free but a bucket needs"):
        cache.build(1, _weights(1).items())
    assert cache.versions() == ()


def test_fletcher_numpy_and_torch_agree_and_detect_changes() -> None:
    rng = np.random.default_rng(0)
    for n in (0, 1, 7, 8, 4095 * 8 + 3, 3 * 4096 * 8, 100_003):
        data = rng.integers(0, 256, n, dtype=np.uint8)
        a = fletcher64_numpy(data)
        assert a == fletcher64_torch(torch.from_numpy(data.copy())), n
        if n:
            flipped = data.copy()
            flipped[n // 2] ^= 1
            assert fletcher64_numpy(flipped) != a
            assert checksum_bytes(flipped, ChecksumKind.CRC32) != checksum_bytes(
                data, ChecksumKind.CRC32
            )
    # swapped blocks and a truncated tail change the checksum too
    data = rng.integers(0, 256, 4 * 4096 * 8, dtype=np.uint8)
    blocks = data.reshape(4, -1)
    swapped = np.concatenate([blocks[1], blocks[0], blocks[2], blocks[3]])
    assert fletcher64_numpy(swapped) != fletcher64_numpy(data)
    assert fletcher64_numpy(data[:-8]) != fletcher64_numpy(data)


def test_segment_checksums_summed_by_torch_equal_the_host_ones() -> None:
    """The path a GPU-staged bucket takes (block sums by torch ops, on any device) gives the
    same bucket and segment checksums as numpy; here on CPU tensors, on a GPU in
    tests/integration/test_training_sync.py."""
    rng = np.random.default_rng(1)
    seg = 32 << 10
    for n in (0, 1, 8, seg - 1, seg, seg + 9, 5 * seg + 3):
        data = rng.integers(0, 256, n, dtype=np.uint8)
        host = segment_checksums(data, seg, ChecksumKind.FLETCHER64)
        assert segment_checksums_torch(torch.from_numpy(data.copy()), seg) == host, n
    with pytest.raises(ValueError, match="multiple of 32768"):
        segment_checksums_torch(torch.zeros(8, dtype=torch.uint8), 1000)


def test_staged_build_packs_and_checksums_like_a_direct_build(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The staging path (pack into one stage, checksum it with torch, copy to the bucket) gives
    the direct build's layout, checksums and bytes; the stage is a CPU tensor here (on a GPU:
    tests/integration/test_training_sync.py), reused across buckets."""
    weights = {f"w{i}": torch.randn(100 + 37 * i).to(torch.bfloat16) for i in range(12)}
    cfg = CacheConfig(bucket_bytes=1024, storage=StorageKind.PAGEABLE, ram_reserve_bytes=0)
    direct = BucketCache("direct", cfg)
    direct.build(1, weights.items())
    staged = BucketCache("staged", cfg)
    stages: list[torch.Tensor] = []

    def cpu_stage(first: torch.Tensor) -> torch.Tensor:
        stages.append(torch.full((cfg.bucket_bytes,), 0xAB, dtype=torch.uint8))  # stale bytes
        return stages[-1]

    monkeypatch.setattr(staged, "_gpu_stage", cpu_stage)
    staged.build(1, weights.items())
    assert len(stages) == 1  # one stage for the whole version
    with direct.pinned(1) as a, staged.pinned(1) as b:
        assert len(a.buckets) > 2
        assert [x.layout for x in a.buckets] == [x.layout for x in b.buckets]
        assert all(torch.equal(x.data, y.data) for x, y in zip(a.buckets, b.buckets, strict=True))
    assert dict(staged.named_tensors(1)).keys() == weights.keys()
    for name, t in staged.named_tensors(1):
        assert torch.equal(t, weights[name])
    direct.close()
    staged.close()


def test_gpu_stage_falls_back_to_the_host_when_the_gpu_is_full(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    cache = BucketCache("p", CacheConfig(bucket_bytes=4096, ram_reserve_bytes=0))
    on_gpu = types.SimpleNamespace(is_cuda=True, device="cuda:0")  # FAKE: a CUDA tensor's face

    def full(*_: object, **__: object) -> torch.Tensor:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(torch, "empty", full)
    with caplog.at_level("WARNING"):
        assert cache._gpu_stage(on_gpu) is None  # type: ignore[arg-type]
    assert "no GPU memory for a 4096-byte staging bucket" in caplog.text
    monkeypatch.undo()
    off = BucketCache("q", CacheConfig(bucket_bytes=4096, ram_reserve_bytes=0, stage_on_gpu=False))
    assert off._gpu_stage(on_gpu) is None  # type: ignore[arg-type]
    crc = BucketCache(
        "r", CacheConfig(bucket_bytes=4096, ram_reserve_bytes=0, checksum=ChecksumKind.CRC32)
    )
    assert crc._gpu_stage(on_gpu) is None  # type: ignore[arg-type]  # no device crc32
    for c in (cache, off, crc):
        c.close()


def test_freed_versions_files_are_recycled_with_a_new_file_header() -> None:
    from rlix_plugins.training.wire import ShmFileHeader

    files0 = _shm_files()
    cache = BucketCache(
        "p", CacheConfig(bucket_bytes=8192, storage=StorageKind.SHARED, ram_reserve_bytes=0)
    )
    cache.build(1, _weights(1).items())
    cache.activate(1)
    v1 = _bucket_paths(cache, 1)
    cache.build(2, _weights(2).items())
    cache.activate(2)  # frees 1: its files go to the pool, not back to the OS
    assert cache.pooled_bytes() == len(v1) * 8192
    assert {p.name for p in v1} <= _shm_files()
    cache.check_capacity(len(v1) * 8192, probe=HostMemory(available_bytes=0, source="probe"))
    cache.build(3, _weights(3).items())
    assert _bucket_paths(cache, 3) == v1 and cache.pooled_bytes() == 0
    with cache.pinned(3) as cv:
        gens = [b.generation for b in cv.buckets]
        for b in cv.buckets:
            assert b._header is not None
            got = ShmFileHeader.from_words(b._header)
            assert got == ShmFileHeader(
                cv.file_token, b.generation, 3, b.layout.index, b.layout.nbytes, b.layout.checksum
            )
    with cache.pinned(2) as cv:
        assert min(gens) > max(b.generation for b in cv.buckets)  # generations only grow
    got = dict(cache.named_tensors(3))
    assert all(torch.equal(got[k].view(-1).view(torch.uint8), v.contiguous().view(-1).view(
        torch.uint8)) for k, v in _weights(3).items())
    cache.close()
    assert _shm_files() == files0  # the pool is emptied on close


def test_recycling_off_returns_freed_files() -> None:
    cache = BucketCache(
        "p",
        CacheConfig(bucket_bytes=8192, storage=StorageKind.SHARED, ram_reserve_bytes=0,
                    recycle_files=False),
    )
    cache.build(1, _weights(1).items())
    cache.activate(1)
    v1 = _bucket_paths(cache, 1)
    cache.build(2, _weights(2).items())
    cache.activate(2)
    assert cache.pooled_bytes() == 0 and not {p.name for p in v1} & _shm_files()
    cache.build(3, _weights(3).items())
    assert not set(_bucket_paths(cache, 3)) & set(v1)
    cache.close()


def test_segment_checksums_cover_each_slice() -> None:
    cache = BucketCache(
        "p", CacheConfig(bucket_bytes=256 << 10, storage=StorageKind.PAGEABLE,
                         ram_reserve_bytes=0, segment_bytes=32 << 10)
    )
    cache.build(1, {f"t{i}": torch.randn(10_000) for i in range(12)}.items())
    with cache.pinned(1) as cv:
        for b in cv.buckets:
            seg = b.layout.segment_bytes
            data = b.data.numpy()
            assert seg == 32 << 10 and len(b.layout.segment_checksums) == -(-len(data) // seg)
            for k, s in enumerate(b.layout.segment_checksums):
                assert s == checksum_bytes(data[k * seg : (k + 1) * seg], ChecksumKind.FLETCHER64)
            assert b.layout.checksum == fletcher64_numpy(data)
    cache.close()
    with pytest.raises(WeightCacheError, match="segment_bytes=1000 is invalid"):
        CacheConfig(segment_bytes=1000)
