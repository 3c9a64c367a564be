"""Pure parts of the service: trace, persistence, topology, compat shim, hooks, aggregation."""

from __future__ import annotations

import json
import pickle
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from rlix_plugins.adapters.pipeline_coordinator import PipelineCoordinator, aggregate_reports
from rlix_plugins.coordinator.service import rlix_compat
from rlix_plugins.coordinator.service.persistence import FileStateStore
from rlix_plugins.coordinator.service.resource_manager import topology_from_nodes
from rlix_plugins.coordinator.service.trace import Holder, OwnershipTrace
from rlix_plugins.errors import RlixPluginsError, SettingsError
from rlix_plugins.hooks import NoOpRLixHooks, make_hooks
from rlix_plugins.hooks.coordinator_hooks import ProgressThrottle
from rlix_plugins.protocol import ProgressReport, coerce_priority, coerce_progress_report
from rlix_plugins.settings import load_settings

# the coordinators built here install the ``rlix`` stand-in process-wide
pytestmark = pytest.mark.usefixtures("no_rlix_shim_left")

def test_trace_slices_follow_ownership_changes() -> None:
    trace = OwnershipTrace(2, t0=100.0)
    a, b = Holder("ft_a_actor_infer", "GENERATION", 0), Holder("ft_b_actor_train", "ACTOR_TRAINING")
    trace.observe([a, None], 100.0)
    trace.observe([a, None], 100.5)  # no change: no event
    trace.observe([b, b], 101.0)
    trace.instant("preempt: ft_a_actor_infer[0]", [0], 101.0, beneficiary="ft_b_actor_train")
    out = json.loads(json.dumps(trace.to_json(102.0)))
    slices = [e for e in out["traceEvents"] if e["ph"] == "X"]
    assert [(e["tid"], e["ts"], e["dur"], e["cat"]) for e in slices] == [
        (0, 0.0, 1e6, "GENERATION"),
        (0, 1e6, 1e6, "ACTOR_TRAINING"),  # still open: cut at "now"
        (1, 1e6, 1e6, "ACTOR_TRAINING"),
    ]
    [instant] = [e for e in out["traceEvents"] if e["ph"] == "i"]
    assert instant["tid"] == 0 and instant["args"]["beneficiary"] == "ft_b_actor_train"
    names = {e["args"]["name"] for e in out["traceEvents"] if e["name"] == "thread_name"}
    assert names == {"GPU 0", "GPU 1"}


def test_file_store_round_trip_and_clear(tmp_path: Path) -> None:
    store = FileStateStore(tmp_path / "d" / "state.json")
    assert store.load() is None
    store.save({"a": [1, 2]})
    store.save({"a": [3]})
    assert store.load() == {"a": [3]}
    assert [p.name for p in (tmp_path / "d").iterdir()] == ["state.json"]
    store.clear()
    store.clear()
    assert store.load() is None


def _node(gpus: float, addr: str, alive: bool = True) -> dict[str, object]:
    return {
        "Alive": alive,
        "NodeManagerAddress": addr,
        "NodeID": addr,
        "Resources": {"GPU": gpus, "CPU": 2.0},
    }


def test_topology_from_ray_nodes() -> None:
    nodes = [_node(8, "b"), _node(8, "a"), _node(0, "cpu"), _node(4, "dead", alive=False)]
    topo = topology_from_nodes(nodes)
    assert (topo.num_nodes, topo.gpus_per_node) == (2, 8)
    with pytest.raises(RlixPluginsError, match="different GPU counts"):
        topology_from_nodes([_node(8, "a"), _node(4, "b")])
    assert topology_from_nodes([_node(8, "a"), _node(4, "b")], 4).num_nodes == 2
    with pytest.raises(RlixPluginsError, match="no node"):
        topology_from_nodes([_node(0, "a")])


def test_rlix_shim_unpickles_rlix_classes_without_rlix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pkg = tmp_path / "rlix" / "protocol"
    pkg.mkdir(parents=True)
    (tmp_path / "rlix" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "types.py").write_text(
        "import enum\nfrom dataclasses import dataclass\n"
        "class Priority(enum.IntEnum):\n    INITIALIZATION = 0\n    GENERATION = 6\n"
        "@dataclass(frozen=True)\nclass ProgressReport:\n    pipeline_id: str\n"
        "    step_target_trajectories: int\n    fifo_timestamp: float = None\n"
        "    metrics: dict = None\n"
        "@dataclass(frozen=True, slots=True)\nclass SlotReport:\n    pipeline_id: str\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    from rlix.protocol import types as real  # type: ignore[import-not-found]

    blobs = [
        pickle.dumps(real.ProgressReport("ft_a", 8, 1.0, {"completed": 3})),
        pickle.dumps(real.Priority.GENERATION),
    ]
    # Now the coordinator's view: no rlix importable.
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(tmp_path)])
    for name in [m for m in sys.modules if m == "rlix" or m.startswith("rlix.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(rlix_compat, "_installed", False)
    before = list(sys.meta_path)
    try:
        assert rlix_compat.install()
        report = coerce_progress_report(pickle.loads(blobs[0]))
        assert (report.pipeline_id, report.remaining) == ("ft_a", 5)
        assert coerce_priority(pickle.loads(blobs[1])).name == "GENERATION"
    finally:
        sys.meta_path[:] = before
        for name in [m for m in sys.modules if m == "rlix" or m.startswith("rlix.")]:
            del sys.modules[name]


def test_progress_throttle_sends_on_bucket_change_done_and_new_batch() -> None:
    t = ProgressThrottle()

    def send(*, target: int, completed: int, new_batch: bool) -> bool:
        """What CoordinatorHooks does when every send is delivered."""
        state = t.state_of(target=target, completed=completed)
        wanted = t.wants(state, new_batch=new_batch)
        if wanted:
            t.mark_sent(state)
        return wanted

    sent = [send(target=100, completed=c, new_batch=False) for c in range(0, 7)]
    assert sent == [True, False, True, False, True, False, True]  # 2% buckets
    assert send(target=100, completed=6, new_batch=True)
    assert send(target=100, completed=100, new_batch=False)
    assert not send(target=100, completed=100, new_batch=False)
    assert send(target=200, completed=100, new_batch=False)  # target changed


def test_make_hooks_is_noop_when_off_and_needs_a_pipeline_id_when_on() -> None:
    assert isinstance(make_hooks(load_settings({})), NoOpRLixHooks)
    with pytest.raises(SettingsError, match="PIPELINE_ID"):
        make_hooks(load_settings({"RLIX_CONTROL_PLANE": "rlix"}), heartbeat=False)


def test_aggregate_reports_sums_streams() -> None:
    streams = {
        ("train", None): ProgressReport(
            "ft_a", 64, 5.0, {"completed": 16, "current_train_step": 3}
        ),
        ("train", "lora1"): ProgressReport("ft_a", 32, 2.0, {"collected": 40, "new_batch": True}),
    }
    agg = aggregate_reports("ft_a", streams)
    assert (agg.step_target_trajectories, agg.completed, agg.remaining) == (96, 48, 48)
    assert agg.fifo_timestamp == 2.0
    assert agg.metrics is not None
    assert agg.metrics["bucket"] == 25 and agg.metrics["new_batch"] is True
    assert agg.metrics["current_train_step"] == 3


class FakeShards:
    """Stands in for the generation module's router (needs vLLM engines) in this unit test."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[int]]] = []
        self.fail = False

    def shrink(self, dp_ranks: Sequence[int]) -> None:
        if self.fail:
            raise RuntimeError("engine gone")
        self.calls.append(("shrink", list(dp_ranks)))

    def expand(self, dp_ranks: Sequence[int]) -> None:
        self.calls.append(("expand", list(dp_ranks)))


def test_pipeline_coordinator_resize_with_fake_shards() -> None:
    shards = FakeShards()
    coord = PipelineCoordinator("ft_a", shards)
    assert coord.resize_infer([], [0, 1]).success
    assert coord.resize_infer([1], []).success
    assert coord.active_ranks() == [0]
    bad = coord.resize_infer([0], [1])
    assert not bad.success and "exactly one" in bad.message
    assert not coord.resize_infer([], []).success
    shards.fail = True
    failed = coord.resize_infer([0], [])
    assert not failed.success and "engine gone" in failed.message
    assert shards.calls == [("expand", [0, 1]), ("shrink", [1])]
    built = PipelineCoordinator("ft_b", lambda pid: FakeShards())
    assert isinstance(built.shards, FakeShards)


@pytest.mark.parametrize(
    ("remove", "add", "named"),
    [([], ["1"], "'1'"), ([], [1.5], "1.5"), ([True], [], "True"), ([-1], [], "-1"),
     ("01", [], "'01'"), ([], [None], "None")],
)
def test_resize_infer_answers_bad_ranks_without_touching_shards(
    remove: object, add: object, named: str
) -> None:
    shards = FakeShards()
    coord = PipelineCoordinator("ft_c", shards)
    reply = coord.resize_infer(remove, add)  # type: ignore[arg-type]
    assert not reply.success
    assert "DP ranks (ints >= 0)" in reply.message and named in reply.message
    assert shards.calls == [] and coord.active_ranks() == []
