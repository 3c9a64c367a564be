"""Megatron policy-worker extension for NeMo RL (runs in the Megatron workers' venv).

Injected through NeMo RL's own seam ``Policy(worker_extension_cls_fqn=...)`` (the adapter's
``Policy`` subclass passes :data:`RLIX_MEGATRON_WORKER_FQN`). Adds, in the worker processes:

* ``rlix_build_cache(version)``: every rank iterates NeMo RL's HF-weight gather
  ``_iter_params_with_optional_kv_scales`` (it is collective: all ranks must take part); rank 0
  keeps the tensors in the versioned CPU :class:`~rlix_plugins.training.bucket_cache.BucketCache`.
* ``rlix_push_weights(version, receivers)``: rank 0 sends the cached version bucket by bucket to
  the given vLLM shard leaders (``rlix_load_weights``): peak extra memory per receiver = 1 bucket.
* ``rlix_destroy_parallel_state`` / ``rlix_reinit_parallel_state``: the training module's
  :class:`~rlix_plugins.training.nccl_lifecycle.MegatronParallelLifecycle`, HERE, in the worker
  process where ``parallel_state`` lives (never in the driver, where it is empty).

The mixin (:class:`RLixMegatronWorkerMixin`) needs from its host only
``_iter_params_with_optional_kv_scales``; the NeMo RL class is built lazily
(:func:`build_worker_class`) because importing it needs megatron-bridge.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from rlix_plugins.training.bucket_cache import BucketCache, CacheConfig
from rlix_plugins.training.nccl_lifecycle import (
    DestroyReport,
    MegatronParallelLifecycle,
    ParallelConfig,
)

logger = logging.getLogger(__name__)

RLIX_MEGATRON_WORKER_FQN = "rlix_plugins.patches.megatron.RLixMegatronPolicyWorker"


def parallel_config_from_state(ps: Any) -> ParallelConfig:
    """The ``initialize_model_parallel`` arguments that reproduce the live parallel state."""
    return ParallelConfig.of(
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        context_parallel_size=ps.get_context_parallel_world_size(),
        expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
    )


class RLixMegatronWorkerMixin:
    """Cache, push and NCCL lifecycle methods of a training worker (see module docstring)."""

    #: which rank keeps the CPU cache
    rlix_owner_rank = 0
    #: bucket size of the cache (one bucket = peak extra receiver memory)
    rlix_bucket_bytes = 256 << 20

    #: provided by the host worker class (annotation only: a stub here would shadow the host's
    #: method, since the mixin comes first in the MRO)
    _iter_params_with_optional_kv_scales: Callable[..., Iterator[tuple[str, Any]]]

    def _rlix_rank(self) -> int:
        import torch.distributed as dist

        return dist.get_rank() if dist.is_initialized() else 0

    def _rlix_cache(self) -> BucketCache:
        cache: BucketCache | None = getattr(self, "_rlix_bucket_cache", None)
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

    def rlix_latest_version(self) -> int | None:
        """Newest cached version on this rank (None on non-owners or before the first build)."""
        return self._rlix_cache().latest_version

    def rlix_push_weights(self, version: int, receivers: Sequence[Any]) -> int:
        """Send cached ``version`` bucket by bucket to ``receivers``; returns buckets sent."""
        import ray

        cache = self._rlix_cache()
        sent = 0
        with cache.pinned(version) as cv:
            from rlix_plugins.training.bucket_cache import unpack_bucket

            for bucket in cv.buckets:
                weights = [(n, t.clone()) for n, t in unpack_bucket(bucket.data,
                                                                    bucket.layout.entries)]
                ray.get([r.rlix_load_weights.remote(weights) for r in receivers])
                sent += 1
        return sent

    def rlix_destroy_parallel_state(self) -> DestroyReport:
        """Destroy every Megatron process group in this worker (frees NCCL buffers)."""
        return self._rlix_lifecycle().destroy()

    def rlix_reinit_parallel_state(self) -> None:
        """Re-create the groups from the saved configuration (before the next step)."""
        lifecycle = self._rlix_lifecycle()
        if not lifecycle.initialized:
            lifecycle.reinitialize()


def build_worker_class() -> tuple[type, Any]:
    """(undecorated subclass of NeMo RL's ``MegatronPolicyWorkerImpl``, Ray actor class)."""
    import ray
    from nemo_rl.models.policy.workers.megatron_policy_worker import MegatronPolicyWorkerImpl

    impl = type(
        "RLixMegatronPolicyWorkerImpl",
        (RLixMegatronWorkerMixin, MegatronPolicyWorkerImpl),
        {"__module__": __name__},
    )
    return impl, ray.remote(impl)


def __getattr__(name: str) -> Any:
    # Lazy: NeMo RL's worker builder imports ``RLixMegatronPolicyWorker`` by FQN inside the
    # Megatron venv; importing this module elsewhere must not need megatron-bridge.
    if name in ("RLixMegatronPolicyWorker", "RLixMegatronPolicyWorkerImpl"):
        impl, actor = build_worker_class()
        globals()["RLixMegatronPolicyWorkerImpl"] = impl
        globals()["RLixMegatronPolicyWorker"] = actor
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
