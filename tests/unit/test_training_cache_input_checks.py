"""Bad cache input is refused up front, typed, with nothing changed.

* ``CacheConfig`` took its enums by value (``storage="pageable"``, ``checksum="fletcher64"``,
  as a YAML config gives them) without converting them: the cache compares kinds by identity,
  so ``"pageable"`` built the version into /dev/shm files and then ``build`` raised a bare
  AttributeError *after* storing it, and ``"fletcher64"`` checksummed with crc32 under the
  fletcher64 label. Float sizes passed too and failed at the first allocation (a TypeError,
  after the gather had started).
* An empty weight iterator was cached as a version of no tensors, which then synced
  "successfully": every receiver recorded the version and kept its old weights. A retried
  build that passes the iterator a failed build already drained does exactly that.
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

import pytest
import torch

from rlix_plugins.errors import OversizeTensorError, WeightCacheError
from rlix_plugins.training.bucket_cache import BucketCache, CacheConfig, StorageKind
from rlix_plugins.training.checksum import ChecksumKind, fletcher64_numpy


def _weights() -> dict[str, torch.Tensor]:
    return {"w": torch.arange(1000, dtype=torch.float32), "b": torch.ones(7, dtype=torch.bfloat16)}


def test_a_storage_kind_given_by_name_is_used(tmp_path: Path) -> None:
    cfg = CacheConfig(bucket_bytes=64 << 10, storage="pageable", shm_dir=tmp_path,  # type: ignore[arg-type]
                      ram_reserve_bytes=0)
    cache = BucketCache("review4-storage", cfg)
    info = cache.build(1, _weights().items())  # was: AttributeError after storing the version
    assert info is not None and info.storage is StorageKind.PAGEABLE
    assert list(tmp_path.iterdir()) == []  # not in shared memory, as asked
    assert cfg.storage is StorageKind.PAGEABLE
    got = dict(cache.named_tensors(1))
    assert all(torch.equal(got[k], v) for k, v in _weights().items())
    cache.close()


def test_a_checksum_kind_given_by_name_is_used() -> None:
    for name, expected in (("fletcher64", fletcher64_numpy), ("crc32", None)):
        cfg = CacheConfig(bucket_bytes=64 << 10, storage=StorageKind.PAGEABLE,
                          checksum=name, ram_reserve_bytes=0)  # type: ignore[arg-type]
        assert cfg.checksum is ChecksumKind(name)
        cache = BucketCache(f"review4-{name}", cfg)
        cache.build(1, _weights().items())
        with cache.pinned(1) as cv:
            assert cv.checksum is ChecksumKind(name)
            data = cv.buckets[0].data.numpy()
            want = expected(data) if expected else zlib.crc32(data.data)
            assert cv.buckets[0].layout.checksum == want
        cache.close()


@pytest.mark.parametrize(
    "field, value",
    [
        ("storage", "tmpfs"),
        ("storage", 3),
        ("checksum", "md5"),
        ("bucket_bytes", float(64 << 10)),
        ("bucket_bytes", True),
        ("segment_bytes", float(2 << 20)),
        ("ram_reserve_bytes", 1.5),
        ("ram_reserve_bytes", "1G"),
    ],
)
def test_a_bad_config_value_is_refused_typed_by_name(field: str, value: Any) -> None:
    with pytest.raises(WeightCacheError, match=field):
        CacheConfig(**{field: value})


def test_an_empty_weight_iterator_is_refused_and_caches_nothing() -> None:
    cache = BucketCache(
        "review4-empty",
        CacheConfig(bucket_bytes=64 << 10, storage=StorageKind.PAGEABLE, ram_reserve_bytes=0),
    )
    with pytest.raises(WeightCacheError, match="no tensors"):
        cache.build(1, iter(()))
    assert cache.versions() == () and cache.latest_version is None
    assert cache.resident_bytes() == 0
    # the number was not kept claimed: a real build of it works
    info = cache.build(1, _weights().items())
    assert info is not None and info.num_tensors == 2
    cache.close()


def test_a_retry_with_the_drained_iterator_of_a_failed_build_is_refused() -> None:
    cache = BucketCache(
        "review4-retry",
        CacheConfig(bucket_bytes=1024, storage=StorageKind.PAGEABLE, ram_reserve_bytes=0),
    )
    cache.build(1, [("small", torch.ones(4))])
    cache.activate(1)
    gather = iter(_weights().items())
    with pytest.raises(OversizeTensorError):
        cache.build(2, gather)  # drains the gather (drain_on_error) for the other ranks
    with pytest.raises(WeightCacheError, match="no tensors"):
        cache.build(2, gather)
    assert cache.versions() == (1,)
    assert cache.latest_version == 1 and cache.active_version == 1
    cache.close()


def test_numpy_integer_sizes_are_still_accepted() -> None:
    import numpy as np

    cfg = CacheConfig(bucket_bytes=np.int64(64 << 10), segment_bytes=np.int32(32 << 10))  # type: ignore[arg-type]
    assert type(cfg.bucket_bytes) is int and cfg.bucket_bytes == 64 << 10
    assert type(cfg.segment_bytes) is int and cfg.segment_bytes == 32 << 10
