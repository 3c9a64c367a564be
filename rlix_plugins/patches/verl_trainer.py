"""RLix subclasses of veRL's v1 trainer modes (installed into veRL's trainer registry).

The job keeps its ``trainer.v1.trainer_mode``; the registry entry of that mode is replaced by
``RLix<Mode>``, which adds to veRL's own hooks:

* ``_init_resource_pool_mgr`` (the first step of veRL's ``init``, before any worker or replica
  exists): claim the pipeline's GPUs (:func:`claim_adapter`: register the layout the job's
  config gives and hold it at INITIALIZATION while veRL loads its models);
* ``on_init_end``: after veRL's initial weight sync, attach the replicas
  (:func:`build_adapter`: bind them as shards in the load balancer, serve ``resize_infer``),
  release the training workers' Megatron groups, put every replica to sleep and end the
  hold; a failed ``init`` leaves the coordinator;
* ``get_llm_client``: the re-dispatching :class:`~.verl_routing.RLixLLMServerClient` on the
  same load balancer (agent loops receive it pickled);
* ``get_llm_client`` / ``get_teacher_client`` / ``get_reward_handles`` (what veRL's driver,
  ``TaskRunnerV1.init_agent_loop_manager``, asks the trainer between ``init`` and ``fit``): a
  failure there leaves the coordinator and unpins the process, as a failed ``init`` does
  (``fit``, which closes, will not run);
* ``on_step_begin``: ask for generation GPUs for the step (non-blocking) and reset progress;
* ``on_init_end`` also replaces the standalone replicas' checkpoint manager (``rlix_cache``)
  by :class:`~.verl_checkpoint.RLixCheckpointEngineManager`: updates cache the version and
  refresh only ACTIVE replicas (claimed on the load balancer against a shrink until their
  aborts landed); the coordinator's expand syncs the ones it wakes;
* ``on_train_begin``: start the progress thread (trajectories counted per trajectory by the
  agent loops, :mod:`.verl_agent_loop`);
* ``on_init_end`` also replaces the hybrid replicas' manager by
  :class:`~.verl_checkpoint.RLixHybridCheckpointManager` (``rlix_cache``): sleep/wake are the
  coordinator's, the coordinator's expand loads them from the CPU cache;
* ``_init_resource_pool_mgr``: the actor role's worker class becomes RLix's subclass
  (:mod:`.verl_workers`: the hybrid replicas' receive method, Megatron group rebinding);
* ``on_sample_end`` (batch collected, training about to start): mark the sampled trajectories
  consumed, block until the trainer GPUs are granted, then re-create Megatron's NCCL groups
  and rebind the groups veRL's engine holds;
* ``on_step_end`` (after veRL's weight update, which with the ``rlix_cache`` backend fills the
  CPU cache): destroy Megatron's NCCL groups, then release the trainer GPUs; after the last
  step, the rollouts' stream is first reported done (nothing will train on it);
* ``on_validate_begin`` / ``on_validate_end``: the validation's trajectories are the
  pipeline's demand while it runs (a stream of their own, like NeMo RL's validation).

separate_async's own hybrid switching (remove/abort/sleep hybrid replicas, add them back) is
disabled: the coordinator decides which replicas run, through ``resize_infer``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from typing import Any

from rlix_plugins.values import as_index, is_int

logger = logging.getLogger(__name__)

#: seconds between progress reports read from the replay buffer
PROGRESS_PERIOD_S = 1.0
#: bound on waiting, at close, for a progress report still in flight
PROGRESS_JOIN_S = 10.0


def _uses_cache_backend(config: Any) -> bool:
    from rlix_plugins.patches.verl_checkpoint import BACKEND

    try:
        return bool(config.actor_rollout_ref.rollout.checkpoint_engine.backend == BACKEND)
    except AttributeError:
        return False


def _uses_megatron(config: Any) -> bool:
    try:
        return bool(config.actor_rollout_ref.actor.strategy == "megatron")
    except AttributeError:
        return False


def routing_load_balancer(trainer: Any) -> Any:
    """The load balancer veRL routes the trainer's generation through (a Ray actor)."""
    mgr = getattr(trainer, "standalone_server_manager", None) or trainer.llm_server_manager
    return mgr.global_load_balancer


def install_cache_manager(trainer: Any) -> bool:
    """Replace the standalone replicas' checkpoint manager by the coordinator-aware one.

    veRL's own manager syncs every replica on every update; with ``rlix_cache`` that would
    make sleeping replicas wait for weights nobody sends. Hybrid replicas: see
    :func:`install_hybrid_manager`.
    """
    from rlix_plugins.patches.verl_checkpoint import RLixCheckpointEngineManager

    stock = getattr(trainer, "standalone_checkpoint_manager", None)
    if stock is None or isinstance(stock, RLixCheckpointEngineManager):
        return False
    if not _uses_cache_backend(trainer.config):
        return False
    trainer.standalone_checkpoint_manager = RLixCheckpointEngineManager(
        config=stock.config, actor_wg=stock.actor_wg, replicas=list(stock.replicas)
    )
    return True


def install_hybrid_manager(trainer: Any) -> bool:
    """Replace veRL's manager of the hybrid replicas (colocated, "naive": veRL sleeps, wakes
    and loads them itself) by :class:`~.verl_checkpoint.RLixHybridCheckpointManager`, which
    leaves sleep/wake to the coordinator and loads them from the CPU cache.

    Only with the ``rlix_cache`` backend, hybrid replicas present and training workers that
    can receive (RLix's worker subclass, :mod:`.verl_workers`)."""
    from dataclasses import replace

    from rlix_plugins.patches.verl_checkpoint import (
        BACKEND,
        RLixHybridCheckpointManager,
        worker_call_name,
    )

    stock = getattr(trainer, "checkpoint_manager", None)
    if stock is None or isinstance(stock, RLixHybridCheckpointManager):
        return False
    if not _uses_cache_backend(trainer.config) or not list(stock.replicas):
        return False
    if worker_call_name(stock.actor_wg, "rlix_receive_weights") is None:
        logger.warning("training workers are not RLix's subclass: hybrid replicas keep "
                       "veRL's own colocated weight update")
        return False
    trainer.checkpoint_manager = RLixHybridCheckpointManager(
        config=replace(stock.config, backend=BACKEND), actor_wg=stock.actor_wg,
        replicas=list(stock.replicas),
    )
    return True


def replica_gpus(rollout: Any) -> int:
    """GPUs of one rollout replica: veRL's rollout world size (tensor x data x pipeline
    parallel sizes; ``LLMServerManager`` divides the GPUs by it into replicas)."""
    return (int(rollout.tensor_model_parallel_size) * int(rollout.data_parallel_size)
            * int(rollout.pipeline_model_parallel_size))


def config_layout(config: Any) -> Any:
    """The :class:`~rlix_plugins.adapters.verl.VerlLayout` veRL will build from ``config``
    (before it builds anything): hybrid replicas over the trainer GPUs unless
    ``actor_rollout_ref.hybrid_engine`` is false, standalone replicas over
    ``actor_rollout_ref.rollout``'s own GPUs in ``separate_async`` mode. None (with the
    reason logged) where it cannot be told ahead: disaggregated prefill/decode replicas, or
    a config without those fields; the pipeline then registers after veRL's init."""
    from rlix_plugins.adapters.verl import VerlLayout
    from rlix_plugins.patches.verl_placement import first_gpu

    try:
        rollout = config.actor_rollout_ref.rollout
        disagg = rollout.get("disaggregation", None)
        if disagg is not None and bool(disagg.get("enabled", False)):
            logger.warning("rlix: disaggregated rollout replicas: no setup hold (their GPUs are "
                           "known only once veRL has built them)")
            return None
        per_replica = replica_gpus(rollout)
        train_gpus = int(config.trainer.n_gpus_per_node) * int(config.trainer.nnodes)
        hybrid = (train_gpus // per_replica
                  if bool(config.actor_rollout_ref.get("hybrid_engine", True)) else 0)
        standalone = 0
        if str(config.trainer.v1.trainer_mode) == "separate_async":
            standalone = int(rollout.n_gpus_per_node) * int(rollout.nnodes) // per_replica
    except (AttributeError, KeyError, TypeError, ValueError, ZeroDivisionError):
        logger.warning("rlix: the job's replica layout is not readable from its config: no "
                       "setup hold", exc_info=True)
        return None
    return VerlLayout(train_gpus=train_gpus, tp=per_replica, hybrid_replicas=hybrid,
                      standalone_replicas=standalone, first_gpu=first_gpu())


def _pipeline_id() -> str:
    from rlix_plugins.protocol.names import new_pipeline_id
    from rlix_plugins.settings import load_settings

    return load_settings().pipeline_id or new_pipeline_id("ft")


def _new_adapter(config: Any, layout: Any, pipeline_id: str, controller: Any = None) -> Any:
    from rlix_plugins.adapters.verl import VerlPipelineAdapter
    from rlix_plugins.hooks import make_hooks
    from rlix_plugins.settings import load_settings

    settings = load_settings()
    return VerlPipelineAdapter(
        settings=settings,
        pipeline_id=pipeline_id,
        layout=layout,
        controller=controller,
        # Built by claim() after the pipeline is admitted: the heartbeat starts then.
        hooks_factory=lambda: make_hooks(settings, pipeline_id=pipeline_id),
        step_target=int(config.data.train_batch_size) * int(config.actor_rollout_ref.rollout.n),
    )


def claim_adapter(trainer: Any) -> Any:
    """Before veRL builds workers and replicas: the pipeline adapter, registered with the
    layout the config gives and holding its GPUs for setup (blocks until they are free);
    None when the layout cannot be told ahead (:func:`config_layout`)."""
    layout = config_layout(trainer.config)
    if layout is None:
        return None
    adapter = _new_adapter(trainer.config, layout, _pipeline_id())
    adapter.claim()
    return adapter


def build_adapter(trainer: Any, claimed: Any = None) -> Any:
    """The pipeline adapter of a veRL trainer whose replicas are up (after init): the
    ``claimed`` one (:func:`claim_adapter`) with the replicas attached, or, without a claim,
    a new one registered now.

    Raises:
        RegistrationError: veRL built another layout than the claimed one (the pipeline
            leaves the coordinator).
    """
    import ray

    from rlix_plugins.adapters.observability import ObservationWriter
    from rlix_plugins.adapters.verl import VerlLayout, make_shard_controller
    from rlix_plugins.patches.verl_checkpoint import RefreshClaim, VerlCacheSync
    from rlix_plugins.patches.verl_placement import first_gpu

    pipeline_id = claimed.pipeline_id if claimed is not None else _pipeline_id()
    hybrid = list(trainer.llm_server_manager.get_replicas())
    standalone_mgr = getattr(trainer, "standalone_server_manager", None)
    standalone = list(standalone_mgr.get_replicas()) if standalone_mgr is not None else []
    replicas = hybrid + standalone
    lb = routing_load_balancer(trainer)
    ray.get(lb.bind_shards.remote([(r.server_address, r.server_handle) for r in replicas]))
    sync = VerlCacheSync.of(trainer.actor_rollout_wg, replicas)
    controller = make_shard_controller(
        lb, [list(r.servers) for r in replicas], sync, sync.latest_version,
        observer=ObservationWriter.from_env(pipeline_id),
    )
    # Hybrid replicas are dp ranks 0..len(hybrid)-1 of the pipeline, standalone ones after;
    # each in-place refresh is recorded like the controller's own (what every active engine
    # holds). A refresh picks its replicas and claims them against a shrink in one balancer
    # call (the shard state's owner), so none is put to sleep before its abort arrives.
    claim_s = controller.shrink_budget.claim_s
    claim = RefreshClaim(
        begin=lambda ranks: ray.get(lb.rlix_refresh_begin.remote(ranks, claim_s)),
        end=lambda ranks: ray.get(lb.rlix_refresh_end.remote(ranks)),
    )
    for attr, ranks in (("checkpoint_manager", range(len(hybrid))),
                        ("standalone_checkpoint_manager",
                         range(len(hybrid), len(hybrid) + len(standalone)))):
        manager: Any = getattr(trainer, attr, None)
        if manager is not None and hasattr(manager, "bind"):
            manager.bind(claim, list(ranks),
                         observe=lambda ranks, v: controller.observe("refresh", ranks, v))
    cfg = trainer.config
    layout = VerlLayout(
        train_gpus=int(cfg.trainer.n_gpus_per_node) * int(cfg.trainer.nnodes),
        tp=replica_gpus(cfg.actor_rollout_ref.rollout),
        hybrid_replicas=len(hybrid),
        standalone_replicas=len(standalone),
        first_gpu=first_gpu(),
    )
    if claimed is None:
        adapter = _new_adapter(cfg, layout, pipeline_id, controller)
        adapter.register()
        return adapter
    claimed.attach(layout, controller)
    return claimed


def validation_size(trainer: Any) -> int | None:
    """Trajectories veRL's ``_validate`` generates: every prompt of ``val_dataloader``'s
    dataset (veRL's validation loader drops no last batch) times
    ``actor_rollout_ref.rollout.val_kwargs.n``; None when either is not readable. (A dataset
    with a per-row ``__rollout_n__`` generates that many for its rows instead.)"""
    try:
        prompts = len(trainer.val_dataloader.dataset)
        n = as_index(trainer.config.actor_rollout_ref.rollout.val_kwargs.n)
    except (AttributeError, KeyError, TypeError):
        return None
    if n is None or n < 1:
        return None
    return prompts * n


class RLixTrainerMixin:
    """The RLix additions; combined with a veRL trainer class by :func:`rlix_trainer_class`."""

    _rlix_wrapped = True
    _rlix_adapter: Any = None
    #: this trainer pinned the process's veRL pools (:mod:`.verl_placement`)
    _rlix_pinned = False
    _rlix_progress: threading.Event | None = None
    _rlix_progress_thread: threading.Thread | None = None

    # veRL attributes this mixin relies on (set by PPOTrainer)
    config: Any
    global_steps: int

    def _init_resource_pool_mgr(self) -> None:
        from rlix_plugins.adapters.verl_support import check_supported_job

        # The first step of veRL's init: refuse an unsupported job before any worker exists
        # (veRL's own driver refused it already; a driver of the job's own may not have).
        check_supported_job(self.config, driver=False)
        # veRL's (and separate_async's) role -> worker mapping, with RLix's training-worker
        # subclass: hybrid replicas receive from the CPU cache, Megatron groups are rebound.
        super()._init_resource_pool_mgr()  # type: ignore[misc]
        from rlix_plugins.patches.verl_workers import install_worker_classes

        changed = install_worker_classes(self.role_worker_mapping)  # type: ignore[attr-defined]
        logger.info("RLix training-worker subclass installed for roles %s", changed)
        # veRL builds its workers and replicas right after this: hold the GPUs first, then
        # put veRL's pools on the coordinator's shared groups (when they exist).
        if self._rlix_adapter is None:
            self._rlix_adapter = claim_adapter(self)
            from rlix_plugins.patches.verl_placement import pin_pipeline, refuse_unclaimed

            if self._rlix_adapter is None:
                refuse_unclaimed()  # veRL's own groups could not be placed beside the shared ones
            else:
                try:
                    self._rlix_pinned = pin_pipeline(
                        self._rlix_adapter.layout, self.config) is not None
                except BaseException:
                    self._rlix_close()
                    raise

    def init(self) -> None:
        # A failed init (on_init_end included: veRL's init calls it) leaves the coordinator;
        # the claim would hold GPUs for nobody otherwise, and fit, which closes, never runs.
        try:
            super().init()  # type: ignore[misc]
        except BaseException:
            self._rlix_close()
            raise

    def on_init_end(self) -> None:
        install_cache_manager(self)
        install_hybrid_manager(self)
        super().on_init_end()  # type: ignore[misc]
        self._rlix_adapter = build_adapter(self, self._rlix_adapter)
        # As after every step (on_sample_end re-makes the groups): the training workers'
        # NCCL communicators leave the GPUs before the hold ends.
        self._worker_call("rlix_release_parallel_state")
        self._rlix_adapter.end_setup()

    def get_llm_client(self) -> Any:
        with self._rlix_close_on_failure():
            from rlix_plugins.patches.verl_routing import RLixLLMServerClient

            stock = super().get_llm_client()  # type: ignore[misc]
            return RLixLLMServerClient(config=self.config,
                                       load_balancer_handle=stock._load_balancer)

    def get_teacher_client(self) -> Any:
        with self._rlix_close_on_failure():
            return super().get_teacher_client()  # type: ignore[misc]

    def get_reward_handles(self) -> Any:
        with self._rlix_close_on_failure():
            return super().get_reward_handles()  # type: ignore[misc]

    @contextlib.contextmanager
    def _rlix_close_on_failure(self) -> Iterator[None]:
        """Close (leave the coordinator, unpin) when the body raises: veRL's driver calls the
        trainer's getters between ``init`` and ``fit``, and a failure there means ``fit``,
        which closes, never runs."""
        try:
            yield
        except BaseException:
            self._rlix_close()
            raise

    def on_train_begin(self) -> None:
        super().on_train_begin()  # type: ignore[misc]
        self._start_progress()

    def on_step_begin(self) -> None:
        super().on_step_begin()  # type: ignore[misc]
        if self._rlix_adapter is not None:
            self._rlix_adapter.request_generation(self.global_steps)

    def on_sample_end(self) -> None:
        super().on_sample_end()  # type: ignore[misc]
        if self._rlix_adapter is not None:
            self._consume_trajectories()
            self._rlix_adapter.before_training(self.global_steps)
        self._worker_call("rlix_restore_parallel_state")

    def on_step_end(self) -> None:
        super().on_step_end()  # type: ignore[misc]
        self._worker_call("rlix_release_parallel_state")
        if self._rlix_adapter is not None:
            if self._rlix_last_step():
                # No step follows: stop reporting the rollouts' demand for one before the
                # release, or the coordinator's next cycle may wake a replica for it.
                self._rlix_stop_progress()
                self._rlix_adapter.end_steps(self.global_steps)
            self._rlix_adapter.after_training(self.global_steps)

    def on_validate_begin(self) -> None:
        super().on_validate_begin()  # type: ignore[misc]
        if self._rlix_adapter is None:
            return
        target = validation_size(self)
        if target is None:
            logger.warning("rlix: the validation at step %s reports no demand (its size is "
                           "not readable from val_dataloader.dataset and "
                           "actor_rollout_ref.rollout.val_kwargs.n)", self.global_steps)
            return
        self._rlix_adapter.begin_validation(self.global_steps, target)

    def on_validate_end(self) -> None:
        try:
            super().on_validate_end()  # type: ignore[misc]
        finally:
            if self._rlix_adapter is not None:
                self._rlix_adapter.end_validation(self.global_steps)

    def fit(self, *args: Any, **kwargs: Any) -> Any:
        # veRL's fit returns from its last step without calling on_train_end: close here too.
        try:
            return super().fit(*args, **kwargs)  # type: ignore[misc]
        finally:
            self._rlix_close()

    def on_train_end(self) -> None:
        super().on_train_end()  # type: ignore[misc]
        self._rlix_close()

    def _rlix_close(self) -> None:
        """Stop progress reports and the heartbeat, unpin the process, leave the coordinator;
        idempotent."""
        self._rlix_stop_progress()
        if self._rlix_pinned:
            from rlix_plugins.patches.verl_placement import set_pins

            set_pins(None)
            self._rlix_pinned = False
        adapter, self._rlix_adapter = self._rlix_adapter, None
        if adapter is not None:
            adapter.close()

    def _rlix_last_step(self) -> bool:
        """This step is the run's last (veRL's own test in ``fit``: ``global_steps >=
        total_training_steps``)."""
        total = getattr(self, "total_training_steps", None)
        return is_int(total) and total > 0 and self.global_steps >= total

    def _rlix_stop_progress(self) -> None:
        """Stop the progress thread; idempotent (it is not restarted)."""
        if self._rlix_progress is not None:
            self._rlix_progress.set()
        thread, self._rlix_progress_thread = self._rlix_progress_thread, None
        if thread is not None and thread is not threading.current_thread():
            # A report in flight must land before the adapter clears the progress, or the
            # coordinator keeps demand from a step nobody trains on.
            thread.join(PROGRESS_JOIN_S)

    # separate_async: the coordinator owns which replicas run
    def switch_to_trainer(self) -> None:
        return None

    def switch_to_rollout(self, *, already_registered: bool = False) -> None:
        del already_registered

    def add_replicas_to_balancer(self) -> None:
        return None

    def remove_replicas_from_balancer(self) -> None:
        return None

    # ---------------------------------------------------------------- helpers
    def _worker_call(self, method: str) -> None:
        """Run an NCCL-lifecycle method of RLix's worker subclass in every training worker
        (Megatron + rlix_cache only: other backends may sync through the training groups)."""
        if not (_uses_megatron(self.config) and _uses_cache_backend(self.config)):
            return
        from rlix_plugins.errors import ParallelStateError
        from rlix_plugins.patches.verl_checkpoint import worker_call_name

        wg = self.actor_rollout_wg  # type: ignore[attr-defined]
        if worker_call_name(wg, method) is None:
            # Destroying without the rebind would leave DDP/optimizer on dead groups.
            raise ParallelStateError(
                f"the training workers ({type(wg).__name__}) have no {method}: Megatron NCCL "
                "teardown needs RLix's worker subclass (rlix_plugins.patches.verl_workers), "
                "which rebinds the groups the engine holds"
            )
        results = getattr(wg, method)()
        logger.info("%s on %d training workers: %s", method, wg.world_size, results[:1])

    def _sample_trajectories(self) -> int:
        """Trajectories one replay-buffer sample takes (veRL samples per parameter sync)."""
        cfg = self.config
        per_sync = int(cfg.data.train_batch_size) // int(getattr(self, "parameter_sync_step", 1))
        return per_sync * int(cfg.actor_rollout_ref.rollout.n)

    def _consume_trajectories(self) -> None:
        import ray

        ray.get(routing_load_balancer(self).rlix_consume.remote(self._sample_trajectories()))

    def _start_progress(self) -> None:
        """Report trajectories stored by the agent loops and not yet trained on as demand,
        with the requests in flight on the shards as the ``outstanding`` metric.

        The agent-loop workers count every stored trajectory on the load balancer
        (:mod:`.verl_agent_loop`); this thread reads that count every ``PROGRESS_PERIOD_S`` and
        the hooks send it when its 2% bucket changes.
        """
        if self._rlix_adapter is None or self._rlix_progress is not None:
            return
        import ray

        stop = threading.Event()
        self._rlix_progress = stop
        lb = routing_load_balancer(self)
        adapter = self._rlix_adapter  # close() clears the attribute; this thread ends first

        def loop() -> None:
            while not stop.wait(PROGRESS_PERIOD_S):
                try:
                    pending, outstanding = ray.get(lb.rlix_progress_counts.remote())
                    if stop.is_set():
                        break  # closed while reading: the progress is being cleared
                    adapter.report_collected(
                        int(pending), self.global_steps, outstanding=int(outstanding)
                    )
                except Exception:
                    logger.exception("progress report failed; retrying")

        thread = threading.Thread(target=loop, daemon=True, name="rlix-verl-progress")
        self._rlix_progress_thread = thread
        thread.start()


def rlix_trainer_class(base: type) -> type:
    """``RLix<base>``: veRL trainer ``base`` with the RLix hooks (see module docstring)."""
    cls = type(f"RLix{base.__name__}", (RLixTrainerMixin, base), {
        "__module__": __name__,
        "__doc__": f"{base.__name__} under the RLix coordinator.",
    })
    return cls
