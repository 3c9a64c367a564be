"""Where sender and receivers are, and which transport connects them."""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from pathlib import Path

from rlix_plugins.errors import TransportUnavailableError
from rlix_plugins.training.wire import TransportKind

_ALL = frozenset(TransportKind)


def local_host_id() -> str:
    """Identity of this machine: hostname plus boot id (containers may share a hostname)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}:{boot}"


@dataclass(frozen=True, slots=True)
class SenderLocation:
    """The cache owner: its host and, if it has one, the UUID of its GPU."""

    host: str = field(default_factory=local_host_id)
    gpu_uuid: str | None = None
    cuda: bool = False


@dataclass(frozen=True, slots=True)
class ReceiverLocation:
    """An inference shard's host, GPU (None = CPU engine) and the transports it accepts."""

    host: str = field(default_factory=local_host_id)
    gpu_uuid: str | None = None
    accepts: frozenset[TransportKind] = _ALL



class AddressedReceiver:
    """Base of the sender-side receiver handles: the shard id and where it runs.

    Gives the ``shard_id`` / ``location`` half of
    :class:`~rlix_plugins.training.sync.ReceiverHandle`; subclasses add ``begin_receive``.
    """

    def __init__(self, shard_id: str, location: ReceiverLocation | None = None) -> None:
        self._shard_id = shard_id
        self._location = location or ReceiverLocation()

    @property
    def shard_id(self) -> str:
        return self._shard_id

    @property
    def location(self) -> ReceiverLocation:
        return self._location

def select_transport(
    sender: SenderLocation, receiver: ReceiverLocation, *, cache_in_shm: bool
) -> TransportKind:
    """Pick the cheapest transport both sides support.

    GPU receiver: CUDA IPC when it is on the sender's GPU, else NCCL broadcast.
    CPU receiver: shared memory on the same host when the cache lives in /dev/shm, else ZMQ.
    """
    acc = receiver.accepts
    if receiver.gpu_uuid is not None:
        if sender.cuda and sender.gpu_uuid == receiver.gpu_uuid and TransportKind.CUDA_IPC in acc:
            return TransportKind.CUDA_IPC
        if sender.cuda and TransportKind.NCCL in acc:
            return TransportKind.NCCL
        raise TransportUnavailableError(
            f"receiver on GPU {receiver.gpu_uuid} needs cuda_ipc or nccl, but the sender "
            f"{'has no CUDA device' if not sender.cuda else 'shares neither'} "
            f"(receiver accepts {sorted(k.value for k in acc)})"
        )
    same_host = sender.host == receiver.host
    if same_host and cache_in_shm and TransportKind.SHM in acc:
        return TransportKind.SHM
    if TransportKind.ZMQ in acc:
        return TransportKind.ZMQ
    if TransportKind.GLOO in acc:
        return TransportKind.GLOO
    raise TransportUnavailableError(
        f"no transport reaches CPU receiver on {receiver.host} from {sender.host}; "
        f"receiver accepts {sorted(k.value for k in acc)}"
    )
