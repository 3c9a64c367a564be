"""Two ROLL-protocol pipelines time-share 8 logical GPUs under the real coordinator."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest
import ray

from tests.support.roll_pipeline import GpuLedger, RollPipelineDriver

pytestmark = pytest.mark.integration



def test_two_pipelines_finish_without_sharing_a_gpu(coordinator: Any) -> None:
    ledger = GpuLedger.remote()
    a = RollPipelineDriver(coordinator, ledger, train=[0, 1], infer=[0, 1, 2, 3, 4, 5], steps=3)
    b = RollPipelineDriver(coordinator, ledger, train=[4, 5], infer=[2, 3, 4, 5, 6, 7], steps=3)
    a.setup()
    b.setup()
    a.start()
    b.start()
    # Sample the coordinator's own view while they run: every GPU has at most one owner and
    # owners only ever hold GPUs of their registered mappings.
    mapping = {
        a.pipeline_id: set(a.infer) | set(a.train),
        b.pipeline_id: set(b.infer) | set(b.train),
    }
    samples = 0
    while a.running or b.running:
        status = coordinator.status()
        for g in status.gpus:
            if g.owner_pipeline is not None:
                assert g.gpu in mapping[g.owner_pipeline]
        samples += 1
    ra, rb = a.join(30), b.join(30)
    assert ra.error is None, repr(ra.error)
    assert rb.error is None, repr(rb.error)
    assert (ra.steps_done, rb.steps_done) == (3, 3)
    violations, claims, claim_count = ray.get(ledger.report.remote())
    assert violations == []
    assert claim_count > 20, "the shards and trainers actually claimed GPUs"
    assert claims == {}, "everything was given back at the end"
    assert samples > 3
    # Generation really was elastic: ranks were added while generating.
    assert max(ra.generation_ranks_seen) >= 2 and max(rb.generation_ranks_seen) >= 2
    final = coordinator.status()
    assert final.idle_gpus == tuple(range(8))
    assert final.wait_queue == ()


def test_trace_has_a_track_per_gpu_and_preemptions(coordinator: Any, tmp_path: Path) -> None:
    ledger = GpuLedger.remote()
    a = RollPipelineDriver(coordinator, ledger, train=[0, 1], infer=[0, 1, 2, 3], steps=2)
    a.setup()
    result = a.run()
    assert result.error is None, repr(result.error)
    path = ray.get(coordinator.scheduler.flush_trace.remote())
    assert path is not None
    trace = json.loads(Path(path).read_text())
    events = trace["traceEvents"]
    tracks = {e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    assert tracks == {f"GPU {g}" for g in range(8)}
    slices = [e for e in events if e["ph"] == "X"]
    stages = {e["args"]["stage"] for e in slices}
    assert {"INITIALIZATION", "GENERATION", "OLD_LOG_PROBS"} <= stages
    assert all(e["dur"] >= 0 for e in slices)
    preempts = [e for e in events if e["ph"] == "i" and e["name"].startswith("preempt")]
    assert preempts, "training on overlap GPUs preempted generation ranks"
    # slices on one track never overlap (one owner at a time)
    for g in range(8):
        track = sorted((e["ts"], e["ts"] + e["dur"]) for e in slices if e["tid"] == g)
        for (_, end), (start, _) in itertools.pairwise(track):
            assert start >= end - 0.2  # µs, rounding of the JSON timestamps
