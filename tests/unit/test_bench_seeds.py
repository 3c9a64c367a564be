"""The seed-spread script on one small workload and two seeds: every spread is computed from
the per-run figures it saves beside it."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from benchmarks.cluster_efficiency import seeds


def test_spreads_follow_the_saved_runs(tmp_path: Path) -> None:
    out = tmp_path / "seeds.json"
    name = "long_tail_agentic_8jobs"
    assert seeds.main(["--seeds", "2", "--only", name, "--out", str(out)]) == 0
    saved = json.loads(out.read_text())
    assert saved["seeds"] == [1, 2]
    runs = saved["runs"][name]
    assert set(runs) == {"1", "2"}
    assert all(set(row) == set(seeds.POLICIES) for row in runs.values())
    summary = saved["summary"][name]
    for base in seeds.BASES:
        for figure, key in (
            ("gpu_hours_per_step", f"ours_gpu_hours_saving_vs_{base}"),
            ("mean_jct_s", f"ours_mean_jct_saving_vs_{base}"),
        ):
            values = [1 - r["ours"][figure] / r[base][figure] for r in runs.values()]
            spread = summary[key]
            assert spread["mean"] == round(statistics.mean(values), 4)
            assert spread["min"] == round(min(values), 4)
            assert spread["above_par"] == f"{sum(v > 0 for v in values)}/2"
    # Long-tail workloads carry the makespan bound per seed; no schedule beats it.
    for seed, bound in saved["bounds"][name].items():
        assert bound["bound_makespan_s"] <= runs[seed]["ours"]["makespan_s"]
        assert 0.0 < bound["ours_fraction_of_bound"] <= 1.0
