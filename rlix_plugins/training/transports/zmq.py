"""ZMQ transport: bucket bytes as one zero-copy frame after the header.

The sender hands ZMQ the cache's buffer itself (``copy=False``), the receiver gets a frame
whose memory it views as tensors without another copy. Works over ``ipc://`` on one host and
``tcp://`` across hosts; the lockstep ack keeps one bucket in flight.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from rlix_plugins.errors import WeightSyncError
from rlix_plugins.training.transports.base import ReceiverTransport, SenderTransport
from rlix_plugins.training.wire import TransportKind

if TYPE_CHECKING:
    import torch

    from rlix_plugins.training.bucket_cache import Bucket


class ZmqSender(SenderTransport):
    kind = TransportKind.ZMQ

    def frames(self, bucket: Bucket) -> tuple[dict[str, Any], list[Any]]:
        data = bucket.data
        return {}, [data.numpy().data]


class ZmqReceiver(ReceiverTransport):
    def __init__(self) -> None:
        self._frame: Any = None

    def fetch(self, header: Mapping[str, Any], frames: list[Any]) -> torch.Tensor:
        import torch

        if len(frames) != 1:
            raise WeightSyncError(
                f"zmq bucket message has {len(frames)} payload frames, expected 1"
            )
        self._frame = frames[0]
        buf = self._frame.buffer if hasattr(self._frame, "buffer") else memoryview(self._frame)
        if len(buf) != int(header["nbytes"]):
            raise WeightSyncError(
                f"zmq bucket {header.get('index')} has {len(buf)} bytes, header says "
                f"{header['nbytes']}"
            )
        if len(buf) == 0:
            return torch.empty(0, dtype=torch.uint8)
        arr = np.frombuffer(buf, dtype=np.uint8)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only frame; never written
            return torch.from_numpy(arr)

    def release(self) -> None:
        self._frame = None
