"""The in-place refresh's pick-to-abort window: ``RLixCheckpointEngineManager._refresh`` picks
its replicas and claims them on the RLix load balancer in one call
(``rlix_refresh_begin``), so the coordinator's shrink cannot put one to sleep between that pick
and the refresh's abort (which then holds the server itself, :mod:`.verl_vllm`).

veRL 0.9.1's real server and load balancer, RLix's real lifecycle, shard-state view and
replica engine; under the server :class:`~tests.support.verl_fake_engine.FakeVllmEngine` (FAKE)
and :class:`~tests.support.verl_fake_engine.FakeActorHandle` (FAKE) for the actor calls, and
:class:`FakeLoopReplica` (FAKE) for veRL's replica object, because each test stops the refresh
between its pick and its abort, which a real Ray actor cannot be made to do. Interleavings are
driven by events and awaits, never by timed sleeps.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Callable
from typing import Any

import pytest

from tests.fixtures.verl_env import VerlEnv
from tests.support.stepping import TEST_BOUND_S
from tests.support.stepping import quiesce as _quiesce
from tests.support.stepping import run_bounded as _run

pytestmark = pytest.mark.verl



def _on_loop(loop: asyncio.AbstractEventLoop, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` called from another thread, run on ``loop`` (as a Ray actor runs its calls on
    its own loop), its result waited for."""
    def call(*args: Any) -> Any:
        async def run() -> Any:
            out = fn(*args)
            return await out if inspect.isawaitable(out) else out

        return asyncio.run_coroutine_threadsafe(run(), loop).result(TEST_BOUND_S)

    return call


class FakeLoopReplica:
    """FAKE veRL ``RolloutReplica`` over one server living on the test's loop; the manager
    runs these coroutines on its own thread's loop (veRL's replica reaches its servers through
    Ray). ``picked`` is set and ``go`` awaited before the abort reaches the server."""

    def __init__(self, server: Any, loop: asyncio.AbstractEventLoop,
                 picked: asyncio.Event | None = None, go: threading.Event | None = None) -> None:
        self.server, self.loop, self.picked, self.go = server, loop, picked, go

    async def _on_server(self, coro: Any) -> Any:
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    async def abort_all_requests(self) -> None:
        if self.picked is not None:
            self.loop.call_soon_threadsafe(self.picked.set)
        if self.go is not None:
            await asyncio.to_thread(self.go.wait, TEST_BOUND_S)
        await self._on_server(self.server.abort_all_requests())

    async def resume_generation(self) -> None:
        await self._on_server(self.server.resume_generation())


class _PreemptSpy:
    """The real balancer; each answer to a ``preempt`` (applied or refused) is also queued."""

    def __init__(self, lb: Any) -> None:
        self.lb = lb
        self.answers: asyncio.Queue[str] = asyncio.Queue()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.lb, name)

    def apply_shard_event(self, dp_ranks: list[int], event: str) -> Any:
        try:
            snap = self.lb.apply_shard_event(dp_ranks, event)
        except Exception as exc:
            if event == "preempt":
                self.answers.put_nowait(type(exc).__name__)
            raise
        if event == "preempt":
            self.answers.put_nowait("applied")
        return snap


def _balancer(handles: list[Any]) -> Any:
    from rlix_plugins.patches.verl_routing import RLixRequestLoadBalancer

    lb = RLixRequestLoadBalancer({})
    lb.bind_shards([(f"s{d}", h) for d, h in enumerate(handles)])
    return lb


class _RecordingReplica:
    """FAKE veRL replica that only records the manager's calls (``fail``: its abort raises)."""

    def __init__(self, calls: list[str], name: str, fail: bool = False) -> None:
        self.calls, self.name, self.fail = calls, name, fail

    async def abort_all_requests(self) -> None:
        self.calls.append(f"abort {self.name}")
        if self.fail:
            raise RuntimeError("server died")

    async def resume_generation(self) -> None:
        self.calls.append(f"resume {self.name}")


def _direct_claim(lb: Any) -> Any:
    from rlix_plugins.patches.verl_checkpoint import RefreshClaim

    return RefreshClaim(begin=lb.rlix_refresh_begin, end=lb.rlix_refresh_end)


# ---------------------------------------------------------------- the window itself
def test_shrink_inside_the_refresh_window_waits_and_never_sleeps_under_the_load(
    verl_env: VerlEnv,
) -> None:
    """Interleaving: the refresh picks replica 0 (ACTIVE) -> the coordinator's shrink
    preempts it -> the refresh's abort arrives -> its weight load -> its resume. The preempt
    must be refused while the refresh has picked but not yet aborted the replica (it stays
    ACTIVE and awake), then go through: the engine sleeps only after the load, and the refresh
    is recorded on replica 0."""
    from rlix_plugins.adapters.verl_shards import LoadBalancerShardState, VerlReplicaEngine
    from rlix_plugins.generation.preemption import ShardLifecycle
    from rlix_plugins.generation.shard_state import ShardStatus
    from tests.support.verl_checkpoint import bare_refresh_manager
    from tests.support.verl_fake_engine import FakeActorHandle, fake_server

    async def run() -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        server, engine = fake_server()
        handle = FakeActorHandle(server)
        lb = _balancer([handle])
        spy = _PreemptSpy(lb)
        lifecycle = ShardLifecycle(LoadBalancerShardState(FakeActorHandle(spy), poll_s=1e-3),
                                   [VerlReplicaEngine([handle], sleep_level=2)])
        picked, go = asyncio.Event(), threading.Event()

        async def load(indices: list[int], version: int) -> dict[str, Any]:
            # veRL's rollout-side update: the load into the engine, then set_global_steps
            engine.events.append(("load", version))
            await server.set_global_steps(version)
            return {"seconds": 0.0}

        from rlix_plugins.patches.verl_checkpoint import RefreshClaim

        mgr = bare_refresh_manager([FakeLoopReplica(server, loop, picked, go)])
        mgr.bind(RefreshClaim(begin=_on_loop(loop, lb.rlix_refresh_begin),
                              end=_on_loop(loop, lb.rlix_refresh_end)), [0])
        mgr.rlix_sync = _on_loop(loop, load)
        refresh = loop.run_in_executor(None, mgr._refresh, 5, {})
        try:
            await picked.wait()  # the refresh picked replica 0; its abort has not arrived
            shrink = asyncio.ensure_future(lifecycle.preempt([0]))
            first_answer = await spy.answers.get()
            await _quiesce()
            seen: dict[str, Any] = {
                "first_answer": first_answer,
                "during": (lb.shard_snapshot().statuses[0], engine.sleeping),
            }
        finally:
            go.set()  # the refresh goes on: abort, load, resume
            await refresh
        await shrink
        seen.update(events=[e[0] for e in engine.events], final=lb.shard_snapshot(),
                    refreshed=mgr.refreshed, held=lb.rlix_refresh_held(),
                    version=await server.rlix_weight_version())
        return seen

    seen = _run(run())
    events = seen["events"]
    assert events.count("sleep") == 1 and events.index("load") < events.index("sleep"), events
    assert seen["during"] == (ShardStatus.ACTIVE, False), "shrunk inside the refresh window"
    assert seen["first_answer"] == "RefreshHoldError"
    assert seen["final"].statuses == (ShardStatus.SLEEPING,)
    assert seen["refreshed"] == [(5, (0,))]
    assert seen["held"] == []
    assert seen["version"] is None  # level 2 discarded the weights the refresh loaded


def test_refresh_skips_a_replica_already_being_shrunk(verl_env: VerlEnv) -> None:
    """A replica the shrink already marked (PREEMPTED, draining) is not claimed: the refresh
    neither aborts, loads nor resumes it; the ACTIVE one is refreshed and released."""
    from rlix_plugins.generation.shard_state import ShardStatus
    from tests.support.verl_checkpoint import bare_refresh_manager

    calls: list[str] = []
    lb = _balancer([object(), object()])
    lb.apply_shard_event([0], "preempt")
    mgr = bare_refresh_manager([_RecordingReplica(calls, "r0"), _RecordingReplica(calls, "r1")])
    mgr.bind(_direct_claim(lb), [0, 1])
    synced: list[list[int]] = []
    mgr.rlix_sync = lambda indices, version: synced.append(list(indices)) or {"seconds": 0.0}
    mgr._refresh(3, {})
    assert calls == ["abort r1", "resume r1"]
    assert synced == [[1]]
    assert mgr.refreshed == [(3, (1,))]
    assert lb.rlix_refresh_held() == []
    lb.apply_shard_event([0], "asleep")  # the shrink goes on undisturbed
    assert lb.shard_snapshot().statuses == (ShardStatus.SLEEPING, ShardStatus.ACTIVE)


def test_claim_released_when_an_abort_fails(verl_env: VerlEnv) -> None:
    """A refresh whose abort fails still releases its claim (a shrink right after is applied
    at once), resumes what it paused and loads nothing."""
    from tests.support.verl_checkpoint import bare_refresh_manager

    calls: list[str] = []
    lb = _balancer([object(), object()])
    mgr = bare_refresh_manager([_RecordingReplica(calls, "r0"),
                                _RecordingReplica(calls, "r1", fail=True)])
    mgr.bind(_direct_claim(lb), [0, 1])
    mgr.rlix_sync = lambda indices, version: pytest.fail("loaded after a failed abort")
    with pytest.raises(RuntimeError, match="server died"):
        mgr._refresh(4, {})
    assert lb.rlix_refresh_held() == []
    assert lb.apply_shard_event([0, 1], "preempt").active == ()
    assert sorted(c for c in calls if c.startswith("resume")) == ["resume r0", "resume r1"]
    assert mgr.refreshed == []


# ---------------------------------------------------------------- the balancer's claims
def test_claimed_preempt_is_refused_all_or_nothing_and_expires(
    verl_env: VerlEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While claimed, a preempt naming the replica (with others or not) is refused and changes
    nothing; a claim nobody ends (its refresh died) expires after ``hold_s``."""
    from rlix_plugins.adapters.verl_shards import RefreshHoldError
    from rlix_plugins.patches import verl_routing

    clock = [100.0]
    monkeypatch.setattr(verl_routing, "_now", lambda: clock[0])
    lb = _balancer([object(), object()])
    assert lb.rlix_refresh_begin([0], hold_s=10.0) == [0]
    before = lb.shard_snapshot()
    with pytest.raises(RefreshHoldError, match=r"\[0\]"):
        lb.apply_shard_event([0, 1], "preempt")
    assert lb.shard_snapshot() == before
    assert lb.apply_shard_event([1], "preempt").active == (0,)  # unclaimed: not held up
    clock[0] += 10.0  # the refresh never ended its claim
    assert lb.rlix_refresh_held() == []
    assert lb.apply_shard_event([0], "preempt").active == ()
    lb.rlix_refresh_end([0])  # a late end of an expired claim is harmless


def test_claim_bad_input_is_typed_and_claims_nothing(verl_env: VerlEnv) -> None:
    from rlix_plugins.adapters.verl_shards import LoadBalancerShardState
    from rlix_plugins.errors import SettingsError, ShardStateError

    lb = _balancer([object(), object()])
    for bad in ([0, 2], [0, "1"], "0", 0):
        with pytest.raises(ShardStateError):
            lb.rlix_refresh_begin(bad)
    for bad_hold in (0, -1.0, "5", float("nan")):
        with pytest.raises(SettingsError, match="hold_s"):
            lb.rlix_refresh_begin([0], hold_s=bad_hold)
    assert lb.rlix_refresh_held() == []
    assert lb.rlix_refresh_begin([]) == []
    lb.rlix_refresh_begin([1])
    with pytest.raises(ShardStateError):
        lb.rlix_refresh_end(1)  # type: ignore[arg-type]
    assert lb.rlix_refresh_held() == [1]
    for kwargs in ({"hold_wait_s": 0}, {"poll_s": -1}, {"hold_wait_s": "1"}):
        with pytest.raises(SettingsError):
            LoadBalancerShardState(lb, **kwargs)


def test_shrink_gives_up_typed_when_the_claim_outlasts_its_wait(verl_env: VerlEnv) -> None:
    """A preempt still refused after ``hold_wait_s`` is a ``PreemptionError``; nothing changed
    (the replica stays ACTIVE and awake; the resize fails)."""
    from rlix_plugins.adapters.verl_shards import LoadBalancerShardState, VerlReplicaEngine
    from rlix_plugins.errors import PreemptionError
    from rlix_plugins.generation.preemption import ShardLifecycle
    from tests.support.verl_fake_engine import FakeActorHandle, fake_server

    async def run() -> tuple[Any, bool]:
        server, engine = fake_server()
        handle = FakeActorHandle(server)
        lb = _balancer([handle])
        lb.rlix_refresh_begin([0])
        state = LoadBalancerShardState(FakeActorHandle(lb), hold_wait_s=0.02, poll_s=1e-3)
        lifecycle = ShardLifecycle(state, [VerlReplicaEngine([handle])])
        with pytest.raises(PreemptionError, match="claimed by an in-place weight refresh"):
            await lifecycle.preempt([0])
        return lb.shard_snapshot(), engine.sleeping

    snap, sleeping = _run(run())
    assert snap.active == (0,) and snap.version == 0
    assert not sleeping


def test_refusal_is_recognised_through_a_ray_task_error(verl_env: VerlEnv) -> None:
    """The balancer is a Ray actor: its refusal reaches the shard-state view as a
    ``RayTaskError``, which must still be retried (and any other error must not be)."""
    from ray.exceptions import RayTaskError

    from rlix_plugins.adapters.verl_shards import RefreshHoldError, _is_refresh_hold
    from rlix_plugins.errors import ShardStateError

    wrapped = RayTaskError("apply_shard_event", "tb", RefreshHoldError("held"))
    assert _is_refresh_hold(wrapped)
    assert _is_refresh_hold(wrapped.as_instanceof_cause())
    other = RayTaskError("apply_shard_event", "tb", ShardStateError("bad rank"))
    assert not _is_refresh_hold(other) and not _is_refresh_hold(other.as_instanceof_cause())
