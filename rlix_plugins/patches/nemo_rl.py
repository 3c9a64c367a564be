"""NeMo RL host patch: what is plugged where when ``RLIX_CONTROL_PLANE=rlix``.

Supported NeMo RL: NVIDIA-NeMo/RL commit ``7ea279abf`` (main, 2026-08-22; package version
0.6.0). NeMo RL's own seams first, replacement of call-time-looked-up names second, nothing is
wrapped in place:

====================  ====================================================================
process               what is plugged, through which seam
====================  ====================================================================
every process         ``ACTOR_ENVIRONMENT_REGISTRY`` gains our worker FQNs (same venvs as the
                      stock classes) - the actor-environment registry seam
driver                ``grpo.VllmGeneration`` -> :class:`RLixVllmGeneration` (router);
                      ``grpo.Policy`` -> a ``Policy`` subclass that passes
                      ``worker_extension_cls_fqn`` (Megatron extension) and runs the
                      before-training half of the cycle; the generation's
                      ``weight_synchronizer`` (NeMo RL's ``WeightSynchronizer`` seam) runs the
                      after-training half with the native refit skipped
driver / any          ``vllm_generation.resolve_generation_worker_cls`` (looked up at call
                      time) maps the stock async worker FQN to ours
driver                placement (partial overlap): ``grpo.RayVirtualCluster`` -> role views
                      of one shared placement group, bound to ``policy.generation.rlix`` by
                      the ``VllmGeneration`` / ``Policy`` subclasses; ``RayWorkerGroup`` as
                      looked up by ``vllm_generation`` and ``lm_policy`` places workers on
                      the role's bundles and checks their GPUs
                      (:mod:`rlix_plugins.adapters.nemo_rl_placement`)
driver                ``async_utils.ReplayBuffer`` / ``AsyncTrajectoryCollector`` (imported at
                      call time inside ``async_grpo_train``) -> subclasses of their undecorated
                      classes, re-decorated: ``valid_count`` and progress reports
driver                ``grpo.setup`` (imported by ``run_grpo.py`` after the patch) -> a
                      function that refuses a job the coordinator cannot time-share (DTensor,
                      synchronous GRPO or vLLM, colocated, ...) before NeMo RL's setup runs
driver                ``grpo.async_grpo_train`` (imported at call time by NeMo RL's
                      ``run_grpo.py``) -> a function that starts the pipeline's step counter
                      at ``grpo_save_state.current_step`` and calls NeMo RL's loop
====================  ====================================================================

The patch is triggered by the import of ``nemo_rl`` (the post-import hook of
:mod:`rlix_plugins.activation`); each part is applied when ITS module is imported in that
process (a vLLM worker never imports ``grpo``, and must not be made to). Drift of a part's plug
points raises :class:`~rlix_plugins.errors.HostDriftError` at that import.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import wrapt

from rlix_plugins.errors import HostDriftError, UnknownHostError
from rlix_plugins.patches.base import (
    HostPatch,
    PlugKind,
    PlugPoint,
    PlugPointStatus,
    check_plug_point,
)

logger = logging.getLogger(__name__)

#: The NeMo RL commit this patch was written and tested against (full and short form).
SUPPORTED_COMMIT = "7ea279abfbeb698b092856d0dab61e7cf39bc909"
SUPPORTED_COMMIT_SHORT = SUPPORTED_COMMIT[:9]
#: ``nemo_rl.__version__`` at that commit.
SUPPORTED_VERSION = "0.6.0"

_GRPO = "nemo_rl.algorithms.grpo"
_ASYNC = "nemo_rl.algorithms.async_utils"
_REPLAY = "nemo_rl.algorithms.async_utils.replay_buffer"
_COLLECTOR = "nemo_rl.algorithms.async_utils.trajectory_collector"
_VGEN = "nemo_rl.models.generation.vllm.vllm_generation"
_VWORKER = "nemo_rl.models.generation.vllm.vllm_worker_async"
_REGISTRY = "nemo_rl.distributed.ray_actor_environment_registry"
_POLICY = "nemo_rl.models.policy.lm_policy"
_MEGATRON = "nemo_rl.models.policy.workers.megatron_policy_worker"
_WSYNC = "nemo_rl.weight_sync.interfaces"
_WGROUP = "nemo_rl.distributed.worker_groups"
_VCLUSTER = "nemo_rl.distributed.virtual_cluster"

#: FQNs NeMo RL's builders import for our worker classes.
RLIX_VLLM_WORKER_FQN = "rlix_plugins.adapters.nemo_rl_workers.RLixVllmAsyncGenerationWorker"
STOCK_VLLM_WORKER_FQN = f"{_VWORKER}.VllmAsyncGenerationWorker"
RLIX_MEGATRON_WORKER_FQN = "rlix_plugins.patches.megatron.RLixMegatronPolicyWorker"
STOCK_MEGATRON_WORKER_FQN = f"{_MEGATRON}.MegatronPolicyWorker"


def _p(name: str, target: str, kind: PlugKind, params: tuple[str, ...] = (), why: str = "") -> (
    PlugPoint
):
    return PlugPoint(name, target, kind, params, why)


#: Plug points of each part, keyed by the module whose import applies the part.
PART_POINTS: dict[str, tuple[PlugPoint, ...]] = {
    _REGISTRY: (
        _p("actor venv registry", f"{_REGISTRY}:ACTOR_ENVIRONMENT_REGISTRY",
           PlugKind.EXTENSION_POINT, why="our worker FQNs run in the stock classes' venvs"),
        _p("actor venv lookup", f"{_REGISTRY}:get_actor_python_env", PlugKind.READ,
           ("actor_class_fqn",)),
    ),
    _VGEN: (
        _p("vLLM worker class resolver", f"{_VGEN}:resolve_generation_worker_cls",
           PlugKind.ATTRIBUTE, ("default_cls", "config"),
           why="looked up at call time in VllmGeneration.__init__: maps to our worker FQN"),
        _p("VllmGeneration", f"{_VGEN}:VllmGeneration.__init__", PlugKind.SUBCLASS,
           ("cluster", "config", "name_prefix", "workers_per_node", "defer_model_load")),
        _p("routing entry", f"{_VGEN}:VllmGeneration._async_generate_base", PlugKind.READ,
           ("data", "method_name", "data_validation_fn", "greedy"),
           why="NeMo RL's real request path; it calls the two overridden methods below"),
        _p("shard choice", f"{_VGEN}:VllmGeneration._next_dp_shard_idx", PlugKind.SUBCLASS),
        _p("shard dispatch", f"{_VGEN}:VllmGeneration._generate_on_shard", PlugKind.SUBCLASS,
           ("data", "method_name", "greedy", "dp_shard_idx", "leader_worker_idx")),
        _p("trainer<->inference NCCL world", f"{_VGEN}:VllmGeneration.init_collective",
           PlugKind.SUBCLASS, ("ip", "port", "world_size", "train_world_size")),
        _p("dp leader of a shard", f"{_WGROUP}:RayWorkerGroup.get_dp_leader_worker_idx",
           PlugKind.READ, ("dp_shard_idx",)),
        _p("worker handles", f"{_WGROUP}:RayWorkerGroup.workers", PlugKind.READ),
        _p("one-worker call", f"{_WGROUP}:RayWorkerGroup.run_single_worker_single_data",
           PlugKind.READ, ("method_name", "worker_idx")),
        _p("vLLM worker group class", f"{_VGEN}:RayWorkerGroup", PlugKind.ATTRIBUTE,
           why="looked up at call time in VllmGeneration.__init__: workers on the role's "
           "bundles of the shared placement group, then checked"),
        _p("worker group", f"{_WGROUP}:RayWorkerGroup.__init__", PlugKind.SUBCLASS,
           ("cluster", "remote_worker_builder", "workers_per_node", "name_prefix",
            "bundle_indices_list", "sharding_annotations", "env_vars")),
        _p("worker creation", f"{_WGROUP}:RayWorkerGroup._create_workers_from_bundle_indices",
           PlugKind.READ, ("remote_worker_builder", "bundle_indices_list", "env_vars"),
           why="it fills self._initializer_pool and calls pool[pg_idx].create_worker.remote "
           "once per worker in rank order; on the coordinator's shared groups our pool adds "
           "each worker's pinning env (CUDA_VISIBLE_DEVICES, Ray's setting off) there"),
        _p("vLLM placement groups", f"{_VCLUSTER}:RayVirtualCluster._init_placement_groups",
           PlugKind.SUBCLASS, ("strategy", "use_unified_pg"),
           why="VllmGeneration.__init__ calls it; a bound view already holds the shared group"),
    ),
    _VWORKER: (
        _p("async vLLM worker (undecorated)", f"{_VWORKER}:VllmAsyncGenerationWorkerImpl",
           PlugKind.SUBCLASS, why="Ray freezes the decorated class; we subclass the Impl"),
        _p("engine creation", f"{_VWORKER}:VllmAsyncGenerationWorkerImpl._create_engine",
           PlugKind.SUBCLASS, ("llm_kwargs",), why="wrap self.llm behind the dispatch gate"),
        _p("sleep (level 1 hard-coded)", f"{_VWORKER}:VllmAsyncGenerationWorkerImpl.sleep_async",
           PlugKind.SUBCLASS),
        _p("per-request generation", f"{_VWORKER}:VllmAsyncGenerationWorkerImpl.generate_async",
           PlugKind.SUBCLASS, ("data", "greedy"),
           why="calls self.llm.generate(prompt=, sampling_params=, request_id=); we take a "
           "continuation's budget and attempt id out of data first"),
        _p("sampling parameters",
           f"{_VWORKER}:VllmAsyncGenerationWorkerImpl._build_sampling_params",
           PlugKind.SUBCLASS, ("greedy", "stop_strings", "max_new_tokens"),
           why="a continuation's max_tokens is capped to the tokens the request has left"),
    ),
    _GRPO: (
        _p("generation class", f"{_GRPO}:VllmGeneration", PlugKind.ATTRIBUTE,
           why="grpo.setup's init_vllm looks the name up at call time"),
        _p("policy class", f"{_GRPO}:Policy", PlugKind.ATTRIBUTE,
           why="grpo.setup uses Policy when no policy_factory is given"),
        _p("cluster class", f"{_GRPO}:RayVirtualCluster", PlugKind.ATTRIBUTE,
           why="grpo.setup looks it up at call time: train/inference clusters become views of "
           "one shared placement group (partial overlap)"),
        _p("cluster", f"{_VCLUSTER}:RayVirtualCluster.__init__", PlugKind.SUBCLASS,
           ("bundle_ct_per_node_list", "use_gpus", "max_colocated_worker_groups",
            "num_gpus_per_node", "name", "placement_group_strategy",
            "node_resource_constraints")),
        _p("cluster shutdown", f"{_VCLUSTER}:RayVirtualCluster.shutdown", PlugKind.SUBCLASS),
        _p("cluster placement groups", f"{_VCLUSTER}:RayVirtualCluster.get_placement_groups",
           PlugKind.READ),
        _p("bundle GPU probe", f"{_VCLUSTER}:get_reordered_bundle", PlugKind.READ,
           ("pg", "segment_size", "gpus_per_node"),
           why="asks Ray which GPU each bundle of the shared group landed on"),
        _p("setup", f"{_GRPO}:setup", PlugKind.ATTRIBUTE, ("master_config", "policy_factory"),
           why="examples/run_grpo.py imports it at module level, after `import nemo_rl` "
           "applied this part: a job the coordinator cannot time-share is refused before "
           "setup builds any cluster, worker or registration"),
        _p("refit", f"{_GRPO}:refit_policy_generation", PlugKind.READ,
           ("policy", "policy_generation", "colocated_inference", "timer", "kv_scales"),
           why="returns early into policy_generation.weight_synchronizer.sync_weights"),
        _p("validation", f"{_GRPO}:validate", PlugKind.ATTRIBUTE,
           ("policy_generation", "val_dataloader", "tokenizer", "val_task_to_env", "step",
            "master_config"),
           why="async_grpo_train calls it by its global name: the validation reports its "
           "trajectories as demand while it runs"),
        _p("checkpoint manager", f"{_GRPO}:CheckpointManager", PlugKind.ATTRIBUTE,
           why="grpo.setup builds it by its global name; its shutdown() is called on every "
           "way out of the training loop: the pipeline's demand is cleared there"),
        _p("async GRPO loop", f"{_GRPO}:async_grpo_train", PlugKind.ATTRIBUTE,
           ("policy", "policy_generation", "grpo_save_state", "master_config",
            "max_trajectory_age_steps"),
           why="examples/run_grpo.py imports it at call time: the pipeline's step counter "
           "starts at grpo_save_state.current_step (a resumed run) before the loop runs"),
    ),
    _ASYNC: (
        _p("replay buffer actor", f"{_ASYNC}:ReplayBuffer", PlugKind.ATTRIBUTE,
           why="imported at call time inside async_grpo_train"),
        _p("collector actor", f"{_ASYNC}:AsyncTrajectoryCollector", PlugKind.ATTRIBUTE,
           why="imported at call time inside async_grpo_train"),
        _p("replay buffer (undecorated)", f"{_REPLAY}:ReplayBufferImpl", PlugKind.SUBCLASS,
           ("max_size",)),
        _p("replay buffer add", f"{_REPLAY}:ReplayBufferImpl.add", PlugKind.READ,
           ("weight_version", "target_weight_version")),
        _p("collector enqueue", f"{_COLLECTOR}:AsyncTrajectoryCollector", PlugKind.SUBCLASS,
           why="progress after each buffered group (_enqueue_rollout_group)"),
    ),
    _POLICY: (
        _p("Policy", f"{_POLICY}:Policy.__init__", PlugKind.SUBCLASS,
           ("cluster", "config", "worker_extension_cls_fqn")),
        _p("before logprobs", f"{_POLICY}:Policy.prepare_for_lp_inference", PlugKind.SUBCLASS),
        _p("before training", f"{_POLICY}:Policy.prepare_for_training", PlugKind.SUBCLASS),
        _p("offload before refit", f"{_POLICY}:Policy.offload_before_refit", PlugKind.READ),
        _p("offload after refit", f"{_POLICY}:Policy.offload_after_refit", PlugKind.READ),
        _p("async checkpoint finalisation", f"{_POLICY}:Policy.finalize_async_save",
           PlugKind.READ, why="a Megatron async save is finalised under the save's GPU hold"),
        _p("all-worker call", f"{_POLICY}:Policy.run_all_workers_single_data", PlugKind.READ,
           ("method_name",)),
        _p("policy worker group class", f"{_POLICY}:RayWorkerGroup", PlugKind.ATTRIBUTE,
           why="looked up at call time in Policy.__init__: training workers are checked "
           "against the layout on the shared placement group"),
    ),
    _MEGATRON: (
        _p("Megatron worker (undecorated)", f"{_MEGATRON}:MegatronPolicyWorkerImpl",
           PlugKind.SUBCLASS),
        _p("HF-weight gather (collective)",
           f"{_MEGATRON}:MegatronPolicyWorkerImpl._iter_params_with_optional_kv_scales",
           PlugKind.READ),
    ),
    _WSYNC: (
        _p("weight synchronizer seam", f"{_WSYNC}:WeightSynchronizer", PlugKind.EXTENSION_POINT),
        _p("sync_weights", f"{_WSYNC}:WeightSynchronizer.sync_weights", PlugKind.READ,
           ("timer", "kv_scales")),
    ),
}


@dataclass(frozen=True, slots=True)
class _Part:
    module: str
    apply: Callable[[NemoRlPatch, Any], None]


def _apply_registry(patch: NemoRlPatch, module: Any) -> None:
    registry: dict[str, str] = module.ACTOR_ENVIRONMENT_REGISTRY
    for ours, stock in (
        (RLIX_VLLM_WORKER_FQN, STOCK_VLLM_WORKER_FQN),
        (RLIX_MEGATRON_WORKER_FQN, STOCK_MEGATRON_WORKER_FQN),
        ("rlix_plugins.adapters.nemo_rl_replay.RLixReplayBuffer", f"{_ASYNC}.ReplayBuffer"),
        ("rlix_plugins.adapters.nemo_rl_collector.RLixAsyncTrajectoryCollector",
         f"{_ASYNC}.AsyncTrajectoryCollector"),
    ):
        if stock in registry:
            patch.set_item(registry, ours, registry[stock])


def _apply_vgen(patch: NemoRlPatch, module: Any) -> None:
    stock = module.resolve_generation_worker_cls

    def resolve_generation_worker_cls(default_cls: str, config: dict[str, Any]) -> str:
        resolved: str = stock(default_cls, config)
        if resolved == STOCK_VLLM_WORKER_FQN:
            return RLIX_VLLM_WORKER_FQN
        if resolved != default_cls:
            logger.warning("rlix: vLLM worker %s (quantized) has no time-sharing subclass; "
                           "its shards cannot be preempted", resolved)
        return resolved

    patch.set_attribute(module, "resolve_generation_worker_cls", resolve_generation_worker_cls)
    _apply_worker_group(patch, module)


def _apply_worker_group(patch: NemoRlPatch, module: Any) -> None:
    from rlix_plugins.adapters.nemo_rl_placement import RLixRayWorkerGroup

    patch.set_attribute(module, "RayWorkerGroup", RLixRayWorkerGroup)


def _apply_grpo(patch: NemoRlPatch, module: Any) -> None:
    from rlix_plugins.adapters.nemo_rl import (
        attach_generation,
        make_checkpoint_manager_class,
        make_policy_class,
    )
    from rlix_plugins.adapters.nemo_rl_generation import RLixVllmGeneration
    from rlix_plugins.adapters.nemo_rl_placement import (
        RLixPlacementCluster,
        make_placed_policy_class,
    )
    from rlix_plugins.adapters.nemo_rl_placement_generation import RLixPlacedVllmGeneration

    patch.set_attribute(RLixVllmGeneration, "_rlix_on_init", staticmethod(attach_generation))
    # Placement binds the clusters before the router subclass and NeMo RL's constructors run.
    patch.set_attribute(module, "RayVirtualCluster", RLixPlacementCluster)
    patch.set_attribute(module, "VllmGeneration", RLixPlacedVllmGeneration)
    patch.set_attribute(
        module, "Policy", make_placed_policy_class(make_policy_class(module.Policy))
    )
    patch.set_attribute(module, "setup", wrap_setup(module.setup))
    patch.set_attribute(module, "async_grpo_train", wrap_async_grpo_train(module.async_grpo_train))
    patch.set_attribute(module, "validate", wrap_validate(module.validate))
    patch.set_attribute(module, "CheckpointManager",
                        make_checkpoint_manager_class(module.CheckpointManager))


def _wrap_bound(stock: Callable[..., Any],
                body: Callable[[inspect.BoundArguments], Any]) -> Callable[..., Any]:
    """``stock`` with ``body(bound arguments)`` run in its place; a call that does not fit
    ``stock``'s signature goes to ``stock`` as it is (NeMo RL raises its own error)."""
    signature = inspect.signature(stock)

    @functools.wraps(stock)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return stock(*args, **kwargs)
        return body(bound)

    return wrapper


def wrap_setup(stock: Callable[..., Any]) -> Callable[..., Any]:
    """``grpo.setup`` that first checks the job is one the coordinator can time-share
    (:func:`~rlix_plugins.adapters.nemo_rl_support.check_supported_job`): an unsupported one
    is refused with every unsupported setting named, before NeMo RL builds any cluster or
    worker; so is a vLLM tp*pp > 1 one when the coordinator's manager runs
    (:func:`~rlix_plugins.adapters.nemo_rl_support.check_shared_placement`). If NeMo RL's
    setup raises, the pipeline it claimed leaves the coordinator."""

    def setup(bound: inspect.BoundArguments) -> Any:
        from rlix_plugins.adapters.nemo_rl_support import (
            check_shared_placement,
            check_supported_job,
        )

        master_config = bound.arguments.get("master_config")
        check_supported_job(master_config, bound.arguments.get("policy_factory"))
        check_shared_placement(master_config)
        try:
            return stock(*bound.args, **bound.kwargs)
        except BaseException:
            from rlix_plugins.adapters.nemo_rl import abandon_setup

            abandon_setup()  # a claimed pipeline must not hold its GPUs for nobody
            raise

    return _wrap_bound(stock, setup)


def wrap_async_grpo_train(stock: Callable[..., Any]) -> Callable[..., Any]:
    """``async_grpo_train`` that first tells the driver's pipeline the step the run starts at
    (``grpo_save_state.current_step``, > 0 on a resume), then runs NeMo RL's loop unchanged,
    and clears the pipeline's demand however the loop leaves (``training_run``)."""

    def async_grpo_train(bound: inspect.BoundArguments) -> Any:
        from rlix_plugins.adapters.nemo_rl import training_run

        with training_run(bound.arguments.get("grpo_save_state")):
            return stock(*bound.args, **bound.kwargs)

    return _wrap_bound(stock, async_grpo_train)


def wrap_validate(stock: Callable[..., Any]) -> Callable[..., Any]:
    """NeMo RL's ``validate`` with the validation's trajectories reported as the pipeline's
    demand while it runs, cleared when it returns or raises (``validation_demand``)."""

    def validate(bound: inspect.BoundArguments) -> Any:
        from rlix_plugins.adapters.nemo_rl import validation_demand

        with validation_demand(bound.arguments.get("val_dataloader"),
                               bound.arguments.get("master_config"),
                               bound.arguments.get("step")) as loader:
            bound.arguments["val_dataloader"] = loader
            return stock(*bound.args, **bound.kwargs)

    return _wrap_bound(stock, validate)


def _apply_async(patch: NemoRlPatch, module: Any) -> None:
    from rlix_plugins.adapters.nemo_rl_collector import RLixAsyncTrajectoryCollector
    from rlix_plugins.adapters.nemo_rl_replay import RLixReplayBuffer

    patch.set_attribute(module, "ReplayBuffer", RLixReplayBuffer)
    patch.set_attribute(module, "AsyncTrajectoryCollector", RLixAsyncTrajectoryCollector)


_PARTS: tuple[_Part, ...] = (
    _Part(_REGISTRY, _apply_registry),
    _Part(_VGEN, _apply_vgen),
    _Part(_POLICY, _apply_worker_group),
    _Part(_GRPO, _apply_grpo),
    _Part(_ASYNC, _apply_async),
)

# The points of _VWORKER, _MEGATRON and _WSYNC are only checked (we subclass there,
# in our own modules, and replace nothing in the host module): doctor checks them all.


class NemoRlPatch(HostPatch):
    """Time-sharing integration of NeMo RL (see module docstring)."""

    module = "nemo_rl"
    distributions = ("nemo-rl", "nemo_rl")
    supported = f"NVIDIA-NeMo/RL commit {SUPPORTED_COMMIT_SHORT} (nemo_rl {SUPPORTED_VERSION})"
    plug_points: Sequence[PlugPoint] = tuple(p for pts in PART_POINTS.values() for p in pts)

    def __init__(self) -> None:
        super().__init__()
        self._enabled = False
        self._parts_done: set[str] = set()
        self._parts_lock = threading.RLock()

    def version(self) -> str | None:
        found = super().version()
        if found is not None:
            return found
        module = sys.modules.get("nemo_rl")
        return getattr(module, "__version__", None) if module is not None else None

    def version_supported(self, version: str | None) -> bool:
        return version == SUPPORTED_VERSION

    def check(self) -> list[PlugPointStatus]:
        """Check the points of every part whose module is already imported here.

        The rest are checked by each part when its module is imported (so checking never
        imports ``grpo`` into a vLLM worker); ``rlix-plugins doctor`` checks them all.
        """
        return [
            check_plug_point(p)
            for mod, pts in PART_POINTS.items()
            if mod in sys.modules
            for p in pts
        ]

    def _apply(self) -> None:
        self._enabled = True

        def disable() -> None:
            self._enabled = False
            self._parts_done.clear()

        self._undo.append(disable)
        for part in _PARTS:
            # Fires at once if the module is imported already, else at its import.
            wrapt.register_post_import_hook(self._hook(part), part.module)

    def _hook(self, part: _Part) -> Callable[[Any], None]:
        def hook(module: Any) -> None:
            self.apply_part(part.module, module)

        return hook

    def apply_part(self, module_name: str, module: Any | None = None) -> bool:
        """Apply one part now (idempotent); False when the patch is not enabled.

        A part that fails halfway is rolled back (the host is left as it was) and the error
        re-raised.

        Raises:
            UnknownHostError: ``module_name`` is not a module with a part (valid ones listed).
            HostDriftError: a plug point of the part drifted (nothing is changed).
        """
        parts = {p.module: p for p in _PARTS}
        if module_name not in parts:
            raise UnknownHostError(
                f"NeMo RL has no patch part for module {module_name!r}; valid parts: "
                f"{', '.join(sorted(parts))}"
            )
        with self._parts_lock:
            if not self._enabled or module_name in self._parts_done:
                return False
            if module is None:
                # The import fires this patch's post-import hook, which applies the part.
                module = importlib.import_module(module_name)
                if module_name in self._parts_done or not self._enabled:
                    return False
            drift = [s for s in map(check_plug_point, PART_POINTS[module_name]) if not s.ok]
            if drift:
                lines = "; ".join(f"{s.point.name} ({s.point.target}): {s.detail}" for s in drift)
                raise HostDriftError(
                    f"NemoRlPatch cannot apply to {module_name} (supported: {self.supported}): "
                    f"{lines}"
                )
            part = parts[module_name]
            mark = len(self._undo)
            try:
                part.apply(self, module)
            except BaseException:
                while len(self._undo) > mark:  # undo this part's own steps, newest first
                    self._undo.pop()()
                raise
            self._parts_done.add(module_name)
            logger.info("rlix: NeMo RL part %s applied", module_name)
            return True

    @property
    def parts_applied(self) -> frozenset[str]:
        """Modules whose part is applied in this process."""
        return frozenset(self._parts_done)


def factory() -> NemoRlPatch:
    """Factory registered in :data:`rlix_plugins.activation.PATCHES`."""
    return NemoRlPatch()


__all__ = [
    "PART_POINTS",
    "RLIX_MEGATRON_WORKER_FQN",
    "RLIX_VLLM_WORKER_FQN",
    "SUPPORTED_COMMIT",
    "SUPPORTED_VERSION",
    "NemoRlPatch",
    "factory",
    "wrap_async_grpo_train",
    "wrap_setup",
    "wrap_validate",
]
