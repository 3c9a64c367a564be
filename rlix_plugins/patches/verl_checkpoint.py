"""The ``rlix_cache`` veRL checkpoint-engine backend: weights go through the CPU bucket cache.

Registered in veRL's ``CheckpointEngineRegistry`` (the official seam) under
:data:`BACKEND`. veRL builds one engine per process: in every training worker (``send_weights``)
and in every rollout worker (``receive_weights``).

Training side: ``send_weights(weights, global_steps)`` consumes veRL's per-tensor generator
(collective on every rank) into a :class:`~rlix_plugins.training.bucket_cache.BucketCache`;
only the owner rank (global rank 0) keeps the bytes. Nothing is sent: the GPUs can be released
right after. ``rlix_serve(version, receivers)`` (reached through veRL's
``execute_checkpoint_engine``) then streams that cached version to EXACTLY the given rollout
workers with :func:`~rlix_plugins.training.sync.sync_version` - the replicas being woken, or
the active ones for an in-place refresh; no other replica is contacted.

Rollout side: :class:`RayRolloutReceiver` hands the offer to the rollout worker
(``rlix_accept_offer``) and calls veRL's own ``update_weights`` there, which pulls
``receive_weights(global_steps)``: this engine runs the receiver on a thread and yields whole
tensors bucket by bucket (a queue of one bucket bounds the extra memory), which veRL's server
adapter loads into the engine as with any other backend.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from verl.checkpoint_engine.base import CheckpointEngineManager, CheckpointEngineWithCache

from rlix_plugins.adapters.verl_support import CACHE_BACKEND
from rlix_plugins.errors import WeightCacheError, WeightSyncError
from rlix_plugins.training.bucket_cache import BucketCache, CacheConfig
from rlix_plugins.training.transports.selection import AddressedReceiver, ReceiverLocation
from rlix_plugins.training.wire import SyncOffer
from rlix_plugins.values import as_index

logger = logging.getLogger(__name__)

#: backend name in veRL's CheckpointEngineRegistry (``rollout.checkpoint_engine.backend``)
BACKEND = CACHE_BACKEND
#: how long a rollout worker waits for the offer of the version it was asked to load
OFFER_WAIT_S = 120.0

_END = object()


def _global_rank() -> int:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return int(dist.get_rank())
    except Exception:  # no torch.distributed in this process: a single-rank sender
        pass
    return int(os.environ.get("RANK", "0"))


class RLixCacheCheckpointEngine(CheckpointEngineWithCache):  # type: ignore[misc]
    """veRL checkpoint engine backed by the RLix CPU bucket cache (see module docstring).

    Args:
        bucket_size: veRL's ``update_weights_bucket_megabytes`` in bytes; the cache bucket size
            (a tensor larger than one bucket is an error, see the cache's docs).
        pipeline_id: cache owner id (default ``PIPELINE_ID`` or ``"verl"``).
        offer_wait_s: bound on a rollout worker's wait for its offer.
    """

    def __init__(
        self,
        bucket_size: int,
        is_master: bool = False,
        *,
        pipeline_id: str | None = None,
        offer_wait_s: float = OFFER_WAIT_S,
        **kwargs: Any,
    ) -> None:
        del kwargs, is_master
        self.bucket_size = int(bucket_size)
        self.pipeline_id = pipeline_id or os.environ.get("PIPELINE_ID") or "verl"
        self.offer_wait_s = offer_wait_s
        self._cache: BucketCache | None = None
        #: offers per version, oldest first: two syncs of one version (a trainer's refresh and
        #: an expand's catch-up) each reach a receive of their own, none overwritten
        self._offers: dict[int, list[SyncOffer]] = {}
        self._offer_cv = threading.Condition()
        self.loaded_versions: list[int] = []

    # ---------------------------------------------------------------- veRL's lifecycle
    def prepare(self) -> dict[str, Any]:
        """No process group to build: the cache is the meeting point."""
        return {"backend": BACKEND, "rank": _global_rank()}

    @classmethod
    def build_topology(
        cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict[str, Any]]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        del actor_wg_world_size, rollout_world_size, metadata
        return {}, {}

    def init_process_group(self, **kwargs: Any) -> None:
        del kwargs

    def finalize(self) -> None:
        return None

    # ---------------------------------------------------------------- training side
    @property
    def cache(self) -> BucketCache:
        """This process's cache (created on first use; only the owner rank fills it)."""
        if self._cache is None:
            self._cache = BucketCache(self.pipeline_id, CacheConfig(bucket_bytes=self.bucket_size))
        return self._cache

    async def send_weights(
        self, weights: Iterable[tuple[str, Any]], global_steps: int | None = None
    ) -> dict[str, Any]:
        """Cache ``weights`` as version ``global_steps`` (every rank drains; rank 0 keeps).

        ``global_steps=None`` caches one above the newest cached version (0 when none is).

        Raises:
            WeightCacheError: ``global_steps`` is not an int >= 0, or not above the newest
                cached version (named); the weights were drained, nothing was cached.
        """
        # A sync generator is consumed on a thread, tensor by tensor (never materialised: its
        # tensors live on the training GPU); only an async one must be collected first.
        items = await _collect(weights) if hasattr(weights, "__aiter__") else weights
        if _global_rank() != 0:
            # Only the owner numbers and keeps versions; this rank takes part in the gather.
            await asyncio.to_thread(_drain, items)
            return {}
        newest = self._cache.latest_version if self._cache is not None else None
        try:
            version = resolve_version(global_steps, newest)
            if version == newest:
                raise WeightCacheError(
                    f"weight version {version} is not above the newest cached version, "
                    f"{newest}: versions are immutable (use a step above it, or None for the "
                    "next one); nothing was cached"
                )
        except WeightCacheError:
            # The other ranks block in the gather until this rank iterated to the end too.
            await asyncio.to_thread(_drain, items)
            raise
        info = await asyncio.to_thread(self.cache.build, version, items, is_owner=True)
        if info is None:
            return {}
        return {"rlix/cache_version": version, "rlix/cache_bytes": int(info.total_bytes)}

    def rlix_serve(self, version: int, receivers: Sequence[Sequence[Any]]) -> dict[str, Any]:
        """Stream cached ``version`` to exactly ``receivers``: (shard id, rollout worker) or
        (shard id, training worker, its receive method) for a hybrid replica's worker."""
        from rlix_plugins.training.sync import sync_version

        if self._cache is None:
            raise WeightSyncError(f"this process holds no weight cache (asked for v{version})")
        handles = [_receiver(entry) for entry in receivers]
        report = sync_version(self._cache, int(version), handles)
        logger.info(
            "synced v%d to %s in %.3fs", version, list(report.succeeded), report.seconds
        )
        return {
            "version": report.version,
            "succeeded": list(report.succeeded),
            "failed": list(report.failed),
            "bytes": report.total_bytes,
            "seconds": report.seconds,
        }

    def rlix_cached_versions(self) -> list[int]:
        return list(self._cache.versions()) if self._cache is not None else []

    # ---------------------------------------------------------------- rollout side
    def rlix_accept_offer(self, offer: dict[str, Any]) -> int:
        """Remember the offer of one version; ``receive_weights`` picks it up."""
        parsed = SyncOffer.from_dict(offer)
        with self._offer_cv:
            self._offers.setdefault(parsed.version, []).append(parsed)
            self._offer_cv.notify_all()
        return parsed.version

    def _take_offer(self, version: int | None) -> SyncOffer:
        deadline = time.monotonic() + self.offer_wait_s
        with self._offer_cv:
            while True:
                if version is None and self._offers:
                    version = max(self._offers)
                if version is not None and version in self._offers:
                    # versions only advance: an older offer will never be taken (its sender
                    # reports this receiver gone when its wait ends)
                    for old in [v for v in self._offers if v < version]:
                        logger.info("dropping the offer(s) of weight version %d: v%d taken",
                                    old, version)
                        del self._offers[old]
                    pending = self._offers[version]
                    offer = pending.pop(0)
                    if not pending:
                        del self._offers[version]
                    return offer
                left = deadline - time.monotonic()
                if left <= 0:
                    raise WeightSyncError(
                        f"no offer for weight version {version} arrived in {self.offer_wait_s:g}s"
                    )
                self._offer_cv.wait(left)

    async def receive_weights(
        self, global_steps: int | None = None
    ) -> AsyncIterator[tuple[str, Any]]:
        """Pull the offered version bucket by bucket and yield whole tensors."""
        from rlix_plugins.training.receiver import receive_weights

        offer = await asyncio.to_thread(self._take_offer, global_steps)
        chunks: queue.Queue[object] = queue.Queue(maxsize=1)
        # Set when the consumer (veRL's loader) is gone: the receiving thread must not wait on
        # a full queue nobody reads (it holds the transport's socket and a bucket).
        stopped = threading.Event()

        def put(item: object) -> bool:
            while not stopped.is_set():
                try:
                    chunks.put(item, timeout=0.1)
                    return True
                except queue.Full:
                    continue
            return False

        def load(batch: list[tuple[str, Any]]) -> None:
            # Copies: the bucket's memory is released as soon as this returns.
            if not put([(name, t.clone()) for name, t in batch]):
                raise WeightSyncError(
                    f"weight version {offer.version}: the loader stopped before the end"
                )

        def run() -> None:
            try:
                receive_weights(offer, load)
                put(_END)
            except BaseException as exc:
                put(exc)

        worker = threading.Thread(target=run, name=f"rlix-recv-v{offer.version}", daemon=True)
        worker.start()
        try:
            while True:
                item = await asyncio.to_thread(chunks.get)
                if item is _END:
                    break
                if isinstance(item, BaseException):
                    raise item
                assert isinstance(item, list)
                for pair in item:
                    yield pair
        finally:
            stopped.set()
            # Wakes a getter thread still waiting if this generator was cancelled there.
            with contextlib.suppress(queue.Full):
                chunks.put_nowait(_END)
        self.loaded_versions.append(offer.version)

    async def get_weights(self) -> AsyncIterator[tuple[str, Any]]:
        """The newest cached version, tensor by tensor (veRL's cache seam)."""
        latest = self.cache.latest_version
        if latest is None:
            return
        for pair in self.cache.named_tensors(latest):
            yield pair


class RayRolloutReceiver(AddressedReceiver):
    """A veRL rollout worker (``CheckpointEngineWorker`` actor) as a sync receiver."""

    def __init__(self, shard_id: str, worker: Any, location: ReceiverLocation | None = None):
        super().__init__(shard_id, location)
        self._worker = worker

    def begin_receive(self, offer: SyncOffer) -> concurrent.futures.Future[Any]:
        self._worker.execute_checkpoint_engine.remote("rlix_accept_offer", offer.to_dict())
        # veRL's own rollout-side update: receive_weights() -> server adapter load.
        ref = self._worker.update_weights.remote(global_steps=offer.version)
        fut: concurrent.futures.Future[Any] = ref.future()
        return fut


def _receiver(entry: Sequence[Any]) -> RayRolloutReceiver | HybridWorkerReceiver:
    if len(entry) == 3 and entry[2]:
        return HybridWorkerReceiver(str(entry[0]), entry[1], str(entry[2]))
    return RayRolloutReceiver(str(entry[0]), entry[1])


async def _collect(weights: Any) -> list[tuple[str, Any]]:
    """An async weight generator, collected (the cache consumes a plain iterable)."""
    return [pair async for pair in weights]


def _drain(items: Iterable[tuple[str, Any]]) -> None:
    """Iterate ``items`` to the end, keeping nothing (a rank's part of a collective gather)."""
    for _ in items:
        pass


def resolve_version(requested: object, newest: int | None) -> int:
    """The weight version an update caches: veRL's ``global_steps``, or for None (veRL's
    ``update_weights()`` without a step) one above ``newest`` (0 when nothing is cached).

    Versions never go back: the shard controller's expand and ``VerlCacheSync.latest_version``
    serve the highest cached number, and a rollout worker drops offers below the one it took,
    so a lower number would be skipped or served as stale. The same number as ``newest`` is
    returned (the caller decides whether that re-serves it or is an error).

    Raises:
        WeightCacheError: ``requested`` is not None or an int >= 0, or is below ``newest``.
    """
    if requested is None:
        return 0 if newest is None else newest + 1
    version = as_index(requested)
    if version is None or version < 0:
        raise WeightCacheError(
            f"weight version (veRL's global_steps) must be an int >= 0 or None, got {requested!r}"
        )
    if newest is not None and version < newest:
        raise WeightCacheError(
            f"weight version {version} goes backwards: the newest cached version is {newest}, "
            "and versions only increase (use a step >= it, or None for the next one); nothing "
            "was cached or synced"
        )
    return version


# ---------------------------------------------------------------- Megatron NCCL lifecycle
# These run inside veRL's training workers through ``execute_checkpoint_engine`` (the engine
# object lives in the worker process, which is where Megatron's parallel_state lives).

_lifecycle: Any = None


def _parallel_config_from_state() -> Any:
    from megatron.core import parallel_state as ps

    from rlix_plugins.training.nccl_lifecycle import ParallelConfig

    return ParallelConfig.of(
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        virtual_pipeline_model_parallel_size=ps.get_virtual_pipeline_model_parallel_world_size(),
        context_parallel_size=ps.get_context_parallel_world_size(),
        expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
        expert_tensor_parallel_size=ps.get_expert_tensor_parallel_world_size(),
    )


def release_parallel_state() -> dict[str, Any]:
    """Destroy every Megatron process group of this worker (config saved for re-init)."""
    global _lifecycle
    from rlix_plugins.training.nccl_lifecycle import MegatronParallelLifecycle

    if _lifecycle is None:
        _lifecycle = MegatronParallelLifecycle.adopt(_parallel_config_from_state())
    if not _lifecycle.initialized:
        return {"destroyed": 0}
    report = _lifecycle.destroy()
    return {"destroyed": int(report.destroyed)}


def restore_parallel_state(roots: Mapping[str, Any]) -> dict[str, Any]:
    """Re-create the groups destroyed by :func:`release_parallel_state` and rebind every old
    group held under ``roots`` (the engines' model chunks, optimizer, ...) to its successor.

    Raises :class:`~rlix_plugins.training.nccl_lifecycle.StaleProcessGroupError` when a
    destroyed group is still reachable from ``roots`` afterwards. ``{"restored": False}`` when
    nothing was destroyed (the state is alive). A re-init whose rebind failed is retried
    (the rebind only: the groups exist), not taken for "nothing to do".
    """
    if _lifecycle is None or not _lifecycle.needs_reinit:
        return {"restored": False}
    report = _lifecycle.reinitialize(dict(roots))
    replaced = 0 if report is None else int(report.replaced)
    logger.info("re-init rebound %d group references under %s", replaced, sorted(roots))
    return {"restored": True, "rebound": replaced, "roots": sorted(roots)}


# ---------------------------------------------------------------- trainer-side manager
def worker_call_name(worker_group: Any, method: str) -> str | None:
    """The Ray actor method behind ``worker_group.<method>`` (None: not bound).

    veRL's trainer builds its workers as colocated ``WorkerDict`` actors whose methods carry
    the role as prefix (``actor_rollout_execute_checkpoint_engine``); the worker group rebinds
    them without it, and names each bound callable's type after the real actor method.
    """
    bound = getattr(worker_group, method, None)
    if bound is None:
        return None
    name = type(bound).__name__
    return name if name.endswith(method) else method


def engine_call_name(worker_group: Any) -> str:
    """The Ray actor method behind ``worker_group.execute_checkpoint_engine``."""
    name = worker_call_name(worker_group, "execute_checkpoint_engine")
    if name is None:
        raise WeightSyncError(
            f"{type(worker_group).__name__} has no execute_checkpoint_engine; the rlix_cache "
            "backend needs veRL's training worker group"
        )
    return name


class HybridWorkerReceiver(AddressedReceiver):
    """A training worker hosting a hybrid replica (RLix worker subclass) as a sync receiver:
    its ``rlix_receive_weights(offer)`` pulls the version and loads it into its rollout."""

    def __init__(self, shard_id: str, worker: Any, method: str,
                 location: ReceiverLocation | None = None) -> None:
        super().__init__(shard_id, location)
        self._worker = worker
        self._method = method

    def begin_receive(self, offer: SyncOffer) -> concurrent.futures.Future[Any]:
        ref = getattr(self._worker, self._method).remote(offer.to_dict())
        fut: concurrent.futures.Future[Any] = ref.future()
        return fut


def _is_hybrid(replica: Any) -> bool:
    mode = getattr(replica, "rollout_mode", None)
    return str(getattr(mode, "value", mode)).lower() == "hybrid"


class VerlCacheSync:
    """``sync(indices, version)``: the cache owner (training rank 0) streams ``version`` to the
    rollout workers of exactly those replicas (picklable: Ray handles and names only).

    ``receive_methods[d]``: None for a replica whose workers are veRL rollout
    ``CheckpointEngineWorker`` actors (standalone: veRL's own ``update_weights`` receives), or
    the training workers' receive method for a hybrid replica (:mod:`.verl_workers`).
    ``owner_serve`` / ``owner_versions``: the owner's ``rlix_serve`` / ``rlix_cached_versions``
    actor methods when the training workers are the RLix subclass (served in the cache's
    concurrency group, on a thread), else None (through ``execute_checkpoint_engine``).
    """

    def __init__(
        self,
        owner_worker: Any,
        owner_method: str,
        replica_workers: list[list[Any]],
        receive_methods: Sequence[str | None] | None = None,
        owner_serve: str | None = None,
        owner_versions: str | None = None,
    ) -> None:
        self.owner = owner_worker
        self.owner_method = owner_method
        self.replica_workers = replica_workers
        self.receive_methods = list(receive_methods or [None] * len(replica_workers))
        if len(self.receive_methods) != len(replica_workers):
            raise ValueError(f"{len(self.receive_methods)} receive methods for "
                             f"{len(replica_workers)} replicas")
        self.owner_serve = owner_serve
        self.owner_versions = owner_versions

    @classmethod
    def of(cls, actor_wg: Any, replicas: Sequence[Any]) -> VerlCacheSync:
        """Sync from ``actor_wg``'s rank 0 to ``replicas`` (veRL ``RolloutReplica`` objects).

        A hybrid replica's workers are ``actor_wg``'s training workers: they need the RLix
        worker subclass (its receive method), which the RLix trainer installs.
        """
        receive = worker_call_name(actor_wg, "rlix_receive_weights")
        methods: list[str | None] = []
        for d, r in enumerate(replicas):
            if not _is_hybrid(r):
                methods.append(None)
                continue
            if receive is None:
                raise WeightSyncError(
                    f"replica {d} is a hybrid replica, but the training workers "
                    f"({type(actor_wg).__name__}) have no rlix_receive_weights: their "
                    "update_weights sends instead of receiving. Use RLix's worker subclass "
                    "(rlix_plugins.patches.verl_workers; the RLix trainer installs it in the "
                    "role-to-worker mapping)"
                )
            methods.append(receive)
        return cls(actor_wg.workers[0], engine_call_name(actor_wg),
                   [list(r.workers) for r in replicas], methods,
                   worker_call_name(actor_wg, "rlix_serve"),
                   worker_call_name(actor_wg, "rlix_cached_versions"))

    def _call(self, *args: Any) -> Any:
        import ray

        return ray.get(getattr(self.owner, self.owner_method).remote(*args))

    def receivers(self, indices: Sequence[int]) -> list[tuple[str, Any]]:
        """(shard id, worker) of every rollout worker of replicas ``indices``."""
        return [
            (f"replica{d}-w{i}", w)
            for d in indices
            for i, w in enumerate(self.replica_workers[d])
        ]

    def __call__(self, indices: Sequence[int], version: int) -> dict[str, Any]:
        import ray

        pairs = self.receivers(indices)
        methods = {f"replica{d}-w{i}": self.receive_methods[d]
                   for d in indices for i in range(len(self.replica_workers[d]))}
        if any(methods.values()) and self.owner_serve is None:
            raise WeightSyncError("hybrid replicas need the cache owner's rlix_serve "
                                  "(RLix's training-worker subclass)")
        if self.owner_serve is not None:
            # (shard id, worker, receive method or None): the owner builds the handles
            triples = [(sid, w, methods[sid]) for sid, w in pairs]
            report: dict[str, Any] = ray.get(
                getattr(self.owner, self.owner_serve).remote(int(version), triples))
        else:
            report = self._call("rlix_serve", int(version), pairs)
        if report.get("failed"):
            raise WeightSyncError(f"weight sync v{version} failed for {report['failed']}")
        return report

    def latest_version(self) -> int | None:
        if self.owner_versions is not None:
            import ray

            # the owner's cache group: answered while the owner trains
            versions = ray.get(getattr(self.owner, self.owner_versions).remote())
        else:
            versions = self._call("rlix_cached_versions")
        return max(versions) if versions else None


def _run(coro: Any) -> Any:
    """Run a veRL replica coroutine from the trainer's (synchronous) step loop."""
    return asyncio.run(coro)


@dataclass(frozen=True)
class RefreshClaim:
    """How an in-place refresh picks its replicas: ``begin(ranks)`` returns those of the dp
    ``ranks`` that are ACTIVE now and claims them (the coordinator's shrink cannot take them
    until ``end(ranks)``), in one step on the shard-state owner: the RLix load balancer's
    ``rlix_refresh_begin`` / ``rlix_refresh_end`` (see ``build_adapter``)."""

    begin: Callable[[list[int]], Iterable[int]]
    end: Callable[[list[int]], None]


class RLixCheckpointEngineManager(CheckpointEngineManager):  # type: ignore[misc]
    """veRL's checkpoint manager for replicas the coordinator owns (``rlix_cache`` backend).

    ``update_weights(step)``: every training rank runs veRL's own
    ``update_weights(mode="rlix_cache")``, which caches the version on rank 0; the version is
    then streamed to the replicas that are ACTIVE now (an in-place refresh: their requests are
    aborted and resumed, as veRL's own update does). Sleeping replicas are NOT contacted: the
    coordinator's expand syncs them from the cache when it wakes them. Until :meth:`bind`
    (veRL's first sync, before the pipeline is registered) every replica is synced.

    The replicas are picked and claimed in one step (:class:`RefreshClaim`) and released once
    their parking aborts settled: from its abort on, each server holds itself against a
    shrink's sleep until its gate reopens (:mod:`.verl_vllm`), so no shrink can put a replica
    to sleep between the pick and the weight load.
    """

    def __init__(self, config: Any, actor_wg: Any, replicas: list[Any]) -> None:
        super().__init__(config=config, actor_wg=actor_wg, replicas=replicas)
        self.rlix_sync = VerlCacheSync.of(actor_wg, replicas)
        self._active: RefreshClaim | None = None
        self._observe: Callable[[Sequence[int], int], None] | None = None
        self._ranks: list[int] = list(range(len(replicas)))
        #: (version, ranks synced in place) per update, for observability: this manager's
        #: replica indices until :meth:`bind`, the pipeline's dp ranks after
        self.refreshed: list[tuple[int, tuple[int, ...]]] = []

    def bind(
        self,
        active: RefreshClaim,
        ranks: Sequence[int],
        observe: Callable[[Sequence[int], int], None] | None = None,
    ) -> None:
        """From now on refresh only the replicas ``active`` claims; ``ranks[i]`` is the
        pipeline dp rank of this manager's replica ``i``. ``observe(ranks, version)`` runs
        after each in-place refresh (the shard controller's version record).

        Raises:
            TypeError: ``active`` is not a :class:`RefreshClaim` (nothing changed). A plain
                ``active()`` callable would read the replicas without claiming them, so a
                shrink could put one to sleep between that read and the refresh's abort.
            ValueError: ``ranks`` does not have one entry per replica (nothing changed).
        """
        if not isinstance(active, RefreshClaim):
            raise TypeError(
                "bind needs a RefreshClaim (begin(ranks) picks and claims the ACTIVE replicas "
                "in one call on the shard-state owner, end(ranks) releases them: the RLix load "
                "balancer's rlix_refresh_begin / rlix_refresh_end), got "
                f"{type(active).__name__}; a plain active() callable is not accepted: it reads "
                "the replicas without claiming them against a shrink"
            )
        if len(ranks) != len(self.replicas):
            raise ValueError(f"{len(ranks)} ranks for {len(self.replicas)} replicas")
        self._active = active
        self._ranks = list(ranks)
        self._observe = observe

    def update_weights(self, global_steps: int | None = None) -> dict[str, Any]:
        """Cache veRL's step ``global_steps`` as that weight version and refresh the replicas
        ACTIVE now with it.

        ``None`` (no step) caches one above the newest cached version (0 when none is); the
        newest cached step again re-serves it without caching (its weights are cached).

        Raises:
            WeightCacheError: a step below the newest cached version (both named) or not an
                int >= 0; nothing was cached or synced.
        """
        version, cached = self._next_version(global_steps)
        metrics = {} if cached else self._cache_version(version)
        return self._refresh(version, metrics)

    def _next_version(self, global_steps: object) -> tuple[int, bool]:
        """(the version this update serves, whether the cache already holds it)."""
        latest = self.rlix_sync.latest_version()
        version = self._version_for(global_steps, latest)
        return version, version == latest

    def _version_for(self, global_steps: object, latest: int | None) -> int:
        return resolve_version(global_steps, latest)

    def _cache_version(self, version: int) -> dict[str, Any]:
        """Every training rank's veRL ``update_weights(mode="rlix_cache")``: rank 0 caches."""
        import ray

        if self.backend != BACKEND:
            raise WeightSyncError(f"{type(self).__name__} needs backend {BACKEND!r}, "
                                  f"got {self.backend!r}")
        metrics: dict[str, Any] = {}
        for result in ray.get(self.actor_wg.update_weights(global_steps=version,
                                                           mode=self.backend)):
            if isinstance(result, dict):
                metrics.update(result)
        return metrics

    def _refresh(self, version: int, metrics: dict[str, Any]) -> dict[str, Any]:
        """Sync ``version`` in place to the replicas ACTIVE now (all of them until bound)."""
        claim = self._active
        if claim is None:
            chosen = list(range(len(self.replicas)))
        else:
            claimed = set(claim.begin(list(self._ranks)))
            chosen = [i for i, r in enumerate(self._ranks) if r in claimed]
        ranks = tuple(self._ranks[i] for i in chosen)
        if not chosen:
            self.refreshed.append((version, ranks))
            return metrics
        replicas = [self.replicas[i] for i in chosen]
        try:
            # Inside the try: an abort failing on one replica must not leave the others
            # paused (their gates would stay closed to every request routed there).
            if claim is not None:
                try:
                    # Every abort settles before any resume: one failing fast must not resume
                    # a replica whose abort is still running (its pause would land after it).
                    _run(_gather((r.abort_all_requests() for r in replicas), settle=True))
                finally:
                    # Each server now holds itself until its gate reopens (a shrink's sleep
                    # waits for that): the claim only had to cover the pick-to-abort gap.
                    claim.end(list(ranks))
            report = self.rlix_sync(chosen, version)
        finally:
            if claim is not None:
                _run(_gather(r.resume_generation() for r in replicas))
        # Recorded once the sync succeeded: the list names refreshes that happened.
        self.refreshed.append((version, ranks))
        metrics["rlix/sync_seconds"] = report.get("seconds")
        if self._observe is not None:
            self._observe(list(ranks), version)
        return metrics


class RLixHybridCheckpointManager(RLixCheckpointEngineManager):
    """veRL's manager of the HYBRID replicas (``trainer.checkpoint_manager``) under RLix.

    veRL drives hybrid replicas with its colocated "naive" manager: it sleeps them before
    training and, in ``update_weights``, wakes them and loads the weights from the training
    engine (all ranks, collective). Under RLix the coordinator owns sleep/wake of every replica
    (shrink before it grants the trainer GPUs, expand after they are released), so once
    :meth:`bind` ran:

    * ``sleep_replicas`` / ``wake_up_replicas`` / ``abort_replicas`` /
      ``resume_generation_replicas`` do nothing (veRL's hooks still call them);
    * ``update_weights(step)`` caches the version (unless the standalone manager already did
      in this step) and refreshes in place only the hybrid replicas ACTIVE now - normally none,
      as they sleep while training holds their GPUs; the coordinator's expand syncs the newest
      cached version to each one it wakes (through the training workers'
      ``rlix_receive_weights``, :mod:`.verl_workers`).

    Before :meth:`bind` (veRL's first sync in ``on_init_end``, after ``_setup`` put them to
    sleep) it does what veRL's naive update does for them: wake, then load (from the cache).
    ``update_weights()`` without a step (veRL's validation, after its colocated reward model
    borrowed the GPUs: the weights did not change) re-syncs the newest cached version, or
    caches version 0 when none is.
    """

    def update_weights(self, global_steps: int | None = None) -> dict[str, Any]:
        # A step already cached (separate_async: its standalone manager cached this step's
        # version first) is served as it is; a step below the newest is refused.
        version, cached = self._next_version(global_steps)
        metrics = {} if cached else self._cache_version(version)
        if self._active is None:
            _run(_gather(r.wake_up() for r in self.replicas))
        return self._refresh(version, metrics)

    def _version_for(self, global_steps: object, latest: int | None) -> int:
        if global_steps is None and latest is not None:
            return latest  # veRL's wake-up after its colocated reward: same weights
        return resolve_version(global_steps, latest)

    def _bound(self) -> bool:
        return self._active is not None

    def sleep_replicas(self) -> Any:
        return None if self._bound() else super().sleep_replicas()

    def wake_up_replicas(self) -> Any:
        return None if self._bound() else super().wake_up_replicas()

    def abort_replicas(self, reject_request: bool = False) -> Any:
        return None if self._bound() else super().abort_replicas(reject_request=reject_request)

    def resume_generation_replicas(self) -> Any:
        return None if self._bound() else super().resume_generation_replicas()


async def _gather(coros: Iterable[Any], *, settle: bool = False) -> list[Any]:
    """``asyncio.gather``; ``settle``: wait for every call, then raise the first error."""
    if not settle:
        return list(await asyncio.gather(*coros))
    results = list(await asyncio.gather(*coros, return_exceptions=True))
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results
