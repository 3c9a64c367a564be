"""RLix subclasses of veRL's training worker (``ActorRolloutRefWorker`` and its variants).

The RLix trainer (:mod:`.verl_trainer`) installs ``rlix_worker_class(<veRL's class>)`` in the
trainer's role-to-worker mapping (``_init_resource_pool_mgr``), so every training worker veRL
spawns for the actor role - including the colocated ``WorkerDict`` actors that also host the
hybrid rollout replicas - carries these methods:

* ``rlix_receive_weights(offer)``: the hybrid replica's receive side. veRL's own
  ``update_weights`` in a training worker SENDS (any mode but ``naive``); this method instead
  pulls a cached version from the CPU cache (the ``rlix_cache`` backend's receiver, run by this
  worker's own checkpoint engine) and loads it into the co-located rollout (``self.rollout``,
  veRL's vLLM ``ServerAdapter``) exactly as veRL's naive path does (``rollout.update_weights``,
  which also records the version on the server). Sleep and wake stay with the coordinator.
* ``rlix_serve(version, receivers)``: the cache owner's (rank 0) stream to the given
  receivers, run on a thread: a receiver may be this same actor (hybrid replica 0 lives in
  training rank 0), whose receive method must be able to run meanwhile.
  ``rlix_cached_versions()``: the versions it holds. Both run in the cache's own Ray
  concurrency group (:mod:`~rlix_plugins.training.cache_group`; veRL's colocated
  ``WorkerDict`` class is declared with it by :func:`colocated_worker_class`), so a standalone
  replica the coordinator wakes while the pipeline trains is synced at once, not after the
  step (veRL's train call blocks the actor's event loop).
* ``rlix_release_parallel_state`` / ``rlix_restore_parallel_state``: Megatron's NCCL groups
  destroyed after the weights are cached and re-created before the next train step; the
  re-init rebinds every old group held under the engines' model chunks, optimizer, scheduler,
  checkpoint manager and bridge (:meth:`RLixTrainingWorkerMixin.rlix_rebind_roots`) and raises
  :class:`~rlix_plugins.training.nccl_lifecycle.StaleProcessGroupError` if a destroyed group
  is still reachable from them.

Methods carry veRL's ``register`` decorator so veRL's worker groups (and ``WorkerDict``, which
prefixes them with the role, e.g. ``actor_rollout_rlix_receive_weights``) bind them.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from verl.single_controller.base.decorator import Dispatch, register

from rlix_plugins.errors import WeightSyncError

logger = logging.getLogger(__name__)

#: attributes of veRL's ``MegatronEngine`` (0.9.1, ``workers/engine/megatron/transformer_impl``)
#: that hold, through megatron-core objects, the process groups a train step uses: the DDP
#: model chunks (``module``), the distributed optimizer, the LR scheduler (holds the
#: optimizer), the checkpoint manager (holds model and optimizer; veRL's spelling) and the
#: bridge / provider / weight converter built from the parallel config
ENGINE_REBIND_ATTRS: tuple[str, ...] = (
    "module", "optimizer", "lr_scheduler", "checkpoint_mananager", "bridge", "provider",
    "weight_converter",
)
#: the worker's ``TrainingWorker`` holders whose ``engine`` is rebound (actor, reference)
WORKER_ENGINE_HOLDERS: tuple[str, ...] = ("actor", "ref")

# Every RLix training worker of this process: veRL's WorkerDict puts several roles (e.g. an
# actor_rollout and a separate ref worker) in one process, which shares one parallel_state, so
# a re-init must rebind the groups held by all of them.
_LIVE: weakref.WeakSet[RLixTrainingWorkerMixin] = weakref.WeakSet()


def process_rebind_roots() -> dict[str, Any]:
    """:meth:`RLixTrainingWorkerMixin.rlix_rebind_roots` of every RLix worker of this process
    (prefixed with the worker's veRL role when there are several)."""
    workers = sorted(_LIVE, key=lambda w: str(getattr(w, "role", "")))
    roots: dict[str, Any] = {}
    for w in workers:
        prefix = f"{getattr(w, 'role', 'worker')}_" if len(workers) > 1 else ""
        for name, value in w.rlix_rebind_roots().items():
            roots[prefix + name] = value
    return roots


class RLixTrainingWorkerMixin:
    """The RLix methods of a veRL training worker (see module docstring)."""

    _rlix_worker = True

    # veRL attributes this mixin relies on (set by ActorRolloutRefWorker.init_model)
    checkpoint_engine: Any
    rollout: Any

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _LIVE.add(self)

    # ---------------------------------------------------------------- Megatron NCCL lifecycle
    def rlix_rebind_roots(self) -> dict[str, Any]:
        """The objects of this worker's engines that hold process groups, named
        ``<holder>_<attribute>`` (``actor_optimizer``: ``self.actor.engine.optimizer``);
        missing or None ones are skipped."""
        roots: dict[str, Any] = {}
        for holder in WORKER_ENGINE_HOLDERS:
            engine = getattr(getattr(self, holder, None), "engine", None)
            if engine is None:
                continue
            for attr in ENGINE_REBIND_ATTRS:
                value = getattr(engine, attr, None)
                if value is not None:
                    roots[f"{holder}_{attr}"] = value
        return roots

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)  # type: ignore[untyped-decorator]
    def rlix_release_parallel_state(self) -> dict[str, Any]:
        """Destroy this worker's Megatron process groups (after the weights were cached)."""
        from rlix_plugins.patches.verl_checkpoint import release_parallel_state

        return release_parallel_state()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)  # type: ignore[untyped-decorator]
    def rlix_restore_parallel_state(self) -> dict[str, Any]:
        """Re-create them and rebind the groups held under :meth:`rlix_rebind_roots` of every
        RLix worker in this process (:func:`process_rebind_roots`)."""
        from rlix_plugins.patches.verl_checkpoint import restore_parallel_state

        return restore_parallel_state(process_rebind_roots())

    # ---------------------------------------------------------------- CPU-cache weight sync
    def _rlix_cache_engine(self) -> Any:
        engine = getattr(self, "checkpoint_engine", None)
        if engine is None or not hasattr(engine, "rlix_accept_offer"):
            from rlix_plugins.patches.verl_checkpoint import BACKEND

            raise WeightSyncError(
                f"this training worker's checkpoint engine is {type(engine).__name__}, not the "
                f"{BACKEND!r} backend: hybrid replicas are synced from the CPU cache only with "
                f"actor_rollout_ref.rollout.checkpoint_engine.backend={BACKEND}"
            )
        return engine

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)  # type: ignore[untyped-decorator]
    async def rlix_serve(
        self, version: int, receivers: Sequence[tuple[str, Any]]
    ) -> dict[str, Any]:
        """Stream cached ``version`` to exactly ``receivers`` (cache owner only)."""
        engine = self._rlix_cache_engine()
        # On a thread: a receiver may be this actor (its receive must run meanwhile).
        report: dict[str, Any] = await asyncio.to_thread(engine.rlix_serve, version, receivers)
        return report

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)  # type: ignore[untyped-decorator]
    async def rlix_cached_versions(self) -> list[int]:
        """The versions this worker's cache holds (empty off the owner rank)."""
        return list(self._rlix_cache_engine().rlix_cached_versions())

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)  # type: ignore[untyped-decorator]
    async def rlix_receive_weights(self, offer: dict[str, Any]) -> int:
        """Load the offered cached version into this worker's co-located rollout."""
        engine = self._rlix_cache_engine()
        rollout = getattr(self, "rollout", None)
        if rollout is None:
            raise WeightSyncError(
                f"{type(self).__name__} hosts no rollout (role without 'rollout'): it is no "
                "hybrid replica worker"
            )
        version = int(engine.rlix_accept_offer(offer))
        # veRL's rollout-side load, as in its naive path: the adapter loads the tensors into
        # the engine, resets caches and records the version on the server when done.
        await rollout.update_weights(engine.receive_weights(version), global_steps=version)
        logger.info("hybrid replica worker loaded cached v%d", version)
        return version


def rlix_worker_class(base: type) -> type:
    """``RLix<base>``: veRL training worker class ``base`` with the RLix methods."""
    if getattr(base, "_rlix_worker", False):
        return base
    return type(f"RLix{base.__name__}", (RLixTrainingWorkerMixin, base), {
        "__module__": __name__,
        "__doc__": f"{base.__name__} with the RLix weight-sync and NCCL-lifecycle methods.",
    })


def install_worker_classes(role_worker_mapping: dict[Any, Any]) -> list[str]:
    """Replace the training-worker classes of ``role_worker_mapping`` (veRL's role -> Ray
    remote class) by their RLix subclasses; returns the roles changed. Critic workers
    (``TrainingWorker``: no rollout, no checkpoint engine) are left as they are."""
    import ray
    from verl.workers.engine_workers import ActorRolloutRefWorker

    changed: list[str] = []
    for role, remote_cls in list(role_worker_mapping.items()):
        base = getattr(remote_cls, "__ray_actor_class__", remote_cls)
        if not isinstance(base, type) or not issubclass(base, ActorRolloutRefWorker):
            continue
        if getattr(base, "_rlix_worker", False):
            continue
        role_worker_mapping[role] = ray.remote(rlix_worker_class(base))
        changed.append(str(getattr(role, "name", role)))
    return changed


#: the RLix worker methods that run in the cache's concurrency group (see module docstring)
CACHE_GROUP_METHODS: tuple[str, ...] = ("rlix_serve", "rlix_cached_versions")


def colocated_worker_class(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap veRL's ``create_colocated_worker_cls(class_dict)``: when a role's class is an RLix
    training worker, the ``WorkerDict`` actor class it returns declares the cache's
    concurrency group and runs that role's :data:`CACHE_GROUP_METHODS` in it (veRL binds
    each as ``<role>_<method>``). Other classes are returned as veRL built them. Wrapping a
    wrapper returns it unchanged."""
    if getattr(original, "_rlix_cache_group", False):
        return original

    def create_colocated_worker_cls(class_dict: dict[str, Any]) -> Any:
        from rlix_plugins.training.cache_group import cache_group_actor, in_cache_group

        built = original(class_dict)
        worker_dict = built.cls.__ray_actor_class__
        tagged: list[str] = []
        for key, with_args in class_dict.items():
            inner = getattr(with_args.cls, "__ray_actor_class__", with_args.cls)
            if not getattr(inner, "_rlix_worker", False):
                continue
            for method in CACHE_GROUP_METHODS:
                # veRL made a fresh function per bound method: tagging it tags nothing else
                bound = vars(worker_dict).get(f"{key}_{method}")
                if bound is not None:
                    in_cache_group(bound)
                    tagged.append(f"{key}_{method}")
        if tagged:
            built.cls = cache_group_actor(worker_dict)
            logger.info("rlix: %s run in the cache's concurrency group", tagged)
        return built

    create_colocated_worker_cls.__wrapped__ = original  # type: ignore[attr-defined]
    create_colocated_worker_cls._rlix_cache_group = True  # type: ignore[attr-defined]
    return create_colocated_worker_cls
