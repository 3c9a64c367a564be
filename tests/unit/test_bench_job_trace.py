"""benchmarks/cluster_efficiency/job_trace.py on a small RollMux trace (real simulator)."""

from __future__ import annotations

from benchmarks.cluster_efficiency import job_trace
from rlix_plugins.sim.engine import EngineConfig
from rlix_plugins.sim.runner import run_policy
from rlix_plugins.sim.workloads import rollmux_trace


def test_the_trace_names_the_makespan_job_and_orders_the_shared_turns() -> None:
    wl = rollmux_trace("training_heavy", num_jobs=16, steps=2, seed=7)
    result = run_policy(wl, "ours", seed=7, config=EngineConfig(record_tenures=True))
    t = job_trace.trace(result, "ours")
    assert t.makespan == result.makespan
    assert t.last_job == max(result.jobs, key=lambda j: j.finished).job
    assert t.turns and [x.start for x in t.turns] == sorted(x.start for x in t.turns)
    for turn in t.turns:
        assert turn.asked <= turn.start < turn.end
    if t.neighbour is not None:
        assert t.shared_gpus and {x.job for x in t.turns} <= {t.last_job, t.neighbour}
        # the two jobs share GPUs: their trainings there never overlap
        for a, b in zip(t.turns, t.turns[1:], strict=False):
            assert a.end <= b.start + 1e-6, (a, b)
