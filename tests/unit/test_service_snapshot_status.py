"""Pure snapshot/restore and the status view of the scheduling state."""

from __future__ import annotations

import json

import pytest

from rlix_plugins.coordinator.core import SchedulerState, Topology, check_state
from rlix_plugins.coordinator.core.snapshot import restore, settle_inflight, snapshot
from rlix_plugins.coordinator.core.status import DeadPipeline, build_status, format_status
from rlix_plugins.errors import ProtocolError
from rlix_plugins.protocol import Priority
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
    train = next(c for c in a.clusters if c.name == "actor_train")
    assert train.held_at == "OLD_LOG_PROBS" and train.held_gpus == (0, 1)
    [waiting] = status.wait_queue
    assert waiting.cluster_id == "ft_b_actor_train" and waiting.priority == "ACTOR_TRAINING"
    assert waiting.waited_s == pytest.approx(10.0)
    assert set(status.idle_gpus) == {g for g, o in enumerate(state.owner) if o is None}
    text = format_status(status)
    for needle in ("ft_a_actor_train", "OLD_LOG_PROBS", "WAIT QUEUE", "lease expired"):
        assert needle in text
    with pytest.raises(AttributeError):
        status.revision = 5  # type: ignore[misc]
