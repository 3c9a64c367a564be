"""The run-length script on two short lengths and one seed: every figure in its summary is
computed from the per-run figures it saves, the bound holds, and bad --steps are refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.cluster_efficiency import run_length


def test_summary_follows_the_saved_runs(tmp_path: Path) -> None:
    out = tmp_path / "run_length.json"
    assert run_length.main(["--steps", "1,2", "--seeds", "1", "--out", str(out)]) == 0
    saved = json.loads(out.read_text())
    assert [ln["steps"] for ln in saved["lengths"]] == [1, 2]
    for ln in saved["lengths"]:
        row = ln["runs"]["1"]
        assert set(row) == set(run_length.POLICIES)
        s = ln["summary"]
        for p in run_length.SHARED:
            x = row[p]["throughput_per_h"] / row["exclusive"]["throughput_per_h"]
            spread = s[f"{p}_throughput_x_exclusive"]
            assert spread["mean"] == spread["min"] == spread["max"] == round(x, 4)
            assert spread["above_par"] == f"{int(x > run_length.LONG_TAIL_X)}/1"
        for b in run_length.BASES:
            x = row["ours"]["throughput_per_h"] / row[b]["throughput_per_h"]
            assert s[f"ours_throughput_x_{b}"]["mean"] == round(x, 4)
        bound = ln["bounds"]["1"]
        # No schedule beats the bound, so no deployment's throughput exceeds what it allows.
        assert bound["bound_makespan_s"] <= row["ours"]["makespan_s"]
        assert s["ours_throughput_x_exclusive"]["max"] <= bound["bound_throughput_x_exclusive"]
        share = row["ours"]["final_drain_s"] / row["ours"]["makespan_s"]
        assert s["ours_final_drain_share"]["mean"] == round(share, 4)
    assert out.with_suffix(".png").stat().st_size > 0
    # The plot can be redrawn from the JSON alone.
    out.with_suffix(".png").unlink()
    assert run_length.main(["--plot-only", "--out", str(out)]) == 0
    assert out.with_suffix(".png").exists()


def test_plot_only_without_results_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exc:
        run_length.main(["--plot-only", "--out", str(tmp_path / "none.json")])
    assert exc.value.code == 2


@pytest.mark.parametrize("bad", ["0", "4,x", ""])
def test_bad_steps_are_refused(tmp_path: Path, bad: str) -> None:
    out = tmp_path / "run_length.json"
    with pytest.raises(SystemExit) as exc:
        run_length.main(["--steps", bad, "--out", str(out)])
    assert exc.value.code == 2
    assert not out.exists()
