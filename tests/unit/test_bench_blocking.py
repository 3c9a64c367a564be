"""The blocking-cycles sensitivity script on one small workload: both engines measured,
margins computed from the saved runs, an unknown workload refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.cluster_efficiency import blocking


def test_both_engines_on_one_workload(tmp_path: Path) -> None:
    out = tmp_path / "blocking.json"
    name = "long_tail_agentic_8jobs"
    assert blocking.main(["--no-512", "--only", name, "--out", str(out)]) == 0
    saved = json.loads(out.read_text())
    (row,) = saved["workloads"].values()
    assert set(row) == set(blocking.ENGINES)
    # Exclusive never resizes: both engines share its run.
    assert row["blocking"]["exclusive"] == row["overlapping"]["exclusive"]
    for engine in blocking.ENGINES:
        runs = row[engine]
        for base in blocking.BASES:
            margin = 1 - runs["ours"]["gpu_hours_per_step"] / runs[base]["gpu_hours_per_step"]
            assert runs["ours_margin_vs"][base] == round(margin, 4)
    # Blocking cycles wait for resizes: fewer cycles for the same jobs.
    assert row["blocking"]["ours"]["cycles"] < row["overlapping"]["ours"]["cycles"]
    assert (tmp_path / "blocking.png").stat().st_size > 0


def test_unknown_workload_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exc:
        blocking.main(["--no-512", "--only", "nope", "--out", str(tmp_path / "b.json")])
    assert exc.value.code == 2
    assert not (tmp_path / "b.json").exists()
