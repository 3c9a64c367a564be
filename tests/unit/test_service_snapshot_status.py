"""Pure snapshot/restore and the status view of the scheduling state."""

from __future__ import annotations

import json

import pytest

from rlix_plugins.coordinator.core import SchedulerState, Topology, check_state
from rlix_plugins.coordinator.core.snapshot import restore, settle_inflight, snapshot
from rlix_plugins.coordinator.core.status import (
    DeadPipeline,
    StreamStatus,
    build_status,
    format_status,
)
from rlix_plugins.errors import ProtocolError
from rlix_plugins.protocol import OUTSTANDING_METRIC, Priority, ProgressReport
from tests.core_builders import cycle, new_state, progress, register

GEN = Priority.GENERATION


def _busy_state() -> SchedulerState:
    state = new_state(1, 8)
    register(state, "ft_a", train=[0, 1], infer=[0, 1, 2, 3, 4, 5], weight=2.0)
    register(state, "ft_b", train=[6, 7], infer=[4, 5, 6, 7], infer_tp=2)
    progress(state, "ft_a", 100, 10)
    state.submit_request("ft_a_actor_infer", GEN, now=0, step_target_estimate=100)
    state.submit_request("ft_b_actor_infer", GEN, now=0, step_target_estimate=50)
    cycle(state, 0)
    state.submit_request("ft_a_actor_train", Priority.OLD_LOG_PROBS, now=1)
    cycle(state, 1)
    state.submit_request("ft_b_actor_train", Priority.ACTOR_TRAINING, now=2)  # left pending
    return state


def test_snapshot_round_trips_through_json() -> None:
    state = _busy_state()
    data = json.loads(json.dumps(snapshot(state)))
    back = restore(data, Topology(1, 8))
    assert back.owner == state.owner
    assert back.holdings == state.holdings
    assert back.active_ranks == {c: r for c, r in state.active_ranks.items()}
    assert back.progress == state.progress
    assert back.estimates == state.estimates
    assert back.pipelines == state.pipelines
    assert back.revision > state.revision
    # Waiting calls died with the old actor; their retries must not collide with ghosts.
    assert back.pending == {} and "ft_b_actor_train" in state.pending
    back.submit_request("ft_b_actor_train", Priority.ACTOR_TRAINING, now=3)
    check_state(back)


def test_warming_ranks_survive_a_snapshot_and_older_snapshots_have_none() -> None:
    state = _busy_state()
    rank = next(iter(state.active_ranks["ft_a_actor_infer"]))
    state.warming.add(("ft_a_actor_infer", rank))
    data = json.loads(json.dumps(snapshot(state)))
    assert restore(data).warming == {("ft_a_actor_infer", rank)}
    del data["warming"]  # written before background expands existed
    assert restore(data).warming == set()


def test_restore_rejects_other_topology_and_version() -> None:
    data = snapshot(_busy_state())
    with pytest.raises(ProtocolError, match="topology"):
        restore(data, Topology(2, 8))
    with pytest.raises(ProtocolError, match="version"):
        restore({**data, "version": 99})


def test_settle_inflight_frees_confirmed_shrinks_and_keeps_possible_expands() -> None:
    state = new_state(1, 4)
    register(state, "ft_a", infer=[0, 1, 2, 3])
    register(state, "ft_b", infer=[2, 3])
    state.submit_request("ft_a_actor_infer", GEN, now=0, step_target_estimate=10)
    cycle(state, 0)
    assert set(state.active_ranks["ft_a_actor_infer"]) == {0, 1, 2, 3}
    # A plan moving a's rank 2 to b's rank 0 was in flight when the scheduler died:
    # the shrink answered, the expand may or may not have happened.
    back = restore(snapshot(state))
    settle_inflight(
        back,
        confirmed_shrinks=[("ft_a_actor_infer", 2)],
        possible_expands=[("ft_b_actor_infer", 0), ("ft_gone_actor_infer", 0)],
        now=5,
    )
    assert set(back.active_ranks["ft_a_actor_infer"]) == {0, 1, 3}
    assert set(back.active_ranks["ft_b_actor_infer"]) == {0}
    # An unconfirmed shrink keeps its GPU owned: the expand that needed it is not applied.
    back2 = restore(snapshot(state))
    settle_inflight(back2, confirmed_shrinks=[], possible_expands=[("ft_b_actor_infer", 0)], now=5)
    assert back2.owner == state.owner


def test_status_view_lists_owners_stages_demand_and_queue() -> None:
    state = _busy_state()
    status = build_status(state, 12.0, dead=[DeadPipeline("ft_x", "lease expired", 3.0)])
    assert status.revision == state.revision
    by_gpu = {g.gpu: g for g in status.gpus}
    assert by_gpu[0].owner_cluster == "ft_a_actor_train" and by_gpu[0].stage == "OLD_LOG_PROBS"
    assert by_gpu[6].owner_pipeline == "ft_b" and by_gpu[6].stage == "GENERATION"
    assert by_gpu[6].dp_rank == 1
    a = status.pipeline("ft_a")
    assert a is not None and a.demand == 90 and a.weight == 2.0
    assert a.streams == (StreamStatus("train", None, 100, 10, 90),)
    train = next(c for c in a.clusters if c.name == "actor_train")
    assert train.held_at == "OLD_LOG_PROBS" and train.held_gpus == (0, 1)
    [waiting] = status.wait_queue
    assert waiting.cluster_id == "ft_b_actor_train" and waiting.priority == "ACTOR_TRAINING"
    assert waiting.waited_s == pytest.approx(10.0)
    assert set(status.idle_gpus) == {g for g, o in enumerate(state.owner) if o is None}
    text = format_status(status)
    for needle in ("ft_a_actor_train", "OLD_LOG_PROBS", "WAIT QUEUE", "lease expired",
                   "stream train        10/100 done  remaining=90"):
        assert needle in text
    with pytest.raises(AttributeError):
        status.revision = 5  # type: ignore[misc]


def test_reservation_figures_and_fenced_pipelines_survive_a_snapshot() -> None:
    """What the reservation rule plans with (held_since, last_hold_s) and the pipelines frozen
    until confirmed dead used to be lost by a restart: no cluster could backfill, and a
    restored fenced pipeline's ranks could be moved (P7)."""
    state = _busy_state()
    state.release("ft_a_actor_train", now=11.0)  # held from 1 to 11
    state.fence("ft_b")
    data = json.loads(json.dumps(snapshot(state)))
    back = restore(data, Topology(1, 8))
    assert back.last_hold_s == state.last_hold_s == {"ft_a_actor_train": 10.0}
    assert back.held_since == state.held_since
    assert back.fenced == {"ft_b"}
    # snapshots written before these fields existed restore as before (nothing known)
    for key in ("held_since", "last_hold_s", "fenced"):
        del data[key]
    older = restore(data, Topology(1, 8))
    assert older.last_hold_s == {} and older.fenced == set()


@pytest.mark.parametrize(
    "damage",
    [
        lambda d: d.pop("topology"),
        lambda d: d["holdings"].update({"x_actor_train": 1}),
        lambda d: d.update(pipelines="nonsense"),
        lambda d: d["active_ranks"].update({"ft_a_actor_infer": [[0, "soon"]]}),
    ],
)
def test_a_malformed_snapshot_is_a_corrupt_state_error(damage: object) -> None:
    from rlix_plugins.errors import CorruptStateError

    data = json.loads(json.dumps(snapshot(_busy_state())))
    damage(data)  # type: ignore[operator]
    with pytest.raises(CorruptStateError, match="snapshot is malformed"):
        restore(data, Topology(1, 8))
    with pytest.raises(CorruptStateError, match="JSON object"):
        restore([], Topology(1, 8))  # type: ignore[arg-type]


def test_bad_request_fields_are_refused_and_leave_state_unchanged() -> None:
    from rlix_plugins.errors import RequestStateError, UnknownPipelineError
    from tests.core_builders import observable

    state = _busy_state()
    before = observable(state)
    with pytest.raises(RequestStateError, match="global_step must be an int >= 0"):
        state.submit_request("ft_a_actor_infer", GEN, now=3, global_step="junk")  # type: ignore[arg-type]
    with pytest.raises(RequestStateError, match="lora_name must be a str"):
        state.submit_request("ft_a_actor_infer", GEN, now=3, lora_name=object())  # type: ignore[arg-type]
    with pytest.raises(ProtocolError, match="pipeline_id must be a non-empty str"):
        state.pipeline(["ft_a"])  # type: ignore[arg-type]
    with pytest.raises(UnknownPipelineError, match="pipeline 'ft_zz' is not registered"):
        state.pipeline("ft_zz")
    assert observable(state) == before


def test_status_lists_each_progress_stream_with_its_outstanding_requests() -> None:
    """Demand is the sum over a pipeline's streams; the view shows each one (a validation
    stream next to training, a LoRA adapter's) and ignores a malformed ``outstanding``."""
    state = new_state(1, 4)
    register(state, "ft_a", infer=[0, 1, 2, 3])
    metrics: list[dict[str, object]] = [
        {"completed": 3, "mode": "train", OUTSTANDING_METRIC: 9},
        {"completed": 0, "mode": "val"},
        {"completed": 1, "mode": "train", "adapter_id": "lora_1", OUTSTANDING_METRIC: -2},
    ]
    for target, m in zip((8, 6, 4), metrics, strict=True):
        state.report_progress(ProgressReport("ft_a", target, None, m))
    a = build_status(state, now=0.0).pipeline("ft_a")
    assert a is not None and a.demand == 5 + 6 + 3 and a.progress_streams == 3
    assert a.streams == (
        StreamStatus("train", None, 8, 3, 5, 9),
        StreamStatus("train", "lora_1", 4, 1, 3, None),
        StreamStatus("val", None, 6, 0, 6, None),
    )
    text = format_status(build_status(state, now=0.0))
    assert "stream train/lora_1 1/4 done  remaining=3\n" in text
    assert "stream val          0/6 done  remaining=6" in text
    assert "remaining=5 outstanding=9" in text
