"""Broadcast transport on a temporary process group: sender (rank 0) + its receivers.

``nccl``: receivers on other GPUs; UNVERIFIED without a GPU. ``gloo``: the same code on CPU
tensors, which is how the group logic is tested here.

The group is built from a private TCPStore rendezvous (``ProcessGroupNCCL/Gloo(store, rank,
size)``), never through ``torch.distributed.init_process_group``: the sender and the inference
workers belong to different torch.distributed worlds (or none). It exists for one sync and is
shut down after it, so no communicator outlives the sync. Each receiver allocates one bucket
of receive buffer (on its GPU for nccl) and reuses it for every bucket.
"""

from __future__ import annotations

import datetime
import logging
import socket
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from rlix_plugins.errors import TransportUnavailableError, WeightSyncError
from rlix_plugins.training.transports.base import ReceiverTransport, SenderTransport
from rlix_plugins.training.wire import SyncOffer, TransportKind

if TYPE_CHECKING:
    import torch

    from rlix_plugins.training.bucket_cache import Bucket, CachedVersion

logger = logging.getLogger(__name__)


def _make_group(backend: TransportKind, store: Any, rank: int, size: int, timeout_s: float) -> Any:
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    if backend is TransportKind.GLOO:
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    pg_nccl = getattr(dist, "ProcessGroupNCCL", None)
    if pg_nccl is None:
        raise TransportUnavailableError("transport 'nccl' needs a torch build with NCCL")
    opts = pg_nccl.Options()
    opts._timeout = timeout
    return pg_nccl(store, rank, size, opts)


def _broadcast(group: Any, tensor: torch.Tensor) -> None:
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([tensor], opts).wait()


def _shutdown(group: Any) -> None:
    for name in ("shutdown", "abort"):
        fn = getattr(group, name, None)
        if fn is not None:
            try:
                fn()
                return
            except Exception:  # a dead peer can make shutdown fail; abort is the fallback
                logger.debug("process group %s() failed", name, exc_info=True)


def _node_address() -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


class BroadcastSender(SenderTransport):
    def __init__(
        self,
        kind: TransportKind,
        version: CachedVersion,
        group_size: int,
        timeout_s: float,
        advertise_host: str | None = None,
    ) -> None:
        import torch
        import torch.distributed as dist

        if kind is TransportKind.NCCL and not torch.cuda.is_available():
            raise TransportUnavailableError("transport 'nccl' needs a CUDA device")
        self.kind = kind
        self._size = group_size + 1
        self._timeout_s = timeout_s
        # The store's server listens on every interface; this is only the address announced
        # to receivers, so it must be the one they can reach (SyncOptions.advertise_host, as
        # for the control sockets): the hostname's address is 127.0.1.1 under Debian's
        # default /etc/hosts, and a receiver on another node never joined the group.
        self._host = advertise_host or (
            "127.0.0.1" if kind is TransportKind.GLOO else _node_address()
        )
        self._store: Any = dist.TCPStore(  # type: ignore[attr-defined]
            self._host,
            0,
            self._size,
            True,
            timeout=datetime.timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )
        self._prefix = f"rlix-sync-{uuid.uuid4().hex}"
        self._port = int(self._store.port)
        self._group: Any = None
        self._staging: torch.Tensor | None = None
        if kind is TransportKind.NCCL:
            cap = max((int(b.storage.numel()) for b in version.buckets), default=1)
            self._staging = torch.empty(cap, dtype=torch.uint8, device="cuda")

    def details(self, rank: int) -> dict[str, Any]:
        return {
            "store_host": self._host,
            "store_port": self._port,
            "prefix": self._prefix,
            "rank": rank,
            "world_size": self._size,
        }

    def prepare(self) -> None:
        import torch.distributed as dist

        if self._store is None:
            raise WeightSyncError("this broadcast sender is closed; a sync makes a new one")
        # blocks until every receiver has joined the rendezvous (bounded by the timeout)
        self._group = _make_group(
            self.kind,
            dist.PrefixStore(  # type: ignore[attr-defined]
                self._prefix, self._store
            ),
            0,
            self._size,
            self._timeout_s,
        )

    def frames(self, bucket: Bucket) -> tuple[dict[str, Any], list[Any]]:
        return {}, []

    def after_headers(self, bucket: Bucket) -> None:
        n = bucket.layout.nbytes
        if n == 0:
            return
        if self._staging is not None:
            self._staging[:n].copy_(bucket.data, non_blocking=True)
            payload = self._staging[:n]
        else:
            payload = bucket.data
        try:
            _broadcast(self._group, payload)
        except Exception as exc:
            raise WeightSyncError(f"{self.kind.value} broadcast of bucket failed: {exc}") from exc

    def close(self) -> None:
        """Shut the group down and stop the rendezvous server (idempotent).

        torch's TCPStore has no close(): its server thread stops when the last reference goes,
        and the group holds one through the PrefixStore, so both are dropped here rather than
        left to garbage collection (a sender per sync would otherwise keep a listening port).
        """
        if self._group is not None:
            _shutdown(self._group)
            self._group = None
        self._store = None
        self._staging = None


class BroadcastReceiver(ReceiverTransport):
    reuses_buffer = True  # one receive buffer for every bucket

    def __init__(self, offer: SyncOffer) -> None:
        import torch
        import torch.distributed as dist

        d = offer.details
        kind = offer.transport
        store = dist.TCPStore(  # type: ignore[attr-defined]
            str(d["store_host"]),
            int(d["store_port"]),
            int(d["world_size"]),
            False,
            timeout=datetime.timedelta(seconds=offer.timeout_s),
        )
        self._group = _make_group(
            kind,
            dist.PrefixStore(  # type: ignore[attr-defined]
                str(d["prefix"]), store
            ),
            int(d["rank"]),
            int(d["world_size"]),
            offer.timeout_s,
        )
        self._store: Any = store
        self._offer = offer
        device = "cuda" if kind is TransportKind.NCCL else "cpu"
        # one bucket of receive buffer, reused: the receiver's whole extra memory
        self._buffer = torch.empty(max(offer.max_bucket_bytes, 1), dtype=torch.uint8, device=device)

    def fetch(self, header: Mapping[str, Any], frames: list[Any]) -> torch.Tensor:
        n = int(header["nbytes"])
        limit = self._offer.max_bucket_bytes
        if not 0 <= n <= limit:
            # A longer bucket was broadcast into a shorter view of the buffer: gloo aborts
            # the whole process on the size mismatch (nccl reads past or hangs); refuse first.
            raise WeightSyncError(
                f"shard {self._offer.shard_id}: bucket {header.get('index')} announces {n} "
                f"bytes, outside 0..{limit} (the offer's max_bucket_bytes, the receive buffer's "
                f"size; sync {self._offer.sync_id})"
            )
        view = self._buffer[:n]
        if n:
            _broadcast(self._group, view)
        return view

    def close(self) -> None:
        """Shut the group down and drop this receiver's store client (idempotent)."""
        import torch

        if self._group is not None:
            _shutdown(self._group)
            self._group = None
        self._store = None
        self._buffer = torch.empty(0, dtype=torch.uint8)
