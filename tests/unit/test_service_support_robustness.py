"""Robustness of the coordinator service's support modules: trace files, state store, topology,
placement groups, orchestrator shutdown and coordinator stop (pure unit tests, no Ray)."""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from rlix_plugins.coordinator.core import Topology
from rlix_plugins.coordinator.service import client, persistence, resource_manager
from rlix_plugins.coordinator.service.orchestrator_actor import OrchestratorService
from rlix_plugins.coordinator.service.persistence import FileStateStore
from rlix_plugins.coordinator.service.resource_manager import (
    ResourceManagerService,
    RollResourceManagerService,
    topology_from_nodes,
)
from rlix_plugins.coordinator.service.trace import Holder, OwnershipTrace
from rlix_plugins.errors import (
    CorruptStateError,
    ProtocolError,
    RlixPluginsError,
    UnknownPipelineError,
)
from rlix_plugins.protocol.names import ROLL_RESOURCE_MANAGER_ACTOR, SCHEDULER_ACTOR

# ------------------------------------------------------------------ trace file


def _two_snapshots() -> tuple[dict[str, Any], dict[str, Any]]:
    trace = OwnershipTrace(1, t0=0.0)
    trace.observe([Holder("ft_a_actor_infer", "GENERATION", 0)], 0.0)
    older = trace.to_json(1.0)
    trace.observe([Holder("ft_b_actor_train", "ACTOR_TRAINING")], 2.0)
    newer = trace.to_json(3.0)
    return older, newer


def _cats(path: Path) -> list[str]:
    return [e["cat"] for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]


def test_concurrent_trace_writes_do_not_collide(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scheduler writes the timeline from a thread (periodic) and on its loop
    (flush_trace, stop) at once: neither write may fail or leave half a file."""
    older, newer = _two_snapshots()
    path = tmp_path / "timeline.json"
    real_replace = os.replace
    first_in_replace, release_first = threading.Event(), threading.Event()
    calls = 0

    def slow_first_replace(src: Any, dst: Any) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:  # the background write is slow to finish
            first_in_replace.set()
            release_first.wait(5)
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", slow_first_replace)
    errors: list[BaseException] = []

    def write(data: dict[str, Any]) -> None:
        try:
            OwnershipTrace.write_json(path, data)
        except BaseException as exc:
            errors.append(exc)

    background = threading.Thread(target=write, args=(older,))
    background.start()
    assert first_in_replace.wait(5)
    final = threading.Thread(target=write, args=(newer,))
    final.start()
    time.sleep(0.2)  # the final write runs into the background one's temp file
    release_first.set()
    background.join(5)
    final.join(5)
    assert errors == []
    assert _cats(path) == ["GENERATION", "ACTOR_TRAINING"]  # the newer snapshot
    assert sorted(p.name for p in tmp_path.iterdir()) == ["timeline.json"]


def test_an_older_trace_snapshot_never_replaces_a_newer_one(tmp_path: Path) -> None:
    """At stop the final write must win over a periodic write still finishing in its thread."""
    older, newer = _two_snapshots()
    path = tmp_path / "timeline.json"
    OwnershipTrace.write_json(path, newer)
    OwnershipTrace.write_json(path, older)
    assert _cats(path) == ["GENERATION", "ACTOR_TRAINING"]


# ------------------------------------------------------------------ state store


def test_a_state_file_with_invalid_utf8_is_a_corrupt_state_error(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    path.write_bytes(b'{"state": "\xff\xfe"}')
    with pytest.raises(CorruptStateError, match=str(path)):
        FileStateStore(path).load()


# ------------------------------------------------------------------ topology


def _node(gpus: float, addr: str) -> dict[str, object]:
    return {"Alive": True, "NodeManagerAddress": addr, "NodeID": addr, "Resources": {"GPU": gpus}}


@pytest.mark.parametrize("required", [0, -1, "4", True, 2.5])
def test_a_bad_required_gpu_count_is_a_typed_error(required: Any) -> None:
    with pytest.raises(ProtocolError, match=r"required_gpus_per_node must be an int >= 1"):
        topology_from_nodes([_node(8, "a")], required)


def test_concurrent_init_topology_first_call_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    """``init_topology``: the first call freezes the topology; a concurrent call asking for
    another GPU count is refused, not silently applied over it."""

    def slow_topology(required: int | None = None) -> Topology:
        time.sleep(0.05)  # a GCS round trip
        return Topology(1, required or 8)

    monkeypatch.setattr(resource_manager, "topology_from_ray", slow_topology)
    rm = ResourceManagerService()

    async def both() -> list[Any]:
        return await asyncio.gather(
            rm.init_topology(required_gpus_per_node=4),
            rm.init_topology(required_gpus_per_node=2),
            return_exceptions=True,
        )

    first, second = asyncio.run(both())
    assert first == 4
    assert isinstance(second, RlixPluginsError) and "frozen at 4" in str(second)
    assert asyncio.run(rm.get_topology()) == Topology(1, 4)


# ------------------------------------------------------------------ placement groups


class FakePendingPlacementGroup:
    """FAKE Ray placement group that never becomes ready (the GPUs are not free yet)."""

    def __init__(self, name: str) -> None:
        self.name = name

    async def ready(self) -> None:
        await asyncio.Event().wait()


def test_a_placement_group_creation_given_up_removes_what_it_created(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A caller that gives up while the shared groups are pending must not leave them
    reserved: the next call would create a second set that can never be placed."""
    pg_module = importlib.import_module("ray.util.placement_group")
    created: list[str] = []
    removed: list[str] = []

    def placement_group(bundles: list[dict[str, float]], name: str,
                        **_: Any) -> FakePendingPlacementGroup:
        created.append(name)
        return FakePendingPlacementGroup(name)

    monkeypatch.setattr(pg_module, "placement_group", placement_group)
    monkeypatch.setattr(pg_module, "remove_placement_group", lambda pg: removed.append(pg.name))
    rm = RollResourceManagerService(Topology(2, 4))

    async def give_up() -> None:
        task = asyncio.ensure_future(rm.get_state())
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(give_up())
    assert created == ["rlix_pg_node0", "rlix_pg_node1"]
    assert sorted(removed) == created


# ------------------------------------------------------------------ orchestrator


class _Remote:
    def __init__(self, fn: Any) -> None:
        self._fn = fn

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        return self._fn(*args, **kwargs)


class FakeSchedulerHandle:
    """FAKE ``rlix:scheduler`` handle: pipeline ``ft_gone`` is listed by get_status but is
    declared dead (unregistered) before shutdown reaches it."""

    def __init__(self) -> None:
        self.ended: list[str] = []
        self.get_status = _Remote(self._status)
        self.unregister_pipeline = _Remote(self._end)
        self.kill_pipeline = _Remote(self._end)

    async def _status(self) -> Any:
        return SimpleNamespace(
            pipelines=[SimpleNamespace(pipeline_id=p) for p in ("ft_gone", "ft_b")]
        )

    async def _end(self, pipeline_id: str) -> tuple[int, ...]:
        if pipeline_id == "ft_gone":
            raise UnknownPipelineError(f"pipeline {pipeline_id!r} is not registered")
        self.ended.append(pipeline_id)
        return ()


@pytest.mark.parametrize("force", [False, True])
def test_shutdown_ends_every_pipeline_even_if_one_went_away_meanwhile(force: bool) -> None:
    orchestrator = OrchestratorService("rlix_test")
    sched = FakeSchedulerHandle()
    orchestrator._scheduler = sched
    ended = asyncio.run(orchestrator.shutdown(force=force, reason="test"))
    assert sched.ended == ["ft_b"]
    assert ended == 1


# ------------------------------------------------------------------ stop_coordinator


def test_stop_clears_the_saved_state_only_once_the_scheduler_is_killed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A scheduler that did not stop in time still saves its state until it is killed, so the
    state must be cleared after the kill, or the next coordinator restores it."""
    events: list[str] = []
    alive = {name: SimpleNamespace(name=name) for name in client.CONTROL_ACTORS}
    alive[SCHEDULER_ACTOR].stop = _Remote(lambda **kw: "stop")
    alive[ROLL_RESOURCE_MANAGER_ACTOR].destroy_placement_group = _Remote(lambda: "destroy")

    def fake_get(ref: Any, timeout: float | None = None) -> None:
        if ref == "stop":
            raise TimeoutError("FAKE: the scheduler did not answer stop in time")

    class FakeKvStore:
        """FAKE Ray-KV store: records when it is cleared."""

        def __init__(self, namespace: str) -> None:
            pass

        def clear(self) -> None:
            events.append("clear")

    def fake_kill(handle: Any, no_restart: bool = True) -> None:
        events.append(f"kill {handle.name}")
        alive.pop(handle.name, None)

    monkeypatch.setattr(client, "_get", lambda name, ns: alive.get(name))
    monkeypatch.setattr(client.ray, "get", fake_get)
    monkeypatch.setattr(client.ray, "kill", fake_kill)
    monkeypatch.setattr(persistence, "KvStateStore", FakeKvStore)
    stopped = client.stop_coordinator("rlix_test", timeout_s=1.0)
    assert sorted(stopped) == sorted(client.CONTROL_ACTORS)
    assert "clear" in events
    assert events.index(f"kill {SCHEDULER_ACTOR}") < events.index("clear")


def test_a_state_directory_made_by_the_first_save_is_made_durable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first save creates the state file's directories; their entries must be synced
    too, or a host crash loses the directory (and the state in it)."""
    synced: set[int] = set()
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        synced.add(os.fstat(fd).st_ino)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    store = FileStateStore(tmp_path / "a" / "b" / "state.json")
    store.save({"x": 1})
    for directory in (tmp_path, tmp_path / "a", tmp_path / "a" / "b"):
        assert directory.stat().st_ino in synced, directory
    assert store.load() == {"x": 1}


@pytest.mark.parametrize(
    ("field", "value"),
    [("tick_s", 0.0), ("liveness_interval_s", -1.0), ("probe_timeout_s", float("nan")),
     ("request_timeout_s", "60"), ("lease_s", True), ("resize_timeout_s", float("inf"))],
)
def test_service_config_rejects_periods_and_timeouts_that_cannot_work(
    field: str, value: object
) -> None:
    from rlix_plugins.coordinator.service.config import ServiceConfig
    from rlix_plugins.errors import SettingsError

    with pytest.raises(SettingsError, match=rf"ServiceConfig\.{field} must be finite seconds"):
        ServiceConfig(**{field: value})  # type: ignore[arg-type]
    with pytest.raises(SettingsError, match="namespace must be a non-empty string"):
        ServiceConfig(namespace="")
