"""Observation records: the line format, the writer (env, atomic appends from several
processes, pickling) and the reader's typed errors; the router's request ledger."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import pickle
from pathlib import Path

import pytest

from rlix_plugins.adapters.observability import (
    ENV_OBSERVE_DIR,
    ObservationError,
    ObservationWriter,
    RouterCountersEmitter,
    RouterCountersObserved,
    ShardVersionsObserved,
    read_observations,
    router_counters_emitter,
    write_all,
)
from rlix_plugins.errors import NoActiveShardError
from rlix_plugins.generation.engine import GenerationRequest
from rlix_plugins.generation.router import (
    RequestLedger,
    RouterConfig,
    RouterCounters,
    ShardRouter,
)
from rlix_plugins.generation.shard_state import ShardStatus
from rlix_plugins.generation.state_store import LocalShardState, ShardStateStore
from tests.unit.test_gates_parts import ScriptedEngineStandIn
from tests.unit.test_generation_router import FakePicklableEngine, _ray_view

PID = "ft_0123456789ab"


def _versions(**kw: object) -> ShardVersionsObserved:
    base: dict[str, object] = dict(pipeline_id=PID, event="expand", trainer_version=3,
                                   synced=(1,), shard_versions={0: 3, 1: 3}, step=2, time=10.0)
    base.update(kw)
    return ShardVersionsObserved(**base)  # type: ignore[arg-type]


def test_records_round_trip_through_the_file(tmp_path: Path) -> None:
    v = _versions(shard_versions={0: 3, 1: None})
    c = RouterCountersObserved(PID, "copy1", submitted=10, completed=7, redispatched=4, lost=1,
                               duplicated=0, cancelled=1, in_flight=1, time=11.0)
    write_all(tmp_path, [v, c])
    lines = (tmp_path / f"{PID}.jsonl").read_text().splitlines()
    assert len(lines) == 2 and json.loads(lines[0])["shard_versions"] == {"0": 3, "1": None}
    obs = read_observations(tmp_path)
    assert obs.shard_versions == (v,) and obs.router_counters == (c,)
    assert obs.pipelines() == [PID] and obs.files == (f"{PID}.jsonl",)


def test_router_counters_carry_migrations_and_read_old_records(tmp_path: Path) -> None:
    """``migrated`` round-trips; a record written before the field existed reads as 0; a
    negative count is refused."""
    c = RouterCountersObserved(PID, "copy1", submitted=6, completed=6, redispatched=1, lost=0,
                               duplicated=0, cancelled=0, in_flight=0, migrated=3, time=2.0)
    old = {k: v for k, v in c.to_json().items() if k != "migrated"} | {"copy_id": "copy0"}
    (tmp_path / f"{PID}.jsonl").write_text(json.dumps(c.to_json()) + "\n" + json.dumps(old)
                                           + "\n")
    got = read_observations(tmp_path).router_counters
    assert [(r.copy_id, r.migrated) for r in got] == [("copy1", 3), ("copy0", 0)]
    with pytest.raises(ObservationError, match="migrated=-1"):
        RouterCountersObserved(PID, "c", 0, 0, 0, 0, 0, 0, 0, migrated=-1)


def test_absent_directory_reads_empty(tmp_path: Path) -> None:
    obs = read_observations(tmp_path / "nothing")
    assert obs.empty and obs.pipelines() == []


@pytest.mark.parametrize("line, message", [
    ("{not json", "not a JSON object"),
    ("[1, 2]", "expected a JSON object"),
    ('{"kind": "weights"}', "kind 'weights' is not valid; expected one of busy, "
                            "lifecycle, memory, router_counters, shard_versions"),
    ('{"kind": "shard_versions", "pipeline_id": "p"}', "malformed shard_versions record"),
    ('{"kind": "router_counters", "pipeline_id": "p", "copy_id": "c", "submitted": 5, '
     '"completed": 1, "redispatched": 0, "lost": 0, "duplicated": 0, "cancelled": 0, '
     '"in_flight": 0, "time": 1}', "submitted=5 != completed 1"),
    ('{"kind": "shard_versions", "pipeline_id": "p", "event": "resync", "trainer_version": 1, '
     '"synced": [], "shard_versions": {}, "time": 1}', "event 'resync' is not valid"),
])
def test_reader_names_file_line_and_what_is_valid(tmp_path: Path, line: str,
                                                 message: str) -> None:
    good = json.dumps(_versions().to_json())
    (tmp_path / "p.jsonl").write_text(f"{good}\n\n{line}\n")
    with pytest.raises(ObservationError, match=r"p\.jsonl:3: ") as err:
        read_observations(tmp_path)
    assert message in str(err.value)


def test_writer_is_off_without_the_env_var(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_OBSERVE_DIR, raising=False)
    monkeypatch.chdir(tmp_path)
    writer = ObservationWriter.from_env(PID)
    assert not writer.enabled and writer.path is None
    writer.write(_versions())  # no-op
    assert router_counters_emitter(PID) is None
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setenv(ENV_OBSERVE_DIR, str(tmp_path / "obs"))
    emitter = router_counters_emitter(PID)
    assert emitter is not None and emitter.writer.path == tmp_path / "obs" / f"{PID}.jsonl"


def test_writer_from_env_takes_dir_and_pipeline_id(tmp_path: Path) -> None:
    env = {ENV_OBSERVE_DIR: str(tmp_path / "obs"), "PIPELINE_ID": PID}
    writer = ObservationWriter.from_env(env=env)
    assert writer.enabled and writer.path == tmp_path / "obs" / f"{PID}.jsonl"
    copy = pickle.loads(pickle.dumps(writer))
    copy.write(_versions())
    assert len(read_observations(tmp_path / "obs").shard_versions) == 1
    with pytest.raises(ObservationError, match="given to the writer of"):
        writer.write(_versions(pipeline_id="ft_ffffffffffff"))


def test_env_var_set_but_empty_is_an_error() -> None:
    with pytest.raises(ObservationError, match="RLIX_OBSERVE_DIR is set but empty"):
        ObservationWriter.from_env(PID, env={ENV_OBSERVE_DIR: " "})


@pytest.mark.parametrize("bad", ["", "a/b", "../x", ".hidden"])
def test_pipeline_id_must_name_a_file(tmp_path: Path, bad: str) -> None:
    with pytest.raises(ObservationError, match="cannot name a record file"):
        ObservationWriter(tmp_path, bad)


def _append_many(directory: str, worker: int, n: int) -> None:
    writer = ObservationWriter(Path(directory), PID)
    emit = RouterCountersEmitter(writer)
    for i in range(n):
        # Long copy ids make each line several hundred bytes: torn writes would show.
        emit(RouterCounters(f"w{worker}-" + "x" * 300, i + 1, i, 0, 0, 1, 0, i))


def test_concurrent_writers_never_tear_a_line(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_append_many, args=(str(tmp_path), w, 150)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    obs = read_observations(tmp_path)  # raises on any torn line
    assert len(obs.router_counters) == 600
    per_copy: dict[str, int] = {}
    for r in obs.router_counters:
        per_copy[r.copy_id] = per_copy.get(r.copy_id, 0) + 1
    assert sorted(per_copy.values()) == [150] * 4


# ---------------------------------------------------------------------------- request ledger


def test_ledger_counts_each_way_a_request_leaves() -> None:
    seen: list[RouterCounters] = []
    led = RequestLedger(seen.append, emit_interval_s=3600)
    for rid in ("a", "b", "c", "d"):
        led.begin(rid)
    led.complete("a")
    led.redispatch()
    led.lose("b")  # a loss is emitted at once
    assert seen[-1].lost == 1 and seen[-1].in_flight == 2
    led.cancel("c")
    led.begin("a")  # already completed: duplicate
    led.begin("d")  # in flight: duplicate
    led.complete("a")
    led.complete("d")
    led.complete("d")  # drained: emitted
    c = led.counters()
    assert (c.submitted, c.completed, c.lost, c.cancelled, c.in_flight, c.duplicated,
            c.redispatched) == (6, 4, 1, 1, 0, 2, 1)
    assert seen[-1] == c
    RouterCountersObserved.from_counters(PID, c)  # the invariant holds


def test_ledger_emits_on_drain_or_interval_only() -> None:
    seen: list[RouterCounters] = []
    led = RequestLedger(seen.append, emit_interval_s=3600)
    led.begin("a")
    led.begin("b")
    led._last_emit = float("inf")  # as if it had just emitted
    led.complete("a")
    assert seen == []  # b still in flight, interval not over
    led.complete("b")
    assert len(seen) == 1 and seen[0].in_flight == 0


def test_ledger_memory_of_completed_ids_is_bounded() -> None:
    led = RequestLedger(None, remember_completed=2)
    for rid in ("a", "b", "c"):
        led.begin(rid)
        led.complete(rid)
    led.begin("c")
    assert led.duplicated == 1
    led.begin("a")  # forgotten: beyond the window
    assert led.duplicated == 1


def test_router_ledger_real_router_lost_and_cancelled() -> None:
    """A real router over a real state owner with no active shard: the request times out
    (lost), a second one is cancelled by its caller; both counted, both emitted."""
    store = ShardStateStore(2, initial=ShardStatus.SLEEPING)
    seen: list[RouterCounters] = []
    router = ShardRouter(LocalShardState(store), [ScriptedEngineStandIn(0.0)] * 2,
                         RouterConfig(wait_timeout_s=0.05), on_counters=seen.append)

    async def go() -> None:
        with pytest.raises(NoActiveShardError):
            await router.generate(GenerationRequest("lost-1", (5,), 2))
        task = asyncio.ensure_future(router.generate(GenerationRequest("cancel-1", (5,), 2)))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(go())
    c = router.counters()
    assert (c.submitted, c.lost, c.cancelled, c.completed, c.in_flight) == (2, 1, 1, 0, 0)
    assert seen[-1] == c


def test_router_completes_and_detects_a_duplicate_id() -> None:
    store = ShardStateStore(2, initial=ShardStatus.ACTIVE)
    seen: list[RouterCounters] = []
    router = ShardRouter(LocalShardState(store), [ScriptedEngineStandIn(0.01)] * 2,
                         on_counters=seen.append)

    async def go() -> None:
        await asyncio.gather(*(router.generate(GenerationRequest(f"r{i}", (5,), 3))
                               for i in range(5)))
        await router.generate(GenerationRequest("r0", (5,), 3))

    asyncio.run(go())
    c = router.counters()
    assert (c.submitted, c.completed, c.duplicated, c.in_flight) == (6, 6, 1, 0)
    assert router.stats().requests == 6 and router.stats().completed == 6


def test_pickled_router_keeps_its_emitter_and_starts_a_new_copy(tmp_path: Path) -> None:
    emitter = RouterCountersEmitter(ObservationWriter(tmp_path, PID))
    router = ShardRouter(_ray_view(), [FakePicklableEngine("a"), FakePicklableEngine("b")],
                         on_counters=emitter)
    router._ledger.begin("x")
    copy = pickle.loads(pickle.dumps(router))
    assert copy.counters().submitted == 0 and copy.counters().copy_id != router.counters().copy_id
    copy.emit_counters()
    (rec,) = read_observations(tmp_path).router_counters
    assert rec.copy_id == copy.counters().copy_id and rec.pipeline_id == PID
