"""Simulator: PlexRL setups with a swept training:rollout pool ratio and the PlexRL-style
deployment (one time-sliced training pool, dedicated rollout pools)."""

from __future__ import annotations

import itertools

import pytest

from rlix_plugins.sim.engine import EngineConfig
from rlix_plugins.sim.metrics import first_crossing, implied_pool_ratio
from rlix_plugins.sim.report import compare
from rlix_plugins.sim.runner import run_policy
from rlix_plugins.sim.workloads import PLEXRL_TABLE2, long_tail_agentic, plexrl_two_jobs

ROW_7B = PLEXRL_TABLE2[0]
CFG = EngineConfig(record_tenures=True)


@pytest.mark.parametrize("train_gpus", [4, 8, 24])
def test_pool_sizes_and_placements_follow_train_gpus(train_gpus: int) -> None:
    wl = plexrl_two_jobs(ROW_7B, steps=2, train_gpus=train_gpus)
    r = ROW_7B.infer_gpus
    assert wl.exclusive_nodes * wl.gpus_per_node == 2 * (train_gpus + r)
    assert wl.shared_nodes * wl.gpus_per_node == train_gpus + 2 * r
    assert wl.pool_placements is not None and wl.shared_placements is not None
    pool = tuple(range(train_gpus))
    a, b = wl.pool_placements
    assert a.train == b.train == pool
    # PlexRL-style: each job's rollout pool is its own, disjoint from the pool and the other's
    assert not set(a.infer) & set(b.infer) and not set(a.infer + b.infer) & set(pool)
    assert len(a.infer) == len(b.infer) == r
    # ours / RLix: one training pool, inference over the whole shared cluster
    assert all(p.infer == tuple(range(train_gpus + 2 * r)) for p in wl.shared_placements)


def test_bad_pool_sizes_are_typed_errors() -> None:
    with pytest.raises(ValueError, match="multiple of tp"):
        plexrl_two_jobs(PLEXRL_TABLE2[1], steps=2, train_gpus=5)
    with pytest.raises(ValueError, match="whole nodes"):
        plexrl_two_jobs(ROW_7B, steps=2, train_gpus=6)


def test_plexrl_deployment_time_slices_the_pool_and_never_moves_shards() -> None:
    wl = plexrl_two_jobs(ROW_7B, steps=3, train_gpus=8, length_scale=0.5)
    res = run_policy(wl, "plexrl", seed=3, config=CFG)
    assert res.cycles.preempt_shrinks == res.cycles.rebalance_shrinks == 0
    assert res.aborted == 0
    assert res.trajectories == sum(j.steps * j.batch for j in wl.jobs)
    pool = set(range(8))
    train = [t for t in res.tenures if t.kind == "train"]
    # both jobs trained on the one pool, never at the same time (one tenant per GPU)
    assert {t.job for t in train} == {j.name for j in wl.jobs}
    assert {t.gpu for t in train} == pool
    per_gpu = sorted((t.start, t.end) for t in train if t.gpu == 0)
    assert all(e0 <= s1 + 1e-9 for (_, e0), (s1, _) in itertools.pairwise(per_gpu))
    # generation stays on each job's own rollout pool
    assert all(t.gpu not in pool for t in res.tenures if t.kind == "gen")


def test_plexrl_saving_stays_below_the_no_slowdown_bound() -> None:
    """Its rollout pools equal exclusive's and the pool is shared, so it cannot beat
    T / (2 (T + R)) (only slowdown can eat into it)."""
    for t_gpus in (8, 24):
        wl = plexrl_two_jobs(ROW_7B, steps=3, train_gpus=t_gpus, length_scale=0.5)
        comp = compare(wl, seed=5, out_dir=None, policies=("exclusive", "plexrl"), config=CFG)
        saving = comp.ratios()["plexrl_gpu_hours_saving_vs_exclusive"]
        bound = t_gpus / (2 * (t_gpus + ROW_7B.infer_gpus))
        assert 0.0 < saving <= bound + 1e-9


def test_plexrl_deployment_needs_pool_placements() -> None:
    wl = long_tail_agentic(num_jobs=2, nodes=2, steps=1)
    with pytest.raises(ValueError, match="pool_placements"):
        run_policy(wl, "plexrl", seed=1)


def test_implied_ratio_and_interpolation() -> None:
    # saving = T / (2 (T + R)): T = R gives 25%, T = 3R gives 37.5%
    assert implied_pool_ratio(0.25) == pytest.approx(1.0)
    assert implied_pool_ratio(0.375) == pytest.approx(3.0)
    with pytest.raises(ValueError, match=r"\[0, 0.5\)"):
        implied_pool_ratio(0.5)
    pts = [(1.0, 0.1), (2.0, 0.3), (4.0, 0.35)]
    assert first_crossing(pts, 0.2) == pytest.approx(1.5)
    assert first_crossing(pts, 0.05) == 1.0
    assert first_crossing(pts, 0.4) is None


def test_right_sized_shared_cluster_has_no_pool_deployment() -> None:
    """``shared_gpus`` sizes the time-shared cluster (ours / RLix) below PlexRL's T + 2R; the
    exclusive deployment is unchanged and PlexRL-style (a rollout pool per job) is refused."""
    r, t = ROW_7B.infer_gpus, ROW_7B.train_gpus
    wl = plexrl_two_jobs(ROW_7B, steps=2, shared_gpus=t + r)
    assert wl.name.endswith(f"_S{t + r}")
    assert wl.exclusive_nodes * wl.gpus_per_node == 2 * (t + r)
    assert wl.shared_nodes * wl.gpus_per_node == t + r
    assert wl.pool_placements is None and wl.shared_placements is not None
    assert all(
        p.train == tuple(range(t)) and p.infer == tuple(range(t + r)) for p in wl.shared_placements
    )
    with pytest.raises(ValueError, match="pool_placements"):
        run_policy(wl, "plexrl", seed=1)
    # T + 2R is PlexRL's own count: same workload as leaving shared_gpus out
    assert plexrl_two_jobs(ROW_7B, steps=2, shared_gpus=t + 2 * r) == plexrl_two_jobs(
        ROW_7B, steps=2
    )


@pytest.mark.parametrize("shared_gpus", [4, 12, 0])
def test_bad_shared_cluster_sizes_are_typed_errors(shared_gpus: int) -> None:
    # below the training pool (8) or not whole 8-GPU nodes
    with pytest.raises(ValueError, match="shared_gpus must be >= the training pool"):
        plexrl_two_jobs(ROW_7B, steps=2, shared_gpus=shared_gpus)


def test_right_sized_cluster_runs_every_trajectory_once_on_its_gpus() -> None:
    """Both jobs on one job's GPUs: every trajectory done, no GPU outside the cluster used,
    training only on the pool, and fewer GPU-hours per step than exclusive."""
    t, r = ROW_7B.train_gpus, ROW_7B.infer_gpus
    wl = plexrl_two_jobs(ROW_7B, steps=3, length_scale=0.5, shared_gpus=t + r)
    comp = compare(wl, seed=5, out_dir=None, policies=("exclusive", "ours"), config=CFG)
    res = comp.get("ours")
    assert res.num_gpus == t + r
    assert comp.ratios()["ours_gpu_hours_saving_vs_exclusive"] > 0.0
    ours = run_policy(wl, "ours", seed=5, config=CFG)
    assert ours.trajectories == sum(j.steps * j.batch for j in wl.jobs)
    assert {x.gpu for x in ours.tenures} <= set(range(t + r))
    assert {x.gpu for x in ours.tenures if x.kind == "train"} <= set(range(t))
