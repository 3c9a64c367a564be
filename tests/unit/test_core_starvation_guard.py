"""The planner's starvation guard (``PolicyConfig.starve_after_s``) and the state it reads
(``SchedulerState.starving_since``): a generation cluster that wanted ranks and had none for
that long takes one rank from a pipeline at or below its target, never a pipeline's last."""

from __future__ import annotations

import json
import math

import pytest

from rlix_plugins.coordinator.core import (
    DemandSharePlanner,
    InvariantViolation,
    PolicyConfig,
    ShrinkReason,
    check_state,
)
from rlix_plugins.coordinator.core.snapshot import restore, snapshot
from rlix_plugins.coordinator.core.status import build_status, format_status
from rlix_plugins.errors import SettingsError
from rlix_plugins.protocol import Priority
from tests.core_builders import active, chain_of_spans, cycle, new_state, progress, register

GEN = Priority.GENERATION
B = "ft_b_actor_infer"


def test_a_starved_pipeline_takes_one_rank_once_it_has_waited_starve_after_s() -> None:
    planner = DemandSharePlanner(PolicyConfig(starve_after_s=50.0))
    state = chain_of_spans(planner)
    progress(state, "ft_b", 8, 0)
    cycle(state, 10.0, planner)
    assert state.starving_since == {B: 10.0}
    plan, _ = cycle(state, 59.0, planner)
    assert plan.empty and not active(state, "ft_b")
    plan, _ = cycle(state, 60.0, planner)
    assert [(m.cluster_id, m.reason, m.beneficiary) for m in plan.shrinks] == [
        ("ft_a_actor_infer", ShrinkReason.STARVATION, B)
    ]
    assert len(active(state, "ft_b")) == 1 and len(active(state, "ft_a")) == 3
    assert B not in state.starving_since
    # One rank, not a share: ft_a is still at or below its (inflated) target, so nothing more
    # moves while ft_b holds a rank.
    for t in (100.0, 1000.0):
        plan, _ = cycle(state, t, planner)
        assert plan.empty
    assert len(active(state, "ft_b")) == 1 and len(active(state, "ft_a")) == 3


def test_the_guard_is_off_with_an_infinite_bound() -> None:
    planner = DemandSharePlanner(PolicyConfig(starve_after_s=math.inf))
    state = chain_of_spans(planner)
    progress(state, "ft_b", 8, 0)
    for t in (10.0, 1e6):
        cycle(state, t, planner)
    assert not active(state, "ft_b") and state.starving_since == {B: 10.0}


def test_the_guard_never_takes_a_pipelines_last_rank() -> None:
    """``ft_b``'s only rank is GPU 0, where ``ft_a`` holds its one rank (its other GPU is
    held by training). The group's budget counts ``ft_c``'s rank on GPU 2, which only
    ``ft_c`` reaches, so both ``ft_a`` and ``ft_b`` get a target of one: ``ft_a`` is at its
    target, and only the guard could move its rank. It does not: a donor keeps one rank."""
    state = new_state(1, 3)
    register(state, "ft_x", train=[1])
    register(state, "ft_a", infer=[0, 1])
    register(state, "ft_b", infer=[0])
    register(state, "ft_c", infer=[1, 2])
    planner = DemandSharePlanner(PolicyConfig(starve_after_s=1.0))
    state.submit_request("ft_x_actor_train", Priority.ACTOR_TRAINING, now=0)
    progress(state, "ft_a", 100, 0)
    state.submit_request("ft_c_actor_infer", GEN, now=0)  # no estimate: one rank, no demand
    cycle(state, 0.0, planner)
    assert active(state, "ft_a") == {0} and active(state, "ft_c") == {1}
    progress(state, "ft_b", 100, 0)
    for t in (1.0, 10.0, 1000.0):
        plan, _ = cycle(state, t, planner)
        assert plan.empty
    assert active(state, "ft_a") == {0} and state.starving_since == {B: 1.0}


def test_starving_since_follows_want_and_ranks() -> None:
    state = chain_of_spans(DemandSharePlanner())
    assert state.starving_since == {}  # ft_b wants nothing yet
    state.submit_request(B, GEN, now=5.0)
    cycle(state, 5.0, DemandSharePlanner(PolicyConfig(starve_after_s=math.inf)))
    assert state.starving_since == {B: 5.0}
    cycle(state, 7.0, DemandSharePlanner(PolicyConfig(starve_after_s=math.inf)))
    assert state.starving_since == {B: 5.0}  # the first commit it starved at is kept
    assert not state.note_starving(7.5)  # nothing changed (the service saves on True)
    state.cancel_request(B)
    assert state.note_starving(7.5) and state.starving_since == {}
    cycle(state, 8.0)
    assert state.starving_since == {}  # wants nothing any more
    progress(state, "ft_b", 8, 0)
    cycle(state, 9.0, DemandSharePlanner(PolicyConfig(starve_after_s=math.inf)))
    assert state.starving_since == {B: 9.0}
    state.fence("ft_b")
    cycle(state, 10.0)
    assert state.starving_since == {}  # a fenced pipeline is frozen, not starving
    state.unregister("ft_b")
    register(state, "ft_b", infer=[0, 1, 2, 3])
    progress(state, "ft_b", 8, 0)
    cycle(state, 11.0, DemandSharePlanner(PolicyConfig(starve_after_s=math.inf)))
    assert state.starving_since == {B: 11.0}
    state.unregister("ft_b")
    assert state.starving_since == {}
    check_state(state)


def test_starving_since_survives_a_snapshot_and_shows_in_the_status() -> None:
    planner = DemandSharePlanner(PolicyConfig(starve_after_s=math.inf))
    state = chain_of_spans(planner)
    progress(state, "ft_b", 8, 0)
    cycle(state, 10.0, planner)
    data = json.loads(json.dumps(snapshot(state)))
    assert restore(data).starving_since == {B: 10.0}
    del data["starving_since"]  # written before the guard existed
    assert restore(data).starving_since == {}
    status = build_status(state, now=70.0)
    clusters = {c.cluster_id: c for p in status.pipelines for c in p.clusters}
    assert clusters[B].starving_s == 60.0 and clusters["ft_a_actor_infer"].starving_s is None
    assert "no rank for 60s" in format_status(status)


def test_check_state_catches_a_starving_record_of_a_cluster_with_ranks() -> None:
    state = chain_of_spans(DemandSharePlanner())
    state.starving_since["ft_a_actor_infer"] = 0.0
    with pytest.raises(InvariantViolation, match="S8"):
        check_state(state)
    del state.starving_since["ft_a_actor_infer"]
    state.starving_since["ft_z_actor_infer"] = 0.0
    with pytest.raises(InvariantViolation, match="S8"):
        check_state(state)


@pytest.mark.parametrize("bad", [-1.0, math.nan])
def test_a_negative_or_nan_bound_is_refused(bad: float) -> None:
    with pytest.raises(SettingsError, match="starve_after_s"):
        PolicyConfig(starve_after_s=bad)


def test_the_guard_may_take_a_donors_only_rank_there_when_the_donor_grows_elsewhere() -> None:
    """Found by the property test (its check was too strict): ``ft_1``'s one active rank sits
    on GPUs 6-7, the only GPUs of the starving ``ft_0``; its training holding GPUs 0, 2 and 4
    is released. The same cycle gives ``ft_1`` three ranks on the freed GPUs 0-5 and moves
    the one on 6-7 to ``ft_0``: the donor ends the cycle with ranks, the starving pipeline
    with its one."""
    planner = DemandSharePlanner(PolicyConfig(starve_after_s=8.0))
    state = new_state(2, 4)
    register(state, "ft_0", train=[0], infer=[6, 7], infer_tp=2)
    register(state, "ft_1", train=[0, 2, 4], infer=list(range(8)), infer_tp=2)
    progress(state, "ft_1", 1, 0)
    cycle(state, 0.0, planner)
    assert active(state, "ft_1") == {0, 1, 2, 3}
    state.submit_request("ft_1_actor_train", Priority.INITIALIZATION, now=0.0)
    state.submit_request("ft_0_actor_infer", GEN, now=0.0)
    cycle(state, 0.0, planner)  # the holding preempts ranks 0-2; ft_0 has none and waits
    assert active(state, "ft_1") == {3} and state.starving_since == {"ft_0_actor_infer": 0.0}
    cycle(state, 7.0, planner)
    assert active(state, "ft_0") == set()  # not yet starve_after_s
    state.release("ft_1_actor_train")
    plan, _ = cycle(state, 9.0, planner)
    assert [(m.cluster_id, m.dp_rank, m.reason) for m in plan.shrinks] == [
        ("ft_1_actor_infer", 3, ShrinkReason.STARVATION)
    ]
    assert active(state, "ft_0") == {0} and active(state, "ft_1") == {0, 1, 2}
    assert not state.starving_since
