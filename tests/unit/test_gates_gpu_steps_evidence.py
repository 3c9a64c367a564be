"""GPU mode's ``steps`` criterion judges the jobs' evidence, not their exit codes: a job that
exits 0 having trained fewer steps than its target (or none: a wrong config, a job that never
reached its loop) fails it. FAKE GPU run (tests.unit.test_gates_flow_failures): no Ray, no
coordinator, no GPU; the FAKE jobs write the records real ones would."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from rlix_plugins.adapters.observability import ENV_OBSERVE_DIR, BusyObserved, ObservationWriter
from rlix_plugins.coordinator.service.wire_log import PipelineWire
from rlix_plugins.gates import gpu_mode
from rlix_plugins.gates.criteria import (
    RLIX_PRIORITY_CLASS,
    CriterionResult,
    RunCount,
    steps_completed,
)
from rlix_plugins.gates.gpu_mode import GpuGateOptions, JobSpec
from tests.unit.test_gates_flow_failures import gpu_run_whose_jobs_fail

TARGET = 3


def _gpu_run_whose_jobs_exit_0(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, train_steps: Mapping[str, int]
) -> None:
    """FAKE GPU run of NeMo RL jobs (one per entry of ``train_steps``, each targeting
    ``TARGET`` steps) that all exit 0; in the shared run each writes ``train_steps[name]``
    train busy records (one per step, as the hooks do) under its pipeline id."""
    gpu_run_whose_jobs_fail(monkeypatch, [])
    jobs = [JobSpec(name, ("true",), tmp_path, steps=TARGET) for name in train_steps]
    monkeypatch.setattr(gpu_mode, "load_jobs", lambda opts, exclusive: jobs)

    def run_jobs(jobs: Sequence[JobSpec], env: dict[str, str], out: Path,
                 **_kw: Any) -> dict[str, int]:  # FAKE: the jobs exit 0
        if env.get(ENV_OBSERVE_DIR):  # the shared run; the baseline writes no records
            for i, job in enumerate(jobs):
                pid = f"ft_00000000000{i}"
                writer = ObservationWriter(Path(env[ENV_OBSERVE_DIR]), pid)
                for _ in range(train_steps[job.name]):
                    t = time.time()
                    writer.write(BusyObserved(pid, "train", (i,), t, t + 0.1))
        return {j.name: 0 for j in jobs}

    monkeypatch.setattr(gpu_mode, "run_jobs", run_jobs)


def _steps(opts: GpuGateOptions) -> CriterionResult:
    result = gpu_mode.run_gpu_gate(opts)
    return next(c for c in result.criteria if c.name == "steps")


@pytest.mark.parametrize("trained", [0, TARGET - 1])
def test_a_job_that_exits_0_without_its_steps_fails_the_steps_criterion(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, trained: int
) -> None:
    """It passed: a job exiting 0 counted as all its steps done."""
    _gpu_run_whose_jobs_exit_0(monkeypatch, tmp_path, {"a": TARGET, "b": trained})
    steps = _steps(GpuGateOptions(2, tmp_path / "out"))
    assert not steps.passed, steps
    assert f"shared/b {trained}/{TARGET}" in steps.measured, steps.measured


def test_jobs_whose_records_show_every_step_pass_the_shared_part(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _gpu_run_whose_jobs_exit_0(monkeypatch, tmp_path, {"a": TARGET, "b": TARGET})
    steps = _steps(GpuGateOptions(2, tmp_path / "out"))
    assert f"shared/a {TARGET}/{TARGET}" in steps.measured, steps.measured
    assert f"shared/b {TARGET}/{TARGET}" in steps.measured, steps.measured


def _roll_wire(generation_requests: int) -> dict[str, PipelineWire]:
    """FAKE wire log: the ROLL pipeline (RLix's Priority class) and one of ours."""
    return {
        "roll_0": PipelineWire("roll_0", {"request_gpus": generation_requests}, {}, {},
                               {RLIX_PRIORITY_CLASS: generation_requests},
                               {"request_gpus: GENERATION": generation_requests}),
        "ft_0": PipelineWire("ft_0", {}, {}, {}, {"rlix_plugins.protocol.types.Priority": 9},
                             {"request_gpus: GENERATION": 9}),
    }


@pytest.mark.parametrize(("requests", "passed"), [(0, False), (TARGET - 1, False),
                                                  (TARGET, True)])
def test_the_roll_job_counts_the_generation_requests_its_pipeline_sent(
    tmp_path: Path, requests: int, passed: bool
) -> None:
    roll = JobSpec("roll", ("true",), tmp_path, steps=TARGET)
    runs = gpu_mode.shared_run_counts([roll], {"roll": 0}, tmp_path / "none",
                                      _roll_wire(requests))
    assert runs == [RunCount("shared/roll", requests, TARGET)]
    assert steps_completed(runs).passed is passed


def test_a_step_target_of_0_needs_at_least_one_recorded_step(tmp_path: Path) -> None:
    """0: the job's config sets its own count; before, 0/0 passed on the exit code."""
    job = JobSpec("a", ("true",), tmp_path, steps=0)
    runs = gpu_mode.shared_run_counts([job], {"a": 0}, tmp_path / "none", {})
    assert not steps_completed(runs).passed, runs


def test_unreadable_records_are_the_jobs_error(tmp_path: Path) -> None:
    (tmp_path / "ft_0.jsonl").write_text("not json\n")
    job = JobSpec("a", ("true",), tmp_path, steps=TARGET)
    [run] = gpu_mode.shared_run_counts([job], {"a": 0}, tmp_path, {})
    assert run.error is not None and run.error.startswith("unreadable records: ")


def test_a_nonzero_exit_fails_whatever_was_recorded(tmp_path: Path) -> None:
    writer = ObservationWriter(tmp_path, "ft_0")
    for _ in range(TARGET):
        writer.write(BusyObserved("ft_0", "train", (0,), 1.0, 2.0))
    job = JobSpec("a", ("true",), tmp_path, steps=TARGET)
    runs = gpu_mode.shared_run_counts([job], {"a": 1}, tmp_path, {})
    assert runs == [RunCount("shared/a", TARGET, TARGET, "exit 1")]
    assert not steps_completed(runs).passed
