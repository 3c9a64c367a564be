"""Simulator: physics checks, policies on the same core, scenario loader, CLI (pure, no Ray)."""

from __future__ import annotations

import argparse
import itertools
import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlix_plugins.coordinator.core import DemandSharePlanner, Plan, Topology
from rlix_plugins.sim import simulate_cli as command
from rlix_plugins.sim.bounds import makespan_lower_bound
from rlix_plugins.sim.calibrate import exclusive_cycle
from rlix_plugins.sim.clock_queue import ClockQueue
from rlix_plugins.sim.engine import EngineConfig, SimCluster
from rlix_plugins.sim.metrics import jain, summarize
from rlix_plugins.sim.physics import GpuLedger, PhysicsViolation, TrajectoryCounter
from rlix_plugins.sim.placement import SpanPlacer
from rlix_plugins.sim.rlix_policy import RlixPlanner, round_half_up
from rlix_plugins.sim.runner import isolated_jct, make_planner, run_policy
from rlix_plugins.sim.scenario import ScenarioError, load_scenario
from rlix_plugins.sim.workloads import (
    JobSpec,
    LengthDistribution,
    PhaseTimes,
    SwitchCosts,
    Workload,
    long_tail_agentic,
)
from tests.core_builders import cycle, new_state, progress, register
from tests.support.sim_scenario import one_node_scenario

FAST = SwitchCosts(1.0, 1.0, 2.0, 1.0, 1.0, 2.0)


def _job(
    i: int,
    *,
    steps: int = 2,
    batch: int = 16,
    max_age: int = 1,
    tp: int = 1,
    turn: float = 5.0,
    arrival: float = 0.0,
    kind: str = "roll",
) -> JobSpec:
    return JobSpec(
        name=f"ft_{i:012x}",
        arrival_s=arrival,
        steps=steps,
        batch=batch,
        train_gpus=2,
        infer_gpus=2 * tp,
        infer_tp=tp,
        n_sat=4,
        max_seqs=8,
        lengths=LengthDistribution("lognormal", 10.0, 1.0, 80.0),
        turn_s=turn,
        phases=PhaseTimes(2.0, 1.0, 5.0, 1.0),
        costs=FAST,
        max_age=max_age,
        kind=kind,
    )


def _workload(jobs: tuple[JobSpec, ...], nodes: int = 1) -> Workload:
    return Workload(
        "t",
        "test",
        jobs,
        gpus_per_node=8,
        exclusive_nodes=nodes,
        shared_nodes=nodes,
        span_factor=4.0,
    )


def test_clock_orders_events_and_cancels() -> None:
    clock = ClockQueue()
    seen: list[str] = []
    clock.at(2.0, lambda: seen.append("b"))
    clock.at(1.0, lambda: seen.append("a"))
    t = clock.at(1.5, lambda: seen.append("x"))
    clock.at(2.0, lambda: seen.append("c"))
    t.cancel()
    clock.run()
    assert seen == ["a", "b", "c"] and clock.now == 2.0


def test_ledger_rejects_two_tenants_and_over_100_percent() -> None:
    ledger = GpuLedger(2)
    ledger.begin((0,), "a", 0.0)
    with pytest.raises(PhysicsViolation, match="still occupies"):
        ledger.begin((0,), "b", 1.0)
    ledger.end((0,), "a", 5.0)
    with pytest.raises(PhysicsViolation, match="still occupies"):
        ledger.begin((0,), "b", 4.0)  # the sleep of "a" is not over
    ledger.begin((0,), "b", 5.0)
    with pytest.raises(PhysicsViolation, match="tenant"):
        ledger.add_useful((0,), "a", 1.0, 6.0)
    ledger.add_useful((0,), "b", 10.0, 6.0)
    with pytest.raises(PhysicsViolation, match="100%"):
        ledger.check_bounds(8.0)
    # Credits are intervals: one GPU never computes twice at the same instant, even when its
    # cumulative total stays under 100% (it was idle earlier).
    ledger.begin((1,), "c", 0.0)
    ledger.add_useful((1,), "c", 5.0, 10.0, 15.0)
    with pytest.raises(PhysicsViolation, match="already credited"):
        ledger.add_useful((1,), "c", 5.0, 10.0, 15.0)
    ledger.add_useful((1,), "c", 2.0, 15.0, 17.0)
    ledger.check_bounds(20.0)  # 7 s in 20: the cumulative bound alone would not catch it
    counter = TrajectoryCounter()
    ids = counter.create(2)
    counter.complete(ids[0])
    with pytest.raises(PhysicsViolation, match="twice"):
        counter.complete(ids[0])
    # one trajectory consumed, the other created and never generated: a run that ends with
    # work left in a queue is caught even when the consumed count is right
    counter.consume(1, 1, 1)
    with pytest.raises(PhysicsViolation, match="completed 1 of 2 created"):
        counter.check_final(1)


def test_three_policies_same_workload_complete_and_count_trajectories() -> None:
    wl = _workload(tuple(_job(i) for i in range(3)))
    results = {p: run_policy(wl, p, seed=3) for p in ("exclusive", "rlix", "ours")}
    for r in results.values():
        assert r.trajectories == 3 * 2 * 16
        assert len(r.jobs) == 3 and len(r.steps) == 6
        assert 0 < r.useful_gpu_s <= r.num_gpus * r.makespan
    # Exclusive: 3 jobs x 4 GPUs do not fit 8 GPUs at once: one waits in the queue.
    assert max(j.admitted for j in results["exclusive"].jobs) > 0
    assert results["exclusive"].aborted == 0


def test_rlix_policy_preempts_eagerly_ours_does_not() -> None:
    state = new_state(1, 4)
    register(state, "ft_a", train=[0, 1], infer=[0, 1, 2, 3])
    register(state, "ft_b", train=[1, 2], infer=[2, 3])
    from rlix_plugins.protocol import Priority

    state.submit_request("ft_a_actor_train", Priority.ACTOR_TRAINING, now=0)
    cycle(state, 0)
    state.submit_request("ft_b_actor_infer", Priority.GENERATION, now=0, step_target_estimate=4)
    progress(state, "ft_b", 4, 0)
    cycle(state, 0, RlixPlanner())
    state.submit_request("ft_b_actor_train", Priority.ACTOR_TRAINING, now=1)
    plan: Plan = RlixPlanner().plan(state, 1)
    assert plan.grants == ()  # GPU 1 is held by ft_a's training ...
    assert {m.cluster_id for m in plan.shrinks} == {"ft_b_actor_infer"}  # ... yet it preempts
    # Ours, on the same state: the request is blocked, so nothing is preempted for it.
    ours: Plan = DemandSharePlanner().plan(state, 1)
    assert ours.grants == () and ours.shrinks == ()
    assert round_half_up(2.5) == 3 and round_half_up(1.5) == 2


def test_rlix_policy_skips_pipelines_that_never_reported() -> None:
    from rlix_plugins.protocol import Priority

    state = new_state(1, 4)
    register(state, "ft_silent", infer=[0, 1, 2, 3])
    state.submit_request("ft_silent_actor_infer", Priority.GENERATION, now=0)
    plan = RlixPlanner().plan(state, 0)
    assert plan.expands == ()


class _Recording:
    """Wraps a planner and records each cycle's time and how many resizes it planned."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.cycles: list[tuple[float, int, int]] = []

    def plan(self, state: Any, now: float) -> Plan:
        plan: Plan = self.inner.plan(state, now)
        self.cycles.append((now, len(plan.shrinks), len(plan.expands)))
        return plan


@pytest.mark.parametrize("policy", ["rlix_async", "ours"])
def test_blocking_cycles_wait_for_their_resizes(policy: str) -> None:
    """With ``blocking_cycles`` no cycle plans before the previous cycle's shrinks are asleep
    (``gen_sleep_s``) and its expands serve (wake or first load, plus the weight sync), as
    RLix's scheduler and our service await their resize calls; without it cycles follow
    ``cycle_interval_s`` apart while shards are still waking."""
    wl = _workload(tuple(_job(i, kind="async", arrival=3.0 * i) for i in range(3)))
    sync = wl.jobs[0].phases.sync_weight_s
    gaps: dict[bool, list[float]] = {}
    for blocking in (False, True):
        rec = _Recording(make_planner(policy))
        config = EngineConfig(blocking_cycles=blocking)
        r = run_policy(wl, policy, seed=5, config=config, planner=rec)
        assert r.trajectories == 3 * 2 * 16
        short: list[float] = []
        for (t0, shrinks, expands), (t1, _, _) in itertools.pairwise(rec.cycles):
            least = max(
                FAST.gen_sleep_s if shrinks else 0.0, FAST.gen_wake_s + sync if expands else 0.0
            )
            if t1 - t0 < least - 1e-9:
                short.append(t1 - t0)
        gaps[blocking] = short
    assert gaps[True] == []
    assert gaps[False]  # the check can fail: unblocked cycles do overlap resizes


def test_background_expands_pace_cycles_by_shrinks_only() -> None:
    """``background_expands`` (our service with RLIX_BACKGROUND_EXPANDS=1): the next cycle
    waits for the last cycle's shrinks but not for its expands, and RLix's deployments keep
    waiting for both (``runner.OUR_SERVICE``)."""
    wl = _workload(tuple(_job(i, kind="async", arrival=3.0 * i) for i in range(3)))
    sync = wl.jobs[0].phases.sync_weight_s
    for policy, paced_by_expands in (("ours", False), ("rlix_async", True)):
        rec = _Recording(make_planner(policy))
        config = EngineConfig(background_expands=True)
        r = run_policy(wl, policy, seed=5, config=config, planner=rec)
        assert r.trajectories == 3 * 2 * 16
        short_of_shrinks = short_of_expands = 0
        for (t0, shrinks, expands), (t1, _, _) in itertools.pairwise(rec.cycles):
            gap = t1 - t0 + 1e-9
            short_of_shrinks += bool(shrinks) and gap < FAST.gen_sleep_s
            short_of_expands += bool(expands) and gap < FAST.gen_wake_s + sync
        assert short_of_shrinks == 0
        assert (short_of_expands == 0) == paced_by_expands, (policy, short_of_expands)


@pytest.mark.parametrize("blocking", [True, False])
def test_a_shrink_of_a_waking_rank_frees_its_gpus_after_the_wake(blocking: bool) -> None:
    """Under background expands the service sends a shrink of a still-waking rank only once
    its expand returned, so the GPUs are free after the wake plus the sleep; the overlapping
    engine (no waiting at all) aborts the wake and frees them after the sleep alone."""
    wl = _workload((_job(0, kind="async"),))
    config = EngineConfig(blocking_cycles=blocking, background_expands=True)
    sim = SimCluster(
        Topology(1, 8), DemandSharePlanner(), SpanPlacer(8, 8, wl.span_factor), wl.jobs,
        seed=1, config=config,
    )
    sim._arrive(0)  # registers the job and starts its pipeline at t=0
    pipe = sim.pipelines[wl.jobs[0].name]
    rank = pipe.ranks[-1].dp_rank  # its GPU is not a training GPU: idle at t=0
    serves = pipe.on_expand(rank)
    assert serves > sim.clock.now
    freed = pipe.on_shrink(rank)
    woke = serves if blocking else sim.clock.now
    assert freed == pytest.approx(woke + pipe.costs.gen_sleep_s)


def test_jain_and_summary() -> None:
    assert jain([1.0, 1.0]) == pytest.approx(1.0)
    assert jain([1.0, 0.0]) == pytest.approx(0.5)
    wl = _workload((_job(0), _job(1)))
    r = run_policy(wl, "ours", seed=1)
    s = summarize("ours", r, {j.job: r.makespan for j in r.jobs})
    assert 0 < s.gpu_utilisation <= 1 and 0 < s.jain_fairness <= 1
    assert s.steps == 4 and s.gpu_hours_per_step > 0


@settings(max_examples=16, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n_jobs=st.integers(1, 4),
    steps=st.integers(1, 2),
    batch=st.integers(1, 12),
    max_age=st.integers(0, 2),
    tp=st.sampled_from([1, 2]),
    turn=st.sampled_from([1.0, 5.0, math.inf]),
    gaps=st.lists(st.floats(0, 200), min_size=4, max_size=4),
    policy=st.sampled_from(["exclusive", "rlix", "rlix_async", "ours"]),
    seed=st.integers(0, 1000),
    kind=st.sampled_from(["roll", "async"]),
    blocking=st.booleans(),
    background=st.booleans(),
)
def test_physics_hold_on_random_small_scenarios(
    n_jobs: int,
    steps: int,
    batch: int,
    max_age: int,
    tp: int,
    turn: float,
    gaps: list[float],
    policy: str,
    seed: int,
    kind: str,
    blocking: bool,
    background: bool,
) -> None:
    """Every run ends with every job done, every trajectory generated exactly once, no GPU
    shared, utilisation <= 100%, and the core's invariants checked on every cycle (the
    engine raises on any violation)."""
    jobs = tuple(
        _job(
            i,
            steps=steps,
            batch=batch,
            max_age=max_age,
            tp=tp,
            turn=turn,
            arrival=sum(gaps[:i]),
            kind=kind,
        )
        for i in range(n_jobs)
    )
    wl = _workload(jobs, nodes=2)
    config = EngineConfig(
        util_bin_s=10.0, blocking_cycles=blocking, background_expands=background
    )
    r = run_policy(wl, policy, seed=seed, config=config)
    assert r.trajectories == n_jobs * steps * batch
    assert all(v <= r.num_gpus * r.util_bin_s + 1e-6 for v in r.util_bins)
    # No deployment beats the relaxed lower bound on the same draws.
    assert r.makespan >= makespan_lower_bound(wl, seed).makespan_s - 1e-6


def test_scenario_loader_runs_a_gate2_like_config(tmp_path: Path) -> None:
    phases = {
        "old_log_probs_s": 0.5,
        "ref_log_probs_s": 0.5,
        "update_actor_s": 2.0,
        "sync_weight_s": 0.3,
    }
    data: dict[str, Any] = {
        "name": "gate2",
        "gpus_per_node": 2,
        "nodes": 1,
        "pipelines": [
            {
                "name": f"ft_{i:012x}",
                "train": [0],
                "infer": [0, 1],
                "steps": 2,
                "batch": 4,
                "max_age": 1,
                "lengths": {"kind": "uniform", "a": 1.0, "b": 3.0, "cap_s": 3.0},
                "phases": phases,
                "costs": {"gen_sleep_s": 0.2, "init_load_s": 1.0},
            }
            for i in (1, 2)
        ],
    }
    path = tmp_path / "gate2.json"
    path.write_text(json.dumps(data))
    wl = load_scenario(path)
    assert wl.shared_nodes == 1 and wl.jobs[0].infer_gpus == 1
    assert wl.jobs[0].kind == "roll"  # the default pipeline model
    data["pipelines"][0] |= {"kind": "async", "redispatch_prefill_s": 0.25}
    asynced = load_scenario(data)
    assert (asynced.jobs[0].kind, asynced.jobs[0].redispatch_prefill_s) == ("async", 0.25)
    data["pipelines"][0]["kind"] = "nemo"
    with pytest.raises(ScenarioError, match="kind 'nemo' is not one of"):
        load_scenario(data)
    data["pipelines"][0]["kind"] = "roll"
    r = run_policy(wl, "ours", seed=0)
    assert r.trajectories == 16 and r.num_gpus == 2
    with pytest.raises(ScenarioError, match="unknown fields"):
        load_scenario({**data, "pipelines": [{**data["pipelines"][0], "phases": {"x": 1}}]})
    with pytest.raises(ScenarioError, match="missing field 'batch'"):
        bad = dict(data["pipelines"][0])
        del bad["batch"]
        load_scenario({**data, "pipelines": [bad]})




@pytest.mark.parametrize(
    ("scenario", "message"),
    [
        ({"gpus_per_node": 0}, "gpus_per_node and nodes must be >= 1"),
        ({"nodes": 0}, "gpus_per_node and nodes must be >= 1"),
        (one_node_scenario(infer_tp=0)["pipelines"][0], "infer_tp must be >= 1"),
        (one_node_scenario(infer=[0, 1, 2], infer_tp=2)["pipelines"][0], "divide the 3 infer GPUs"),
        (one_node_scenario(train=[1.7])["pipelines"][0], "integer GPU ids"),
        (one_node_scenario(train=[])["pipelines"][0], "non-empty list"),
        (one_node_scenario(infer=[0, 9])["pipelines"][0], r"distinct GPU ids in 0\.\.3"),
        (one_node_scenario(infer=[1, 1])["pipelines"][0], "distinct GPU ids"),
        (one_node_scenario(turn_s=0)["pipelines"][0], "turn_s must be > 0"),
        (one_node_scenario(turn_s=-30)["pipelines"][0], "turn_s must be > 0"),
        # a misspelled field would silently take its default (max_age 0, default costs)
        (one_node_scenario(max_ages=1)["pipelines"][0], r"unknown fields \['max_ages'\]"),
        (one_node_scenario(cost={})["pipelines"][0], r"unknown fields \['cost'\]"),
        (one_node_scenario(n_sat=0)["pipelines"][0], "n_sat must be >= 1, got 0"),
        (one_node_scenario(max_seqs=0)["pipelines"][0], "max_seqs must be >= 1, got 0"),
        (
            one_node_scenario(lengths={"kind": "lognormal", "a": 2.0, "b": -1.0, "cap_s": 8.0})[
                "pipelines"
            ][0],
            "needs b > 0",
        ),
        (
            one_node_scenario(
                phases={
                    "old_log_probs_s": -1.0,
                    "ref_log_probs_s": 0.5,
                    "update_actor_s": 2.0,
                    "sync_weight_s": 0.3,
                }
            )["pipelines"][0],
            "old_log_probs_s must be a finite number of seconds >= 0",
        ),
    ],
)
def test_scenario_refuses_bad_values_before_any_run(
    scenario: dict[str, Any], message: str
) -> None:
    data = one_node_scenario()
    if "pipelines" in scenario or "train" in scenario:
        data["pipelines"] = [scenario]
    else:
        data |= scenario
    with pytest.raises(ScenarioError, match=message):
        load_scenario(data)


def test_a_tp_group_across_nodes_is_refused_at_load_not_after_other_deployments_ran() -> None:
    data = one_node_scenario(train=[1], infer=[1, 2], infer_tp=2) | {"gpus_per_node": 2,
                                                                     "nodes": 2}
    with pytest.raises(ScenarioError, match=r"pipelines\[0\]: .*crosses a node boundary"):
        load_scenario(data)


def test_scenario_exclusive_cluster_holds_every_job_at_once() -> None:
    # tp 1 with 3 GPUs, then tp 2 with 4: the tp-2 block starts on GPU 4, not 3, so a
    # cluster of 3 + 4 = 7 GPUs made the second job queue behind the first.
    data = one_node_scenario(train=[0], infer=[0, 1, 2])
    data["pipelines"].append(
        one_node_scenario(name="ft_000000000002", train=[0, 1], infer=[0, 1, 2, 3], infer_tp=2)[
            "pipelines"
        ][0]
    )
    wl = load_scenario(data)
    assert wl.exclusive_nodes * wl.gpus_per_node >= 8
    r = run_policy(wl, "exclusive", seed=0, config=EngineConfig(record_tenures=False))
    assert all(j.admitted == j.arrival for j in r.jobs)


def test_simulate_command_prints_and_saves(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    args = parser.parse_args(
        [
            "--workload",
            "long-tail",
            "--jobs",
            "2",
            "--steps",
            "1",
            "--nodes",
            "4",
            "--out",
            str(tmp_path),
            "--no-plots",
        ]
    )
    assert command.run(args) == 0
    out = capsys.readouterr().out
    assert "ours_throughput_x_exclusive" in out and "source:" in out
    saved = json.loads((tmp_path / "long_tail_agentic.json").read_text())
    assert {s["policy"] for s in saved["summaries"]} == {"exclusive", "rlix", "rlix_async", "ours"}


def test_simulate_command_right_sizes_plexrl_and_rejects_bad_sizes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    common = ["--steps", "2", "--out", str(tmp_path), "--no-plots"]
    args = parser.parse_args(
        ["--workload", "plexrl-7B", "--shared-gpus", "16", "--policies", "exclusive,ours", *common]
    )
    assert command.run(args) == 0
    saved = json.loads((tmp_path / "plexrl_7B_S16.json").read_text())
    assert {s["policy"]: s["num_gpus"] for s in saved["summaries"]} == {"exclusive": 32, "ours": 16}
    # PlexRL-style needs its T + 2R GPUs; a size off the node grid, a cluster smaller than a
    # job, or job sizes on a workload without them fail with a message
    for argv in (
        ["--workload", "plexrl-7B", "--shared-gpus", "16", "--policies", "plexrl"],
        ["--workload", "plexrl-7B", "--shared-gpus", "12"],
        ["--workload", "long-tail", "--shared-gpus", "12"],
        ["--workload", "long-tail", "--shared-gpus", "8"],
        ["--workload", "long-tail", "--job-sizes", "S"],
        ["--workload", "rollmux-mixed", "--nodes", "1"],
        ["--workload", "rollmux-mixed", "--job-sizes", "XL"],
        # zero is an error, not "the default" (it used to be replaced silently)
        ["--workload", "long-tail", "--jobs", "0"],
        ["--workload", "long-tail", "--nodes", "0"],
        ["--workload", "rollmux-mixed", "--jobs", "0"],
        ["--workload", "long-tail", "--policies", ","],
        ["--scenario", str(tmp_path / "missing.json")],
    ):
        capsys.readouterr()
        assert command.run(parser.parse_args([*argv, *common])) == 2
        assert "error:" in capsys.readouterr().err


def test_plexrl_lengths_are_calibrated_on_a_steady_run_whatever_the_run_length() -> None:
    """A 1- or 2-step run has no steady cycle to calibrate on: the probe runs
    ``CALIBRATION_STEPS``, so the lengths do not depend on ``--steps`` (they used to fall back
    to the first guess, 2.0, with no warning)."""
    short = command.build_workload("plexrl-7B", jobs=None, steps=2, nodes=None, seed=7)
    full = command.build_workload("plexrl-7B", jobs=None, steps=8, nodes=None, seed=7)
    assert short.jobs[0].steps == 2
    assert short.jobs[0].lengths == full.jobs[0].lengths
    with pytest.raises(ValueError, match=">= 4 steps"):
        exclusive_cycle(short, seed=7)


def test_simulate_command_shares_half_the_gpus_and_small_job_sizes(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    common = ["--steps", "1", "--out", str(tmp_path), "--no-plots", "--policies", "exclusive,ours"]
    argv = ["--workload", "long-tail", "--jobs", "2", "--nodes", "4", "--shared-gpus", "16"]
    assert command.run(parser.parse_args([*argv, *common])) == 0
    saved = json.loads((tmp_path / "long_tail_agentic_shared16.json").read_text())
    assert {s["policy"]: s["num_gpus"] for s in saved["summaries"]} == {"exclusive": 32, "ours": 16}
    argv = ["--workload", "rollmux-mixed", "--jobs", "3", "--nodes", "1", "--job-sizes", "S"]
    assert command.run(parser.parse_args([*argv, *common])) == 0
    saved = json.loads((tmp_path / "rollmux_mixed.json").read_text())
    assert {s["num_gpus"] for s in saved["summaries"]} == {8}


def test_simulate_command_background_expands_changes_ours_only(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    argv = ["--workload", "rollmux-mixed", "--jobs", "4", "--nodes", "1", "--steps", "2"]
    argv += ["--job-sizes", "S"]
    runs = {}
    for flag in ([], ["--background-expands"]):
        out = tmp_path / ("bg" if flag else "default")
        common = ["--out", str(out), "--no-plots", "--policies", "rlix_async,ours", *flag]
        assert command.run(parser.parse_args([*argv, *common])) == 0
        saved = json.loads((out / "rollmux_mixed.json").read_text())
        runs[bool(flag)] = {s["policy"]: s for s in saved["summaries"]}
    # RLix's scheduler always waits for its expands: its run is the same either way.
    a, b = runs[False]["rlix_async"], runs[True]["rlix_async"]
    assert (a["makespan_s"], a["preemptions"]) == (b["makespan_s"], b["preemptions"])
    assert runs[False]["ours"]["cycles"] != runs[True]["ours"]["cycles"]


def test_workloads_are_deterministic_per_seed() -> None:
    wl = long_tail_agentic(num_jobs=2, steps=1, nodes=4)
    wl = replace(wl, jobs=tuple(replace(j, batch=16) for j in wl.jobs))
    a = run_policy(wl, "ours", seed=5, config=EngineConfig(record_tenures=False))
    b = run_policy(wl, "ours", seed=5, config=EngineConfig(record_tenures=False))
    assert a.makespan == b.makespan and a.aborted == b.aborted


def test_slowdown_denominators_run_under_the_comparisons_engine_settings() -> None:
    """A job's JCT alone is measured with the engine settings of the runs it divides (the
    4,096-GPU point runs 1 s cycles and a 30 s tick; its denominators used the defaults)."""
    job = long_tail_agentic(num_jobs=1, nodes=1, steps=2).jobs[0]
    slow = EngineConfig(cycle_interval_s=5.0, tick_s=30.0)
    default = isolated_jct(job, 8, seed=3)
    assert isolated_jct(job, 8, seed=3, config=EngineConfig()) == default
    assert isolated_jct(job, 8, seed=3, config=slow) != default
