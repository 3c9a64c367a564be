"""``rlix-plugins simulate --policies ...,plexrl`` on a workload without PlexRL's pools: refused
before any deployment runs (it used to run every deployment listed before ``plexrl``, then
fail with exit 2 and no results written)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rlix_plugins.cli import main
from rlix_plugins.sim import simulate_cli
from tests.support.sim_scenario import one_node_scenario


@pytest.fixture
def no_compare(monkeypatch: pytest.MonkeyPatch) -> None:
    """The comparison must not start: were it started, the test fails here."""

    def refuse(*_args: Any, **_kwargs: Any) -> Any:
        raise AssertionError("deployments ran although plexrl cannot run on this workload")

    monkeypatch.setattr(simulate_cli, "compare", refuse)


@pytest.mark.parametrize(
    "source",
    [["--workload", "long-tail", "--jobs", "1", "--nodes", "2", "--steps", "1"], "scenario"],
)
def test_plexrl_on_a_workload_without_its_pools_is_refused_before_running(
    no_compare: None, tmp_path: Path, capsys: pytest.CaptureFixture[str], source: Any
) -> None:
    if source == "scenario":
        scenario = tmp_path / "scenario.json"
        scenario.write_text(json.dumps(one_node_scenario()))
        source = ["--scenario", str(scenario)]
    out = tmp_path / "out"
    code = main(["simulate", *source, "--policies", "exclusive,plexrl", "--no-plots",
                 "--out", str(out)])
    captured = capsys.readouterr()
    assert code == 2
    assert "rlix-plugins simulate: error: the plexrl deployment" in captured.err
    assert "Traceback" not in captured.err
    assert not out.exists()


def test_plexrl_on_a_plexrl_workload_is_accepted(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The check must not refuse the workloads plexrl is for."""
    ran: list[tuple[str, ...]] = []

    class _Comparison:  # FAKE: what format_table gets
        pass

    def fake_compare(workload: Any, **kw: Any) -> Any:
        ran.append(kw["policies"])
        return _Comparison()

    monkeypatch.setattr(simulate_cli, "compare", fake_compare)
    monkeypatch.setattr(simulate_cli, "format_table", lambda c: "table")
    monkeypatch.setattr(simulate_cli, "build_workload",
                        lambda *a, **k: _PlexrlWorkload())
    code = main(["simulate", "--workload", "plexrl-7B", "--policies", "exclusive,plexrl",
                 "--no-plots", "--out", str(tmp_path / "out")])
    assert code == 0 and ran == [("exclusive", "plexrl")]


class _PlexrlWorkload:
    """FAKE workload with PlexRL's pools (what plexrl_two_jobs builds)."""

    pool_placements = ((),)
    sources: tuple[str, ...] = ()
    assumptions: tuple[str, ...] = ()
