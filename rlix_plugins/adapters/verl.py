"""The veRL pipeline adapter: a veRL trainer's lifecycle turned into coordinator calls.

One adapter per veRL job, built by the RLix trainer (``patches/verl_trainer.py``) before veRL
creates its workers, and given the replicas, load balancer and checkpoint managers once they
exist. It

* claims the pipeline's GPUs before veRL builds its workers (:meth:`VerlPipelineAdapter.claim`:
  register with the orchestrator, ``actor_train`` = the trainer GPUs, ``actor_infer`` = every
  rollout replica, hybrid replicas mapped onto the trainer GPUs and standalone ones after them,
  so the coordinator sees the partial overlap; then hold ``actor_infer`` at INITIALIZATION
  while veRL loads its models), attaches the replicas once they exist and ends the hold with
  every replica asleep (``attach``, ``end_setup``);
* serves ``resize_infer`` through the pipeline coordinator actor with a
  :class:`VerlShardController` (ShardController protocol): shrink = the generation module's
  preempt (mark -> abort -> drain -> sleep) on veRL replicas, expand = wake -> selective sync
  from the CPU cache to exactly those replicas -> activate;
* requests and releases GPUs around each train step through the RLix hooks, which are built
  only after the pipeline is registered and admitted (their heartbeat would otherwise beat for
  a pipeline the coordinator does not know yet).

Host details stay here and in patches/; generation/ and training/ never import veRL.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from rlix_plugins.adapters.observability import ObservationWriter
from rlix_plugins.adapters.shard_controller import LifecycleShardController, SyncFn
from rlix_plugins.adapters.verl_shards import (
    DEFAULT_SHRINK_BUDGET,
    LoadBalancerShardState,
    ShrinkBudget,
    VerlReplicaEngine,
)
from rlix_plugins.errors import ProtocolError, RegistrationError, RlixPluginsError, SettingsError
from rlix_plugins.generation.preemption import PreemptionConfig, ShardLifecycle
from rlix_plugins.hooks.protocol import (
    RLixHooks,
    SetupHold,
    report_validation,
    validation_count,
)
from rlix_plugins.protocol.names import (
    ACTOR_INFER,
    ACTOR_TRAIN,
    CONTROL_PLANE_NAMESPACE,
    ORCHESTRATOR_ACTOR,
    cluster_id,
    pipeline_namespace,
)
from rlix_plugins.protocol.types import Priority
from rlix_plugins.settings import Settings, load_settings
from rlix_plugins.values import count, is_int

logger = logging.getLogger(__name__)


class AdapterNotRegisteredError(RlixPluginsError, RuntimeError):
    """The adapter's hooks were used before :meth:`VerlPipelineAdapter.register`."""


@dataclasses.dataclass(frozen=True, slots=True)
class VerlLayout:
    """Where a veRL job's GPUs are, as the coordinator is told (global GPU ids).

    ``hybrid_replicas`` replicas live on the trainer GPUs (veRL's hybrid engine); the
    ``standalone_replicas`` after them on their own GPUs. Replica ``d`` uses ``tp`` GPUs
    (veRL's rollout world size: tensor x data x pipeline parallel sizes).
    """

    train_gpus: int
    tp: int
    hybrid_replicas: int
    standalone_replicas: int
    first_gpu: int = 0

    @property
    def num_replicas(self) -> int:
        return self.hybrid_replicas + self.standalone_replicas

    def device_mappings(self) -> dict[str, list[int]]:
        """Raises :class:`RegistrationError` for a layout the coordinator cannot be told."""
        counts = {"train_gpus": self.train_gpus, "tp": self.tp, "first_gpu": self.first_gpu,
                  "hybrid_replicas": self.hybrid_replicas,
                  "standalone_replicas": self.standalone_replicas}
        # A negative count would slice the GPU list from the end (a wrong, accepted mapping).
        bad = {k: v for k, v in counts.items() if not is_int(v) or v < 0}
        if bad:
            raise RegistrationError(f"veRL layout {bad}: each must be an int >= 0")
        train = list(range(self.first_gpu, self.first_gpu + self.train_gpus))
        infer_gpus = self.hybrid_replicas * self.tp
        if infer_gpus > self.train_gpus:
            raise RegistrationError(
                f"{self.hybrid_replicas} hybrid replicas x tp {self.tp} exceed the "
                f"{self.train_gpus} trainer GPUs they live on"
            )
        start = self.first_gpu + self.train_gpus
        infer = train[:infer_gpus] + list(range(start, start + self.standalone_replicas * self.tp))
        return {ACTOR_TRAIN: train, ACTOR_INFER: sorted(infer)}

    def tp_configs(self) -> dict[str, int]:
        return {ACTOR_TRAIN: 1, ACTOR_INFER: self.tp}

    def setup_clusters(self) -> tuple[str, ...]:
        """The clusters held while veRL loads its models: the inference cluster, which with
        the hybrid engine covers every trainer GPU, and the training cluster too where none
        of its GPUs hosts a replica (``actor_rollout_ref.hybrid_engine=false``).

        Raises:
            RegistrationError: some trainer GPUs host a replica and others none (trainer
                GPUs not a multiple of the replica size): veRL would load the training model
                on the others unheld, and the two clusters cannot both be held (they share
                GPUs).
        """
        m = self.device_mappings()
        train, infer = set(m[ACTOR_TRAIN]), set(m[ACTOR_INFER])
        outside = sorted(train - infer)
        if not outside:
            return (ACTOR_INFER,)
        if not train & infer:
            return (ACTOR_TRAIN, ACTOR_INFER)
        raise RegistrationError(
            f"veRL layout {self}: trainer GPUs {outside} host no rollout replica while "
            f"{sorted(train & infer)} do; veRL would load its training model there without "
            f"a setup hold. Use trainer GPUs that are a multiple of the replica size "
            f"({self.tp}), or actor_rollout_ref.hybrid_engine=false"
        )


class VerlShardController(LifecycleShardController):
    """ShardController over veRL replicas: the load balancer owns the shard state, ``sync``
    streams the cached version to the chosen replicas, ``version`` names the newest one.
    ``shrink_budget`` is how its shrinks' waits share the coordinator's resize timeout (an
    in-place refresh's claim uses its ``claim_s``)."""

    def __init__(
        self,
        lifecycle: ShardLifecycle,
        state: LoadBalancerShardState,
        sync: SyncFn,
        version: Callable[[], int | None],
        observer: ObservationWriter | None = None,
        shrink_budget: ShrinkBudget = DEFAULT_SHRINK_BUDGET,
    ) -> None:
        super().__init__(lifecycle, state, sync, version, observer=observer)
        self.shrink_budget = shrink_budget

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "shrink_budget": self.shrink_budget}

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.shrink_budget = state.get("shrink_budget", DEFAULT_SHRINK_BUDGET)


def make_shard_controller(
    load_balancer: Any,
    replica_servers: Sequence[Sequence[Any]],
    sync: SyncFn,
    version: Callable[[], int | None],
    preemption: PreemptionConfig | None = None,
    observer: ObservationWriter | None = None,
    settings: Settings | None = None,
) -> VerlShardController:
    """Controller for replicas ``replica_servers[d]`` (server handles of dp rank ``d``);
    ``observer`` gets the version records (default: ``RLIX_OBSERVE_DIR`` / ``PIPELINE_ID``).

    Preempted replicas sleep at ``settings.vllm_sleep_level`` (``RLIX_VLLM_SLEEP_LEVEL``, as on
    the generation path; ``preemption.sleep_level`` overrides it). A shrink's waits for an
    in-place refresh share ``settings.resize_timeout_s`` (``RLIX_RESIZE_TIMEOUT_S``) with the
    drain (:class:`~.verl_shards.ShrinkBudget`), so a shrink gives up before the coordinator
    times it out. ``settings`` default: this process's environment, read here (the trainer's,
    which holds the job's variables).

    Raises:
        SettingsError: an invalid ``RLIX_VLLM_SLEEP_LEVEL`` (or other setting), naming it
            and its valid values, a resize timeout no longer than the drain bound, or a
            ``preemption.sleep_timeout_s`` no longer than the sleep's wait for an in-place
            refresh; nothing is built. (Without ``preemption`` the sleep's bound is the
            default one plus that wait.)
    """
    settings = settings if settings is not None else load_settings()
    config = preemption or PreemptionConfig()
    budget = ShrinkBudget.within(settings.resize_timeout_s, config.drain_timeout_s)
    # A replica's sleep first waits up to refresh_wait_s for an in-place refresh holding it:
    # the lifecycle's bound on that call must leave the sleep its own time after that wait.
    if preemption is None:
        config = dataclasses.replace(
            config, sleep_timeout_s=config.sleep_timeout_s + budget.refresh_wait_s)
    elif config.sleep_timeout_s <= budget.refresh_wait_s:
        raise SettingsError(
            f"PreemptionConfig.sleep_timeout_s={config.sleep_timeout_s:g}s does not exceed a "
            f"veRL replica's wait for an in-place refresh before it sleeps "
            f"({budget.refresh_wait_s:g}s under RLIX_RESIZE_TIMEOUT_S="
            f"{settings.resize_timeout_s:g}s): every sleep delayed by a refresh would time out; "
            f"valid: sleep_timeout_s > {budget.refresh_wait_s:g}"
        )
    engines = [
        VerlReplicaEngine(servers, sleep_level=settings.vllm_sleep_level,
                          refresh_wait_s=budget.refresh_wait_s)
        for servers in replica_servers
    ]
    state = LoadBalancerShardState(load_balancer, hold_wait_s=budget.hold_wait_s)
    lifecycle = ShardLifecycle(state, engines, config)
    return VerlShardController(lifecycle, state, sync, version, observer, budget)


class VerlPipelineAdapter:
    """Coordinator-side life of one veRL pipeline (see module docstring)."""

    def __init__(
        self,
        *,
        settings: Settings,
        pipeline_id: str,
        layout: VerlLayout,
        controller: VerlShardController | None = None,
        hooks_factory: Callable[[], RLixHooks],
        step_target: int,
    ) -> None:
        self.settings = settings
        self.pipeline_id = pipeline_id
        self.layout = layout
        #: None until :meth:`attach` (the replicas do not exist when the pipeline claims)
        self.controller = controller
        self._hooks_factory = hooks_factory
        self._hooks: RLixHooks | None = None
        self.step_target = step_target
        self._coordinator: Any = None
        self._generation_thread: threading.Thread | None = None
        #: our own register_pipeline succeeded (close unregisters only then: the id of a
        #: failed registration may be another job's)
        self._registered = False
        self._closed = False
        #: trajectories the running validation generates (None: no validation running)
        self._validation_target: int | None = None
        #: the last training step is done: no further rollout demand is reported
        self._steps_over = False
        #: :meth:`end_setup` ran (every replica asleep, the setup hold given back)
        self._setup_done = False

    @property
    def hooks(self) -> RLixHooks:
        """The pipeline's hooks (built by :meth:`register`)."""
        if self._hooks is None:
            raise AdapterNotRegisteredError(
                f"veRL pipeline {self.pipeline_id}: hooks are used before register(); "
                "call register() first (it builds them once the pipeline is admitted)"
            )
        return self._hooks

    # ---------------------------------------------------------------- registration
    def claim(self, *, loaded: bool = False) -> None:
        """Register and admit the pipeline, serve ``resize_infer`` for it, build the hooks
        (their heartbeat starts only now, for a pipeline the coordinator knows), then hold
        every GPU of the layout at INITIALIZATION, blocking, as ROLL's init and NeMo RL's
        setup do: other pipelines' generation ranks there are shrunk and training there
        finishes first, so veRL loads its models onto GPUs nobody else uses. The hold lasts
        until :meth:`end_setup`. Hooks that cannot hold (not a ``SetupHold``) skip it.

        Until :meth:`attach` the coordinator actor serves a ``PendingController`` (the
        scheduler resizes nothing of a pipeline that holds its GPUs for setup).

        On any failure the pipeline leaves the coordinator (:meth:`close`) before the error
        propagates: a half-registered pipeline would hold its GPUs for nobody.

        ``loaded``: veRL has loaded its models already (:meth:`register`, replicas built
        before the pipeline could claim): the hold then only keeps others off while
        :meth:`end_setup` puts the replicas to sleep, so it takes the inference cluster and a
        layout :meth:`VerlLayout.setup_clusters` refuses is accepted.
        """
        import ray

        from rlix_plugins.adapters.pipeline_coordinator import (
            PendingController,
            start_pipeline_coordinator,
        )

        if self._registered:
            return
        # refused before anything is sent
        setup_clusters = (ACTOR_INFER,) if loaded else self.layout.setup_clusters()
        orch = ray.get_actor(ORCHESTRATOR_ACTOR, namespace=self.settings.namespace)
        ray.get(
            orch.register_pipeline.remote(
                pipeline_id=self.pipeline_id,
                ray_namespace=pipeline_namespace(self.pipeline_id),
                cluster_tp_configs=self.layout.tp_configs(),
                cluster_device_mappings=self.layout.device_mappings(),
            )
        )
        self._registered = True
        try:
            self._coordinator = start_pipeline_coordinator(
                self.pipeline_id,
                self.controller if self.controller is not None else PendingController(),
                control_namespace=self.settings.namespace or CONTROL_PLANE_NAMESPACE,
            )
            ray.get(orch.admit_pipeline.remote(pipeline_id=self.pipeline_id))
            if self._hooks is None:
                self._hooks = self._hooks_factory()
            hold = self._setup_hold()
            if hold is not None:
                hold.hold_for_setup(*setup_clusters)
        except BaseException:
            self.close(raise_errors=False)
            raise
        logger.info("veRL pipeline %s registered: %s", self.pipeline_id, self.layout)

    def attach(self, layout: VerlLayout, controller: VerlShardController) -> None:
        """The replicas exist (after veRL's init): serve ``resize_infer`` with ``controller``.
        ``layout`` is the one the replicas have; it must be the one claimed.

        Raises:
            RegistrationError: not claimed yet (nothing is changed), or ``layout`` differs
                from the claimed one (the coordinator would move replicas on GPUs they are
                not on: the pipeline leaves the coordinator and ``controller`` is closed).
        """
        from rlix_plugins.adapters.pipeline_coordinator import set_shard_controller

        if not self._registered or self._closed:
            raise RegistrationError(
                f"veRL pipeline {self.pipeline_id}: attach before claim (or after close); "
                "valid: claim() first"
            )
        try:
            if layout != self.layout:
                raise RegistrationError(
                    f"veRL pipeline {self.pipeline_id}: veRL built {layout}, but the pipeline "
                    f"claimed {self.layout} from the job's config; valid: the same replica "
                    "counts and GPUs per replica"
                )
            if controller is not self.controller:
                set_shard_controller(self._coordinator, controller)
                self.controller = controller
        except BaseException:
            if controller is not self.controller:
                controller.close()
            self.close(raise_errors=False)
            raise

    def register(self) -> None:
        """:meth:`claim` then :meth:`attach` the controller given at construction (a pipeline
        whose replicas were built before it could claim). :meth:`end_setup` ends the hold."""
        controller = self.controller
        if controller is None:
            raise RegistrationError(
                f"veRL pipeline {self.pipeline_id}: register() needs the shard controller "
                "given at construction; valid: claim() now, attach(layout, controller) later"
            )
        self.claim(loaded=True)
        self.attach(self.layout, controller)

    def end_setup(self) -> None:
        """veRL's init is done (models loaded, the first weights synced, the training workers'
        groups released by the trainer): put every replica to sleep, then give back the setup
        hold. From here the coordinator decides which replicas run: the first step's
        generation request wakes them (each syncs the newest cached version). Idempotent.

        Raises:
            RegistrationError: called before :meth:`attach`.
        """
        if self.controller is None:
            raise RegistrationError(
                f"veRL pipeline {self.pipeline_id}: end_setup before attach; valid: "
                "attach(layout, controller) first"
            )
        if self._setup_done or self._closed:
            return
        hold = self._setup_hold()
        # Every replica, not only those on held GPUs: the coordinator counts none of them
        # awake once the hold ends (veRL's init left all of them loaded and serving).
        self.controller.shrink(list(range(self.layout.num_replicas)))
        if hold is not None:
            hold.release_setup_hold()
        self._setup_done = True
        logger.info("veRL pipeline %s: setup done, every replica asleep", self.pipeline_id)

    def _setup_hold(self) -> SetupHold | None:
        return self._hooks if isinstance(self._hooks, SetupHold) else None

    # ---------------------------------------------------------------- per step
    def request_generation(self, step: int) -> None:
        """Ask for generation GPUs for ``step`` (returns at once; the grant arrives as
        ``resize_infer(add)``); progress starts from zero for the new batch."""
        self.hooks.report_progress(
            step_target_trajectories=self.step_target, collected=0,
            current_train_step=step, new_batch=True,
        )
        if self._generation_thread is not None and self._generation_thread.is_alive():
            return  # an earlier request is still pending; the scheduler keeps it
        self._generation_thread = threading.Thread(
            target=self._request_generation, args=(step,), daemon=True,
            name=f"rlix-verl-gen-{step}",
        )
        self._generation_thread.start()

    def _request_generation(self, step: int) -> None:
        import ray

        try:
            sched = ray.get_actor("rlix:scheduler", namespace=self.settings.namespace)
            ray.get(sched.request_gpus.remote(
                cluster_id=cluster_id(self.pipeline_id, ACTOR_INFER),
                priority=Priority.GENERATION,
                global_step=step,
                step_target_estimate=self.step_target,
            ))
        except Exception:
            logger.exception("generation request for step %d failed", step)

    def report_collected(self, collected: int, step: int,
                         outstanding: int | None = None) -> None:
        """Demand for the current step: ``collected`` of ``step_target`` trajectories, and
        (optional) the requests in flight over every step (``outstanding`` metric). Nothing
        is reported after :meth:`end_steps`."""
        if self._steps_over:
            return
        if outstanding is None:
            self.hooks.report_progress(
                step_target_trajectories=self.step_target, collected=collected,
                current_train_step=step,
            )
            return
        self.hooks.report_progress(
            step_target_trajectories=self.step_target, collected=collected,
            current_train_step=step, outstanding=outstanding,
        )

    # ---------------------------------------------------------------- validation
    def begin_validation(self, step: object, target: object) -> None:
        """veRL's ``_validate`` starts: report its ``target`` trajectories (validation prompts x
        ``val_kwargs.n``) as demand of a stream of their own (mode :data:`VALIDATION_MODE`),
        so the coordinator keeps ranks for them, or wakes some, as for a rollout. Before,
        nothing was reported for a validation: its replicas could be lent away mid-validation,
        and after the last step only the rollouts' leftover demand kept one awake.

        A failed report is logged (progress is advisory: the validation must not fail for it).

        Raises:
            ProtocolError: ``step`` or ``target`` is not an int >= 0; nothing is sent.
        """
        step_i = validation_count("step", step)
        target_i = validation_count("target", target)
        if self._closed:
            return
        self._validation_target = target_i
        report_validation(self.hooks, self.pipeline_id, step=step_i, done=0, target=target_i,
                          new_batch=True)

    def end_validation(self, step: object) -> None:
        """The validation ended: its stream reports nothing remaining (only that stream: the
        rollouts' demand is the progress thread's). No-op when none runs.

        Raises:
            ProtocolError: ``step`` is not an int >= 0; nothing is sent, the demand stays.
        """
        step_i = validation_count("step", step)
        target, self._validation_target = self._validation_target, None
        if target is None or self._closed:
            return
        report_validation(self.hooks, self.pipeline_id, step=step_i, done=target,
                          target=target, new_batch=False)

    def end_steps(self, step: object) -> None:
        """The last training step (``step``) is done, before its release: the rollouts' stream
        reports nothing remaining, and the progress thread's later reports are dropped. veRL's
        rollouts keep generating for the step after the last until ``fit`` returns; that
        demand used to outlive the release, and the coordinator's next cycle could wake a
        replica for work nobody trains on (a hybrid replica: a model load and a sync).

        Reported as a finished stream, not cleared: without a stream the scheduler falls back
        to the step estimate of the generation requests. A validation that follows reports its
        own stream. Idempotent; a failed report is logged (``close`` clears the demand).

        Raises:
            ProtocolError: ``step`` is not an int >= 0; nothing is sent.
        """
        step_i = count(step, ProtocolError, "last step")
        if self._steps_over or self._closed:
            return
        self._steps_over = True
        try:
            self.hooks.report_progress(
                step_target_trajectories=self.step_target, collected=self.step_target,
                current_train_step=step_i, outstanding=0,
            )
        except Exception:
            logger.warning("veRL pipeline %s: the rollouts' demand after the last step not "
                           "reported done", self.pipeline_id, exc_info=True)

    def before_training(self, step: int) -> None:
        """Block until the trainer GPUs are granted (overlapping shards shrunk)."""
        self.hooks.before_training(step)

    def after_training(self, step: int) -> None:
        """Weights are cached and training state offloaded: release the trainer GPUs."""
        self.hooks.after_training(step)

    def close(self, *, raise_errors: bool = True) -> None:
        """Leave the coordinator: clear progress, stop the heartbeat, unregister (every GPU the
        pipeline held is freed and a pending generation request fails; only a registration
        of our own), stop the coordinator actor and the controller's event-loop thread.

        Idempotent. Each part is attempted even if an earlier one failed (a heartbeat left
        running would keep the lease of a job that has ended alive); the first failure is
        raised at the end unless ``raise_errors`` is False (it is logged either way).
        """
        if self._closed:
            return
        self._closed = True
        import ray

        errors: list[Exception] = []

        def attempt(what: str, fn: Callable[[], object]) -> None:
            try:
                fn()
            except Exception as exc:
                logger.warning("veRL pipeline %s close: %s failed", self.pipeline_id, what,
                               exc_info=True)
                errors.append(exc)

        def unregister() -> None:
            orch = ray.get_actor(ORCHESTRATOR_ACTOR, namespace=self.settings.namespace)
            ray.get(orch.unregister_pipeline.remote(self.pipeline_id))

        hooks = self._hooks
        if hooks is not None:
            attempt("clear progress", hooks.clear_progress)
            close = getattr(hooks, "close", None)
            if callable(close):
                attempt("heartbeat stop", close)
        if self._registered:
            attempt("unregister", unregister)
        if self._generation_thread is not None:
            # Unregistering failed its pending generation request; the thread ends with it.
            self._generation_thread.join(timeout=10)
        coordinator = self._coordinator
        if coordinator is not None:
            attempt("coordinator actor", lambda: ray.kill(coordinator, no_restart=True))
        if self.controller is not None:
            attempt("shard controller", self.controller.close)
        logger.info("veRL pipeline %s left the coordinator", self.pipeline_id)
        if errors and raise_errors:
            raise errors[0]
