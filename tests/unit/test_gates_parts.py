"""Pieces of the CPU rehearsal that run without Ray or vLLM: the busy-interval wrapper around
a shard engine when its request fails (with a failing stand-in engine, named as such; the
wrapper's intervals are in test_gates_busy_records.py) and the ROLL pipeline's simulated
shards."""

from __future__ import annotations

import asyncio

import pytest

from rlix_plugins.adapters.observability import BusyObserved, BusyRecordingEngine
from rlix_plugins.gates.nemo_rehearsal import PipelineSpec
from rlix_plugins.gates.roll_sequence import SimulatedRollShards
from rlix_plugins.generation.engine import EngineOutput, GenerationRequest


class ScriptedEngineStandIn:
    """Stand-in for VllmAsyncShard: each request takes ``delay`` seconds (also used by
    test_observability.py)."""

    def __init__(self, delay: float) -> None:
        self.delay = delay

    async def generate(self, request: GenerationRequest) -> EngineOutput:
        await asyncio.sleep(self.delay)
        return EngineOutput((1,) * request.max_tokens, "length")


def test_busy_engine_closes_interval_when_the_request_fails() -> None:
    class FailingStandIn:
        async def generate(self, request: GenerationRequest) -> EngineOutput:
            raise RuntimeError("boom")

    log: list[BusyObserved] = []
    eng = BusyRecordingEngine(FailingStandIn(), pipeline_id="ft_x", shard=1, gpus=(2, 3),
                              record=log.append)
    with pytest.raises(RuntimeError, match="boom"):  # the engine's own error, unchanged
        asyncio.run(eng.generate(GenerationRequest("r", (5,), 1)))
    (rec,) = log
    assert (rec.pipeline_id, rec.stage, rec.gpus, rec.shard) == ("ft_x", "generation", (2, 3), 1)
    assert rec.end >= rec.start


def test_simulated_roll_shards_idempotent_and_logged() -> None:
    shards = SimulatedRollShards("ft_0123456789ab", [0, 1])
    shards.expand([0, 1])
    shards.expand([1])  # repeated expand: no second interval start
    shards.shrink([1])
    shards.shrink([1])  # repeated shrink: nothing more
    assert [iv.gpu for iv in shards.busy] == [1]
    assert shards.busy[0].owner == "ft_0123456789ab_actor_infer"
    shards.close_open()
    assert sorted(iv.gpu for iv in shards.busy) == [0, 1] and not shards.active


def test_pipeline_spec_requires_partial_overlap() -> None:
    PipelineSpec("a", (0, 1), (0,), ("0", "1"), "/m")
    with pytest.raises(ValueError, match="subset"):
        PipelineSpec("a", (0, 1), (2,), ("0", "1"), "/m")
    with pytest.raises(ValueError, match="cpu bind"):
        PipelineSpec("a", (0, 1), (0,), ("0",), "/m")
