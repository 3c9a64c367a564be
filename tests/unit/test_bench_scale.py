"""The cluster-size sweep script on its smallest point (8 GPUs): JSON and PNG written, every
deployment measured, and a --max-gpus that leaves nothing is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.cluster_efficiency import scale


def test_smallest_point_writes_json_and_plot(tmp_path: Path) -> None:
    assert scale.main(["--max-gpus", "8", "--out", str(tmp_path)]) == 0
    saved = json.loads((tmp_path / "scale.json").read_text())
    (point,) = saved["points"]
    assert point["gpus"] == 8 and point["job_sizes"] == ["S"]
    assert set(point["makespan_s"]) == set(saved["deployments"])
    # Every shared deployment is compared with exclusive; the figures come from real runs.
    assert set(point["saving"]) == set(saved["deployments"]) - {"exclusive"}
    assert all(-1.0 < v < 1.0 for v in point["saving"].values())
    assert (tmp_path / "scale.png").stat().st_size > 0
    assert (tmp_path / "scale" / "rollmux_mixed_8gpus.json").exists()
    # The plot can be redrawn from the JSON alone.
    (tmp_path / "scale.png").unlink()
    assert scale.main(["--plot-only", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "scale.png").exists()


def test_max_gpus_below_every_size_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exc:
        scale.main(["--max-gpus", "4", "--out", str(tmp_path)])
    assert exc.value.code == 2
    assert not (tmp_path / "scale.json").exists()
