"""Yardsticks of a run: the makespan lower bound (exact on a hand-computed case, below every
deployment's makespan; the random-scenario physics test checks it too) and the final drain."""

from __future__ import annotations

from dataclasses import replace

import pytest

from rlix_plugins.sim.bounds import makespan_lower_bound
from rlix_plugins.sim.engine import EngineConfig
from rlix_plugins.sim.metrics import final_drain
from rlix_plugins.sim.runner import run_policy
from rlix_plugins.sim.workloads import LengthDistribution, PhaseTimes, Workload, long_tail_agentic


def _fixed_workload(max_age: int, arrival: float = 0.0) -> Workload:
    template = long_tail_agentic(num_jobs=1, steps=1).jobs[0]
    job = replace(
        template,
        arrival_s=arrival,
        steps=3,
        batch=4,
        train_gpus=1,
        infer_gpus=1,
        infer_tp=1,
        n_sat=2,
        max_seqs=4,
        lengths=LengthDistribution("fixed", 100.0, 0.0, 1000.0),
        phases=PhaseTimes(1.0, 1.0, 8.0, 5.0),
        max_age=max_age,
    )
    return Workload("fixed", "hand-computed", (job,), 8, 1, 1, 4.0)


@pytest.mark.parametrize(
    ("max_age", "arrival", "path"),
    [
        # on-policy: generate 100 s, train 10 s, three times
        (0, 0.0, 330.0),
        # one step stale: steps 0 and 1 generate at once; step 2 waits for step 0's weights
        (1, 0.0, 220.0),
        (0, 50.0, 380.0),
    ],
)
def test_bound_is_exact_on_fixed_lengths(max_age: int, arrival: float, path: float) -> None:
    bound = makespan_lower_bound(_fixed_workload(max_age, arrival), seed=3)
    # per step: 4 x 100 solo-s / 2 per rank-second = 200 GPU-s + 10 GPU-s training; 8 GPUs
    assert bound.work_s == pytest.approx(3 * 210.0 / 8)
    assert bound.critical_path_s == pytest.approx(path)
    assert bound.makespan_s == pytest.approx(path)


def test_every_deployment_is_above_the_bound_on_the_long_tail() -> None:
    wl = long_tail_agentic(num_jobs=4, nodes=2, steps=2)
    bound = makespan_lower_bound(wl, seed=5)
    assert bound.work_s > 0 and bound.critical_path_s > 0
    for policy in ("exclusive", "rlix_async", "ours"):
        r = run_policy(wl, policy, seed=5, config=EngineConfig(record_tenures=False))
        assert r.makespan >= bound.makespan_s


def test_final_drain_splits_idle_time_at_the_last_busy_bin() -> None:
    wl = long_tail_agentic(num_jobs=1, nodes=2, steps=1)
    run = run_policy(wl, "ours", seed=1, config=EngineConfig(record_tenures=False))
    # 2 GPUs, bins of 100 s, makespan 250 s: busy, then 30% and 10% of the cluster (the last bin
    # is 50 s long), then nothing recorded up to the makespan.
    run = replace(run, num_gpus=2, makespan=250.0, util_bin_s=100.0, util_bins=(200.0, 60.0, 10.0))
    drain = final_drain(run)
    assert (drain.start_s, drain.length_s) == (100.0, 150.0)
    assert drain.idle_in_s == pytest.approx(70.0 + 45.0)
    assert drain.idle_before_s == 0.0
    # Bins missing at the end count as idle; at a level of 4% the last bin (10%) is busy enough.
    short = final_drain(replace(run, util_bins=(200.0,)))
    assert (short.start_s, short.idle_in_s) == (100.0, pytest.approx(100.0 + 50.0))
    assert final_drain(run, level=0.04).length_s == 0.0
    with pytest.raises(ValueError, match="fraction of the cluster"):
        final_drain(run, level=0.0)
