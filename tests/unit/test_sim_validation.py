"""Validation in the simulator's physics checks, clock, scenario loader and ``simulate`` command:
each test here failed before its fix (a check that could not fail, or bad input accepted)."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import pytest

from rlix_plugins.errors import RlixPluginsError
from rlix_plugins.sim import simulate_cli as command
from rlix_plugins.sim.clock_queue import ClockQueue
from rlix_plugins.sim.physics import GpuLedger, PhysicsViolation
from rlix_plugins.sim.scenario import ScenarioError, load_scenario
from tests.support.sim_scenario import one_node_scenario

# ----------------------------------------------------------------------------- physics


def test_ledger_refuses_a_credit_that_starts_before_the_tenure() -> None:
    """B computing at 5 while A still occupied the GPU (A never credited anything, so the
    interval check had nothing to compare with): two stages on one GPU at once."""
    ledger = GpuLedger(1)
    ledger.begin((0,), "a", 0.0)
    ledger.end((0,), "a", 10.0)
    ledger.begin((0,), "b", 10.0)
    with pytest.raises(PhysicsViolation, match="before its tenure"):
        ledger.add_useful((0,), "b", 10.0, 5.0, 15.0)


def test_ledger_refuses_a_credit_past_the_end_of_the_tenure() -> None:
    """A left the GPU at 10 (asleep from then on) but is credited compute until 20."""
    ledger = GpuLedger(1)
    ledger.begin((0,), "a", 0.0)
    ledger.end((0,), "a", 10.0)
    with pytest.raises(PhysicsViolation, match="after its tenure ended"):
        ledger.add_useful((0,), "a", 15.0, 5.0, 20.0)


def test_ledger_refuses_a_tenant_leaving_before_its_credited_compute_ends() -> None:
    ledger = GpuLedger(1)
    ledger.begin((0,), "a", 0.0)
    ledger.add_useful((0,), "a", 10.0, 0.0, 10.0)  # e.g. a training phase credited at start
    with pytest.raises(PhysicsViolation, match="credited until"):
        ledger.end((0,), "a", 5.0)


def test_ledger_refuses_more_useful_seconds_than_the_interval_holds() -> None:
    """10 useful seconds in [0, 5): 200% of the GPU; the cumulative bound (checked against a
    later horizon) does not see it."""
    ledger = GpuLedger(1)
    ledger.begin((0,), "a", 0.0)
    with pytest.raises(PhysicsViolation, match="100%"):
        ledger.add_useful((0,), "a", 10.0, 0.0, 5.0)


def test_ledger_still_accepts_credits_inside_the_tenure() -> None:
    ledger = GpuLedger(1)
    ledger.begin((0,), "a", 0.0)
    ledger.add_useful((0,), "a", 2.5, 0.0, 5.0)
    ledger.end((0,), "a", 7.0)  # a sleep in progress: ends in the future
    ledger.add_useful((0,), "a", 1.0, 5.0, 6.0)  # credited up to "now" before the end
    ledger.begin((0,), "b", 7.0)
    ledger.add_useful((0,), "b", 3.0, 7.0, 10.0)
    ledger.end((0,), "b", 10.0)
    ledger.check_bounds(10.0)


# ----------------------------------------------------------------------------- clock


@pytest.mark.parametrize("schedule", ["at", "after"])
def test_clock_refuses_nan_times(schedule: str) -> None:
    """A NaN time broke the heap order (a NaN scenario arrival hung the run); ``after(nan)``
    silently ran the action at once."""
    clock = ClockQueue()
    with pytest.raises(ValueError, match="NaN"):
        getattr(clock, schedule)(math.nan, lambda: None)


# ----------------------------------------------------------------------------- scenario




@pytest.mark.parametrize(
    ("fields", "message"),
    [
        # NaN hung the simulator; inf ran to the horizon and failed as "jobs unfinished";
        # a negative arrival ran at 0 with its JCT counted from before the run began
        ({"arrival_s": math.nan}, "arrival_s must be a finite number >= 0"),
        ({"arrival_s": math.inf}, "arrival_s must be a finite number >= 0"),
        ({"arrival_s": -5.0}, "arrival_s must be a finite number >= 0"),
        # failed only once a run registered the pipeline
        ({"weight": 0.0}, "weight must be a finite number > 0"),
        ({"weight": math.nan}, "weight must be a finite number > 0"),
        ({"redispatch_prefill_s": math.nan}, "redispatch_prefill_s must be a finite number >= 0"),
        ({"redispatch_prefill_s": math.inf}, "redispatch_prefill_s must be a finite number >= 0"),
        # true read as 1.0
        (
            {"lengths": {"kind": "fixed", "a": True, "b": 0.0, "cap_s": 3.0}},
            "'a' must be a number",
        ),
        (
            {
                "phases": {
                    "old_log_probs_s": 0.5,
                    "ref_log_probs_s": 0.5,
                    "update_actor_s": False,
                    "sync_weight_s": 0.3,
                }
            },
            "'update_actor_s' must be a number",
        ),
    ],
)
def test_scenario_refuses_bad_job_fields(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ScenarioError, match=message):
        load_scenario(one_node_scenario(**fields))


def test_scenario_refuses_duplicate_pipeline_names() -> None:
    data = one_node_scenario(name="ft_000000000001")
    data["pipelines"].append(dict(data["pipelines"][0]))
    with pytest.raises(ScenarioError, match="'ft_000000000001' is used by pipelines 0 and 1"):
        load_scenario(data)


@pytest.mark.parametrize("text", ["5", '"gpus_per_node"', "[1]", "null"])
def test_scenario_file_that_is_not_an_object_is_a_scenario_error(
    tmp_path: Path, text: str
) -> None:
    path = tmp_path / "s.json"
    path.write_text(text)
    with pytest.raises(ScenarioError, match="a table/object at the top"):
        load_scenario(path)


def test_scenario_error_is_a_package_error() -> None:
    assert issubclass(ScenarioError, RlixPluginsError)
    assert issubclass(ScenarioError, ValueError)


# ----------------------------------------------------------------------------- command


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    return parser


@pytest.mark.parametrize(
    "extra",
    [
        ["--jobs", "5"],
        ["--steps", "9"],
        ["--nodes", "3"],
        ["--shared-gpus", "8"],
        ["--job-sizes", "S"],
    ],
)
def test_simulate_refuses_workload_options_with_aone_node_scenario(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str]
) -> None:
    """They were ignored: the scenario ran as written and the command said nothing."""
    path = tmp_path / "s.json"
    path.write_text(json.dumps(one_node_scenario()))
    argv = ["--scenario", str(path), *extra, "--out", str(tmp_path / "o"), "--no-plots"]
    assert command.run(_parser().parse_args(argv)) == 2
    err = capsys.readouterr().err
    assert "error:" in err and extra[0] in err and "--scenario" in err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("option", ["jobs", "nodes"])
def test_plexrl_workloads_refuse_jobs_and_nodes(option: str) -> None:
    """PlexRL's setup is two jobs on its own pools: --jobs / --nodes were ignored."""
    kwargs: dict[str, Any] = {"jobs": None, "steps": 2, "nodes": None, "seed": 7}
    kwargs[option] = 3
    with pytest.raises(ValueError, match=f"--{option} does not apply to plexrl-7B"):
        command.build_workload("plexrl-7B", **kwargs)


def test_simulate_names_a_negative_seed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """numpy's "expected non-negative integer" came out of the first run, naming no option."""
    argv = ["--workload", "long-tail", "--jobs", "1", "--steps", "1", "--nodes", "2"]
    argv += ["--seed", "-1", "--out", str(tmp_path), "--no-plots", "--policies", "exclusive"]
    assert command.run(_parser().parse_args(argv)) == 2
    assert "--seed must be >= 0" in capsys.readouterr().err


def test_simulate_refuses_an_out_path_that_is_a_file_before_running(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It failed with FileExistsError only after every simulation had run."""
    out = tmp_path / "results"
    out.write_text("")
    path = tmp_path / "s.json"
    path.write_text(json.dumps(one_node_scenario()))
    argv = ["--scenario", str(path), "--out", str(out), "--no-plots"]
    assert command.run(_parser().parse_args(argv)) == 2
    assert "--out" in capsys.readouterr().err


def test_simulate_refuses_an_out_directory_it_cannot_create_before_running(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A parent that is a file: it failed with FileNotFoundError only after every simulation
    had run, the results lost."""
    parent = tmp_path / "file"
    parent.write_text("")
    path = tmp_path / "s.json"
    path.write_text(json.dumps(one_node_scenario()))
    argv = ["--scenario", str(path), "--out", str(parent / "results"), "--no-plots"]
    assert command.run(_parser().parse_args(argv)) == 2
    err = capsys.readouterr().err
    assert err.startswith("rlix-plugins simulate: error: --out") and "cannot" in err


def test_simulate_names_an_unknown_deployment_as_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--workload", "long-tail", "--policies", "ours,foo", "--out", str(tmp_path)]
    assert command.run(_parser().parse_args(argv)) == 2
    assert capsys.readouterr().err.startswith(
        "rlix-plugins simulate: error: unknown deployments ['foo']")
