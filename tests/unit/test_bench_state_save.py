"""The state-save benchmark on its smallest scale: JSON and PNG written, and the ratios are
those of the measured times."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.scheduler_latency import save


def test_smallest_scale_writes_json_and_plot(tmp_path: Path) -> None:
    assert save.main(["--scales", "1", "--repeats", "3", "--out", str(tmp_path)]) == 0
    saved = json.loads((tmp_path / "save.json").read_text())
    (row,) = saved["rows"]
    assert (row["pipelines"], row["gpus"]) == (10, 64)
    assert row["plan_ms"] > 0 and row["snapshot_ms"] > 0 and row["file_save_ms"] > 0
    assert row["snapshot_vs_plan"] == round(row["snapshot_ms"] / row["plan_ms"], 2)
    assert row["file_save_vs_plan"] == round(row["file_save_ms"] / row["plan_ms"], 2)
    assert row["state_kb"] > 0
    assert (tmp_path / "save.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_an_unknown_scale_count_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exc:
        save.main(["--scales", "5", "--out", str(tmp_path)])
    assert exc.value.code == 2
    assert not (tmp_path / "save.json").exists()
