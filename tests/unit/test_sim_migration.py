"""Simulator: request migration to a newly active shard (async kind, our router's rule; pure)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlix_plugins.generation.migration import MigrationCandidate
from rlix_plugins.generation.migration import plan_migration as router_plan
from rlix_plugins.sim.async_pipeline import MIN_MIGRATION_GAP, plan_migration
from rlix_plugins.sim.engine import EngineConfig
from rlix_plugins.sim.runner import MIGRATING, run_policy
from rlix_plugins.sim.workloads import (
    JobSpec,
    LengthDistribution,
    PhaseTimes,
    Placement,
    SwitchCosts,
    Workload,
)

FAST = SwitchCosts(1.0, 1.0, 2.0, 1.0, 1.0, 2.0)
CFG = EngineConfig(record_tenures=False)


def _job(
    i: int,
    *,
    batch: int,
    steps: int,
    lengths: LengthDistribution,
    n_sat: int = 4,
    max_seqs: int = 8,
    prefill: float = 1.0,
) -> JobSpec:
    return JobSpec(
        name=f"ft_{i:012x}",
        arrival_s=0.0,
        steps=steps,
        batch=batch,
        train_gpus=1,
        infer_gpus=2,
        infer_tp=1,
        n_sat=n_sat,
        max_seqs=max_seqs,
        lengths=lengths,
        turn_s=math.inf,
        phases=PhaseTimes(2.0, 1.0, 5.0, 1.5),
        costs=FAST,
        max_age=1,
        kind="async",
        redispatch_prefill_s=prefill,
    )


def _one_job_two_shards() -> Workload:
    """One job; its two shards wake in the same cycle, the first takes every request."""
    job = _job(
        0,
        batch=16,
        steps=1,
        lengths=LengthDistribution("fixed", 40.0, 0.0, 40.0),
        max_seqs=16,
    )
    return Workload(
        "two_shards",
        "one job, 2 shards",
        (job,),
        gpus_per_node=2,
        exclusive_nodes=2,
        shared_nodes=1,
        shared_placements=(Placement((0,), (0, 1)),),
    )


def _contended(num_jobs: int = 3) -> Workload:
    """Jobs training on GPUs their peers generate on: shards move back and forth."""
    jobs = tuple(
        _job(i, batch=24, steps=3, lengths=LengthDistribution("lognormal", 10.0, 0.8, 60.0))
        for i in range(num_jobs)
    )
    span = tuple(range(2 * num_jobs))
    return Workload(
        "contended",
        "jobs overlapping on every GPU",
        jobs,
        gpus_per_node=2 * num_jobs,
        exclusive_nodes=2,
        shared_nodes=1,
        shared_placements=tuple(Placement((2 * i,), span) for i in range(num_jobs)),
    )


def test_plan_moves_from_the_most_loaded_until_balanced() -> None:
    loads = {0: 9, 1: 5, 2: 0}
    donors = plan_migration(loads, 2, {0: 9, 1: 5}, capacity=32)
    assert donors == [0, 0, 0, 0]  # 9,5,0 -> 5,5,4: then every gap is < 2
    assert plan_migration({0: 3, 1: 2}, 1, {0: 3}, capacity=8) == []  # imbalance 1: nothing
    assert plan_migration({0: 8, 1: 0}, 1, {0: 8}, capacity=2) == [0, 0]  # new shard's room
    assert plan_migration({0: 8, 1: 0}, 1, {0: 1}, capacity=8) == [0]  # moved once already
    with pytest.raises(ValueError, match="not among the active"):
        plan_migration({0: 8}, 1, {0: 8}, capacity=8)
    with pytest.raises(ValueError, match="min_gap"):
        plan_migration({0: 8, 1: 0}, 1, {0: 8}, capacity=8, min_gap=1)


@settings(max_examples=200, deadline=None)
@given(
    loads=st.lists(st.integers(0, 40), min_size=2, max_size=8),
    data=st.data(),
)
def test_plan_conserves_and_never_raises_the_maximum(loads: list[int], data: st.DataObject) -> None:
    new = data.draw(st.integers(0, len(loads) - 1))
    movable = {d: data.draw(st.integers(0, n)) for d, n in enumerate(loads) if d != new}
    capacity = data.draw(st.integers(0, 64))
    donors = plan_migration(dict(enumerate(loads)), new, movable, capacity)
    after = list(loads)
    for d in donors:
        assert d != new
        after[d] -= 1
        after[new] += 1
    assert sum(after) == sum(loads) and min(after) >= 0
    assert max(after) <= max(loads)
    assert len(donors) <= capacity
    assert all(donors.count(d) <= k for d, k in movable.items())
    # Stopped for a reason: full, out of movable requests, or no gap of MIN_MIGRATION_GAP left.
    left = [d for d, k in movable.items() if donors.count(d) < k]
    if len(donors) < capacity and left:
        assert max(after[d] for d in left) - after[new] < MIN_MIGRATION_GAP


def test_migration_shortens_the_tail_when_a_shard_joins_a_loaded_one() -> None:
    """16 requests of 40 solo-s sit on shard 0 (4 at full speed at a time) while shard 1 idles:
    160 s. Migration moves 8 to shard 1: 80 s on shard 0, (40 + 1 s re-prefill) x 8 / 4 = 82 s
    on shard 1, so the step's batch completes 78 s sooner."""
    wl = _one_job_two_shards()
    moved = run_policy(wl, "ours", seed=1, config=CFG)
    stuck = run_policy(wl, "ours_nomigr", seed=1, config=CFG)
    assert moved.migrated == 8 and stuck.migrated == 0
    assert moved.migration_prefill_s == pytest.approx(8.0)
    assert moved.trajectories == stuck.trajectories == 16
    # Training (same costs in both) follows the batch: the whole difference is the tail.
    assert stuck.steps[0].end - moved.steps[0].end == pytest.approx(78.0, abs=1e-6)
    assert stuck.makespan - moved.makespan == pytest.approx(78.0, abs=1e-6)


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_migration_conserves_trajectories_under_preemption(seed: int) -> None:
    """Shards are preempted for training and handed between jobs all the time: every
    trajectory still completes exactly once (the counter raises otherwise), nothing moves
    twice, and the physics checks (one tenant per GPU, utilisation <= 100%) hold."""
    wl = _contended()
    r = run_policy(wl, "ours", seed=seed, config=CFG)
    assert r.trajectories == 3 * 3 * 24
    assert r.migrated > 0
    assert r.migration_prefill_s == pytest.approx(1.0 * r.migrated)
    assert r.useful_gpu_s <= r.num_gpus * r.makespan
    # Migration is not an abort: lost work still counts aborts' re-prefills only.
    assert r.lost_work_s == pytest.approx(1.0 * r.aborted)


def test_only_our_router_migrates() -> None:
    assert "ours" in MIGRATING and not {"rlix", "rlix_async", "exclusive", "plexrl"} & MIGRATING
    wl = _contended()
    assert run_policy(wl, "rlix_async", seed=1, config=CFG).migrated == 0
    assert run_policy(wl, "exclusive", seed=1, config=CFG).migrated == 0


@settings(max_examples=200, deadline=None)
@given(
    loads=st.lists(st.integers(0, 30), min_size=2, max_size=6),
    data=st.data(),
)
def test_plan_matches_the_routers_rule(loads: list[int], data: st.DataObject) -> None:
    """One newly active shard, no capacity limit: the simulator moves as many requests from
    each donor, in the same order, as the router's policy (generation/migration.py)."""
    new = data.draw(st.integers(0, len(loads) - 1))
    movable = {d: data.draw(st.integers(0, n)) for d, n in enumerate(loads) if d != new}
    # The router's candidates: the movable requests; the rest already migrated once.
    candidates = [
        MigrationCandidate(f"{d}-{i}", d, remaining_tokens=100, migrations=0 if i < k else 1)
        for d, n in enumerate(loads)
        if d != new
        for i in range(n)
        for k in (movable[d],)
    ]
    ours = plan_migration(dict(enumerate(loads)), new, movable, capacity=10**6)
    theirs = router_plan(loads, range(len(loads)), [new], candidates, min_gap=MIN_MIGRATION_GAP)
    assert ours == [m.source for m in theirs]
    assert all(m.target == new for m in theirs)


@pytest.mark.parametrize("seed", [1, 2])
def test_nemo_rl_restart_loses_the_partial_work_and_never_migrates(seed: int) -> None:
    """``ours_nemo_rl`` (NeMo RL's adapter with ``RLIX_NEMO_RL_REDISPATCH=restart``): an
    aborted request is generated again from the prompt. Every trajectory still completes
    exactly once, nothing migrates, and the work lost is decode work, not the fixed re-prefill
    of a continuation."""
    wl = _contended()
    restart = run_policy(wl, "ours_nemo_rl", seed=seed, config=CFG)
    cont = run_policy(wl, "ours_nomigr", seed=seed, config=CFG)
    assert restart.trajectories == cont.trajectories == 3 * 3 * 24
    assert restart.migrated == 0 and restart.aborted > 0
    assert restart.useful_gpu_s <= restart.num_gpus * restart.makespan
    # Continuation loses exactly one re-prefill (1 s) per abort; a restart loses what the
    # aborted attempt had generated, which is not that constant.
    assert cont.lost_work_s == pytest.approx(1.0 * cont.aborted)
    assert restart.lost_work_s != pytest.approx(1.0 * restart.aborted)
    assert restart.lost_work_s > 0
