"""A version number still pinned by a sync cannot be rebuilt until that sync ends.

Rebuilding it used to replace the pinned record, so the record was never freed when the sync
ended: its buckets and /dev/shm files outlived ``close()``.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from rlix_plugins.errors import WeightCacheError
from rlix_plugins.training.bucket_cache import BucketCache, CacheConfig, StorageKind


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    """A private directory in /dev/shm (tmpfs): other tests' cache files never show up here."""
    d = Path(tempfile.mkdtemp(prefix="rlix-test-rebuild-", dir="/dev/shm"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _weights() -> list[tuple[str, torch.Tensor]]:
    return [("a", torch.ones(1000)), ("b", torch.full((1000,), 2.0))]


@pytest.mark.parametrize("recycle", [False, True])
def test_rebuilding_a_pinned_version_is_refused_and_nothing_leaks(
    shm_dir: Path, recycle: bool
) -> None:
    cache = BucketCache(
        "p",
        CacheConfig(
            bucket_bytes=1 << 16,
            storage=StorageKind.SHARED,
            shm_dir=shm_dir,
            ram_reserve_bytes=0,
            recycle_files=recycle,
        ),
    )
    cache.build(1, iter(_weights()))
    with cache.pinned(1) as old:
        cache.free(1)  # retired; freed when this "sync" ends
        consumed: list[str] = []

        def rebuild() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in _weights():
                consumed.append(name)
                yield name, tensor

        with pytest.raises(WeightCacheError, match=r"version 1 was freed but a sync still uses"):
            cache.build(1, rebuild())
        assert consumed == ["a", "b"]  # the collective iterator was still drained
        assert cache.versions() == () and not old.freed  # state unchanged
    assert old.freed and old.buckets == []
    # once the sync ended the number is free again
    cache.build(1, iter(_weights()))
    assert dict(cache.named_tensors(1))["b"].eq(2.0).all()
    cache.close()
    assert sorted(p.name for p in shm_dir.iterdir()) == []
