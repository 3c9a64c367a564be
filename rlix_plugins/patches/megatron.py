"""Megatron policy-worker extension for NeMo RL (runs in the Megatron workers' venv).

Injected through NeMo RL's own seam ``Policy(worker_extension_cls_fqn=...)`` (the adapter's
``Policy`` subclass passes :data:`RLIX_MEGATRON_WORKER_FQN`). Adds, in the worker processes:

* ``rlix_build_cache(version)``: every rank iterates NeMo RL's HF-weight gather
  ``_iter_params_with_optional_kv_scales`` (it is collective: all ranks must take part); rank 0
  keeps the tensors in the versioned CPU :class:`~rlix_plugins.training.bucket_cache.BucketCache`.
* ``rlix_push_weights(version, receivers)``: rank 0 runs the training module's selective sync
  (:func:`~rlix_plugins.training.sync.sync_version`) to exactly the given vLLM shard leaders,
  whose engines receive through the
  :class:`~rlix_plugins.training.vllm_receiver.RlixWeightReceiverExtension` (shared memory on
  one host): peak extra memory per receiver = 1 bucket, no tensor passes through Ray. It and
  ``rlix_latest_version`` run in the actor's own concurrency group
  (:mod:`~rlix_plugins.training.cache_group`), so a shard the coordinator wakes while the
  pipeline trains is synced at once instead of after the step.
* pinned placement (the coordinator's shared groups): before NeMo RL's ``__init__`` makes its
  first CUDA call, the node's GPUs are made visible
  (:func:`~rlix_plugins.adapters.nemo_rl_placement_plan.widen_to_node_gpus`), because NeMo RL
  takes Ray's GPU id as the CUDA ordinal.
* ``rlix_destroy_parallel_state`` / ``rlix_reinit_parallel_state``: the training module's
  :class:`~rlix_plugins.training.nccl_lifecycle.MegatronParallelLifecycle`, HERE, in the worker
  process where ``parallel_state`` lives (never in the driver, where it is empty). The re-init
  also rebinds the groups held by the worker's model, optimizer and scheduler (megatron's DDP,
  buffers, distributed optimizer keep the group objects they were built with) and raises
  :class:`~rlix_plugins.training.nccl_lifecycle.StaleProcessGroupError` if a destroyed group is
  still reachable from them.

The mixin (:class:`RLixMegatronWorkerMixin`) needs from its host only
``_iter_params_with_optional_kv_scales``; the NeMo RL class is built lazily
(:func:`build_worker_class`) because importing it needs megatron-bridge.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from rlix_plugins.training.bucket_cache import BucketCache, CacheConfig
from rlix_plugins.training.cache_group import cache_group_actor, in_cache_group
from rlix_plugins.training.nccl_lifecycle import (
    DestroyReport,
    MegatronParallelLifecycle,
    ParallelConfig,
    RebindReport,
    init_keywords,
)
from rlix_plugins.training.transports.selection import AddressedReceiver, ReceiverLocation
from rlix_plugins.training.vllm_receiver import (
    EngineCall,
    EngineWorkers,
    engine_shard_id,
    engines_synced,
)
from rlix_plugins.training.wire import ReceiveResult, SyncOffer

logger = logging.getLogger(__name__)

# The cache is created by the first caller, which may be a push or version query (cache group
# thread) racing the first build (the default group's thread): one cache, not two.
_CACHE_INIT_LOCK = threading.Lock()

RLIX_MEGATRON_WORKER_FQN = "rlix_plugins.patches.megatron.RLixMegatronPolicyWorker"


def parallel_config_from_state(ps: Any) -> ParallelConfig:
    """The ``initialize_model_parallel`` arguments that reproduce the live parallel state.

    Read back: TP, PP, virtual PP, CP, EP and expert-TP sizes, and whether the ``*_GLOO``
    groups exist (each only where this megatron-core's ``initialize_model_parallel`` takes
    it). Not readable from the state (so megatron's defaults are used on re-init): ``order``,
    timeouts, NCCL communicator configs, hierarchical CP sizes, distributed-optimizer
    instances.
    """
    kwargs: dict[str, Any] = {
        "tensor_model_parallel_size": ps.get_tensor_model_parallel_world_size(),
        "pipeline_model_parallel_size": ps.get_pipeline_model_parallel_world_size(),
        "context_parallel_size": ps.get_context_parallel_world_size(),
        "expert_model_parallel_size": ps.get_expert_model_parallel_world_size(),
    }
    optional: dict[str, Callable[[], Any]] = {
        # without it the re-initialised state reports no interleaving (None) to the schedule
        "virtual_pipeline_model_parallel_size": lambda: (
            ps.get_virtual_pipeline_model_parallel_world_size()
        ),
        # megatron defaults it to the TP size, which re-shapes experts that had their own
        "expert_tensor_parallel_size": lambda: ps.get_expert_tensor_parallel_world_size(),
        # megatron's default (True) would add gloo groups the host turned off, and change the
        # layout the destroyed groups are paired against
        "create_gloo_process_groups": lambda: (
            getattr(ps, "_DATA_PARALLEL_GROUP_GLOO", None) is not None
        ),
    }
    accepted = init_keywords(ps)
    for name, read in optional.items():
        if name in accepted:
            kwargs[name] = read()
    return ParallelConfig.of(**kwargs)


class RLixMegatronWorkerMixin:
    """Cache, push and NCCL lifecycle methods of a training worker (see module docstring)."""

    #: which rank keeps the CPU cache
    rlix_owner_rank = 0
    #: bucket size of the cache (one bucket = peak extra receiver memory)
    rlix_bucket_bytes = 256 << 20

    #: attributes of NeMo RL's MegatronPolicyWorkerImpl that hold (through megatron objects)
    #: process groups a train step uses; missing or None ones are skipped
    rlix_rebind_roots: tuple[str, ...] = (
        "model", "optimizer", "scheduler", "draft_model", "inference_model", "mcore_state",
        "_first_train_step_param_sync_func",
    )

    #: provided by the host worker class (annotation only: a stub here would shadow the host's
    #: method, since the mixin comes first in the MRO)
    _iter_params_with_optional_kv_scales: Callable[..., Iterator[tuple[str, Any]]]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # On the coordinator's shared groups the worker is pinned by CUDA_VISIBLE_DEVICES=g,
        # while NeMo RL's __init__ does set_device(ray.get_gpu_ids()[0]) = set_device(g):
        # the node's GPUs are made visible first so that ordinal g is physical GPU g.
        import os

        from rlix_plugins.adapters.nemo_rl_placement_plan import widen_to_node_gpus

        pinned = widen_to_node_gpus(os.environ)
        if pinned is not None:
            logger.info("rlix: pinned Megatron worker on GPU %s sees the node's GPUs %s",
                        pinned, os.environ["CUDA_VISIBLE_DEVICES"])
        super().__init__(*args, **kwargs)

    def _rlix_rank(self) -> int:
        import torch.distributed as dist

        return dist.get_rank() if dist.is_initialized() else 0

    def _rlix_cache(self) -> BucketCache:
        cache: BucketCache | None = getattr(self, "_rlix_bucket_cache", None)
        if cache is not None:
            return cache
        with _CACHE_INIT_LOCK:
            cache = getattr(self, "_rlix_bucket_cache", None)
            if cache is None:
                import os

                cache = BucketCache(
                    os.environ.get("PIPELINE_ID", "nemo_rl"),
                    CacheConfig(bucket_bytes=self.rlix_bucket_bytes),
                )
                self._rlix_bucket_cache = cache
        return cache

    def _rlix_lifecycle(self) -> MegatronParallelLifecycle:
        lifecycle: MegatronParallelLifecycle | None = getattr(self, "_rlix_parallel", None)
        if lifecycle is None:
            from megatron.core import parallel_state as ps

            lifecycle = MegatronParallelLifecycle.adopt(parallel_config_from_state(ps), ps)
            self._rlix_parallel = lifecycle
        return lifecycle

    def rlix_build_cache(self, version: int) -> dict[str, Any] | None:
        """Collective: every rank gathers, the owner rank caches ``version``."""
        owner = self._rlix_rank() == self.rlix_owner_rank
        cache = self._rlix_cache()
        info = cache.build(version, self._iter_params_with_optional_kv_scales(), is_owner=owner)
        if info is None:
            return None
        cache.activate(version)
        return {"version": version, "info": repr(info)}

    @in_cache_group
    def rlix_latest_version(self) -> int | None:
        """Newest cached version on this rank (None on non-owners or before the first build)."""
        return self._rlix_cache().latest_version

    @in_cache_group
    def rlix_push_weights(self, version: int, receivers: Sequence[tuple[str, Any]],
                          ack_timeout_s: float = 300.0) -> dict[str, Any]:
        """Selective sync of cached ``version`` to exactly ``receivers`` (``(shard_id, vLLM
        worker actor)`` pairs) through the training module's :func:`sync_version`.

        Each actor runs the receiver extension in its engine (``rlix_receive_weights``); on one
        host the buckets travel through shared memory (the cache's own pages), else ZMQ. Raises
        :class:`~rlix_plugins.errors.WeightSyncError` naming the failed and succeeded shards.
        """
        import ray

        from rlix_plugins.training.sync import ReceiverHandle, SyncOptions, sync_version

        if not receivers:
            return {"version": version, "shards": [], "transports": {}, "bytes": 0,
                    "buckets": 0, "seconds": 0.0}
        # Where each receiver runs decides its transport; ask them all at once.
        locations = ray.get([actor.rlix_receiver_location.remote() for _, actor in receivers])
        handles: list[ReceiverHandle] = []
        for (sid, actor), loc in zip(receivers, locations, strict=True):
            workers = int(loc.get("workers", 1))
            if workers == 1:
                handles.append(RayWorkerReceiver(str(sid), actor, str(loc["host"])))
            else:  # a tensor-parallel engine: one receiver per vLLM worker, one Ray call
                handles.extend(EngineWorkers(
                    str(sid), workers,
                    _engine_call(actor),
                    ReceiverLocation(host=str(loc["host"])),
                ).receivers)
        report = sync_version(self._rlix_cache(), version, handles,
                              options=SyncOptions(ack_timeout_s=ack_timeout_s))
        return {"version": report.version,
                "shards": list(engines_synced(report.succeeded, report.failed)),
                "transports": {engine_shard_id(o.shard_id): o.transport.value
                               for o in report.outcomes},
                "bytes": report.total_bytes, "buckets": report.num_buckets,
                "seconds": report.seconds}

    #: attributes where NeMo RL caches a group it built itself with ``new_group`` (not in
    #: parallel_state, so the lifecycle does not know it) and rebuilds, collectively, on the
    #: next use when the attribute is absent (``_get_replica_group``)
    rlix_lazy_groups: tuple[str, ...] = ("_replica_group_cache",)

    def rlix_destroy_parallel_state(self) -> DestroyReport:
        """Destroy every Megatron process group in this worker (frees NCCL buffers), and the
        groups NeMo RL built lazily (:attr:`rlix_lazy_groups`): those are dropped so that NeMo
        RL rebuilds them on first use after the re-init, as on its first step. The lazy
        groups go last: they are the youngest, and NCCL groups come down fastest oldest first
        (see ``nccl_lifecycle._destroy_live``)."""
        report = self._rlix_lifecycle().destroy()
        self._rlix_drop_lazy_groups()
        return report

    def _rlix_drop_lazy_groups(self) -> int:
        import torch.distributed as dist

        from rlix_plugins.training.nccl_lifecycle import live_process_groups

        dropped = 0
        live = set(live_process_groups())
        for name in self.rlix_lazy_groups:
            group = self.__dict__.get(name)
            if group is not None and group is not dist.GroupMember.NON_GROUP_MEMBER \
                    and group in live:
                # a failed destroy raises with the attribute kept: a retry finds the group
                dist.destroy_process_group(group)
                dropped += 1
            # dropped on every rank (NON_GROUP_MEMBER and already-destroyed handles too): NeMo
            # RL rebuilds it with new_group, a collective every rank must then join
            self.__dict__.pop(name, None)
        if dropped:
            logger.info("destroyed %d lazily built NeMo RL group(s) %s", dropped,
                        self.rlix_lazy_groups)
        return dropped

    def rlix_reinit_parallel_state(self) -> RebindReport | None:
        """Re-create the groups from the saved configuration (before the next step) and rebind
        every old group held under :attr:`rlix_rebind_roots` to its successor; None when the
        state was already initialised (nothing destroyed, nothing to rebind). After a re-init
        whose rebind raised, the retry rebinds again (the groups are not re-created)."""
        lifecycle = self._rlix_lifecycle()
        if not lifecycle.needs_reinit:
            return None
        roots = {name: value for name in self.rlix_rebind_roots
                 if (value := getattr(self, name, None)) is not None}
        report = lifecycle.reinitialize(roots)
        if report is not None:
            logger.info(
                "re-init rebound %d group references under %s (%d objects, %.3f s)",
                report.replaced, sorted(roots), report.objects_visited, report.seconds,
            )
        return report


def _engine_call(actor: Any) -> EngineCall:
    """One Ray call of ``actor.rlix_receive_weights`` with every worker's offer."""

    def call(offers: list[dict[str, Any]]) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = actor.rlix_receive_weights.remote(
            offers).future()
        return future

    return call


class RayWorkerReceiver(AddressedReceiver):
    """:class:`~rlix_plugins.training.sync.ReceiverHandle` for a vLLM worker actor whose
    ``rlix_receive_weights(offer)`` runs the receiver extension in its engine (NeMo RL:
    ``RLixVllmWorkerMixin``). Only the offer (plain data) crosses Ray; buckets go through the
    transport the sync picked."""

    def __init__(self, shard_id: str, actor: Any, host: str) -> None:
        super().__init__(shard_id, ReceiverLocation(host=host))
        self._actor = actor

    def begin_receive(self, offer: SyncOffer) -> concurrent.futures.Future[ReceiveResult]:
        done: concurrent.futures.Future[ReceiveResult] = concurrent.futures.Future()
        ref_future = self._actor.rlix_receive_weights.remote(offer.to_dict()).future()

        def finish(f: concurrent.futures.Future[Any]) -> None:
            try:
                done.set_result(ReceiveResult.from_dict(f.result()))
            except BaseException as exc:  # the sync reports it as this shard's failure
                done.set_exception(exc)

        ref_future.add_done_callback(finish)
        return done


def build_worker_class() -> tuple[type, Any]:
    """(undecorated subclass of NeMo RL's ``MegatronPolicyWorkerImpl``, Ray actor class with
    the cache's concurrency group)."""
    from nemo_rl.models.policy.workers.megatron_policy_worker import MegatronPolicyWorkerImpl

    impl = type(
        "RLixMegatronPolicyWorkerImpl",
        (RLixMegatronWorkerMixin, MegatronPolicyWorkerImpl),
        {"__module__": __name__},
    )
    return impl, cache_group_actor(impl)


def __getattr__(name: str) -> Any:
    # Lazy: NeMo RL's worker builder imports ``RLixMegatronPolicyWorker`` by FQN inside the
    # Megatron venv; importing this module elsewhere must not need megatron-bridge.
    if name in ("RLixMegatronPolicyWorker", "RLixMegatronPolicyWorkerImpl"):
        impl, actor = build_worker_class()
        globals()["RLixMegatronPolicyWorkerImpl"] = impl
        globals()["RLixMegatronPolicyWorker"] = actor
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
