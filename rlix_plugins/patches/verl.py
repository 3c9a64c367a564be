"""veRL 0.9.1 host patch: what RLix plugs into veRL, and where.

Delivery: ``VERL_USE_EXTERNAL_MODULES=rlix_plugins.autoload`` makes veRL import our autoload
module during ``import verl`` in EVERY process that imports veRL (driver, TaskRunner, workers,
vLLM servers, agent-loop workers); with ``RLIX_CONTROL_PLANE=rlix`` that installs the
post-import hook which applies :class:`VerlPatch` (activation.PATCHES["verl"]). Unset, nothing
is hooked and veRL runs unchanged. On an existing Ray cluster, workers do not inherit the
driver's shell: the patch wraps ``get_ppo_ray_runtime_env`` so the driver forwards every
``RLIX_*`` variable (and ``PIPELINE_ID``, ``ROLL_RAY_NAMESPACE``, ``VERL_USE_EXTERNAL_MODULES``)
through ``runtime_env.env_vars``. It is wrapped where veRL defines it (``constants_ppo``) as
well as in ``main_ppo``: ``python -m verl.trainer.main_ppo`` runs main_ppo as ``__main__``,
whose ``from verl.trainer.constants_ppo import get_ppo_ray_runtime_env`` runs after
``import verl`` applied this patch, so it binds the wrapper only if ``constants_ppo`` holds it.
The same wrapper refuses a job the coordinator cannot time-share
(:func:`~rlix_plugins.adapters.verl_support.check_supported_job`): veRL's ``run_ppo`` calls it
with the job's config before ``ray.init``, the driver's first look at the config.

What is applied (official seams first; every change goes through ``set_attribute`` or a
registry entry with an undo step, so ``revert`` restores veRL exactly):

* trainer registry (``TRAINER_REGISTRY``): each registered v1 trainer mode is replaced by an
  RLix subclass that calls the hooks around the step (``on_sample_end`` -> before training,
  ``on_step_end`` -> after training) and hands generation to the coordinator (see
  :mod:`.verl_trainer`);
* ``router.GlobalRequestLoadBalancer`` (looked up at call time by veRL's router factory) ->
  :class:`~.verl_routing.RLixRequestLoadBalancer`, which routes only to ACTIVE shards;
* ``RolloutReplicaRegistry["vllm"]`` -> RLix vLLM replica/server subclasses (lazy loader);
* ``CheckpointEngineRegistry["rlix_cache"]`` -> the CPU-cache checkpoint engine;
* ``agent_loop_tq.AgentLoopWorkerTQ`` -> :class:`~.verl_agent_loop.RLixAgentLoopWorkerTQ`,
  which counts each stored trajectory (per-trajectory progress);
* ``trainer_base.create_colocated_worker_cls`` -> a wrapper whose training-worker actor class
  serves the CPU cache in its own concurrency group
  (:func:`~.verl_workers.colocated_worker_class`);
* ``ResourcePoolManager.create_resource_pool`` and ``RayWorkerGroup._init_with_resource_pool``
  -> wrappers that put a pinned pipeline's pools and workers on the coordinator's shared
  per-node groups (:mod:`.verl_placement`; veRL's own otherwise);
* ``constants_ppo.get_ppo_ray_runtime_env`` and ``main_ppo.get_ppo_ray_runtime_env`` ->
  check the job is supported, then forward the RLix environment to Ray workers.

Plug points that live in modules needing vLLM or Megatron (:data:`DEFERRED_PLUG_POINTS`) are
checked where they are used (the replica loader, the worker-side NCCL calls), not in every
process that imports veRL, which may have neither installed; :meth:`VerlPatch.check_all`
checks them too (the doctor's full report).
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

from rlix_plugins.errors import HostDriftError
from rlix_plugins.patches.base import (
    HostPatch,
    PlugKind,
    PlugPoint,
    PlugPointStatus,
    check_plug_point,
    resolve,
)
from rlix_plugins.settings import ENV_PIPELINE_ID, ENV_ROLL_RAY_NAMESPACE

logger = logging.getLogger(__name__)

SUPPORTED_VERL = ("0.9.1",)
ENV_VERL_EXTERNAL_MODULES = "VERL_USE_EXTERNAL_MODULES"
#: every variable with this prefix is forwarded to veRL's Ray workers (a fixed list went stale
#: whenever a module added an RLIX_* setting; workers must see the driver's settings)
FORWARDED_ENV_PREFIX = "RLIX_"
#: forwarded too, though outside the prefix: the pipeline's identity and the veRL delivery
FORWARDED_ENV = (ENV_VERL_EXTERNAL_MODULES, ENV_PIPELINE_ID, ENV_ROLL_RAY_NAMESPACE)


def forwarded_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables of ``environ`` (default: ``os.environ``) veRL's Ray workers must get:
    every ``RLIX_*`` one plus :data:`FORWARDED_ENV`, those that are set."""
    environ = os.environ if environ is None else environ
    return {
        key: value for key, value in environ.items()
        if key.startswith(FORWARDED_ENV_PREFIX) or key in FORWARDED_ENV
    }

_TB = "verl.trainer.ppo.v1.trainer_base"
_ROUTER = "verl.workers.rollout.router"
_LLM = "verl.workers.rollout.llm_server"
_REPLICA = "verl.workers.rollout.replica"
_CKPT = "verl.checkpoint_engine.base"
_MAIN = "verl.trainer.main_ppo"
_CONSTANTS = "verl.trainer.constants_ppo"
_VLLM_SERVER = "verl.workers.rollout.vllm_rollout.vllm_async_server"
_ENGINE_WORKERS = "verl.workers.engine_workers"
_AGENT_TQ = "verl.trainer.ppo.v1.agent_loop_tq"
_AGENT = "verl.experimental.agent_loop.agent_loop"
_MEGATRON = "verl.workers.engine.megatron.transformer_impl"
_SC = "verl.single_controller.ray.base"

CORE_PLUG_POINTS: tuple[PlugPoint, ...] = (
    PlugPoint("external modules", "verl.utils.import_utils:import_external_libs",
              PlugKind.EXTENSION_POINT, ("external_libs",),
              "VERL_USE_EXTERNAL_MODULES delivery into every veRL process"),
    PlugPoint("trainer registry", f"{_TB}:TRAINER_REGISTRY", PlugKind.EXTENSION_POINT, (),
              "v1 trainer modes replaced by RLix subclasses"),
    PlugPoint("trainer lookup", f"{_TB}:get_trainer_cls", PlugKind.READ, ("name",),
              "TaskRunnerV1 resolves trainer.v1.trainer_mode through the registry"),
    PlugPoint("init", f"{_TB}:PPOTrainer.init", PlugKind.SUBCLASS, ("self",),
              "a failed init leaves the coordinator (the setup claim came first)"),
    PlugPoint("on_init_end", f"{_TB}:PPOTrainer.on_init_end", PlugKind.SUBCLASS, ("self",)),
    PlugPoint("on_step_begin", f"{_TB}:PPOTrainer.on_step_begin", PlugKind.SUBCLASS, ("self",)),
    PlugPoint("on_sample_end", f"{_TB}:PPOTrainer.on_sample_end", PlugKind.SUBCLASS, ("self",)),
    PlugPoint("on_step_end", f"{_TB}:PPOTrainer.on_step_end", PlugKind.SUBCLASS, ("self",)),
    PlugPoint("on_train_end", f"{_TB}:PPOTrainer.on_train_end", PlugKind.SUBCLASS, ("self",)),
    PlugPoint("on_validate_begin", f"{_TB}:PPOTrainer.on_validate_begin", PlugKind.SUBCLASS,
              ("self",), "a validation's trajectories are the pipeline's demand"),
    PlugPoint("on_validate_end", f"{_TB}:PPOTrainer.on_validate_end", PlugKind.SUBCLASS,
              ("self",)),
    PlugPoint("get_llm_client", f"{_TB}:PPOTrainer.get_llm_client", PlugKind.SUBCLASS,
              ("self",), "agent loops get the re-dispatching client"),
    PlugPoint("hybrid switch", "verl.trainer.ppo.v1.trainer_separate_async:"
              "PPOTrainerSeparateAsync.switch_to_trainer", PlugKind.SUBCLASS, ("self",),
              "separate_async's own hybrid switching is handed to the coordinator"),
    PlugPoint("load balancer", f"{_ROUTER}:GlobalRequestLoadBalancer", PlugKind.ATTRIBUTE,
              ("__init__", "servers", "max_cache_size", "full_determinism"),
              "subclassed and replaced where the router factory looks it up"),
    PlugPoint("lb acquire", f"{_ROUTER}:GlobalRequestLoadBalancer.acquire_server",
              PlugKind.SUBCLASS, ("request_id",)),
    PlugPoint("lb add", f"{_ROUTER}:GlobalRequestLoadBalancer.add_servers", PlugKind.SUBCLASS,
              ("servers",)),
    PlugPoint("lb remove", f"{_ROUTER}:GlobalRequestLoadBalancer.remove_servers",
              PlugKind.READ, ("server_ids",)),
    PlugPoint("router factory", f"{_ROUTER}:_create_global_sticky_inflight", PlugKind.READ,
              ("servers", "full_determinism", "load_balancer_cls"),
              "reads GlobalRequestLoadBalancer from the module at call time"),
    PlugPoint("client generate", f"{_LLM}:LLMServerClient.generate", PlugKind.SUBCLASS,
              ("request_id", "prompt_ids", "sampling_params")),
    PlugPoint("client acquire", f"{_LLM}:LLMServerClient._acquire_server", PlugKind.SUBCLASS,
              ("request_id",)),
    PlugPoint("replica registry", f"{_REPLICA}:RolloutReplicaRegistry.register",
              PlugKind.EXTENSION_POINT, ("name", "loader")),
    PlugPoint("replica abort", f"{_REPLICA}:RolloutReplica.abort_all_requests", PlugKind.READ,
              ("reject_request",)),
    PlugPoint("checkpoint registry", f"{_CKPT}:CheckpointEngineRegistry.register",
              PlugKind.EXTENSION_POINT, ("backend",)),
    PlugPoint("checkpoint cache seam", f"{_CKPT}:CheckpointEngineWithCache.get_weights",
              PlugKind.SUBCLASS, ("self",)),
    PlugPoint("checkpoint manager sync", f"{_CKPT}:CheckpointEngineManager.update_weights",
              PlugKind.READ, ("global_steps",)),
    PlugPoint("rollout worker update", f"{_CKPT}:CheckpointEngineWorker.update_weights",
              PlugKind.READ, ("global_steps",)),
    PlugPoint("agent loop worker", f"{_AGENT_TQ}:AgentLoopWorkerTQ", PlugKind.ATTRIBUTE, (),
              "looked up by AgentLoopManagerTQ.__init__ at call time; replaced by the "
              "per-trajectory progress subclass"),
    PlugPoint("trajectory stored", f"{_AGENT}:AgentLoopWorker._agent_loop_postprocess",
              PlugKind.SUBCLASS, ("output", "validate"),
              "the per-trajectory completion point (TQ override keeps this signature)"),
    PlugPoint("checkpoint manager", f"{_CKPT}:CheckpointEngineManager", PlugKind.SUBCLASS,
              ("__init__", "config", "actor_wg", "replicas"),
              "standalone replicas' manager replaced by the coordinator-aware one"),
    PlugPoint("worker update", f"{_ENGINE_WORKERS}:ActorRolloutRefWorker.update_weights",
              PlugKind.READ, ("global_steps", "mode"), "fills the cache (mode=rlix_cache)"),
    PlugPoint("worker mapping", f"{_TB}:PPOTrainer._init_resource_pool_mgr", PlugKind.SUBCLASS,
              ("self",), "role_worker_mapping's training worker becomes RLix's subclass; "
              "the pipeline claims its GPUs there, before veRL builds any worker"),
    PlugPoint("colocated worker class", f"{_TB}:create_colocated_worker_cls", PlugKind.WRAP,
              ("class_dict",), "looked up in trainer_base when the trainer builds its worker "
              "actors: the training workers' class declares the cache's concurrency group, so "
              "a sync is served while the owner trains"),
    PlugPoint("training worker", f"{_ENGINE_WORKERS}:ActorRolloutRefWorker", PlugKind.SUBCLASS,
              ("__init__", "config", "role"),
              "subclassed: hybrid replicas' receive method, Megatron group rebinding"),
    PlugPoint("hybrid manager sleep", f"{_CKPT}:CheckpointEngineManager.sleep_replicas",
              PlugKind.SUBCLASS, ("self",),
              "hybrid replicas' manager: sleep/wake left to the coordinator"),
    PlugPoint("hybrid manager abort", f"{_CKPT}:CheckpointEngineManager.abort_replicas",
              PlugKind.SUBCLASS, ("reject_request",)),
    PlugPoint("resource pools", f"{_SC}:ResourcePoolManager.create_resource_pool",
              PlugKind.WRAP, ("self",), "the trainer's and each standalone replica's pools: "
              "pinned to the layout's GPUs on the coordinator's shared groups"),
    PlugPoint("worker placement", f"{_SC}:RayWorkerGroup._init_with_resource_pool",
              PlugKind.WRAP, ("resource_pool", "ray_cls_with_init", "bin_pack", "detached",
                              "worker_env"),
              "a pinned pool's workers go on the shared groups"),
    PlugPoint("worker creation", f"{_SC}:RayWorkerGroup._create_worker", PlugKind.READ,
              ("rank", "pg_idx", "pg", "local_rank", "resource_pool", "ray_cls_with_init",
               "worker_env", "detached"), "builds each pinned worker (env, name)"),
    PlugPoint("worker class call", f"{_SC}:RayClassWithInitArgs.__call__", PlugKind.READ,
              ("placement_group", "placement_group_bundle_idx", "use_gpu", "num_gpus",
               "sharing_with", "device_name"), "a pinned worker's bundle and CPU request"),
    PlugPoint("master address", f"{_SC}:get_master_addr_port", PlugKind.READ, (),
              "a Ray task: run with no CPU on a pinned pool's first node group"),
    PlugPoint("runtime env", f"{_MAIN}:get_ppo_ray_runtime_env", PlugKind.WRAP, ("config",),
              "forward RLix variables to workers of an existing Ray cluster"),
    PlugPoint("runtime env (definition)", f"{_CONSTANTS}:get_ppo_ray_runtime_env",
              PlugKind.WRAP, ("config",),
              "`python -m verl.trainer.main_ppo` binds it from here; run_ppo calls it with the "
              "job's config before ray.init: unsupported jobs are refused there"),
)

DEFERRED_PLUG_POINTS: tuple[PlugPoint, ...] = (
    PlugPoint("vllm server", f"{_VLLM_SERVER}:vLLMHttpServer", PlugKind.SUBCLASS, (),
              "needs vLLM; checked by the replica loader"),
    PlugPoint("vllm abort", f"{_VLLM_SERVER}:vLLMHttpServer.abort_all_requests",
              PlugKind.SUBCLASS, ("reset_prefix_cache", "reject_request"),
              "a parking abort (veRL's weight update) holds the server until its gate reopens"),
    PlugPoint("vllm gate", f"{_VLLM_SERVER}:vLLMHttpServer.open_submission_gate",
              PlugKind.SUBCLASS, ("self",), "kept closed while the coordinator holds it down"),
    PlugPoint("vllm resume", f"{_VLLM_SERVER}:vLLMHttpServer.resume_engine_generation",
              PlugKind.SUBCLASS, ("self",), "no-op while the coordinator holds it down"),
    PlugPoint("vllm generate", f"{_VLLM_SERVER}:vLLMHttpServer.generate", PlugKind.SUBCLASS,
              ("prompt_ids", "sampling_params", "request_id"),
              "an attempt aborted by an in-place refresh is tagged for the client"),
    PlugPoint("vllm weight version", f"{_VLLM_SERVER}:vLLMHttpServer.set_global_steps",
              PlugKind.SUBCLASS, ("global_steps",), "the version the engine holds"),
    PlugPoint("vllm sleep level", f"{_VLLM_SERVER}:vLLMHttpServer._resolve_sleep_level",
              PlugKind.READ),
    PlugPoint("vllm replica", f"{_VLLM_SERVER}:vLLMReplica", PlugKind.SUBCLASS, ()),
    PlugPoint("worker checkpoint call", f"{_ENGINE_WORKERS}:"
              "ActorRolloutRefWorker.execute_checkpoint_engine", PlugKind.READ, ("method",),
              "runs the NCCL destroy/re-init inside the training workers"),
    PlugPoint("worker offload", f"{_ENGINE_WORKERS}:ActorRolloutRefWorker.to", PlugKind.READ,
              ("device", "model", "optimizer", "grad")),
    PlugPoint("megatron engine offload", f"{_MEGATRON}:MegatronEngine.to", PlugKind.READ,
              ("device", "model", "optimizer", "grad")),
    PlugPoint("megatron engine groups", f"{_MEGATRON}:MegatronEngine.initialize", PlugKind.READ,
              ("self",), "sets module/optimizer/lr_scheduler/checkpoint_mananager, the roots "
              "whose process groups are rebound after re-init"),
)


def check_deferred(prefix: str) -> None:
    """Raise :class:`HostDriftError` if a deferred plug point under ``prefix`` drifted."""
    bad = [
        s for s in (check_plug_point(p) for p in DEFERRED_PLUG_POINTS)
        if s.point.target.startswith(prefix) and not s.ok
    ]
    if bad:
        lines = "; ".join(f"{s.point.name} ({s.point.target}): {s.detail}" for s in bad)
        raise HostDriftError(f"VerlPatch cannot use veRL's {prefix}: {lines}")


def _rlix_vllm_loader() -> type:
    """``RolloutReplicaRegistry`` loader: imports vLLM only when veRL builds replicas."""
    check_deferred(_VLLM_SERVER)
    from rlix_plugins.patches.verl_vllm import load_rlix_vllm_replica

    return load_rlix_vllm_replica()


def forwarding_runtime_env(original: Callable[..., dict[str, Any]]) -> Callable[..., Any]:
    """Wrap veRL's runtime-env builder so the RLix variables reach every Ray worker, after
    refusing a job the coordinator cannot time-share.

    veRL drops variables already set in the driver's shell (a local cluster inherits them),
    which loses them on an existing cluster; they are added back after its filter. veRL's
    ``run_ppo`` calls the builder with the job's config before ``ray.init``: an unsupported
    job (:func:`~rlix_plugins.adapters.verl_support.check_supported_job`) stops there, before
    anything is started. Wrapping a wrapper returns it unchanged.
    """
    if getattr(original, "_rlix_forwarding", False):
        return original

    def get_ppo_ray_runtime_env(config: Any = None) -> dict[str, Any]:
        if config is not None:
            from rlix_plugins.adapters.verl_support import check_supported_job

            check_supported_job(config)
        env = original(config)
        env.setdefault("env_vars", {}).update(forwarded_env())
        return env

    get_ppo_ray_runtime_env.__wrapped__ = original  # type: ignore[attr-defined]
    get_ppo_ray_runtime_env._rlix_forwarding = True  # type: ignore[attr-defined]
    return get_ppo_ray_runtime_env


def _initializing(module_name: str) -> bool:
    """True while ``module_name`` is still executing its own import (a partial module)."""
    mod = sys.modules.get(module_name)
    spec = getattr(mod, "__spec__", None)
    return mod is not None and bool(getattr(spec, "_initializing", False))


_ROUTING_MOD = "rlix_plugins.patches.verl_routing"
_CKPT_MOD = "rlix_plugins.patches.verl_checkpoint"
_AGENT_MOD = "rlix_plugins.patches.verl_agent_loop"


class VerlPatch(HostPatch):
    """RLix integration of veRL 0.9.1 (see module docstring)."""

    module = "verl"
    distributions = ("verl",)
    supported = "verl==0.9.1"
    plug_points = CORE_PLUG_POINTS

    def version_supported(self, version: str | None) -> bool:
        return version is not None and version.split("+")[0] in SUPPORTED_VERL

    def check_all(self) -> list[PlugPointStatus]:
        """Every plug point, deferred ones included (imports vLLM and Megatron)."""
        return [check_plug_point(p) for p in (*CORE_PLUG_POINTS, *DEFERRED_PLUG_POINTS)]

    def _apply(self) -> None:
        from rlix_plugins.patches.verl_trainer import rlix_trainer_class

        registry: dict[str, type] = resolve(f"{_TB}:TRAINER_REGISTRY")
        for name, cls in list(registry.items()):
            if not getattr(cls, "_rlix_wrapped", False):
                self.set_item(registry, name, rlix_trainer_class(cls))
        # A process that unpickles one of our veRL subclasses (e.g. the load-balancer actor)
        # imports our module first, which imports veRL, which runs this patch while our module
        # is still half-imported. Such a process only hosts that object and never builds one,
        # so the piece that needs the half-imported module is skipped there.
        if not _initializing(_ROUTING_MOD):
            from rlix_plugins.patches.verl_routing import RLixRequestLoadBalancer

            self.set_attribute(sys.modules[_ROUTER], "GlobalRequestLoadBalancer",
                               RLixRequestLoadBalancer)
        else:
            logger.debug("load balancer class not replaced: %s is being imported", _ROUTING_MOD)
        replica_registry = resolve(f"{_REPLICA}:RolloutReplicaRegistry")
        replicas: dict[str, Callable[[], type]] = replica_registry._registry
        self.set_item(replicas, "vllm", _rlix_vllm_loader)
        if not _initializing(_CKPT_MOD):
            from rlix_plugins.patches.verl_checkpoint import BACKEND, RLixCacheCheckpointEngine

            engines: dict[str, type] = resolve(f"{_CKPT}:CheckpointEngineRegistry")._registry
            self.set_item(engines, BACKEND, RLixCacheCheckpointEngine)
        if not _initializing(_AGENT_MOD):
            from rlix_plugins.patches.verl_agent_loop import rlix_agent_loop_worker_actor

            self.set_attribute(importlib.import_module(_AGENT_TQ), "AgentLoopWorkerTQ",
                               rlix_agent_loop_worker_actor())
        from rlix_plugins.patches.verl_workers import colocated_worker_class

        trainer_base = importlib.import_module(_TB)
        wrapped_cls = colocated_worker_class(trainer_base.create_colocated_worker_cls)
        if wrapped_cls is not trainer_base.create_colocated_worker_cls:
            self.set_attribute(trainer_base, "create_colocated_worker_cls", wrapped_cls)
        from rlix_plugins.patches.verl_placement import (
            pinned_create_resource_pool,
            pinned_init_with_resource_pool,
        )

        base = importlib.import_module(_SC)
        for owner, attr, wrap in (
            (base.ResourcePoolManager, "create_resource_pool", pinned_create_resource_pool),
            (base.RayWorkerGroup, "_init_with_resource_pool", pinned_init_with_resource_pool),
        ):
            current = getattr(owner, attr)
            if wrap(current) is not current:
                self.set_attribute(owner, attr, wrap(current))
        # The definition first: a `python -m verl.trainer.main_ppo` driver binds it from there.
        for name in (_CONSTANTS, _MAIN):
            module = importlib.import_module(name)
            wrapped = forwarding_runtime_env(module.get_ppo_ray_runtime_env)
            if wrapped is not module.get_ppo_ray_runtime_env:
                self.set_attribute(module, "get_ppo_ray_runtime_env", wrapped)


def factory() -> HostPatch:
    """``activation.PATCHES["verl"]`` factory."""
    return VerlPatch()

