"""Changing a workload's switch costs (``with_switch_costs``, ``rlix-plugins simulate
--switch-scale / --switch-cost``): exactly the named costs change, only shared deployments pay
them, and bad values are refused with the field named."""

from __future__ import annotations

import argparse
import json
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import pytest

from rlix_plugins.sim import simulate_cli as command
from rlix_plugins.sim.runner import run_policy
from rlix_plugins.sim.workloads import (
    PER_STEP_COSTS,
    SwitchCosts,
    Workload,
    long_tail_agentic,
    with_switch_costs,
)


def _small() -> Workload:
    return long_tail_agentic(num_jobs=2, nodes=4, steps=1)


def test_scale_then_overrides_change_every_jobs_costs_and_nothing_else() -> None:
    wl = _small()
    changed = with_switch_costs(wl, scale=2.0, overrides={"gen_wake_s": 1.5, "init_load_s": 9.0})
    for old, new in zip(wl.jobs, changed.jobs, strict=True):
        for f in fields(SwitchCosts):
            expected = {"gen_wake_s": 1.5, "init_load_s": 9.0}.get(
                f.name, getattr(old.costs, f.name) * (2.0 if f.name in PER_STEP_COSTS else 1.0)
            )
            assert getattr(new.costs, f.name) == expected
        assert replace(new, costs=old.costs) == old
    assert replace(changed, jobs=wl.jobs, assumptions=wl.assumptions) == wl
    assert changed.assumptions[-1] == (
        "switch costs changed: per-step costs x2.0, then gen_wake_s=1.5 s, init_load_s=9.0 s"
    )
    assert "init_load_s" not in PER_STEP_COSTS and "nccl_reinit_s" in PER_STEP_COSTS


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"scale": -1.0}, "scale must be a finite number >= 0"),
        ({"scale": float("nan")}, "scale must be a finite number >= 0"),
        ({"scale": True}, "scale must be a finite number >= 0"),
        ({"overrides": {"nccl_s": 1.0}}, r"unknown switch cost\(s\) \['nccl_s'\]; valid: "),
        ({"overrides": {"nccl_reinit_s": -1.0}}, "nccl_reinit_s must be a finite number"),
        ({"overrides": {"gen_sleep_s": float("inf")}}, "gen_sleep_s must be a finite number"),
    ],
)
def test_bad_scales_and_costs_are_refused(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        with_switch_costs(_small(), **kwargs)


def test_only_shared_deployments_pay_the_per_step_costs() -> None:
    wl = _small()
    doubled = with_switch_costs(wl, scale=2.0)
    assert run_policy(doubled, "exclusive", seed=3).makespan == run_policy(
        wl, "exclusive", seed=3
    ).makespan
    assert run_policy(doubled, "ours", seed=3).makespan > run_policy(wl, "ours", seed=3).makespan


def _simulate(tmp_path: Path, *extra: str) -> int:
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    argv = ["--workload", "long-tail", "--jobs", "2", "--steps", "1", "--nodes", "4"]
    argv += ["--out", str(tmp_path), "--no-plots", "--policies", "exclusive,ours", *extra]
    return command.run(parser.parse_args(argv))


def _makespans(out: Path) -> dict[str, float]:
    saved = json.loads((out / "long_tail_agentic.json").read_text())
    return {s["policy"]: s["makespan_s"] for s in saved["summaries"]}


def test_the_simulate_command_takes_switch_costs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _simulate(tmp_path / "a") == 0
    flags = ("--switch-scale", "3", "--switch-cost", "nccl_reinit_s=20")
    assert _simulate(tmp_path / "b", *flags) == 0
    printed = capsys.readouterr().out
    assert "assumption: switch costs changed: per-step costs x3.0, then nccl_reinit_s=20.0 s" in (
        printed
    )
    before, after = _makespans(tmp_path / "a"), _makespans(tmp_path / "b")
    assert after["exclusive"] == before["exclusive"]
    assert after["ours"] > before["ours"]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--switch-cost", "nccl=1"), "NAME=SECONDS with NAME one of gen_sleep_s, "),
        (("--switch-cost", "nccl_reinit_s"), "NAME=SECONDS"),
        (("--switch-cost", "nccl_reinit_s=fast"), "'fast' is not a number of seconds"),
        (("--switch-cost", "nccl_reinit_s=-2"), "nccl_reinit_s must be a finite number"),
        (("--switch-scale", "-1"), "scale must be a finite number >= 0"),
        (("--switch-scale", "nan"), "scale must be a finite number >= 0"),
    ],
)
def test_the_simulate_command_refuses_bad_switch_costs_before_running(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: tuple[str, ...], message: str
) -> None:
    out = tmp_path / "never"
    assert _simulate(out, *flags) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()  # refused before anything ran or was written
