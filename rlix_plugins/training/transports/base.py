"""The transport interface: a sender side (one per receiver group) and a receiver side.

The control channel (headers, acks) is common to all transports and lives in the sync loop;
a transport only moves a bucket's bytes:

* sender: ``details(rank)`` goes into each receiver's offer; ``prepare()`` runs after the
  receivers were started (a collective transport rendezvouses there); per bucket
  ``frames(bucket)`` gives header extras and extra ZMQ frames, then ``after_headers(bucket)``
  moves bytes out of band (a broadcast).
* receiver: ``fetch(header, frames)`` returns the bucket's bytes as a 1-D uint8 tensor (on
  CPU or on the receiver's GPU); ``release()`` drops it once applied.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from rlix_plugins.errors import TransportUnavailableError, WeightSyncError
from rlix_plugins.training.wire import SyncOffer, TransportKind

if TYPE_CHECKING:
    import torch

    from rlix_plugins.training.bucket_cache import Bucket, CachedVersion


class SenderTransport(abc.ABC):
    """Sender side of one transport for one group of receivers."""

    kind: TransportKind
    #: How many bucket headers may be sent before the oldest is acked. 1 (lockstep) keeps a
    #: receiver's extra memory at one bucket for transports that copy bytes to the receiver.
    headers_ahead: int = 1

    def details(self, rank: int) -> dict[str, Any]:
        """Transport details for the receiver at ``rank`` (1-based within the group)."""
        del rank
        return {}

    def prepare(self) -> None:  # noqa: B027 - optional hook
        """Called once the receivers were asked to start."""

    @abc.abstractmethod
    def frames(self, bucket: Bucket) -> tuple[dict[str, Any], list[Any]]:
        """Header extras and extra frames (buffers) to send with this bucket's header."""

    def after_headers(self, bucket: Bucket) -> None:  # noqa: B027 - optional hook
        """Move the bucket out of band once every receiver has its header."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release transport resources (idempotent)."""


class ReceiverTransport(abc.ABC):
    """Receiver side of one transport."""

    #: True when the bytes :meth:`fetch` returns are overwritten by a later bucket once this
    #: one is released (one receive or staging buffer reused for every bucket): a consumer
    #: that keeps a tensor past the bucket's ack must get a copy, never a view.
    reuses_buffer: bool = False

    @abc.abstractmethod
    def fetch(self, header: Mapping[str, Any], frames: list[Any]) -> torch.Tensor:
        """The bucket's used bytes as a 1-D uint8 tensor (valid until :meth:`release`)."""

    def release(self) -> None:  # noqa: B027 - optional hook
        """Drop references to the current bucket."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release transport resources (idempotent)."""


def check_sync_id(header: Mapping[str, Any], offer: SyncOffer) -> None:
    """Refuse a bucket header of another sync. A remote receiver's control address is a tcp
    port the sender picked at random; a receive that started after its sync gave up kept
    connecting to it and, once a later sync (of any pipeline on that host) had bound the same
    port, took that sync's buckets, applied them and recorded its own offer's version."""
    sent = header.get("sync_id")
    if sent is not None and sent != offer.sync_id:
        raise WeightSyncError(
            f"shard {offer.shard_id}: bucket {header.get('index')} belongs to sync {sent}, not "
            f"to this receiver's sync {offer.sync_id} (its control address "
            f"{offer.control_address} was reused); nothing of it was applied"
        )


def open_sender_transport(
    kind: TransportKind,
    version: CachedVersion,
    group_size: int,
    timeout_s: float,
    advertise_host: str | None = None,
) -> SenderTransport:
    """Create the sender side of ``kind`` for a group of ``group_size`` receivers;
    ``advertise_host`` is the address receivers on other nodes reach this sender at (the
    broadcast transports announce their rendezvous there)."""
    if kind is TransportKind.SHM:
        from rlix_plugins.training.transports.shm import ShmSender

        return ShmSender(version)
    if kind is TransportKind.ZMQ:
        from rlix_plugins.training.transports.zmq import ZmqSender

        return ZmqSender()
    if kind is TransportKind.CUDA_IPC:
        from rlix_plugins.training.transports.cuda_ipc import CudaIpcSender

        return CudaIpcSender(version)
    if kind in (TransportKind.NCCL, TransportKind.GLOO):
        from rlix_plugins.training.transports.collective import BroadcastSender

        return BroadcastSender(kind, version, group_size, timeout_s, advertise_host)
    raise TransportUnavailableError(f"no sender for transport {kind!r}")


def open_receiver_transport(offer: SyncOffer) -> ReceiverTransport:
    """Create the receiver side for ``offer.transport``."""
    kind = offer.transport
    if kind is TransportKind.SHM:
        from rlix_plugins.training.transports.shm import ShmReceiver

        return ShmReceiver(offer)
    if kind is TransportKind.ZMQ:
        from rlix_plugins.training.transports.zmq import ZmqReceiver

        return ZmqReceiver()
    if kind is TransportKind.CUDA_IPC:
        from rlix_plugins.training.transports.cuda_ipc import CudaIpcReceiver

        return CudaIpcReceiver()
    if kind in (TransportKind.NCCL, TransportKind.GLOO):
        from rlix_plugins.training.transports.collective import BroadcastReceiver

        return BroadcastReceiver(offer)
    raise TransportUnavailableError(f"no receiver for transport {kind!r}")
