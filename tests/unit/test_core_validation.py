"""Scheduling core validation: invariants that could not fail, inputs that were accepted
and broke planning later, and a fenced pipeline's GPUs freed by a release."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rlix_plugins.coordinator.core import (
    ClusterSpec,
    GpuOwner,
    Grant,
    InvariantViolation,
    PendingRequest,
    PipelineSpec,
    Plan,
    PolicyConfig,
    RankMove,
    SchedulerState,
    ShrinkReason,
    Topology,
    check_plan,
    check_state,
    validate_registration,
)
from rlix_plugins.coordinator.core.snapshot import restore, snapshot
from rlix_plugins.errors import (
    CorruptStateError,
    RegistrationError,
    RequestStateError,
    SettingsError,
)
from rlix_plugins.protocol import Priority, ProgressReport
from tests.core_builders import cycle, new_state, observable, progress, register

GEN = Priority.GENERATION
INFER = "ft_a_actor_infer"


def _one_active_rank(gpus: int = 4) -> SchedulerState:
    """ft_a's generation cluster on GPUs 0..gpus-1 (tp=1) with rank 0 active."""
    state = new_state(1, gpus)
    register(state, "ft_a", train=[gpus - 1], infer=list(range(gpus)))
    state.active_ranks[INFER][0] = 0.0
    state.owner[0] = GpuOwner(INFER, 0, GEN)
    check_state(state)
    return state


# ---------------------------------------------------------------- check_plan


def test_p6_counts_ranks_the_same_plan_expands() -> None:
    """A plan that completes a planned release while expanding a rank of the same cluster
    leaves the cluster with an active rank after commit: P6 must refuse it (it only looked
    at the shrinks)."""
    state = _one_active_rank()
    state.plan_release(INFER, now=1.0)
    plan = Plan(
        state.revision,
        shrinks=(RankMove(INFER, 0, (0,), ShrinkReason.PLANNED_RELEASE),),
        expands=(RankMove(INFER, 1, (1,)),),
        completed_releases=(INFER,),
    )
    with pytest.raises(InvariantViolation) as info:
        check_plan(state, plan)
    assert info.value.code == "P6"


def test_p1_refuses_a_shrink_that_names_other_gpus_than_its_rank() -> None:
    """P5 reads a shrink's ``gpus``; a shrink naming the grant's GPU instead of its rank's
    passed P5 although the GPU it really frees (0) is taken by nobody."""
    state = _one_active_rank(2)
    state.submit_request("ft_a_actor_train", Priority.ACTOR_TRAINING, now=0.0)
    plan = Plan(
        state.revision,
        shrinks=(RankMove(INFER, 0, (1,), ShrinkReason.PREEMPT, "ft_a_actor_train"),),
        grants=(Grant("ft_a_actor_train", (1,)),),
    )
    with pytest.raises(InvariantViolation) as info:
        check_plan(state, plan)
    assert info.value.code == "P1"


# ---------------------------------------------------------------- check_state


def test_s5_refuses_a_pending_generation_request_for_a_cluster_with_active_ranks() -> None:
    """S5: never a pending request for a cluster that already has what it asks for; a
    GENERATION request is answered as soon as its cluster has an active rank."""
    state = _one_active_rank()
    state.pending[INFER] = PendingRequest(INFER, GEN, seq=1, submitted_at=0.0)
    with pytest.raises(InvariantViolation) as info:
        check_state(state)
    assert info.value.code == "S5"


def test_s3_refuses_an_owner_table_of_the_wrong_size() -> None:
    """S3 (idle + allocated = all GPUs) compared two numbers derived from each other and
    could not fail; a GPU table longer than the topology passed."""
    state = _one_active_rank()
    state.owner.append(None)
    with pytest.raises(InvariantViolation) as info:
        check_state(state)
    assert info.value.code == "S3"
    state.owner[-2:] = []
    with pytest.raises(InvariantViolation) as info:
        check_state(state)
    assert info.value.code == "S3"


@pytest.mark.parametrize("table", ["holdings", "active_ranks"])
def test_state_naming_an_unregistered_cluster_is_an_invariant_violation(table: str) -> None:
    """check_state raised a bare KeyError (not InvariantViolation) for a holding or active
    ranks of a cluster that is not registered."""
    state = _one_active_rank()
    if table == "holdings":
        state.holdings["ft_x_actor_train"] = Priority.ACTOR_TRAINING
    else:
        state.active_ranks["ft_x_actor_infer"] = {0: 0.0}
    with pytest.raises(InvariantViolation) as info:
        check_state(state)
    assert info.value.code == "S1"


# ---------------------------------------------------------------- demand


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_non_finite_outstanding_metric_is_ignored_not_a_planner_crash(bad: float) -> None:
    """``outstanding`` is documented as ignored when malformed; NaN raised ValueError and inf
    OverflowError in every planning cycle."""
    state = new_state(1, 2)
    register(state, "ft_a", infer=[0, 1])
    state.submit_request(INFER, GEN, now=0.0, step_target_estimate=4)
    state.report_progress(ProgressReport("ft_a", 10, None, {"outstanding": bad}))
    assert state.outstanding("ft_a") is None
    plan, _ = cycle(state, 0.0)
    assert plan.expands


# ---------------------------------------------------------------- registration


def _register_args(weight: object) -> dict[str, object]:
    return {
        "pipeline_id": "ft_a",
        "ray_namespace": "pipeline_ft_a_NS",
        "cluster_tp_configs": {"actor_infer": 1},
        "cluster_device_mappings": {"actor_infer": [0, 1]},
        "weight": weight,
    }


@pytest.mark.parametrize("weight", [math.inf, 10**400])
def test_registration_refuses_a_weight_that_is_not_a_finite_number(weight: object) -> None:
    """An infinite weight was accepted and made the planner's shares NaN (ValueError in every
    cycle); an int too big for a float raised a bare OverflowError."""
    with pytest.raises(RegistrationError, match="weight must be a finite number > 0"):
        validate_registration(Topology(1, 2), **_register_args(weight))  # type: ignore[arg-type]


@pytest.mark.parametrize("gpus", [(-1,), (0, 2)])
def test_register_refuses_gpu_ids_outside_the_topology(gpus: tuple[int, ...]) -> None:
    """``register`` only refused ids >= num_gpus: a negative id aliased the last GPU."""
    state = new_state(1, 2)
    before = observable(state)
    spec = PipelineSpec(
        "ft_a", "ns", (ClusterSpec("ft_a_actor_train", "ft_a", "actor_train", 1, gpus),)
    )
    with pytest.raises(RegistrationError, match=r"outside 0\.\.1"):
        state.register(spec)
    assert observable(state) == before


# ---------------------------------------------------------------- fencing


def test_a_fenced_pipeline_may_not_release_its_gpus() -> None:
    """A fenced pipeline's GPUs stay owned until it is unregistered (its shards may still
    run); ``release`` freed them, so the next plan could hand them to someone else."""
    state = new_state(1, 2)
    register(state, "ft_a", infer=[0, 1])
    register(state, "ft_b", train=[0, 1])
    state.submit_request(INFER, GEN, now=0.0, step_target_estimate=5)
    cycle(state, 0.0)
    state.fence("ft_a")
    before = observable(state)
    with pytest.raises(RequestStateError, match="fenced"):
        state.release(INFER, now=1.0)
    assert observable(state) == before
    state.submit_request("ft_b_actor_train", Priority.ACTOR_TRAINING, now=1.0)
    plan, _ = cycle(state, 2.0)
    assert not plan.grants


# ---------------------------------------------------------------- policy


@pytest.mark.parametrize("field", ["aging_s", "min_hold_s", "reserve_after_s"])
def test_policy_refuses_nan(field: str) -> None:
    """NaN passed every ``< 0`` / ``<= 0`` check; NaN aging_s crashes each cycle."""
    with pytest.raises(SettingsError, match=field):
        PolicyConfig(**{field: math.nan})  # type: ignore[arg-type]


# ---------------------------------------------------------------- snapshot


def _with_progress() -> dict[str, object]:
    state = new_state(1, 2)
    register(state, "ft_a", infer=[0, 1])
    progress(state, "ft_a", 10, 2)
    state.submit_request(INFER, GEN, now=0.0, step_target_estimate=10)
    cycle(state, 0.0)
    data: dict[str, object] = json.loads(json.dumps(snapshot(state)))
    return data


def _damage_completed(d: dict) -> None:  # type: ignore[type-arg]
    d["progress"]["ft_a"][0]["metrics"]["completed"] = "x"


def _damage_target(d: dict) -> None:  # type: ignore[type-arg]
    d["progress"]["ft_a"][0]["step_target_trajectories"] = -3


def _ghost_progress(d: dict) -> None:  # type: ignore[type-arg]
    d["progress"]["ft_gone"] = [{**d["progress"]["ft_a"][0], "pipeline_id": "ft_gone"}]


def _misfiled_progress(d: dict) -> None:  # type: ignore[type-arg]
    d["progress"]["ft_a"][0]["pipeline_id"] = "ft_other"


def _ghost_estimate(d: dict) -> None:  # type: ignore[type-arg]
    d["estimates"]["ft_gone"] = 3


def _bad_estimate(d: dict) -> None:  # type: ignore[type-arg]
    d["estimates"]["ft_a"] = -1


@pytest.mark.parametrize(
    "damage",
    [
        _damage_completed,
        _damage_target,
        _ghost_progress,
        _misfiled_progress,
        _ghost_estimate,
        _bad_estimate,
    ],
)
def test_restore_refuses_malformed_demand(damage: object) -> None:
    """Progress was rebuilt without the wire checks (a malformed ``completed`` restored fine
    and crashed every planning cycle), and progress or estimates of unregistered pipelines
    were kept: a pipeline registering later under that id inherited a ghost's demand."""
    data = _with_progress()
    assert restore(data).demand("ft_a") == 8
    damage(data)  # type: ignore[operator]
    with pytest.raises(CorruptStateError, match="snapshot is malformed"):
        restore(data)


@given(
    completed=st.integers(0, 50),
    target=st.integers(0, 50),
    mode=st.sampled_from(["train", "val"]),
    adapter=st.one_of(st.none(), st.text("ab", min_size=1, max_size=3)),
    outstanding=st.one_of(st.none(), st.integers(0, 99)),
)
def test_progress_round_trips_through_a_snapshot(
    completed: int, target: int, mode: str, adapter: str | None, outstanding: int | None
) -> None:
    state = new_state(1, 2)
    register(state, "ft_a", infer=[0, 1])
    metrics: dict[str, object] = {"completed": completed, "mode": mode}
    if adapter is not None:
        metrics["adapter_id"] = adapter
    if outstanding is not None:
        metrics["outstanding"] = outstanding
    state.report_progress(ProgressReport("ft_a", target, 1.5, metrics))
    back = restore(json.loads(json.dumps(snapshot(state))))
    assert back.progress == state.progress
    assert back.demand("ft_a") == state.demand("ft_a")
    assert back.outstanding("ft_a") == state.outstanding("ft_a")
