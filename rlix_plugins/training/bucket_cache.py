"""Versioned CPU weight cache, packed into fixed-size buckets.

After a train step the host gathers full HF-named weights collectively (every training rank
iterates, one owner rank receives the full tensors). :meth:`BucketCache.build` consumes that
iterator on every rank; only the owner keeps the bytes, packed into buckets of
``CacheConfig.bucket_bytes``. A weight sync then streams a version bucket by bucket, so a
receiver never holds more than one bucket of extra memory.

Decisions:

* **A tensor larger than a bucket is an error** (:class:`OversizeTensorError`), never split:
  the receiver's ``load_weights`` needs whole tensors, so a split tensor would have to be
  reassembled and the receiver's peak would exceed one bucket. Raise ``bucket_bytes`` to at
  least the largest tensor (typically the embedding or LM head).
* **Two versions at most**: ``latest`` (newest built) and ``active`` (the one being served and
  synced). Building or activating frees every other version; a version a sync still uses is
  freed when that sync ends (pins), never under it.
* **Errors leave nothing behind**: on any failure the partially built version is freed and,
  because the gather is collective, the rest of the iterator is still drained (``drain_on_error``)
  so the other ranks do not hang in the gather.
* **Memory kind**: pinned when a CUDA device exists (fast H2D / NCCL staging); otherwise
  pageable memory backed by a file in ``/dev/shm`` (``SHARED``) so same-host receivers can map
  buckets without a copy, or plain pageable memory (``PAGEABLE``).
"""

from __future__ import annotations

import contextlib
import enum
import logging
import mmap
import os
import secrets
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from rlix_plugins.errors import (
    InsufficientHostMemoryError,
    OversizeTensorError,
    UnknownWeightVersionError,
    WeightCacheError,
)
from rlix_plugins.training.checksum import ChecksumKind, checksum_tensor
from rlix_plugins.training.host_memory import (
    HostMemory,
    accelerator_available,
    check_host_memory,
)

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

#: Every tensor starts at a multiple of this many bytes, so a byte slice can be viewed as any
#: dtype (bf16 needs 2, float64 8) and vector loads stay aligned.
ALIGNMENT = 64
SHM_PREFIX = "rlix-wcache-"


class StorageKind(str, enum.Enum):
    """Where bucket bytes live."""

    PINNED = "pinned"
    SHARED = "shared"
    PAGEABLE = "pageable"


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """Configuration of one pipeline's weight cache.

    ``storage=None`` picks automatically (pinned with a CUDA device, else shared if
    ``shm_dir`` has room, else pageable). ``ram_reserve_bytes`` is kept free for everything
    else on the node when checking host RAM.
    """

    bucket_bytes: int = 256 << 20
    storage: StorageKind | None = None
    checksum: ChecksumKind = ChecksumKind.FLETCHER64
    ram_reserve_bytes: int = 1 << 30
    shm_dir: Path = Path("/dev/shm")
    drain_on_error: bool = True

    def __post_init__(self) -> None:
        if self.bucket_bytes < ALIGNMENT or self.bucket_bytes % ALIGNMENT:
            raise WeightCacheError(
                f"bucket_bytes={self.bucket_bytes} is invalid; expected a positive multiple of "
                f"{ALIGNMENT}"
            )
        if self.ram_reserve_bytes < 0:
            raise WeightCacheError(f"ram_reserve_bytes={self.ram_reserve_bytes} must be >= 0")


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """Where one tensor sits inside a bucket."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    def to_wire(self) -> list[object]:
        return [self.name, self.dtype, list(self.shape), self.offset, self.nbytes]

    @staticmethod
    def from_wire(raw: list[object]) -> TensorEntry:
        name, dtype, shape, offset, nbytes = raw
        assert isinstance(name, str) and isinstance(dtype, str) and isinstance(shape, list)
        assert isinstance(offset, int) and isinstance(nbytes, int)
        return TensorEntry(name, dtype, tuple(int(s) for s in shape), offset, nbytes)


@dataclass(frozen=True, slots=True)
class BucketLayout:
    """What a bucket holds: its tensors, its used size and its checksum."""

    index: int
    nbytes: int
    checksum: int
    entries: tuple[TensorEntry, ...]


@dataclass(slots=True)
class Bucket:
    """One bucket's bytes (``storage`` has the full capacity; ``data`` the used prefix)."""

    layout: BucketLayout
    storage: torch.Tensor
    shm_path: Path | None = None
    _mmap: mmap.mmap | None = None

    @property
    def data(self) -> torch.Tensor:
        return self.storage[: self.layout.nbytes]


@dataclass(frozen=True, slots=True)
class VersionInfo:
    """Summary of a cached version."""

    version: int
    num_buckets: int
    num_tensors: int
    total_bytes: int
    storage: StorageKind


@dataclass(slots=True)
class CachedVersion:
    """A version's buckets plus its pin count (syncs in flight)."""

    version: int
    buckets: list[Bucket]
    storage: StorageKind
    checksum: ChecksumKind
    pins: int = 0
    retired: bool = False
    freed: bool = False
    sizes: tuple[int, int] = field(default=(0, 0))  # (num_tensors, total_bytes)

    @property
    def info(self) -> VersionInfo:
        return VersionInfo(
            version=self.version,
            num_buckets=len(self.buckets),
            num_tensors=self.sizes[0],
            total_bytes=self.sizes[1],
            storage=self.storage,
        )


def torch_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``; raises for anything that is not a dtype."""
    import torch

    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype):
        raise WeightCacheError(f"unknown tensor dtype {name!r} in a bucket entry")
    return value


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def unpack_bucket(
    data: torch.Tensor, entries: Iterable[TensorEntry]
) -> list[tuple[str, torch.Tensor]]:
    """Views (no copy) of each tensor in a bucket's bytes."""
    out: list[tuple[str, torch.Tensor]] = []
    for e in entries:
        raw = data[e.offset : e.offset + e.nbytes]
        out.append((e.name, raw.view(torch_dtype(e.dtype)).view(e.shape)))
    return out


def _align(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a tensor's contiguous bytes."""
    import torch

    return t.detach().contiguous().reshape(-1).view(torch.uint8)


class BucketCache:
    """One pipeline's versioned CPU weight cache. Thread-safe; its lock is never held during a
    copy or a sync, only for bookkeeping."""

    def __init__(self, pipeline_id: str, config: CacheConfig | None = None) -> None:
        self.pipeline_id = pipeline_id
        self.config = config or CacheConfig()
        self._lock = threading.Lock()
        self._versions: dict[int, CachedVersion] = {}
        self._building: set[int] = set()
        self._latest: int | None = None
        self._active: int | None = None
        self._closed = False

    # --- queries -------------------------------------------------------------------------

    @property
    def latest_version(self) -> int | None:
        with self._lock:
            return self._latest

    @property
    def active_version(self) -> int | None:
        with self._lock:
            return self._active

    def versions(self) -> tuple[int, ...]:
        """Versions held (built, not freed), ascending."""
        with self._lock:
            return tuple(sorted(v for v, cv in self._versions.items() if not cv.retired))

    def info(self, version: int) -> VersionInfo:
        with self._lock:
            return self._get(version).info

    def resident_bytes(self) -> int:
        """Bytes of bucket capacity currently allocated (all versions, retired included)."""
        with self._lock:
            return sum(int(b.storage.numel()) for cv in self._versions.values() for b in cv.buckets)

    def _get(self, version: int) -> CachedVersion:
        cv = self._versions.get(version)
        if cv is None or cv.retired:
            held = sorted(v for v, c in self._versions.items() if not c.retired)
            raise UnknownWeightVersionError(
                f"pipeline {self.pipeline_id!r}: weight version {version} is not cached; "
                f"cached versions: {held} (latest={self._latest}, active={self._active})"
            )
        return cv

    # --- building ------------------------------------------------------------------------

    def resolve_storage(self, expected_bytes: int | None = None) -> StorageKind:
        """The storage kind a build would use now (see :class:`CacheConfig`)."""
        if self.config.storage is not None:
            return self.config.storage
        if accelerator_available():
            return StorageKind.PINNED
        need = max(expected_bytes or 0, 2 * self.config.bucket_bytes)
        if self._shm_free() >= need:
            return StorageKind.SHARED
        return StorageKind.PAGEABLE

    def _shm_free(self) -> int:
        try:
            st = os.statvfs(self.config.shm_dir)
        except OSError:
            return 0
        return int(st.f_bavail) * int(st.f_frsize)

    def check_capacity(self, expected_bytes: int, *, probe: HostMemory | None = None) -> HostMemory:
        """Check host RAM for a version of ``expected_bytes``; call it on the owner rank
        BEFORE starting the collective gather (and share the verdict with the other ranks).
        Raises :class:`InsufficientHostMemoryError`."""
        return check_host_memory(
            expected_bytes,
            reserve_bytes=self.config.ram_reserve_bytes,
            what=f"weight cache of pipeline {self.pipeline_id!r}",
            probe=probe,
        )

    def build(
        self,
        version: int,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        is_owner: bool = True,
        expected_bytes: int | None = None,
        memory_probe: HostMemory | None = None,
    ) -> VersionInfo | None:
        """Consume the host's (collective) HF-weight iterator and cache it as ``version``.

        Every rank calls this with the same iterator; non-owners only drain it (taking part in
        the gather) and get ``None``. The owner gets the new version's summary; it becomes
        ``latest`` and every version that is neither latest nor active is freed.
        """
        iterator = iter(named_tensors)
        if not is_owner:
            for _ in iterator:
                pass
            return None
        try:
            self._begin_build(version)
            if expected_bytes is not None:
                self.check_capacity(expected_bytes, probe=memory_probe)
            storage = self.resolve_storage(expected_bytes)
            built = self._pack(version, iterator, storage, memory_probe)
        except BaseException:
            with self._lock:
                self._building.discard(version)
            if self.config.drain_on_error:
                self._drain(iterator)
            raise
        with self._lock:
            self._building.discard(version)
            self._versions[version] = built
            self._latest = version
            freed = self._retire_others_locked()
        self._free_all(freed)
        logger.info(
            "pipeline %s: cached weight version %d (%d buckets, %d tensors, %.1f MiB, %s)",
            self.pipeline_id,
            version,
            len(built.buckets),
            built.sizes[0],
            built.sizes[1] / 2**20,
            built.storage.value,
        )
        return built.info

    def _begin_build(self, version: int) -> None:
        with self._lock:
            if self._closed:
                raise WeightCacheError(f"pipeline {self.pipeline_id!r}: the cache is closed")
            if version in self._building or (
                version in self._versions and not self._versions[version].retired
            ):
                raise WeightCacheError(
                    f"pipeline {self.pipeline_id!r}: weight version {version} is already cached "
                    "or being built; versions are immutable, build a new version number"
                )
            self._building.add(version)

    @staticmethod
    def _drain(iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        # The gather is collective: the other ranks block until every rank has iterated to the
        # end, so the owner keeps iterating (and discarding) after a local failure.
        try:
            for _ in iterator:
                pass
        except Exception:  # the iterator itself failed; nothing more to drain
            logger.exception("draining the weight iterator after a cache error failed")

    def _allocate(
        self, storage: StorageKind, version: int, index: int, probe: HostMemory | None
    ) -> Bucket:
        import torch

        cap = self.config.bucket_bytes
        check_host_memory(
            cap,
            reserve_bytes=self.config.ram_reserve_bytes,
            what=f"bucket {index} of weight version {version} (pipeline {self.pipeline_id!r})",
            probe=probe,
        )
        empty = BucketLayout(index=index, nbytes=0, checksum=0, entries=())
        if storage is StorageKind.PINNED:
            return Bucket(empty, torch.empty(cap, dtype=torch.uint8, pin_memory=True))
        if storage is StorageKind.PAGEABLE:
            return Bucket(empty, torch.empty(cap, dtype=torch.uint8))
        # SHARED: a tmpfs file; writing past a full tmpfs raises SIGBUS, so check room first.
        free = self._shm_free()
        if free < cap:
            raise InsufficientHostMemoryError(
                f"{self.config.shm_dir} has {free / 2**20:.1f} MiB free but a bucket needs "
                f"{cap / 2**20:.1f} MiB; enlarge it (docker --shm-size) or use "
                "CacheConfig(storage=StorageKind.PAGEABLE)"
            )
        path = self.config.shm_dir / (
            f"{SHM_PREFIX}{os.getpid()}-{self.pipeline_id}-v{version}-b{index}-"
            f"{secrets.token_hex(4)}"
        )
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, cap)
            mm = mmap.mmap(fd, cap)
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        os.close(fd)
        arr = np.frombuffer(mm, dtype=np.uint8)
        return Bucket(empty, torch.from_numpy(arr), shm_path=path, _mmap=mm)

    def _pack(
        self,
        version: int,
        iterator: Iterator[tuple[str, torch.Tensor]],
        storage: StorageKind,
        probe: HostMemory | None,
    ) -> CachedVersion:
        cap = self.config.bucket_bytes
        buckets: list[Bucket] = []
        entries: list[TensorEntry] = []
        current: Bucket | None = None
        offset = 0
        n_tensors = 0
        total = 0
        seen: set[str] = set()
        try:
            for name, tensor in iterator:
                if name in seen:
                    raise WeightCacheError(
                        f"tensor {name!r} appears twice in weight version {version}"
                    )
                seen.add(name)
                raw = _as_bytes(tensor)
                nbytes = int(raw.numel())
                if nbytes > cap:
                    raise OversizeTensorError(
                        f"tensor {name!r} ({dtype_name(tensor.dtype)}, shape "
                        f"{tuple(tensor.shape)}) is {nbytes} bytes, larger than one bucket "
                        f"({cap} bytes); tensors are never split across buckets, so set "
                        f"CacheConfig.bucket_bytes >= {_align(nbytes)}"
                    )
                if current is None or offset + nbytes > cap:
                    if current is not None:
                        buckets.append(self._seal(current, entries, offset))
                        current = None
                    current = self._allocate(storage, version, len(buckets), probe)
                    entries, offset = [], 0
                dst = current.storage[offset : offset + nbytes]
                # non_blocking D2H into pinned memory overlaps the copies of one bucket; the
                # bucket is synchronised in _seal before its checksum is taken.
                dst.copy_(raw, non_blocking=storage is StorageKind.PINNED and raw.is_cuda)
                entries.append(
                    TensorEntry(name, dtype_name(tensor.dtype), tuple(tensor.shape), offset, nbytes)
                )
                end = _align(offset + nbytes)
                if end > offset + nbytes:
                    # zero the alignment gap so the checksum does not depend on stale bytes
                    current.storage[offset + nbytes : min(end, cap)].zero_()
                offset = end
                n_tensors += 1
                total += nbytes
            if current is not None:
                buckets.append(self._seal(current, entries, min(offset, cap)))
                current = None
        except BaseException:
            for b in buckets if current is None else [*buckets, current]:
                self._free_bucket(b)
            raise
        return CachedVersion(
            version=version,
            buckets=buckets,
            storage=storage,
            checksum=self.config.checksum,
            sizes=(n_tensors, total),
        )

    def _seal(self, bucket: Bucket, entries: list[TensorEntry], used: int) -> Bucket:
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()  # pending non_blocking D2H copies into this bucket
        data = bucket.storage[:used]
        bucket.layout = BucketLayout(
            index=bucket.layout.index,
            nbytes=used,
            checksum=checksum_tensor(data, self.config.checksum),
            entries=tuple(entries),
        )
        return bucket

    # --- versions ------------------------------------------------------------------------

    def activate(self, version: int) -> None:
        """Mark ``version`` as the one being served; frees every version but latest/active."""
        with self._lock:
            self._get(version)
            self._active = version
            freed = self._retire_others_locked()
        self._free_all(freed)

    def _retire_others_locked(self) -> list[CachedVersion]:
        keep = {self._latest, self._active}
        to_free: list[CachedVersion] = []
        for v, cv in list(self._versions.items()):
            if v in keep or cv.retired:
                continue
            cv.retired = True
            if cv.pins == 0:
                del self._versions[v]
                to_free.append(cv)
        return to_free

    @contextlib.contextmanager
    def pinned(self, version: int) -> Iterator[CachedVersion]:
        """Hold ``version`` for the duration of a sync (it cannot be freed meanwhile)."""
        with self._lock:
            cv = self._get(version)
            cv.pins += 1
        try:
            yield cv
        finally:
            freed: list[CachedVersion] = []
            with self._lock:
                cv.pins -= 1
                if cv.retired and cv.pins == 0 and self._versions.get(cv.version) is cv:
                    del self._versions[cv.version]
                    freed.append(cv)
            self._free_all(freed)

    def named_tensors(self, version: int) -> Iterator[tuple[str, torch.Tensor]]:
        """Copies of every tensor of ``version`` (for checks and debugging)."""
        with self.pinned(version) as cv:
            for b in cv.buckets:
                for name, view in unpack_bucket(b.data, b.layout.entries):
                    yield name, view.clone()

    def free(self, version: int) -> None:
        """Drop ``version`` now (deferred until its syncs end); latest/active pointers reset."""
        with self._lock:
            cv = self._get(version)
            cv.retired = True
            if self._latest == version:
                self._latest = None
            if self._active == version:
                self._active = None
            freed: list[CachedVersion] = []
            if cv.pins == 0:
                del self._versions[version]
                freed.append(cv)
        self._free_all(freed)

    def close(self) -> None:
        """Free every version (syncs still running keep theirs until they end)."""
        with self._lock:
            self._closed = True
            self._latest = self._active = None
            freed: list[CachedVersion] = []
            for v, cv in list(self._versions.items()):
                cv.retired = True
                if cv.pins == 0:
                    del self._versions[v]
                    freed.append(cv)
        self._free_all(freed)

    def _free_all(self, versions: list[CachedVersion]) -> None:
        for cv in versions:
            for b in cv.buckets:
                self._free_bucket(b)
            cv.buckets = []
            cv.freed = True
            logger.debug("pipeline %s: freed weight version %d", self.pipeline_id, cv.version)

    @staticmethod
    def _free_bucket(bucket: Bucket) -> None:
        import torch

        bucket.storage = torch.empty(0, dtype=torch.uint8)
        if bucket.shm_path is not None:
            bucket.shm_path.unlink(missing_ok=True)
        if bucket._mmap is not None:
            try:
                bucket._mmap.close()
            except BufferError:
                # A caller still holds a view; the pages go when that view is collected (the
                # file is already unlinked, so nothing outlives the process).
                logger.debug("bucket %d still referenced; unmapped later", bucket.layout.index)
            bucket._mmap = None
