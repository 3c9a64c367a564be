"""Busy records (when each stage computed where) and the ownership criterion judged from
them: written by the library's engine wrapper and the coordinator hooks, read by the gate.
The hooks' train records are checked on real Ray in
tests/integration/test_coordinator_cli_hooks.py, the whole path in the gate rehearsals."""

from __future__ import annotations

import asyncio
import pickle
from pathlib import Path
from typing import Any

import pytest

from rlix_plugins.adapters.observability import (
    BusyObserved,
    BusyRecordingEngine,
    ObservationError,
    ObservationWriter,
    read_observations,
    recording_engines,
    write_all,
)
from rlix_plugins.gates.observed import ownership_from_records

A = "ft_aaaaaaaaaaaa"
B = "ft_bbbbbbbbbbbb"


def busy(pid: str, stage: str, gpus: tuple[int, ...], start: float, end: float) -> BusyObserved:
    return BusyObserved(pid, stage, gpus, start, end, 0 if stage == "generation" else None)


def test_busy_records_round_trip_and_refuse_bad_values(tmp_path: Path) -> None:
    recs = [busy(A, "generation", (0,), 1.0, 2.0), busy(A, "train", (0, 1), 2.5, 4.0)]
    write_all(tmp_path, recs)
    assert read_observations(tmp_path).busy == tuple(recs)
    for bad, message in (
        (dict(stage="sync"), "stage 'sync' is not one of"),
        (dict(gpus=()), r"gpus must be a non-empty list of GPU ids, got \(\)"),
        (dict(gpus=(-1,)), r"gpus must be a non-empty list of GPU ids, got \(-1,\)"),
        (dict(end=0.5), r"ends at 0\.5 before it starts \(1\.0\)"),
    ):
        kw: dict[str, Any] = dict(pipeline_id=A, stage="train", gpus=(0,), start=1.0, end=2.0)
        with pytest.raises(ObservationError, match=message):
            BusyObserved(**(kw | bad))


def test_ownership_from_records_passes_apart_and_fails_on_overlap(tmp_path: Path) -> None:
    ok = [busy(A, "generation", (0,), 0.0, 1.0), busy(B, "train", (0,), 1.5, 3.0),
          busy(B, "generation", (1,), 0.0, 3.0), busy(A, "train", (1,), 3.5, 4.0)]
    write_all(tmp_path / "ok", ok)
    res = ownership_from_records(tmp_path / "ok", expected_pipelines=2)
    assert res.passed, res.measured
    # A's shard still computes on GPU 0 while B's train step holds it
    write_all(tmp_path / "bad", [*ok, busy(A, "generation", (0,), 1.0, 2.0)])
    res = ownership_from_records(tmp_path / "bad", expected_pipelines=2)
    assert not res.passed and "1 overlap(s)" in res.measured
    # no records, a missing pipeline, or a pipeline that never recorded a train step
    assert not ownership_from_records(tmp_path / "none").passed
    write_all(tmp_path / "one", [*ok[:1], busy(A, "train", (0,), 2.0, 3.0)])
    assert not ownership_from_records(tmp_path / "one", expected_pipelines=2).passed
    write_all(tmp_path / "gen_only", ok[:1])
    res = ownership_from_records(tmp_path / "gen_only")
    assert not res.passed and f"no train records of ['{A}']" in res.measured


class _Engine:
    """A minimal ShardEngine stand-in (this test is about the wrapper's bookkeeping, not the
    engine): each generate call waits on its own event."""

    def __init__(self) -> None:
        self.gates: list[asyncio.Event] = []

    async def generate(self, request: Any) -> str:
        gate = asyncio.Event()
        self.gates.append(gate)
        await gate.wait()
        return f"out-{request}"

    async def abort_requests(self, ids: list[str]) -> list[str]:
        return ids


def test_the_engine_wrapper_records_one_interval_per_busy_stretch() -> None:
    records: list[BusyObserved] = []
    inner = _Engine()
    eng = BusyRecordingEngine(inner, pipeline_id=A, shard=1, gpus=(2, 3), record=records.append)

    async def scenario() -> None:
        first = asyncio.ensure_future(eng.generate("a"))
        second = asyncio.ensure_future(eng.generate("b"))
        await asyncio.sleep(0.01)
        inner.gates[0].set()
        assert await first == "out-a"
        assert records == []  # "b" still runs: the shard is still busy
        inner.gates[1].set()
        await second
        assert len(records) == 1
        third = asyncio.ensure_future(eng.generate("c"))
        await asyncio.sleep(0.01)
        inner.gates[2].set()
        await third

    asyncio.run(scenario())
    assert [(r.stage, r.shard, r.gpus) for r in records] == [("generation", 1, (2, 3))] * 2
    assert records[0].end <= records[1].start
    # optional capabilities are the inner engine's; the wrapper pickles (NeMo RL pickles its
    # generation object, router and engines included, into the collector actor)
    assert asyncio.run(eng.abort_requests(["x"])) == ["x"]
    copy = pickle.loads(pickle.dumps(BusyRecordingEngine(
        "inner", pipeline_id=A, shard=0, gpus=(0,), record=ObservationWriter(None, A).write)))
    assert copy.inner == "inner" and copy.gpus == (0,)


def test_recording_engines_only_wrap_when_records_are_on(tmp_path: Path) -> None:
    engines = [object(), object()]
    off = recording_engines(engines, A, [0, 1], 1, writer=ObservationWriter(None, A))
    assert off == engines
    on = recording_engines(engines, A, [0, 1, 2, 3], 2, writer=ObservationWriter(tmp_path, A))
    assert [(e.shard, e.gpus) for e in on] == [(0, (0, 1)), (1, (2, 3))]
    with pytest.raises(ObservationError, match="2 shard engines but 1 ranks"):
        recording_engines(engines, A, [0, 1], 2, writer=ObservationWriter(tmp_path, A))
