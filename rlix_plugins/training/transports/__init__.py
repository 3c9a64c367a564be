"""Bucket transports behind one interface; :func:`select_transport` picks one per receiver.

Verified on CPU here: ``shm``, ``zmq`` and ``gloo``. ``cuda_ipc`` and ``nccl`` are written
for GPU machines and are UNVERIFIED until run on one (their tests are marked ``gpu``).
"""

from rlix_plugins.training.transports.base import (
    ReceiverTransport,
    SenderTransport,
    open_receiver_transport,
    open_sender_transport,
)
from rlix_plugins.training.transports.selection import (
    ReceiverLocation,
    SenderLocation,
    local_host_id,
    select_transport,
)

__all__ = [
    "ReceiverLocation",
    "ReceiverTransport",
    "SenderLocation",
    "SenderTransport",
    "local_host_id",
    "open_receiver_transport",
    "open_sender_transport",
    "select_transport",
]
