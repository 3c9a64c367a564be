"""Pipeline adapter for NeMo RL async GRPO: NeMo RL's lifecycle -> coordinator calls.

Wiring (installed by :mod:`rlix_plugins.patches.nemo_rl`, nothing in NeMo RL is edited):

* ``RLixVllmGeneration.__init__`` (driver, in ``grpo.setup``) calls :func:`attach_generation`:
  the pipeline registers (``allocate_pipeline_id`` / ``register_pipeline`` / ``admit_pipeline``),
  starts its ``rlix:coordinator:{id}`` actor (``resize_infer`` -> :class:`NemoRlShardController`),
  creates the one shard-state owner (:class:`~rlix_plugins.generation.ray_state.RayShardState`),
  attaches the router, and installs :class:`RLixWeightSynchronizer` as the generation's
  ``weight_synchronizer`` (NeMo RL then skips its native NCCL refit and its trainer<->inference
  NCCL world). ``PIPELINE_ID`` is exported so the collector/buffer actors inherit it.
* The ``Policy`` subclass (:func:`make_policy_class`) passes the Megatron worker extension
  (``worker_extension_cls_fqn``) and runs :meth:`NemoRlPipeline.before_training` the first time a
  step touches the training GPUs (``prepare_for_lp_inference`` or ``prepare_for_training``):
  request the GPUs (blocks; overlapping shards are preempted by the coordinator), re-initialise
  the Megatron NCCL groups in the workers.
* ``refit_policy_generation`` -> ``RLixWeightSynchronizer.sync_weights``: cache the new weights
  (collective HF gather, owner rank keeps them), offload, destroy the NCCL groups in the
  workers, refresh the still-active shards, release the training GPUs (``after_training``), ask
  for generation GPUs for the next step. The first call (before any step) caches version 0 and
  puts every shard to sleep; the coordinator wakes them as demand warrants.
* ``Policy.save_checkpoint`` (async GRPO saves after the refit released the GPUs and destroyed
  the groups) takes the training GPUs and groups back for the save and releases them after
  (:meth:`NemoRlPipeline.hold_training` / :meth:`NemoRlPipeline.release_training`); a Megatron
  async save is finalised under that hold, before the release.
* ``async_grpo_train`` (the patch wraps the name) runs inside :func:`training_run`:
  :func:`start_run` first (the pipeline's step counter starts at NeMo RL's
  ``grpo_save_state.current_step``, > 0 on a resumed run), :func:`end_run` however it leaves.
* ``validate`` (wrapped) reports the validation's trajectories as demand while it runs
  (:func:`validation_demand`); ``CheckpointManager.shutdown`` (subclass) clears the demand when
  the training loop ends (:func:`end_run`).
* The collector reports progress (:mod:`.nemo_rl_progress`); once NeMo RL's weight
  version reaches ``grpo.max_num_steps`` it clears the pipeline's demand instead.
* The heartbeat starts once ``register_pipeline`` has succeeded (a beat before it is refused).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rlix_plugins.adapters.nemo_rl_progress import (
    CollectorTracker,
    CountedBatches,
    SchedulerProgressSink,
    ValidationShape,
    progress_tracker_for_collector,
    router_outstanding,
    router_rank_load,
    validation_size,
    with_rank_load,
)
from rlix_plugins.adapters.observability import (
    LifecycleObserved,
    ObservationWriter,
    shard_gpus,
)
from rlix_plugins.adapters.shard_controller import LifecycleShardController
from rlix_plugins.errors import (
    CoordinatorUnavailableError,
    RegistrationError,
    RunOverError,
)
from rlix_plugins.generation.preemption import PreemptionConfig, ShardLifecycle
from rlix_plugins.generation.shard_state import ShardStatus
from rlix_plugins.generation.state_store import ShardStateView
from rlix_plugins.hooks.protocol import (
    VALIDATION_MODE,
    RLixHooks,
    SetupHold,
    report_validation,
    validation_count,
)
from rlix_plugins.protocol.names import (
    ACTOR_INFER,
    ACTOR_TRAIN,
    ORCHESTRATOR_ACTOR,
    SCHEDULER_ACTOR,
    cluster_id,
    pipeline_namespace,
)
from rlix_plugins.protocol.types import Priority
from rlix_plugins.settings import ENV_PIPELINE_ID, Settings, settings_if_enabled
from rlix_plugins.values import as_index

logger = logging.getLogger(__name__)

RLIX_MEGATRON_WORKER_FQN = "rlix_plugins.patches.megatron.RLixMegatronPolicyWorker"


# ---------------------------------------------------------------------------- layout


@dataclass(frozen=True, slots=True)
class NemoRlLayout:
    """Global GPU ids of the pipeline's clusters (partial overlap: train within infer)."""

    infer_gpus: tuple[int, ...]
    train_gpus: tuple[int, ...]
    infer_tp: int = 1

    def __post_init__(self) -> None:
        if not self.infer_gpus or not self.train_gpus:
            raise RegistrationError("a NeMo RL pipeline needs inference and training GPUs")
        if self.infer_tp < 1:
            raise RegistrationError(
                f"inference tp={self.infer_tp} is not valid; the tensor-parallel size must be >= 1"
            )
        for name, gpus in (("infer_gpus", self.infer_gpus), ("train_gpus", self.train_gpus)):
            twice = sorted({g for g in gpus if gpus.count(g) > 1})
            if twice:
                raise RegistrationError(
                    f"{name} {list(gpus)} name GPU(s) {twice} twice; valid: distinct global "
                    "GPU ids"
                )
        if len(self.infer_gpus) % self.infer_tp:
            raise RegistrationError(
                f"{len(self.infer_gpus)} inference GPUs are not a multiple of tp={self.infer_tp}"
            )
        extra = sorted(set(self.train_gpus) - set(self.infer_gpus))
        if extra:
            raise RegistrationError(
                f"training GPUs {extra} are not inference GPUs; under the coordinator the "
                "training GPUs must be a subset of the inference GPUs (partial overlap)"
            )

    @property
    def num_shards(self) -> int:
        return len(self.infer_gpus) // self.infer_tp

    def tp_configs(self) -> dict[str, int]:
        return {ACTOR_INFER: self.infer_tp, ACTOR_TRAIN: len(self.train_gpus)}

    def device_mappings(self) -> dict[str, list[int]]:
        return {ACTOR_INFER: sorted(self.infer_gpus), ACTOR_TRAIN: sorted(self.train_gpus)}

    @classmethod
    def from_generation_config(cls, cfg: Any, num_shards: int, tp: int) -> NemoRlLayout:
        """``policy.generation.rlix.{infer_gpus,train_gpus}`` or, absent, all inference GPUs
        with training on the first ``rlix.train_gpu_count`` (default 1) of them."""
        # The placement plan's type checks: ``int(...)`` would read "01" as GPUs 0 and 1,
        # 0.7 as GPU 0 and True as GPU 1 (attach_generation reaches here without a plan).
        from rlix_plugins.adapters.nemo_rl_placement_plan import _checked_rlix_section

        rl = _checked_rlix_section(cfg)
        infer = tuple(int(g) for g in rl.get("infer_gpus", range(num_shards * tp)))
        if "train_gpus" in rl:
            train = tuple(int(g) for g in rl["train_gpus"])
        else:
            count = int(rl.get("train_gpu_count", 1))
            # A slice would silently take fewer GPUs (or, negative, all but some) than asked.
            if not 1 <= count <= len(infer):
                raise RegistrationError(
                    f"policy.generation.rlix.train_gpu_count={count} is not valid for "
                    f"{len(infer)} inference GPU(s); valid: 1..{len(infer)}"
                )
            train = infer[:count]
        return cls(infer, train, tp)


# ---------------------------------------------------------------------------- shard control


class CacheSync:
    """Selective sync of a cached weight version from the cache owner (Megatron rank 0) to
    exactly the chosen shard leaders.

    Picklable (actor handles only). The owner runs the training module's
    :func:`~rlix_plugins.training.sync.sync_version` (``RLixMegatronWorkerMixin.rlix_push_weights``)
    and the leaders' engines receive through the weight-receiver extension: shared memory on
    one host, one bucket of extra memory per receiver, no tensor through Ray.
    """

    def __init__(self, owner: Any, leaders: Sequence[Any], pipeline_id: str = "nemo_rl") -> None:
        self.owner = owner
        self.leaders = list(leaders)
        self.pipeline_id = pipeline_id

    def latest(self) -> int | None:
        import ray

        version: int | None = ray.get(self.owner.rlix_latest_version.remote())
        return version

    def __call__(self, dp_ranks: Sequence[int], version: int) -> dict[str, Any]:
        import ray

        bad = [r for r in dp_ranks if not 0 <= r < len(self.leaders)]
        if bad:
            raise RegistrationError(
                f"pipeline {self.pipeline_id}: dp ranks {bad} do not exist; valid: "
                f"0..{len(self.leaders) - 1}"
            )
        targets = [(f"{self.pipeline_id}/{r}", self.leaders[r]) for r in dp_ranks]
        report: dict[str, Any] = ray.get(self.owner.rlix_push_weights.remote(version, targets))
        return report


class NemoRlShardController(LifecycleShardController):
    """:class:`LifecycleShardController` whose weights come from the Megatron cache owner."""

    def __init__(self, lifecycle: ShardLifecycle, state: ShardStateView, sync: CacheSync,
                 rank_gpus: Sequence[Sequence[int]] | None = None) -> None:
        super().__init__(lifecycle, state, sync, sync.latest, rank_gpus=rank_gpus)


# ---------------------------------------------------------------------------- pipeline


class NemoRlPipeline:
    """Driver-side life of one NeMo RL pipeline under the coordinator (one per driver)."""

    def __init__(self, settings: Settings, generation: Any, layout: NemoRlLayout,
                 hooks: RLixHooks, pipeline_id: str) -> None:
        self.settings = settings
        self.generation = generation
        self.layout = layout
        self.hooks = hooks
        self.pipeline_id = pipeline_id
        self.policy: Any = None
        self.state: Any = None
        self.coordinator: Any = None
        self.step = 0
        self._holding_train = False
        self._nccl_destroyed = False
        self._cached_once = False
        self._gen_thread: threading.Thread | None = None
        self._controller: NemoRlShardController | None = None
        self._registered = False
        self._closed = False
        #: the training loop has ended (:meth:`end_run`): no demand is reported any more
        self._run_over = False
        #: trajectories the running validation generates (None: no validation running)
        self._validation_target: int | None = None
        #: NCCL destroy / re-init records for the gates (``RLIX_OBSERVE_DIR``; off when unset)
        self._observer = ObservationWriter.from_env(pipeline_id)

    # registration -------------------------------------------------------------------------
    def register(self) -> None:
        """:meth:`claim` then :meth:`attach` the generation given at construction (for a
        generation built outside a placement view, whose setup could not be claimed first).
        The placement is checked first: a refused one never registers."""
        self._guarded(self.check_placement)
        self.claim()
        self._guarded(self._attach)

    def claim(self) -> None:
        """Register + admit, serve ``resize_infer``, and hold every GPU of the layout at
        INITIALIZATION until the first refit has put the shards to sleep and offloaded the
        policy (:meth:`after_training`): the GPUs this pipeline's setup loads its models on
        are shrunk of other pipelines' shards first, and nobody is woken on them meanwhile.

        On any failure the pipeline is shut down (:meth:`shutdown`: unregistered if it got
        that far, heartbeat and actors stopped) before the error propagates: nobody else
        holds it to clean up.
        """
        self._guarded(self._claim)

    def attach(self, generation: Any) -> None:
        """Check the generation's placement, create the shard-state owner and route the
        generation's requests by it (after :meth:`claim`). Shut down on failure, like
        :meth:`claim`."""
        self.generation = generation
        self._guarded(self._check_claimed, self.check_placement, self._attach)

    def _guarded(self, *steps: Callable[[], None]) -> None:
        try:
            for step in steps:
                step()
        except BaseException:
            self.shutdown()
            raise

    def _check_claimed(self) -> None:
        if not self._registered:
            raise RegistrationError(
                f"pipeline {self.pipeline_id}: attach before claim; valid: claim() first"
            )

    def _claim(self) -> None:
        import ray

        from rlix_plugins.adapters.pipeline_coordinator import (
            PendingController,
            start_pipeline_coordinator,
        )

        orch = _orchestrator(self.settings)
        ray.get(orch.register_pipeline.remote(
            pipeline_id=self.pipeline_id,
            ray_namespace=pipeline_namespace(self.pipeline_id),
            cluster_tp_configs=self.layout.tp_configs(),
            cluster_device_mappings=self.layout.device_mappings(),
        ))
        self._registered = True
        # Only now: the scheduler refuses a beat of a pipeline it does not know (the hooks
        # are made without their heartbeat so that the first beat cannot come earlier).
        start_heartbeat = getattr(self.hooks, "start_heartbeat", None)
        if callable(start_heartbeat):
            start_heartbeat()
        self.coordinator = start_pipeline_coordinator(
            self.pipeline_id, PendingController(),
            control_namespace=self.settings.namespace,
        )
        ray.get(orch.admit_pipeline.remote(pipeline_id=self.pipeline_id))
        hold = self._setup_hold()
        if hold is not None:
            hold.hold_for_setup(ACTOR_INFER)
        logger.info("NeMo RL pipeline %s registered: %s", self.pipeline_id, self.layout)

    def _attach(self) -> None:
        from rlix_plugins.generation.ray_state import RayShardState

        # Shards start ACTIVE (NeMo RL loads and refits them during setup); the first
        # sync_weights puts them to sleep and the coordinator takes over.
        self.state = RayShardState.create(
            self.layout.num_shards, name=f"rlix:shard_state:{self.pipeline_id}",
            namespace=pipeline_namespace(self.pipeline_id), initial=ShardStatus.ACTIVE,
        )
        # Ranks over the mapping registered with the coordinator (sorted), as its trace has them.
        self.generation.rlix_attach(self.state, pipeline_id=self.pipeline_id,
                                    infer_gpus=self.layout.device_mappings()[ACTOR_INFER],
                                    infer_tp=self.layout.infer_tp)

    def _setup_hold(self) -> SetupHold | None:
        # Hooks without it (another RLixHooks) cannot hold GPUs for setup.
        return self.hooks if isinstance(self.hooks, SetupHold) else None

    def check_placement(self) -> None:
        """When the generation's workers were placed by an RLix placement view (its cluster
        carries ``rlix_plan``), the GPUs about to be told to the coordinator must be the ones
        the workers are on: raises
        :class:`~rlix_plugins.adapters.nemo_rl_placement_plan.PlacementError` otherwise."""
        wg = getattr(self.generation, "worker_group", None)
        plan = getattr(getattr(wg, "cluster", None), "rlix_plan", None)
        if plan is None:
            return
        from rlix_plugins.adapters.nemo_rl_placement_plan import check_device_mappings

        check_device_mappings(plan, self.layout.device_mappings())

    def controller(self) -> NemoRlShardController:
        """The shard controller (needs the policy: its rank 0 worker owns the cache).

        Built once: each controller owns an event-loop thread, and the driver uses it every
        step (initial sleep, active refresh). The coordinator actor gets its own copy.
        """
        if self._controller is None:
            if self.policy is None or self.state is None:
                raise RegistrationError(
                    f"pipeline {self.pipeline_id}: the shard controller needs the registered "
                    "shard state and the policy (attach_policy was not called)"
                )
            shards = self.generation.rlix_shards()
            wg = self.generation.worker_group
            leaders = [wg.workers[wg.get_dp_leader_worker_idx(r)] for r in range(wg.dp_size)]
            owner = self.policy.worker_group.workers[0]
            lifecycle = ShardLifecycle(self.state, shards, PreemptionConfig())
            self._controller = NemoRlShardController(
                lifecycle, self.state, CacheSync(owner, leaders, self.pipeline_id),
                rank_gpus=shard_gpus(self.layout.device_mappings()[ACTOR_INFER],
                                     self.layout.infer_tp))
        return self._controller

    def attach_policy(self, policy: Any) -> None:
        """Called by the Policy subclass once its workers exist."""
        from rlix_plugins.adapters.pipeline_coordinator import set_shard_controller

        self.policy = policy
        ctrl = self.controller()
        # The coordinator actor was started before the policy existed: hand it the controller.
        set_shard_controller(self.coordinator, ctrl)

    def start_at(self, step: object) -> None:
        """The run's first step: NeMo RL's ``grpo_save_state.current_step`` (> 0 when it
        resumed from a checkpoint; its weight version starts there too). Must come before the
        first refit, which caches the weights as version ``step``.

        Raises:
            RegistrationError: ``step`` is not an int >= 0, or the run already started (the
                first refit cached a version or a step holds the GPUs); nothing is changed.
        """
        value = as_index(step)
        if value is None or value < 0:
            raise RegistrationError(
                f"pipeline {self.pipeline_id}: start step {step!r} is not valid; valid: an int "
                ">= 0 (NeMo RL's grpo_save_state.current_step)"
            )
        if self._cached_once or self._holding_train:
            raise RegistrationError(
                f"pipeline {self.pipeline_id}: start step {value} given after the run started "
                f"(at step {self.step}); valid: before the first refit"
            )
        self.step = value
        logger.info("NeMo RL pipeline %s starts at step %d", self.pipeline_id, value)

    # training cycle -----------------------------------------------------------------------
    def before_training(self) -> None:
        """First touch of the training GPUs in a step: request them, re-init NCCL groups.

        Before the first refit the setup hold has every GPU of the pipeline already (a
        request for the training cluster would wait for the pipeline's own hold): nothing is
        requested then."""
        hold = self._setup_hold()
        if not self._holding_train and not (hold is not None and hold.holding_for_setup):
            self.hooks.before_training(self.step)
            self._holding_train = True
        # Checked even when the GPUs are already held: a re-init that failed must be retried,
        # never skipped (training would run without its process groups).
        if self._nccl_destroyed and self.policy is not None:
            # Policy.run_all_workers_single_data waits for the workers and returns results.
            self.policy.run_all_workers_single_data("rlix_reinit_parallel_state")
            self._nccl_destroyed = False
            self._observe_nccl("nccl_reinit")

    def after_training(self) -> dict[str, float]:
        """Cache, offload, destroy NCCL groups, refresh active shards, release, re-request.

        The first call (NeMo RL's initial refit) instead puts every shard to sleep, offloads
        the policy and ends the setup hold (:meth:`claim`) before asking for generation."""
        if self.policy is None:
            raise RegistrationError(
                f"pipeline {self.pipeline_id}: refit before the policy was attached (the Policy "
                "subclass from make_policy_class attaches it at construction)"
            )
        # NeMo RL's numbering: the weights before step s are version s (s > 0 on a resume).
        version = self.step + 1 if self._cached_once else self.step
        self.policy.run_all_workers_single_data("rlix_build_cache", version)
        if not self._cached_once:
            # Init: every shard was loaded by NeMo RL; from now on the coordinator decides.
            ctrl = self.controller()
            ctrl.shrink(list(range(self.layout.num_shards)))
            # The policy leaves the training GPUs as after every step (the first step's
            # before_training re-makes its groups), then the setup hold ends: nothing of this
            # pipeline is left on its GPUs for the coordinator to wake others onto. If the
            # shrink or the offload fails the hold stays (shards or training state may still
            # be on the GPUs) until the pipeline ends, and this refit has not happened: a
            # retry takes this path again.
            self._offload_training()
            self._cached_once = True
            hold = self._setup_hold()
            if hold is not None:
                hold.release_setup_hold()
            self._request_generation()
            return {"rlix/cached_version": float(version)}
        self._offload_training()
        try:
            active = list(self.state.snapshot().active)
            # Active refresh: shards that never slept take the new version without draining
            # (the collector is paused by NeMo RL around the refit); recorded for the gates.
            self.controller().refresh(active, version, step=self.step)
        finally:
            # Nothing of this pipeline is on the training GPUs any more (cached, offloaded,
            # groups destroyed): they go back even when the refresh failed.
            self.hooks.after_training(self.step)
            self._holding_train = False
        self.step += 1
        self._request_generation()
        return {"rlix/cached_version": float(version), "rlix/refreshed_shards": float(len(active))}

    def _offload_training(self) -> None:
        """Training state off the GPUs and the Megatron NCCL groups destroyed (their
        communicators hold GPU memory); :meth:`before_training` re-makes the groups."""
        self.policy.offload_before_refit()
        self.policy.offload_after_refit()
        self.policy.run_all_workers_single_data("rlix_destroy_parallel_state")
        self._nccl_destroyed = True
        self._observe_nccl("nccl_destroy")

    def _observe_nccl(self, event: str) -> None:
        """Record that every worker returned from the groups' destroy / re-init (evidence for
        the gates' overlap-cycle criterion; never fails the step)."""
        if not self._observer.enabled:
            return
        try:
            self._observer.write(LifecycleObserved(self.pipeline_id, event, step=self.step,
                                                   gpus=tuple(self.layout.train_gpus)))
        except Exception:  # evidence only: never fails the step
            logger.warning("step %s: %s record not written", self.step, event, exc_info=True)

    def hold_training(self) -> bool:
        """Take the training GPUs and groups back outside a step: NeMo RL saves its checkpoint
        after the refit, which released them (the save moves model and optimizer to the GPU
        and runs Megatron's collectives). True when taken here; then
        :meth:`release_training` gives them back."""
        taken = not self._holding_train
        try:
            self.before_training()
        except BaseException:
            if taken and self._holding_train:
                # Granted, then the groups' re-init failed: the save never starts, so its
                # release_training never runs; the GPUs must not stay held by nobody.
                try:
                    self.release_training()
                except Exception:
                    logger.warning("step %s: releasing the training GPUs after a failed "
                                   "checkpoint hold failed", self.step, exc_info=True)
            raise
        return taken

    def release_training(self) -> None:
        """Give back GPUs taken by :meth:`hold_training`: finish an async checkpoint write,
        offload what the save moved to the GPU, destroy the NCCL groups, release, ask for
        generation GPUs again (as after a step). The release is sent even when one of those
        fails (the GPUs must not stay held by nobody).

        With Megatron's ``async_save`` the save returns after staging and the write goes on in
        the background; its finalisation is a collective over the world group (an
        ``all_reduce`` on a CUDA tensor), and NVRx's persistent writer holds CUDA handles into
        the worker's memory until then. NeMo RL would finalise later
        (``checkpointer.finalize_pending`` at the next save or at exit), on GPUs released by
        then. It is run here, blocking, under the hold, so NeMo RL's later call finds nothing
        pending. (NeMo RL's Megatron worker also finalises at the start of
        ``offload_after_refit``; the explicit call keeps the hold right without relying on
        that.)"""
        if not self._holding_train:
            return
        try:
            finalize = getattr(self.policy, "finalize_async_save", None)
            if callable(finalize):
                finalize()
            self.policy.offload_after_refit()
            self.policy.run_all_workers_single_data("rlix_destroy_parallel_state")
            self._nccl_destroyed = True
            self._observe_nccl("nccl_destroy")
        finally:
            self.hooks.after_training(self.step)
            self._holding_train = False
        self._request_generation()

    def _request_generation(self) -> None:
        """Ask for generation GPUs for this step (returns at once; grants arrive as expands)."""
        if self._gen_thread is not None and self._gen_thread.is_alive():
            return
        step = self.step

        def run() -> None:
            import ray

            try:
                sched = ray.get_actor(SCHEDULER_ACTOR, namespace=self.settings.namespace)
                ray.get(sched.request_gpus.remote(
                    cluster_id=cluster_id(self.pipeline_id, ACTOR_INFER),
                    priority=Priority.GENERATION, global_step=step,
                ))
            except RunOverError:
                logger.info("generation request for step %d cancelled: the run is over", step)
            except Exception:
                logger.exception("generation request for step %d failed", step)

        self._gen_thread = threading.Thread(target=run, daemon=True, name=f"rlix-gen-{step}")
        self._gen_thread.start()

    # validation ---------------------------------------------------------------------------
    def begin_validation(self, step: object, target: object) -> None:
        """NeMo RL's ``validate`` starts: report ``target`` trajectories (validation prompts x
        generations per prompt) as demand of its own stream (mode :data:`VALIDATION_MODE`),
        so the coordinator counts it as a rollout's and keeps ranks for it.

        Validation generates through the driver's generation on the pipeline's inference
        ranks; before, nothing was reported for it and the ranks it ran on could be lent away
        mid-validation. A failed report is logged (progress is advisory: the validation
        itself must not fail for it).

        Raises:
            ProtocolError: ``step`` or ``target`` is not an int (>= 0); nothing is sent.
        """
        step_i = validation_count("step", step)
        target_i = validation_count("target", target)
        if self._run_over or self._closed:
            return
        self._validation_target = target_i
        self._report_validation(step_i, 0, new_batch=True)

    def validation_progress(self, step: object, done: object) -> None:
        """``done`` of the running validation's trajectories are generated (reported in 2%
        buckets, like rollouts). No-op when no validation runs.

        Raises:
            ProtocolError: ``step`` or ``done`` is not an int >= 0; nothing is sent.
        """
        step_i = validation_count("step", step)
        done_i = validation_count("done", done)
        if self._validation_target is None or self._run_over or self._closed:
            return
        self._report_validation(step_i, min(done_i, self._validation_target), new_batch=False)

    def end_validation(self, step: object) -> None:
        """The validation ended (returned or raised): its stream reports nothing remaining.

        Only that stream: the scheduler's ``clear_progress`` would also drop the collector's
        training demand, which the collector re-sends only at its next 2% bucket.

        Raises:
            ProtocolError: ``step`` is not an int >= 0; nothing is sent, the demand stays.
        """
        step_i = validation_count("step", step)
        target = self._validation_target
        if target is None:
            return
        self._validation_target = None
        if self._run_over or self._closed:
            return
        self._report_validation(step_i, target, new_batch=False, target=target)

    def _report_validation(self, step: int, done: int, *, new_batch: bool,
                           target: int | None = None) -> None:
        total = self._validation_target if target is None else target
        assert total is not None
        report_validation(self.hooks, self.pipeline_id, step=step, done=done, target=total,
                          new_batch=new_batch)

    # end of the run -----------------------------------------------------------------------
    def end_run(self) -> None:
        """NeMo RL's training loop has ended (however: last step, early stop, timeout,
        exception): forget the pipeline's demand now (``clear_progress``: every stream), not
        when :meth:`shutdown` unregisters, which NeMo RL reaches only after finalising its
        checkpoint, killing its actors and shutting its environments down (or never, on the
        paths that return before its ``finally``). Idempotent; a failure is logged, never
        raised (it runs while NeMo RL unwinds, maybe from an exception of its own)."""
        if self._run_over or self._closed:
            return
        self._run_over = True
        self._validation_target = None
        # The coordinator's end_run also ignores the collector's later reports (it runs until
        # NeMo RL kills it) and cancels the generation request made after the last training;
        # hooks without it (another RLixHooks) clear the demand only.
        end = getattr(self.hooks, "end_run", None)
        try:
            if callable(end):
                end()
            else:
                self.hooks.clear_progress()
        except Exception:
            logger.warning("pipeline %s: demand not cleared at the end of the run",
                           self.pipeline_id, exc_info=True)
        else:
            logger.info("NeMo RL pipeline %s: run over, demand cleared", self.pipeline_id)

    # end of the job ---------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Leave the coordinator: unregister (every GPU the pipeline held is freed and a
        waiting request fails; skipped if it never registered), stop the heartbeat, the
        shard controller's event-loop thread, the coordinator and shard-state actors.
        Idempotent; each part is attempted even if an earlier one failed."""
        if self._closed:
            return
        self._closed = True
        import ray

        def attempt(what: str, fn: Any) -> None:
            try:
                fn()
            except Exception:
                logger.warning("pipeline %s shutdown: %s failed", self.pipeline_id, what,
                               exc_info=True)

        def unregister() -> None:
            orch = ray.get_actor(ORCHESTRATOR_ACTOR, namespace=self.settings.namespace)
            ray.get(orch.unregister_pipeline.remote(self.pipeline_id))

        if self._registered:
            # Only our own registration: the id of a failed register_pipeline may be another
            # job's (an explicit PIPELINE_ID already taken).
            attempt("unregister", unregister)
        close = getattr(self.hooks, "close", None)
        if callable(close):
            attempt("heartbeat stop", close)
        if self._gen_thread is not None:
            # Unregistering failed its pending generation request; the thread ends with it.
            self._gen_thread.join(timeout=10)
        if self._controller is not None:
            attempt("shard controller", self._controller.close)
        if self.coordinator is not None:
            attempt("coordinator actor", lambda: ray.kill(self.coordinator, no_restart=True))
        if self.state is not None:
            state = self.state
            attempt("shard state", lambda: (state.close(), ray.kill(state.handle,
                                                                     no_restart=True)))
        logger.info("NeMo RL pipeline %s left the coordinator", self.pipeline_id)


def _orchestrator(settings: Settings) -> Any:
    """The coordinator's orchestrator actor, or :class:`CoordinatorUnavailableError` naming the
    namespace looked in (Ray's own error is an untyped ``ValueError``)."""
    import ray

    try:
        return ray.get_actor(ORCHESTRATOR_ACTOR, namespace=settings.namespace)
    except ValueError:
        raise CoordinatorUnavailableError(
            f"RLIX_CONTROL_PLANE=rlix but no {ORCHESTRATOR_ACTOR} runs in Ray namespace "
            f"{settings.namespace!r} (RLIX_NAMESPACE); start the coordinator there or set "
            "RLIX_NAMESPACE to the namespace it runs in"
        ) from None


_pipeline: NemoRlPipeline | None = None


@dataclass(frozen=True, slots=True)
class _Claim:
    """A pipeline :func:`claim_setup` registered (holding its GPUs for setup), and
    ``PIPELINE_ID`` as it was before that pipeline exported its id (restored if it leaves)."""

    pipeline: NemoRlPipeline
    previous_id: str | None


#: the setup claim attach_generation completes
_claimed: _Claim | None = None
_pending_policy: Any = None  # grpo.setup builds policy and generation in parallel threads
_pipeline_lock = threading.Lock()


def current_pipeline() -> NemoRlPipeline | None:
    """This driver's pipeline, once registered."""
    return _pipeline


def claim_setup(layout: NemoRlLayout) -> None:
    """The first placement bind of ``grpo.setup`` (no worker exists yet): register this
    driver's pipeline and hold every GPU of ``layout`` at INITIALIZATION while NeMo RL loads
    its models (:meth:`NemoRlPipeline.claim`). No-op with the gate off or once a pipeline was
    claimed or registered; the generation attaches later (:func:`attach_generation`)."""
    global _claimed
    settings = settings_if_enabled()
    if settings is None:
        return
    with _pipeline_lock:
        if _pipeline is not None or _claimed is not None:
            return
        previous = os.environ.get(ENV_PIPELINE_ID)
        _claimed = _Claim(_new_pipeline(settings, None, layout, NemoRlPipeline.claim), previous)


def abandon_setup() -> None:
    """``grpo.setup`` raised (the patch's wrapper calls this): the pipeline it claimed or
    registered leaves the coordinator, its setup hold freed and ``PIPELINE_ID`` as before.
    Without this a pipeline whose Policy build failed after the claim held every GPU of its
    layout until the driver exited and its lease lapsed. No-op without one."""
    global _pipeline, _claimed, _pending_policy
    with _pipeline_lock:
        claim, _claimed = _claimed, None
        pipeline, _pipeline = _pipeline, None
        _pending_policy = None
    if claim is not None:
        claim.pipeline.shutdown()
        _restore_pipeline_id(claim.previous_id)
    if pipeline is not None:
        pipeline.shutdown()


def attach_generation(generation: Any) -> None:
    """``RLixVllmGeneration`` construction hook (driver): attach the generation to the
    pipeline :func:`claim_setup` registered, or register one now."""
    global _pipeline, _claimed
    settings = settings_if_enabled()
    if settings is None:
        return
    with _pipeline_lock:
        if _pipeline is not None:
            return
        layout = NemoRlLayout.from_generation_config(
            generation.cfg, generation.dp_size, generation.model_parallel_size
        )
        # The coordinator resizes ranks 0..num_shards-1 and the shard state has that many
        # entries; the router and the controller drive NeMo RL's dp_size shards.
        claim, _claimed = _claimed, None
        claimed = claim.pipeline if claim is not None else None
        try:
            if layout.num_shards != generation.dp_size:
                raise RegistrationError(
                    f"policy.generation.rlix: {len(layout.infer_gpus)} inference GPU(s) at "
                    f"tp*pp={layout.infer_tp} make {layout.num_shards} shard(s), but NeMo RL "
                    f"built {generation.dp_size} dp rank(s); infer_gpus must list exactly the "
                    "inference cluster's GPUs"
                )
            if claimed is not None and claimed.layout != layout:
                raise RegistrationError(
                    f"pipeline {claimed.pipeline_id}: the generation was built for {layout}, "
                    f"but its setup was claimed for {claimed.layout}"
                )
            if claimed is not None:
                claimed.attach(generation)  # shuts itself down when it fails
        except BaseException:
            if claim is not None:
                claim.pipeline.shutdown()  # a pipeline that can never attach gives its GPUs back
                _restore_pipeline_id(claim.previous_id)
            raise
        if claimed is not None:
            pipeline = claimed
        else:
            pipeline = _new_pipeline(settings, generation, layout, NemoRlPipeline.register)
        generation.weight_synchronizer = RLixWeightSynchronizer(pipeline)
        _pipeline = pipeline
        policy = _pending_policy
    if policy is not None:  # the policy finished first
        _attach_or_leave(pipeline, policy)


def _new_pipeline(settings: Settings, generation: Any, layout: NemoRlLayout,
                  join: Callable[[NemoRlPipeline], None]) -> NemoRlPipeline:
    """A pipeline with its id (``PIPELINE_ID`` or allocated by the coordinator, exported for
    the collector and buffer actors) after ``join`` (claim or register) succeeded."""
    import ray

    from rlix_plugins.hooks import make_hooks

    orch = _orchestrator(settings)
    pid: str = settings.pipeline_id or str(ray.get(orch.allocate_pipeline_id.remote("ft")))
    previous_pid = os.environ.get(ENV_PIPELINE_ID)
    os.environ[ENV_PIPELINE_ID] = pid  # inherited by the collector and buffer actors
    try:
        # The heartbeat starts in claim(), once register_pipeline has succeeded.
        hooks = make_hooks(settings, pipeline_id=pid, heartbeat=False)
        pipeline = NemoRlPipeline(settings, generation, layout, hooks, pid)
        join(pipeline)  # shuts itself down when it fails
    except BaseException:
        _restore_pipeline_id(previous_pid)
        raise
    return pipeline


def _restore_pipeline_id(previous: str | None) -> None:
    """No pipeline exists: its id must not reach actors started later."""
    if previous is None:
        os.environ.pop(ENV_PIPELINE_ID, None)
    else:
        os.environ[ENV_PIPELINE_ID] = previous


def start_run(grpo_save_state: Any) -> None:
    """``async_grpo_train`` is starting (the patch's wrapper calls this first): this driver's
    pipeline starts counting at ``grpo_save_state.current_step``, the step NeMo RL resumes at
    (its weight version starts there too), instead of 0. No-op without a pipeline.

    Raises:
        RegistrationError: the state has no valid ``current_step`` (see
            :meth:`NemoRlPipeline.start_at`); the pipeline is unchanged.
    """
    pipeline = current_pipeline()
    if pipeline is None:
        return
    if isinstance(grpo_save_state, Mapping):
        step = grpo_save_state.get("current_step")
    else:
        step = getattr(grpo_save_state, "current_step", None)
    pipeline.start_at(step)


def attach_policy(policy: Any) -> None:
    """``Policy`` subclass construction hook: attach now, or when the pipeline registers."""
    global _pending_policy
    with _pipeline_lock:
        pipeline = _pipeline
        if pipeline is None:
            _pending_policy = policy
            return
    _attach_or_leave(pipeline, policy)


def _attach_or_leave(pipeline: NemoRlPipeline, policy: Any) -> None:
    """``pipeline.attach_policy(policy)``; when it fails the pipeline could never be resized,
    so it leaves the coordinator (unregistered, heartbeat and actors stopped) before the
    error propagates, as a failed registration does."""
    global _pipeline, _pending_policy
    try:
        pipeline.attach_policy(policy)
    except BaseException:
        pipeline.shutdown()
        with _pipeline_lock:
            if _pipeline is pipeline:
                _pipeline, _pending_policy = None, None
        raise


def end_run() -> None:
    """NeMo RL's training loop has ended: the driver's pipeline forgets its demand
    (:meth:`NemoRlPipeline.end_run`). No-op without a pipeline."""
    pipeline = current_pipeline()
    if pipeline is not None:
        pipeline.end_run()


@contextlib.contextmanager
def training_run(grpo_save_state: Any) -> Iterator[None]:
    """Around NeMo RL's ``async_grpo_train``: :func:`start_run` first, :func:`end_run`
    however the call leaves (return or exception). The paths NeMo RL returns or raises by
    before its loop's ``finally`` (an early stop after the initial validation, a failed
    initial buffer fill) never reach ``policy_generation.shutdown()``; their demand used to
    stay until the pipeline's lease lapsed."""
    start_run(grpo_save_state)
    try:
        yield
    finally:
        end_run()


def make_checkpoint_manager_class(base: type) -> type:
    """``CheckpointManager`` subclass whose ``shutdown`` ends the pipeline's run first.

    NeMo RL calls ``checkpointer.shutdown()`` ("Call at training exit") on every way out of
    its training loop, right where the loop ends and before it finalises a pending
    checkpoint, kills the collector and shuts the generation down. Clearing the demand there
    frees the pipeline's GPUs for others while those run.
    """

    class RLixCheckpointManager(base):  # type: ignore[misc]
        def shutdown(self, *args: Any, **kwargs: Any) -> Any:
            end_run()
            return super().shutdown(*args, **kwargs)

    RLixCheckpointManager.__qualname__ = f"RLix{base.__name__}"
    return RLixCheckpointManager


class RLixWeightSynchronizer:
    """NeMo RL ``WeightSynchronizer`` seam: the after-training half of the cycle.

    ``refit_policy_generation`` returns ``sync_weights(...)`` when a synchronizer is set, so the
    native refit (a broadcast to EVERY inference rank, sleeping ones included) never runs.
    """

    def __init__(self, pipeline: NemoRlPipeline) -> None:
        self.pipeline = pipeline
        self._stale = True

    @property
    def is_stale(self) -> bool:
        return self._stale

    def init_communicator(self) -> None:
        """Nothing to set up: no trainer<->inference NCCL world under RLix."""

    def sync_weights(self, timer: Any = None, kv_scales: Any = None) -> dict[str, float]:
        if kv_scales:
            logger.warning("rlix: FP8 KV scales are not carried by the selective sync")
        metrics = self.pipeline.after_training()
        self._stale = False
        return metrics

    def shutdown(self) -> None:
        """``VllmGeneration.shutdown`` calls this: the pipeline leaves the coordinator."""
        global _pipeline, _pending_policy
        self.pipeline.shutdown()
        with _pipeline_lock:
            if _pipeline is self.pipeline:
                _pipeline, _pending_policy = None, None

    def __reduce__(self) -> tuple[Any, ...]:
        # async_grpo_train pickles the generation into its collector actor (whose router copy
        # routes); the pipeline (registration, heartbeat, threads) stays in the driver.
        return (DetachedWeightSynchronizer, ())


class DetachedWeightSynchronizer:
    """What a pickled copy of the generation carries instead of :class:`RLixWeightSynchronizer`
    (NeMo RL's collector never refits): refits are refused, shutdown leaves the driver's
    pipeline alone."""

    is_stale = False

    def init_communicator(self) -> None:
        """Nothing to set up."""

    def sync_weights(self, timer: Any = None, kv_scales: Any = None) -> dict[str, float]:
        raise RegistrationError(
            "rlix: this generation is a copy (e.g. the trajectory collector's); refit through "
            "the driver's generation, which holds the pipeline"
        )

    def shutdown(self) -> None:
        """A copy going away must not unregister the driver's pipeline."""


def make_policy_class(base: type) -> type:
    """``Policy`` subclass: Megatron extension + the before-training half of the cycle."""

    class RLixPolicy(base):  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            config = kwargs.get("config", args[1] if len(args) > 1 else {})
            if (config.get("megatron_cfg") or {}).get("enabled") and kwargs.get(
                "worker_extension_cls_fqn"
            ) is None:
                kwargs["worker_extension_cls_fqn"] = RLIX_MEGATRON_WORKER_FQN
            super().__init__(*args, **kwargs)
            if settings_if_enabled() is not None:
                attach_policy(self)

        def prepare_for_lp_inference(self, *args: Any, **kwargs: Any) -> Any:
            pipeline = current_pipeline()
            if pipeline is not None:
                pipeline.before_training()
            return super().prepare_for_lp_inference(*args, **kwargs)

        def prepare_for_training(self, *args: Any, **kwargs: Any) -> Any:
            pipeline = current_pipeline()
            if pipeline is not None:
                pipeline.before_training()
            return super().prepare_for_training(*args, **kwargs)

        def save_checkpoint(self, *args: Any, **kwargs: Any) -> Any:
            # async GRPO saves after the refit released the GPUs and destroyed the groups
            pipeline = current_pipeline()
            if pipeline is None or not pipeline.hold_training():
                return super().save_checkpoint(*args, **kwargs)
            try:
                return super().save_checkpoint(*args, **kwargs)
            finally:
                pipeline.release_training()

    RLixPolicy.__qualname__ = f"RLix{base.__name__}"
    return RLixPolicy


# ---------------------------------------------------------------------------- validation

@contextlib.contextmanager
def validation_demand(val_dataloader: Any, master_config: Any, step: Any) -> Iterator[Any]:
    """Around NeMo RL's ``validate(policy_generation, val_dataloader, ..., step, master_config)``:
    the driver's pipeline reports the validation's trajectories as demand while it runs
    (:meth:`NemoRlPipeline.begin_validation`), lowers it as batches finish, and reports
    nothing remaining when it ends, also when it raises. Yields the loader ``validate`` must
    iterate (``val_dataloader`` itself when nothing is reported: no pipeline, no loader, a
    size the config does not give)."""
    pipeline = current_pipeline()
    shape = None if pipeline is None or val_dataloader is None else ValidationShape.of(
        master_config)
    step_i = as_index(step)
    if pipeline is None or shape is None or step_i is None or step_i < 0:
        if pipeline is not None and val_dataloader is not None:
            logger.warning("rlix: validation at step %r reports no demand (grpo.val_batch_size "
                           "/ max_val_samples / val_num_generations_per_prompt or the step "
                           "unknown); its ranks may be lent away", step)
        yield val_dataloader
        return
    per_batch = shape.per_batch
    pipeline.begin_validation(step_i, shape.size(val_dataloader))
    try:
        yield CountedBatches(
            val_dataloader, lambda done: pipeline.validation_progress(step_i, done * per_batch))
    finally:
        pipeline.end_validation(step_i)


# RLixVllmGeneration runs attach_generation at construction (the patch sets the class hook).
__all__ = [
    "VALIDATION_MODE",
    "CacheSync",
    "CollectorTracker",
    "DetachedWeightSynchronizer",
    "NemoRlLayout",
    "NemoRlPipeline",
    "NemoRlShardController",
    "RLixWeightSynchronizer",
    "SchedulerProgressSink",
    "attach_generation",
    "attach_policy",
    "claim_setup",
    "end_run",
    "make_checkpoint_manager_class",
    "make_policy_class",
    "progress_tracker_for_collector",
    "router_outstanding",
    "router_rank_load",
    "start_run",
    "training_run",
    "validation_demand",
    "validation_size",
    "with_rank_load",
]
