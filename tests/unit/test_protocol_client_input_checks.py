"""Input checks of the wire protocol, the pipeline coordinator and progress accounting.

Each test pins a defect found in review: bad input that was accepted silently (and then lost
demand further down the wire), or a valid input the code mis-read.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import numpy as np
import pytest

from rlix_plugins.adapters.observability import ObservationWriter
from rlix_plugins.adapters.pipeline_coordinator import PipelineCoordinator
from rlix_plugins.adapters.shard_controller import LifecycleShardController
from rlix_plugins.errors import ProtocolError, ShardStateError
from rlix_plugins.generation import ShardLifecycle
from rlix_plugins.generation.loop_thread import LoopThread
from rlix_plugins.generation.shard_state import ShardStatus
from rlix_plugins.generation.state_store import LocalShardState, ShardStateStore
from rlix_plugins.protocol import (
    ProgressReport,
    coerce_progress_report,
    parse_cluster_id,
    validate_pipeline_id,
)
from rlix_plugins.training.progress import ProgressTracker
from tests.support.recording_engine import FakeRecordingEngine

# ----------------------------------------------------------------------------- names


@pytest.mark.parametrize("bad", ["ft_0123456789ab\n", "ft_a\n"])
def test_a_pipeline_id_with_a_trailing_newline_is_refused(bad: str) -> None:
    # ``$`` also matches before a trailing newline: the id (and the Ray actor and namespace
    # names built from it) was accepted with the newline in it.
    with pytest.raises(ProtocolError, match="invalid characters"):
        validate_pipeline_id(bad)
    with pytest.raises(ProtocolError, match="invalid characters"):
        parse_cluster_id(bad + "_actor_train")
    assert validate_pipeline_id("ft_0123456789ab") == "ft_0123456789ab"


# ----------------------------------------------------------------------------- reports


@pytest.mark.parametrize("fifo", [True, math.nan, math.inf, -math.inf])
def test_a_report_with_a_bool_or_non_finite_fifo_timestamp_is_refused(fifo: object) -> None:
    wire = {"pipeline_id": "ft_a", "step_target_trajectories": 4, "fifo_timestamp": fifo}
    with pytest.raises(ProtocolError, match="fifo_timestamp must be a finite number or None"):
        coerce_progress_report(wire)
    ok = coerce_progress_report({**wire, "fifo_timestamp": 3})
    assert ok.fifo_timestamp == 3.0


# ----------------------------------------------------------------------------- coordinator



class FakeShardsByClass:
    """FAKE shard controller (the real router needs vLLM engines), passed as a CLASS: the
    factory form ``Callable[[str], ShardController]`` the coordinator documents."""

    built_for: list[str] = []

    def __init__(self, pipeline_id: str) -> None:
        FakeShardsByClass.built_for.append(pipeline_id)
        self.calls: list[tuple[str, list[int]]] = []

    def shrink(self, dp_ranks: Sequence[int]) -> None:
        self.calls.append(("shrink", list(dp_ranks)))

    def expand(self, dp_ranks: Sequence[int]) -> None:
        self.calls.append(("expand", list(dp_ranks)))


@pytest.mark.usefixtures("no_rlix_shim_left")
def test_a_shard_controller_class_is_used_as_a_factory_not_as_the_controller() -> None:
    # A class has ``shrink``/``expand`` attributes, so the runtime Protocol check took the
    # class itself for a controller: every resize then failed (unbound method) and the
    # scheduler fenced the pipeline.
    FakeShardsByClass.built_for.clear()
    coord = PipelineCoordinator("ft_a", FakeShardsByClass)
    assert isinstance(coord.shards, FakeShardsByClass)
    assert FakeShardsByClass.built_for == ["ft_a"]
    reply = coord.resize_infer([], [0])
    assert reply.success, reply.message
    assert coord.shards.calls == [("expand", [0])]


# ----------------------------------------------------------------------------- tracker


def _wire_tracker() -> tuple[ProgressTracker, list[ProgressReport]]:
    """A tracker whose sink applies the scheduler's own wire check (what it accepts)."""
    accepted: list[ProgressReport] = []

    def sink(report: ProgressReport) -> None:
        accepted.append(coerce_progress_report(report))

    return ProgressTracker("ft_0123456789ab", sink, clock=lambda: 1.0), accepted


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"step_target": 64.0}, "step_target"),
        ({"step_target": True}, "step_target"),
        ({"step": 1.0}, "step"),
        ({"weight_version": "0"}, "weight_version"),
        ({"already_collected": 2.5}, "already_collected"),
    ],
)
def test_begin_batch_refuses_non_int_values_and_leaves_the_tracker_unchanged(
    kwargs: dict[str, object], named: str
) -> None:
    # A float target was accepted; every report then failed the scheduler's wire check
    # inside the sink, which the tracker swallows: the pipeline's demand never arrived.
    t, accepted = _wire_tracker()
    args: dict[str, object] = {"step": 1, "step_target": 64, "weight_version": 0}
    with pytest.raises(ProtocolError, match=named):
        t.begin_batch(**{**args, **kwargs})  # type: ignore[arg-type]
    assert accepted == [] and not t.active
    t.begin_batch(step=1, step_target=64, weight_version=0)
    assert [r.step_target_trajectories for r in accepted] == [64]


@pytest.mark.parametrize("n", [1.5, True, "1"])
def test_record_refuses_a_non_int_count_and_keeps_the_count(n: object) -> None:
    t, accepted = _wire_tracker()
    t.begin_batch(step=1, step_target=4, weight_version=0)
    with pytest.raises(ProtocolError, match="n must be an int"):
        t.record(n, weight_version=0)  # type: ignore[arg-type]
    with pytest.raises(ProtocolError, match="collected must be an int"):
        t.set_collected(n)  # type: ignore[arg-type]
    assert t.collected == 0
    t.record(2, weight_version=0)
    assert [r.completed for r in accepted] == [0, 2]


def test_tracker_refuses_a_bad_pipeline_id_or_age_window_at_construction() -> None:
    # Both were accepted; the id failed every report at the scheduler (swallowed), the age
    # window raised from every record() instead.
    with pytest.raises(ProtocolError, match="pipeline_id"):
        ProgressTracker("ft:a", lambda r: None)
    with pytest.raises(ProtocolError, match="max_age_steps"):
        ProgressTracker("ft_a", lambda r: None, max_age_steps=-1)


# ----------------------------------------------------------------------------- shard controller


@pytest.fixture
def two_shards() -> Iterator[tuple[LifecycleShardController, ShardStateStore, list[object]]]:
    """Two ACTIVE shards under a real lifecycle; version 3 cached; calls and syncs recorded."""
    store = ShardStateStore(2)
    view = LocalShardState(store)
    calls: list[object] = []
    lifecycle = ShardLifecycle(view, [FakeRecordingEngine(r, calls) for r in range(2)])
    loop = LoopThread(name="test-review-shards")
    controller = LifecycleShardController(
        lifecycle, view, lambda ranks, v: calls.append(("sync", list(ranks), v)), lambda: 3,
        observer=ObservationWriter(None, None), loop=loop,
    )
    try:
        yield controller, store, calls
    finally:
        loop.close()


@pytest.mark.parametrize("op", ["shrink", "expand"])
def test_an_unhashable_rank_gets_a_shard_state_error_not_a_type_error(
    two_shards: tuple[LifecycleShardController, ShardStateStore, list[object]], op: str
) -> None:
    controller, store, calls = two_shards
    with pytest.raises(ShardStateError, match=r"\[\[1\]\] do not exist; valid ranks are 0\.\.1"):
        getattr(controller, op)([0, [1]])
    assert calls == [] and store.snapshot().statuses == (ShardStatus.ACTIVE,) * 2


def test_numpy_ranks_are_taken_as_the_ranks_they_are(
    two_shards: tuple[LifecycleShardController, ShardStateStore, list[object]],
) -> None:
    # They were refused as ranks that "do not exist" although 0..1 are valid.
    controller, store, calls = two_shards
    controller.shrink([np.int64(1), np.int64(1)])  # type: ignore[list-item]
    assert store.snapshot().statuses == (ShardStatus.ACTIVE, ShardStatus.SLEEPING)
    controller.expand(np.array([1]))  # type: ignore[arg-type]
    assert store.snapshot().statuses == (ShardStatus.ACTIVE,) * 2
    assert calls == [("abort_all", 1), ("sleep", 1), ("wake_up", 1), ("sync", [1], 3),
                     ("resume", 1)]
