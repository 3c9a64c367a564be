"""The receiving end inside vLLM: a worker extension plus a sender-side handle for an engine.

Install by engine argument, no patching::

    worker_extension_cls="rlix_plugins.training.vllm_receiver.RlixWeightReceiverExtension"

vLLM mixes the class into its worker, so its methods run in the worker process (where the
model lives) and are called with ``collective_rpc("rlix_receive_weights", args=(offer,))``.
The weights go through the model's own ``load_weights`` (HF names in, vLLM's fused
``qkv_proj``/``gate_up_proj`` layouts out), exactly as a checkpoint load does.

The worker's recorded version is cleared when a sync starts and set only when every bucket
arrived and verified: a worker whose sync failed reports ``None`` and must be resynced before
it serves requests. A level-2 sleep discards the weights: whoever sleeps the engine calls
``rlix_forget_weights`` (or :meth:`VllmEngineReceiver.sleep`), after which it reports ``None``
too.

Nothing here imports vLLM: the extension only relies on the worker's ``model_runner``. It
supports one worker per engine (tensor parallel size 1); with TP > 1 every worker would need
its own offer (not implemented).
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from rlix_plugins.errors import WeightSyncError
from rlix_plugins.training.checksum import ChecksumKind, checksum_tensor
from rlix_plugins.training.receiver import receive_weights, receive_weights_streaming
from rlix_plugins.training.transports.selection import AddressedReceiver, ReceiverLocation
from rlix_plugins.training.wire import ReceiveResult, SyncOffer

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

EXTENSION_FQN = "rlix_plugins.training.vllm_receiver.RlixWeightReceiverExtension"


class RlixWeightReceiverExtension:
    """Methods mixed into vLLM's worker class (``worker_extension_cls``)."""

    model_runner: Any  # provided by the vLLM worker this class is mixed into

    def _rlix_model(self) -> Any:
        runner = self.model_runner
        get_model = getattr(runner, "get_model", None)
        return get_model() if callable(get_model) else runner.model

    def rlix_receive_weights(self, offer: dict[str, Any]) -> dict[str, Any]:
        """Pull the offered version bucket by bucket into the model; returns the result."""
        parsed = SyncOffer.from_dict(offer)
        self._rlix_weight_version: int | None = None  # invalid until the sync completes
        reload = getattr(self.model_runner, "reload_weights", None)
        if callable(reload):
            # vLLM's in-place reload: restores each layer to checkpoint format, loads it and
            # re-runs its post-load processing (CPU/GPU kernels repack weights after loading, so
            # a plain load_weights into a processed model fails or is silently wrong).
            def consume(weights: Iterator[tuple[str, torch.Tensor]]) -> None:
                reload(weights_iterator=weights, is_checkpoint_format=True)

            result = receive_weights_streaming(parsed, consume)
        else:
            model = self._rlix_model()

            def load(weights: list[tuple[str, torch.Tensor]]) -> None:
                model.load_weights(weights=weights)

            result = receive_weights(parsed, load)
        self._rlix_weight_version = result.version
        logger.info(
            "shard %s: weight version %d applied (%d buckets, %.1f MiB, %.3fs)",
            result.shard_id,
            result.version,
            result.buckets,
            result.bytes / 2**20,
            result.seconds,
        )
        return result.to_dict()

    def rlix_release_weight_mappings(self) -> int:
        """Unmap the cache's bucket files this worker kept mapped after shm syncs (returns how
        many). Kept mappings are the cache's pages, not worker memory, but they keep a closed
        cache's pages alive until the next sync; call this when the worker stops syncing."""
        from rlix_plugins.training.transports.shm import release_shm_mappings

        return release_shm_mappings()

    def rlix_weight_version(self) -> int | None:
        """The version last applied completely, or None (never synced, or a sync failed)."""
        return getattr(self, "_rlix_weight_version", None)

    def rlix_forget_weights(self) -> None:
        """Clear the recorded version: call after a level-2 sleep, which discards the weights
        (vLLM keeps the extension out of its own ``sleep``, so the engine's owner calls this).
        Until the next complete sync the worker reports ``None``."""
        self._rlix_weight_version = None

    def rlix_param_checksums(self, names: Sequence[str] | None = None) -> dict[str, str]:
        """Fletcher-64 (hex) of each named model parameter's bytes (all when ``names`` is None).

        Lets a caller verify what a worker holds without shipping the tensors back. Parameters
        left empty by kernel repacking (CPU linear layers) are omitted.
        """
        wanted = None if names is None else set(names)
        out: dict[str, str] = {}
        for name, param in self._rlix_model().named_parameters():
            if wanted is not None and name not in wanted:
                continue
            if param.numel() == 0:
                # vLLM's CPU backend repacks linear weights into its GEMM kernel and leaves an
                # empty parameter behind: nothing to fingerprint there
                continue
            raw = param.detach().contiguous().reshape(-1).view(_uint8())
            out[name] = f"{checksum_tensor(raw, ChecksumKind.FLETCHER64):016x}"
        return out


def _uint8() -> torch.dtype:
    import torch

    return torch.uint8


class VllmEngineReceiver(AddressedReceiver):
    """Sender-side handle for one vLLM engine (``vllm.LLM`` or anything with a synchronous
    ``collective_rpc``), usable with :func:`~rlix_plugins.training.sync.sync_version`.

    ``collective_rpc`` blocks until the worker has received everything, so it runs on this
    handle's own thread while the sender streams buckets.
    """

    def __init__(
        self, shard_id: str, engine: Any, location: ReceiverLocation | None = None
    ) -> None:
        super().__init__(shard_id, location)
        self._engine = engine
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=f"rlix-vllm-{shard_id}"
        )

    def begin_receive(self, offer: SyncOffer) -> concurrent.futures.Future[ReceiveResult]:
        def run() -> ReceiveResult:
            replies = self._engine.collective_rpc("rlix_receive_weights", args=(offer.to_dict(),))
            if len(replies) != 1:
                raise WeightSyncError(
                    f"shard {self._shard_id}: {len(replies)} workers answered; the vLLM receiver "
                    "supports one worker per engine (tensor parallel size 1)"
                )
            return ReceiveResult.from_dict(replies[0])

        return self._pool.submit(run)

    def weight_version(self) -> int | None:
        replies = self._engine.collective_rpc("rlix_weight_version")
        return None if replies[0] is None else int(replies[0])

    def sleep(self, level: int = 1) -> None:
        """Sleep the engine; at level 2 (weights discarded) its version is cleared."""
        self._engine.sleep(level=level)
        if level == 2:
            self._engine.collective_rpc("rlix_forget_weights")

    def close(self) -> None:
        self._pool.shutdown(wait=True)
