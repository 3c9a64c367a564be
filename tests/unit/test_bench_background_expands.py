"""The background-expands comparison on one small workload and one seed: both modes of ours
run, every change and margin follows the saved runs, RLix's baselines are shared."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.cluster_efficiency import background_expands as bx


def test_both_modes_on_one_workload(tmp_path: Path) -> None:
    out = tmp_path / "bx.json"
    name = "long_tail_agentic_8jobs"
    assert bx.main(["--seeds", "1", "--no-scale", "--only", name, "--out", str(out)]) == 0
    saved = json.loads(out.read_text())
    entry = saved["workloads"][name]
    (row,) = entry["runs"]
    assert set(row) == {*bx.BASES, "ours_blocking", "ours_background"}
    s = entry["summary"]
    pairs = (("gpu_hours_change", "gpu_hours_per_step"), ("mean_jct_change", "mean_jct_s"))
    for key, figure in pairs:
        change = row["ours_background"][figure] / row["ours_blocking"][figure] - 1
        assert s[key]["mean"] == round(change, 4)
    for mode in bx.MODES:
        for base in bx.BASES:
            margin = 1 - row[f"ours_{mode}"]["gpu_hours_per_step"] / row[base]["gpu_hours_per_step"]
            assert s[f"ours_{mode}_margin_vs_{base}"]["mean"] == round(margin, 4)
    assert saved["scale"] == {}
    assert out.with_suffix(".png").stat().st_size > 0
    out.with_suffix(".png").unlink()
    assert bx.main(["--plot-only", "--out", str(out)]) == 0  # redrawn from the JSON alone
    assert out.with_suffix(".png").exists()


def test_unknown_workload_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exc:
        bx.main(["--only", "nope", "--no-scale", "--out", str(tmp_path / "b.json")])
    assert exc.value.code == 2
    assert not (tmp_path / "b.json").exists()
