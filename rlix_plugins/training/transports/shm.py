"""Shared-memory transport: a same-host CPU receiver maps the cache's own bucket files.

The cache (``StorageKind.SHARED``) already keeps each bucket in a /dev/shm file, so sending
copies nothing: the header names the file (path, ``(st_dev, st_ino)``, the generation the
cache wrote into the file's :class:`~rlix_plugins.training.wire.ShmFileHeader`), the receiver
maps it read-only, checks the file header, verifies and applies the tensors.

Kept mappings: when the cache recycles its files (``CacheConfig.recycle_files``, announced in
the offer as ``keep_mappings``), the receiver keeps each file mapped after the sync, in a
process-wide registry keyed by path and file identity. The next version is written into the
same files (the same tmpfs pages), so the next sync maps nothing: setting up and tearing down
the page tables of 4 KiB tmpfs pages cost about as much per byte as copying them. Safety: a
kept mapping is used only when its file identity matches the header and the file header read
through that mapping names exactly the announced cache token, generation, version, index, size
and checksum; otherwise it is dropped and the file mapped afresh, and a fresh mapping that
still disagrees is an error. The segment checksums are verified as always.

Memory: kept mappings are the sender's tmpfs pages (counted once, in the cache), not new
receiver memory, but they do show in the receiver's RSS (``RssShmem``). A mapping is dropped
at the end of a sync of its pipeline when its file is gone (unlinked or replaced), or by
:func:`release_shm_mappings`; until then it keeps a closed cache's pages alive.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import threading
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from rlix_plugins.errors import TransportUnavailableError, WeightSyncError
from rlix_plugins.training.transports.base import ReceiverTransport, SenderTransport
from rlix_plugins.training.wire import ShmFileHeader, SyncOffer, TransportKind

if TYPE_CHECKING:
    import torch

    from rlix_plugins.training.bucket_cache import Bucket, CachedVersion

logger = logging.getLogger(__name__)

#: madvise(MADV_POPULATE_READ) (Linux 5.14): map a range's pages in one call (Python's mmap
#: module does not name it).
_MADV_POPULATE_READ = 22
_PAGE = mmap.PAGESIZE


class ShmSender(SenderTransport):
    kind = TransportKind.SHM
    #: A receiver maps the cache's own pages, so a queued header costs it no memory: many
    #: headers may be in flight (they are a few KiB each), saving a sender round trip per
    #: bucket. The receiver still works on one bucket at a time. Bounded well below ZMQ's
    #: default high-water mark (1,000 messages a side): with every header ahead, a version of
    #: thousands of buckets filled both directions (headers unread by the receiver while it
    #: blocked on acks unread by the sender) and a healthy receiver was declared gone.
    headers_ahead = 256

    def __init__(self, version: CachedVersion) -> None:
        missing = [b.layout.index for b in version.buckets if b.shm_path is None]
        if missing:
            raise TransportUnavailableError(
                f"transport 'shm' needs a cache in shared memory (StorageKind.SHARED); weight "
                f"version {version.version} is {version.storage.value}"
            )
        self._version = version

    def details(self, rank: int) -> dict[str, Any]:
        del rank
        return {"keep_mappings": self._version.recycles_files}

    def frames(self, bucket: Bucket) -> tuple[dict[str, Any], list[Any]]:
        from rlix_plugins.training.wire import SHM_FILE_HEADER_BYTES

        assert bucket.shm_path is not None and bucket.file_id is not None
        file_header = ShmFileHeader(
            self._version.file_token,
            bucket.generation,
            self._version.version,
            bucket.layout.index,
            bucket.layout.nbytes,
            bucket.layout.checksum,
        )
        return {
            "path": str(bucket.shm_path),
            "file_id": list(bucket.file_id),
            "data_offset": SHM_FILE_HEADER_BYTES,
            "file_header": file_header.to_wire(),
        }, []


@dataclass(slots=True, eq=False)
class _Mapped:
    """One mapped bucket file."""

    path: str
    file_id: tuple[int, int]
    pipeline_id: str
    mm: mmap.mmap
    arr: np.ndarray
    populated: int = 0
    users: int = 0
    dropped: bool = False

    def populate(self, end: int) -> None:
        """Map the pages of ``[0, end)`` now (one call instead of a fault per page)."""
        end = min(len(self.mm), -(-end // _PAGE) * _PAGE)
        if end <= self.populated:
            return
        start = self.populated - self.populated % _PAGE
        # OSError on an older kernel: the pages fault in on first read instead
        with contextlib.suppress(OSError):
            self.mm.madvise(_MADV_POPULATE_READ, start, end - start)
        self.populated = end

    def header(self) -> ShmFileHeader | None:
        return ShmFileHeader.from_words(self.arr[: 8 * ShmFileHeader.WORDS].view("<u8"))

    def close(self) -> None:
        self.arr = np.empty(0, dtype=np.uint8)
        # BufferError: a load_weights callback kept a view; the mapping goes with that view
        with contextlib.suppress(BufferError):
            self.mm.close()


_opened_lock = threading.Lock()
_opened = 0


def _map_file(path: str, file_id: tuple[int, int], pipeline_id: str) -> _Mapped:
    global _opened
    with _opened_lock:
        _opened += 1
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise WeightSyncError(f"cannot open shared bucket {path}: {exc}") from None
    try:
        st = os.fstat(fd)
        got = (int(st.st_dev), int(st.st_ino))
        if got != file_id:
            raise WeightSyncError(
                f"shared bucket {path} is file {got}, the sender announced {file_id}: the file "
                "was replaced (the cache was rebuilt or closed during the sync?)"
            )
        # the whole file, populated on demand for the used range only: a read fault on a
        # tmpfs hole would allocate a page
        mm = mmap.mmap(fd, st.st_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    return _Mapped(path, file_id, pipeline_id, mm, np.frombuffer(mm, dtype=np.uint8))


class _Registry:
    """Process-wide kept mappings; its lock guards only the dict, never a copy or a map."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._maps: dict[str, _Mapped] = {}

    def acquire(
        self, path: str, file_id: tuple[int, int], pipeline_id: str
    ) -> tuple[_Mapped, bool]:
        """The kept mapping of ``path`` if it is the same file, else a new kept one;
        the flag says whether it was reused."""
        stale: _Mapped | None = None
        with self._lock:
            m = self._maps.get(path)
            if m is not None and m.file_id == file_id:
                m.users += 1
                return m, True
            if m is not None:
                stale = self._unlink_locked(m)
        if stale is not None:
            stale.close()
        fresh = _map_file(path, file_id, pipeline_id)
        with self._lock:
            other = self._maps.get(path)
            if other is not None and other.file_id == file_id:
                # another receiver thread of this process mapped it meanwhile: share theirs
                other.users += 1
                m, duplicate = other, fresh
            else:
                if other is not None:
                    stale = self._unlink_locked(other)
                fresh.users = 1
                self._maps[path] = fresh
                m, duplicate = fresh, None
        if duplicate is not None:
            duplicate.close()
        if stale is not None:
            stale.close()
        return m, False

    def _unlink_locked(self, m: _Mapped) -> _Mapped | None:
        """Take ``m`` out of the registry; returns it if it can be closed now."""
        if self._maps.get(m.path) is m:
            del self._maps[m.path]
        m.dropped = True
        return m if m.users == 0 else None

    def drop(self, m: _Mapped) -> None:
        """Forget a mapping that showed the wrong file header (closed when unused)."""
        with self._lock:
            closable = self._unlink_locked(m)
        if closable is not None:
            closable.close()

    def release(self, m: _Mapped) -> None:
        with self._lock:
            m.users -= 1
            closable = m if m.dropped and m.users == 0 else None
        if closable is not None:
            closable.close()

    def prune(self, pipeline_id: str) -> int:
        """Drop unused mappings of ``pipeline_id`` whose file is gone; returns how many."""
        with self._lock:
            candidates = [
                m for m in self._maps.values() if m.pipeline_id == pipeline_id and m.users == 0
            ]
        gone = []
        for m in candidates:
            try:
                st = os.stat(m.path)
                alive = (int(st.st_dev), int(st.st_ino)) == m.file_id
            except OSError:
                alive = False
            if not alive:
                gone.append(m)
        return self._drop_all(gone)

    def release_all(self, pipeline_id: str | None) -> int:
        with self._lock:
            chosen = [
                m for m in self._maps.values() if pipeline_id in (None, m.pipeline_id)
            ]
        return self._drop_all(chosen)

    def _drop_all(self, ms: list[_Mapped]) -> int:
        closable = []
        with self._lock:
            for m in ms:
                c = self._unlink_locked(m)
                if c is not None:
                    closable.append(c)
        for m in closable:
            m.close()
        return len(ms)

    def mapped_bytes(self, pipeline_id: str | None = None) -> int:
        with self._lock:
            return sum(
                len(m.mm) for m in self._maps.values() if pipeline_id in (None, m.pipeline_id)
            )


_REGISTRY = _Registry()


def release_shm_mappings(pipeline_id: str | None = None) -> int:
    """Unmap the bucket files this process kept mapped (of one pipeline, or all); returns how
    many. Call it when a receiver stops syncing (sleep, shutdown) so a closed cache's pages are
    not kept alive by its mappings."""
    return _REGISTRY.release_all(pipeline_id)


def kept_mapping_bytes(pipeline_id: str | None = None) -> int:
    """Bytes of bucket files this process keeps mapped (shared pages, not private memory)."""
    return _REGISTRY.mapped_bytes(pipeline_id)


def mappings_opened() -> int:
    """How many times this process has mapped a bucket file so far (a kept mapping counts
    once; without kept mappings every bucket of every sync counts)."""
    with _opened_lock:
        return _opened


class ShmReceiver(ReceiverTransport):
    def __init__(self, offer: SyncOffer | None = None) -> None:
        self._offer = offer
        self._keep = bool(offer.details.get("keep_mappings")) if offer is not None else False
        self._pipeline = offer.pipeline_id if offer is not None else ""
        self._current: _Mapped | None = None
        self._view: torch.Tensor | None = None

    def fetch(self, header: Mapping[str, Any], frames: list[Any]) -> torch.Tensor:
        import torch

        self.release()
        path = str(header["path"])
        nbytes = int(header["nbytes"])
        offset = int(header.get("data_offset", 0))
        raw_id = header.get("file_id")
        if raw_id is None:
            raise WeightSyncError(f"shm bucket header for {path} lacks the file identity")
        file_id = (int(raw_id[0]), int(raw_id[1]))
        expected = ShmFileHeader(**{k: int(v) for k, v in dict(header["file_header"]).items()})
        if expected.nbytes != nbytes or (
            self._offer is not None and expected.version != self._offer.version
        ):
            raise WeightSyncError(
                f"shm bucket header {expected} does not match the offer (version "
                f"{self._offer.version if self._offer else '?'}, {nbytes} bytes)"
            )
        m = self._map(path, file_id, expected)
        if len(m.mm) < offset + nbytes:
            self._discard(m)
            raise WeightSyncError(
                f"shared bucket {path} has {len(m.mm)} bytes, header says {offset + nbytes}"
            )
        m.populate(offset + nbytes)
        self._current = m
        arr = m.arr[offset : offset + nbytes]
        with warnings.catch_warnings():
            # read-only mapping: torch warns that writes are undefined; nothing writes to it
            warnings.simplefilter("ignore", UserWarning)
            self._view = torch.from_numpy(arr) if nbytes else torch.empty(0, dtype=torch.uint8)
        return self._view

    def _map(self, path: str, file_id: tuple[int, int], expected: ShmFileHeader) -> _Mapped:
        """A mapping of ``path`` whose file header says ``expected``; a kept one that does not
        is dropped and the file mapped again (once)."""
        for _attempt in range(2):
            if self._keep:
                m, reused = _REGISTRY.acquire(path, file_id, self._pipeline)
            else:
                m, reused = _map_file(path, file_id, self._pipeline), False
                m.users = 1
            m.populate(8 * ShmFileHeader.WORDS)
            got = m.header()
            if got == expected:
                return m
            self._discard(m)
            if not reused:
                raise WeightSyncError(
                    f"shared bucket {path} holds {got}, the sender announced {expected}: "
                    "stale or foreign bucket file; nothing of it was applied"
                )
            logger.info("kept mapping of %s is stale (%s); mapping it again", path, got)
        raise AssertionError("unreachable")  # pragma: no cover

    def _discard(self, m: _Mapped) -> None:
        if self._keep:
            _REGISTRY.drop(m)
            _REGISTRY.release(m)
        else:
            m.close()

    def release(self) -> None:
        self._view = None
        m, self._current = self._current, None
        if m is None:
            return
        if self._keep:
            _REGISTRY.release(m)
        else:
            m.close()

    def close(self) -> None:
        self.release()
        if self._keep:
            _REGISTRY.prune(self._pipeline)
