"""The switch-cost sensitivity script: its settings are the library's switch-cost changes, and a
run on one small workload reports run.py's targets and the seed spread of a missed line."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from benchmarks.cluster_efficiency import switch_costs
from benchmarks.cluster_efficiency.run import _plexrl
from rlix_plugins.sim.workloads import with_switch_costs


def test_a_setting_changes_every_jobs_costs_as_named() -> None:
    wl = _plexrl(0, 2)
    doubled = switch_costs.with_setting(wl, "switch_x2")
    assert doubled == with_switch_costs(wl, scale=2.0)
    one = switch_costs.with_setting(wl, "nccl_1s")
    for j, o in zip(one.jobs, wl.jobs, strict=True):
        assert j.costs == replace(o.costs, nccl_reinit_s=1.0)
    assert switch_costs.with_setting(wl, "assumed").jobs == wl.jobs


def test_a_run_reports_run_pys_targets_per_setting(tmp_path: Path) -> None:
    out = tmp_path / "switch_costs.json"
    name = "plexrl_7B_S16"  # right-sized: the 37.6% target and the RLix margins
    assert switch_costs.main(
        ["--settings", "assumed,switch_x2", "--only", name, "--workers", "1", "--out", str(out)]
    ) == 0
    saved = json.loads(out.read_text())
    assert set(saved["settings"]) == {"assumed", "switch_x2"}
    for s in saved["settings"].values():
        # the 37.6% target and ours vs rlix, rlix_async, rlix_async_migr
        assert s["targets"] == 4
        assert s["targets_met"] == s["targets"] - len(s["missed"])
        assert set(s["margins"]) == {name}
    assumed = saved["settings"]["assumed"]["margins"][name]
    doubled = saved["settings"]["switch_x2"]["margins"][name]
    # exclusive pays no per-step switch: doubling them costs ours against it
    key = "ours_gpu_hours_saving_vs_exclusive"
    assert doubled[key] < assumed[key]
    assert out.with_suffix(".png").stat().st_size > 0
    with pytest.raises(SystemExit):
        switch_costs.main(["--settings", "nope", "--out", str(out)])


def test_the_spread_of_a_missed_line_matches_the_seed_7_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    name = "plexrl_7B_S16"
    setting = switch_costs.run_setting("switch_x2", {name})
    missed = {"target": f"{name}: ours ahead of rlix_async (GPU-h/step margin)", "measured": 0}
    assert switch_costs.missed_workloads({"missed": [missed, dict(missed)]}) == [name]
    monkeypatch.setattr(switch_costs, "SPREAD_SEEDS", (7,))
    spread = switch_costs.spread("switch_x2", name)
    for base in switch_costs.SPREAD_BASES:
        key = f"ours_gpu_hours_saving_vs_{base}"
        assert spread[key]["mean"] == pytest.approx(setting["margins"][name][key], abs=1e-4)
        assert spread[key]["above_par"] == f"{int(spread[key]['mean'] > 0)}/1"
