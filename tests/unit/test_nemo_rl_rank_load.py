"""``rank_load`` hints: the NeMo RL collector's router in-flight counts ride on its progress
reports, and the scheduling core takes the lightest donor rank from them.

The router, tracker, sink and planner are the real ones; the shard engines are fakes that hold
each request until released (only their in-flight count matters here), and the scheduler actor
handle is a fake that records what the sink sends (no Ray in unit tests).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from rlix_plugins.adapters import nemo_rl as adapter
from rlix_plugins.generation.engine import EngineOutput, GenerationRequest
from rlix_plugins.generation.router import RouterConfig, RoutingPolicy, ShardRouter
from rlix_plugins.generation.shard_state import ShardEvent
from rlix_plugins.generation.state_store import LocalShardState, ShardStateStore
from rlix_plugins.protocol import Priority, ProgressReport
from tests.core_builders import cycle, new_state, progress, register
from tests.support.fake_scheduler_handle import FakeSchedulerHandle


class FakeHeldEngine:
    """Fake shard engine: each request waits until :meth:`release` (in-flight counting only)."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()

    async def generate(self, request: GenerationRequest) -> EngineOutput:
        await self.gate.wait()
        return EngineOutput((1,) * request.max_tokens, "length")

    def release(self) -> None:
        """Finish what is running; later requests wait again."""
        self.gate.set()
        self.gate = asyncio.Event()


class Generation:
    """What the collector holds: its copy of the generation, with ``rlix_router``."""

    def __init__(self, router: ShardRouter) -> None:
        self.rlix_router = router


def test_router_rank_load_counts_in_flight_on_active_ranks_only() -> None:
    async def run() -> None:
        store = ShardStateStore(3)
        engines = [FakeHeldEngine() for _ in range(3)]
        router = ShardRouter(LocalShardState(store), engines,
                             RouterConfig(policy=RoutingPolicy.ROUND_ROBIN))
        gen = Generation(router)
        assert adapter.router_rank_load(gen) == {0: 0, 1: 0, 2: 0}
        tasks = [asyncio.create_task(router.generate(GenerationRequest(f"r{i}", (5,), 2, {})))
                 for i in range(5)]
        await asyncio.sleep(0.01)
        assert adapter.router_rank_load(gen) == {0: 2, 1: 2, 2: 1}
        store.apply([1], ShardEvent.PREEMPT)  # a preempted rank is never a donor
        assert adapter.router_rank_load(gen) == {0: 2, 2: 1}
        for e in engines:
            e.release()
        await asyncio.gather(*tasks)
        assert adapter.router_rank_load(gen) == {0: 0, 2: 0}

    asyncio.run(run())
    assert adapter.router_rank_load(object()) is None  # NeMo RL's own selection: no hint


def test_with_rank_load_keeps_the_report_and_adds_the_hint() -> None:
    rep = ProgressReport("ft_a", 8, 1.0, {"completed": 3, "mode": "train"})
    out = adapter.with_rank_load(rep, {1: 4, 0: 0})
    assert out.metrics == {"completed": 3, "mode": "train", "rank_load": {1: 4, 0: 0}}
    assert (out.pipeline_id, out.step_target_trajectories, out.fifo_timestamp) == ("ft_a", 8, 1.0)
    assert rep.metrics == {"completed": 3, "mode": "train"}  # the original is not mutated
    assert adapter.with_rank_load(rep, None) is rep


def _collector_tracker(
    monkeypatch: pytest.MonkeyPatch, gen: Any
) -> tuple[Any, FakeSchedulerHandle]:
    import ray

    sched = FakeSchedulerHandle()
    monkeypatch.setenv("RLIX_CONTROL_PLANE", "rlix")
    monkeypatch.setenv("PIPELINE_ID", "ft_a")
    monkeypatch.setattr(ray, "get_actor", lambda name, namespace=None: sched)
    tracker = adapter.progress_tracker_for_collector(
        {"grpo": {"num_prompts_per_step": 10}}, gen)
    assert tracker is not None
    return tracker, sched


def test_collector_reports_carry_rank_load_and_the_planner_uses_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def run() -> ProgressReport:
        engines = [FakeHeldEngine() for _ in range(4)]
        router = ShardRouter(LocalShardState(ShardStateStore(4)), engines)
        tracker, sched = _collector_tracker(monkeypatch, Generation(router))
        tracker.begin_version(1)

        def submit(n: int, tag: str) -> list[asyncio.Task[Any]]:
            return [asyncio.create_task(router.generate(
                GenerationRequest(f"{tag}{i}", (5,), 1, {}))) for i in range(n)]

        tasks = submit(40, "a")  # least-loaded: 10 per rank
        await asyncio.sleep(0.01)
        for e in engines[1:]:
            e.release()  # ranks 1-3 finish theirs
        await asyncio.sleep(0.01)
        tasks += submit(6, "b")  # spread over the idle ranks 1-3
        await asyncio.sleep(0.01)
        tracker.set_collected(9)  # a new 2% bucket: one report
        report = sched.reports[-1]
        for e in engines:
            e.release()
        await asyncio.gather(*tasks)
        return report

    report = asyncio.run(run())
    hint = report.metrics["rank_load"]  # type: ignore[index]
    assert hint[0] == 10 and sum(hint.values()) == 16 and set(hint) == {0, 1, 2, 3}
    assert report.metrics["outstanding"] == 16  # type: ignore[index]
    # The scheduling core reads the hint: the lightest ranks are the donors.
    state = new_state(1, 4)
    register(state, "ft_a", infer=[0, 1, 2, 3])
    register(state, "ft_b", infer=[0, 1, 2, 3])
    progress(state, "ft_a", 100, 0)
    state.submit_request("ft_a_actor_infer", Priority.GENERATION, now=0)
    cycle(state, 0)
    state.report_progress(ProgressReport("ft_a", 100, None,
                                         {**(report.metrics or {}), "completed": 90}))
    progress(state, "ft_b", 100, 0)
    plan, _ = cycle(state, 100)
    # ft_a keeps its busiest rank (0, 10 requests in flight); the three light ones go.
    assert sorted(m.dp_rank for m in plan.shrinks) == [1, 2, 3]


def test_a_failing_load_reader_drops_only_the_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    class Broken:
        @property
        def rlix_router(self) -> Any:
            raise RuntimeError("router gone")

    tracker, sched = _collector_tracker(monkeypatch, Broken())
    tracker.begin_version(0)
    assert len(sched.reports) == 1
    assert "rank_load" not in (sched.reports[0].metrics or {})
    assert "outstanding" not in (sched.reports[0].metrics or {})
    assert sched.reports[0].step_target_trajectories == 10


def test_router_outstanding_counts_requests_waiting_for_a_shard() -> None:
    """``outstanding`` is every accepted, unfinished request: those waiting for an active
    shard count too (``rank_load`` only sees requests on a shard)."""

    async def run() -> None:
        store = ShardStateStore(2)
        engines = [FakeHeldEngine() for _ in range(2)]
        router = ShardRouter(LocalShardState(store), engines)
        gen = Generation(router)
        assert adapter.router_outstanding(gen) == 0
        store.apply([0, 1], ShardEvent.PREEMPT)  # nothing routable: requests wait
        tasks = [asyncio.create_task(router.generate(GenerationRequest(f"w{i}", (5,), 1, {})))
                 for i in range(3)]
        await asyncio.sleep(0.01)
        assert adapter.router_outstanding(gen) == 3
        assert sum((adapter.router_rank_load(gen) or {}).values()) == 0
        for event in (ShardEvent.ASLEEP, ShardEvent.WAKE, ShardEvent.ACTIVATE):
            store.apply([0], event)
        await asyncio.sleep(0.05)
        engines[0].release()
        await asyncio.gather(*tasks)
        assert adapter.router_outstanding(gen) == 0

    asyncio.run(run())
    assert adapter.router_outstanding(object()) is None
