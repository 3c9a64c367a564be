"""The reservation script on one trace, one size and one seed: its summary follows the runs it
saves, the rule before the change is among the variants, and bad arguments are refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.cluster_efficiency import reservation


def test_summary_follows_the_saved_runs(tmp_path: Path) -> None:
    out = tmp_path / "reservation.json"
    args = ["--seeds", "1", "--gpus", "32", "--profiles", "mixed", "--out", str(out)]
    assert reservation.main(args) == 0
    saved = json.loads(out.read_text())
    assert list(saved["workloads"]) == ["rollmux_mixed_S32"]
    assert saved["variants"]["reserve_at_once"] == {"reserve_after_s": 0.0, "backfill": False}
    assert saved["variants"]["never_reserve"]["reserve_after_s"] is None
    w = saved["workloads"]["rollmux_mixed_S32"]
    (row,) = w["runs"]
    base = row[reservation.BASE]
    for v in reservation.VARIANTS:
        ours = row[f"ours_{v}"]
        s = w["summary"][v]
        jct = 1 - ours["mean_jct_s"] / base["mean_jct_s"]
        assert s["mean_jct_saving_vs_base"]["mean"] == round(jct, 4)
        gpu_h = 1 - ours["gpu_hours_per_step"] / base["gpu_hours_per_step"]
        assert s["gpu_hours_saving_vs_base"]["mean"] == round(gpu_h, 4)
        assert s["max_slowdown"]["max"] == round(ours["max_slowdown"], 3)
        assert ours["max_slowdown"] >= 1.0 - 1e-9  # no job beats its own GPUs alone
    assert out.with_suffix(".png").stat().st_size > 0
    out.with_suffix(".png").unlink()
    assert reservation.main(["--plot-only", "--out", str(out)]) == 0
    assert out.with_suffix(".png").exists()


@pytest.mark.parametrize(
    "bad", [["--gpus", "30"], ["--gpus", "x"], ["--seeds", "0"], ["--profiles", "heavy"]]
)
def test_bad_arguments_are_refused(tmp_path: Path, bad: list[str]) -> None:
    out = tmp_path / "reservation.json"
    with pytest.raises(SystemExit) as exc:
        reservation.main([*bad, "--out", str(out)])
    assert exc.value.code == 2
    assert not out.exists()
