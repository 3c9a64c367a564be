"""CUDA IPC transport for a receiver on the sender's own GPU. UNVERIFIED without a GPU.

The sender copies each bucket from the (pinned) cache into ONE staging buffer on its GPU,
synchronises, and sends the buffer's CUDA IPC handle; the receiver maps that memory (no
receiver-side allocation), verifies and applies it, then acks so the staging buffer can be
reused. Extra GPU memory: one bucket, owned by the sender.

The handle is torch's own (``torch.multiprocessing.reductions.reduce_tensor``). The device
index in it is the sender's; the receiver may see the same GPU under another index
(CUDA_VISIBLE_DEVICES), so it substitutes its current device, as veRL and NeMo RL do.
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from rlix_plugins.errors import TransportUnavailableError, WeightSyncError
from rlix_plugins.training.transports.base import ReceiverTransport, SenderTransport
from rlix_plugins.training.wire import TransportKind

if TYPE_CHECKING:
    import torch

    from rlix_plugins.training.bucket_cache import Bucket, CachedVersion

#: Position of the device index in reduce_tensor's argument tuple for CUDA tensors (torch 2.x).
_DEVICE_ARG = 6


class CudaIpcSender(SenderTransport):
    kind = TransportKind.CUDA_IPC

    def __init__(self, version: CachedVersion) -> None:
        import torch

        if not torch.cuda.is_available():
            raise TransportUnavailableError("transport 'cuda_ipc' needs a CUDA device")
        cap = max((int(b.storage.numel()) for b in version.buckets), default=0)
        self._staging = torch.empty(max(cap, 1), dtype=torch.uint8, device="cuda")
        self._handle: bytes | None = None

    def prepare(self) -> None:
        from torch.multiprocessing.reductions import reduce_tensor

        fn, args = reduce_tensor(self._staging)  # type: ignore[no-untyped-call]
        self._handle = pickle.dumps((fn, args))

    def frames(self, bucket: Bucket) -> tuple[dict[str, Any], list[Any]]:
        import torch

        n = bucket.layout.nbytes
        self._staging[:n].copy_(bucket.data, non_blocking=True)
        # the receiver reads from another process: the copy must be complete, not queued
        torch.cuda.current_stream().synchronize()
        assert self._handle is not None
        return {}, [self._handle]

    def close(self) -> None:
        import torch

        self._staging = torch.empty(0, dtype=torch.uint8)


class CudaIpcReceiver(ReceiverTransport):
    reuses_buffer = True  # a view of the sender's staging buffer, rewritten after each ack

    def __init__(self) -> None:
        self._mapped: torch.Tensor | None = None
        self._key: bytes | None = None

    def fetch(self, header: Mapping[str, Any], frames: list[Any]) -> torch.Tensor:
        import torch

        if len(frames) != 1:
            raise WeightSyncError("cuda_ipc bucket message needs exactly one handle frame")
        raw = bytes(frames[0].buffer if hasattr(frames[0], "buffer") else frames[0])
        if self._mapped is None or raw != self._key:
            fn, args = pickle.loads(raw)  # our own sender, over a local socket
            args = list(args)
            args[_DEVICE_ARG] = torch.cuda.current_device()
            self._mapped = fn(*args)
            self._key = raw
        assert self._mapped is not None
        return self._mapped[: int(header["nbytes"])]

    def release(self) -> None:
        import torch

        # The ack that follows lets the sender overwrite its staging buffer; copies out of it
        # queued on this process's streams (the loader's) must have run by then.
        torch.cuda.synchronize()

    def close(self) -> None:
        self._mapped = None
        self._key = None
