"""Grants and registrations (Ray-free service from tests/fixtures/scheduler_service.py, FAKE
pipeline coordinators; and the pure core): a grant whose caller stopped waiting before its
save succeeded is given back, not kept by nobody; a plan carries the registration of each
pipeline it touches and its commit applies nothing to a successor under the same id."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from rlix_plugins.coordinator.core import (
    DemandSharePlanner,
    Grant,
    InvariantViolation,
    Plan,
    RankMove,
    SchedulerState,
    Topology,
    check_plan,
    check_state,
    validate_registration,
)
from rlix_plugins.errors import (
    CoordinatorUnavailableError,
    RequestStateError,
    RequestTimeoutError,
)
from rlix_plugins.protocol import Priority
from tests.fixtures.scheduler_service import ServiceBuilder, register_pipeline
from tests.unit.test_coordinator_service_failures import _failing_saves

PID, OTHER = "ft_review500001", "ft_review500002"
TRAIN, INFER = f"{PID}_actor_train", f"{PID}_actor_infer"
OTHER_TRAIN = f"{OTHER}_actor_train"


async def _until(check: object, what: str) -> None:
    for _ in range(200):
        if check():  # type: ignore[operator]
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


# ====================================================================== item 1: lost grants
@pytest.mark.parametrize("how", ["timeout", "cancelled"])
def test_a_grant_whose_caller_stopped_waiting_before_it_was_saved_is_given_back(
    scheduler_service: ServiceBuilder, how: str
) -> None:
    """Granted in memory while saves fail (its answer waits for a save), the caller's
    request_gpus timed out (or was cancelled) meanwhile: the grant used to stay with the
    pipeline, told nothing, holding its GPUs until it unregistered. Another pipeline waiting
    for those GPUs then waited forever."""

    async def go() -> None:
        service = scheduler_service(request_timeout_s=0.6)
        await register_pipeline(service, PID, train=[0, 1])
        await register_pipeline(service, OTHER, train=[0, 1])
        flag = _failing_saves(service)
        request = asyncio.create_task(
            service.request_gpus(cluster_id=TRAIN, priority=Priority.ACTOR_TRAINING)
        )
        await _until(lambda: bool(service._durable.held), "a commit whose save failed")
        assert TRAIN in service._state.holdings and not request.done()
        if how == "timeout":
            with pytest.raises(RequestTimeoutError, match="withdrawn"):
                await request
        else:
            request.cancel()
            with pytest.raises(asyncio.CancelledError):
                await request
        # Given back at once (in memory; saved with the next successful save).
        assert TRAIN not in service._state.holdings
        assert service._state.owner[0] is None and service._state.owner[1] is None
        check_state(service._state)
        flag["failing"] = False
        # The GPUs are free for the other pipeline, whose request is granted.
        assert await asyncio.wait_for(
            service.request_gpus(cluster_id=OTHER_TRAIN, priority=Priority.ACTOR_TRAINING), 5
        ) == [0, 1]
        assert [o and o.cluster_id for o in service._state.owner] == [
            OTHER_TRAIN, OTHER_TRAIN, None, None
        ]
        await service.stop()

    asyncio.run(asyncio.wait_for(go(), 60))


def test_a_grant_whose_caller_was_cancelled_in_the_same_instant_is_given_back(
    scheduler_service: ServiceBuilder,
) -> None:
    """The caller's request_gpus is cancelled (the hooks cancel a call they gave up on) in
    the very step its grant is answered: the answer was returned to nobody and the grant
    kept, so the GPUs stayed with a pipeline that believed it had none."""

    async def go() -> None:
        service = scheduler_service()
        await register_pipeline(service, PID, train=[0, 1])
        await register_pipeline(service, OTHER, train=[0, 1])
        assert await service.request_gpus(
            cluster_id=OTHER_TRAIN, priority=Priority.ACTOR_TRAINING) == [0, 1]
        request = asyncio.create_task(
            service.request_gpus(cluster_id=TRAIN, priority=Priority.ACTOR_TRAINING)
        )
        await _until(lambda: TRAIN in service._state.pending, "the request queued")
        resolve = service._waiters.resolve

        def resolve_then_cancel(cid: str, gpus: tuple[int, ...]) -> float | None:
            asked = resolve(cid, gpus)
            if cid == TRAIN:
                request.cancel()  # the same step: the answer is set, the caller is gone
            return asked

        service._waiters.resolve = resolve_then_cancel  # type: ignore[method-assign]
        await service.notify_release_gpus(cluster_id=OTHER_TRAIN)
        with pytest.raises(asyncio.CancelledError):
            await request
        assert TRAIN not in service._state.holdings, "the grant was kept by nobody"
        assert service._state.owner[0] is None and service._state.owner[1] is None
        check_state(service._state)
        await service.stop()

    asyncio.run(asyncio.wait_for(go(), 60))


def test_a_late_answer_does_not_answer_the_callers_next_request(
    scheduler_service: ServiceBuilder,
) -> None:
    """The caller gave up and asked again while saves still failed: the retry waits for a
    grant of its own (made once a save succeeds), not the given-back one; before, the retry
    was answered at once from the grant nobody had been told of, before any save."""

    async def go() -> None:
        service = scheduler_service(request_timeout_s=0.6)
        await register_pipeline(service, PID, train=[0, 1])
        flag = _failing_saves(service)
        with pytest.raises(RequestTimeoutError):
            await service.request_gpus(cluster_id=TRAIN, priority=Priority.ACTOR_TRAINING)
        retry = asyncio.create_task(
            service.request_gpus(cluster_id=TRAIN, priority=Priority.ACTOR_TRAINING)
        )
        await asyncio.sleep(0.2)
        assert not retry.done(), "answered while nothing of it could be saved"
        assert TRAIN in service._state.pending
        flag["failing"] = False
        assert await asyncio.wait_for(retry, 5) == [0, 1]
        assert TRAIN in service._state.holdings and not service._durable.held
        assert TRAIN not in service._waiters
        # The saved state has exactly this grant (what a restart restores).
        saved = service._store.load()
        assert saved is not None and TRAIN in saved["state"]["holdings"]
        await service.stop()

    asyncio.run(asyncio.wait_for(go(), 60))


def _request_generation(service: Any) -> Any:
    """``request_gpus`` of ``PID``'s generation cluster (a coroutine)."""
    return service.request_gpus(
        cluster_id=INFER, priority=Priority.GENERATION, step_target_estimate=8
    )


async def _generation_granted_unsaved(service: Any) -> dict[str, bool]:
    """``PID`` registered with inference GPUs 0-1, saves failing (the returned flag turns
    them back on); its generation request timed out while its ranks were activated by a
    commit that could not be saved."""
    await register_pipeline(service, PID, infer=[0, 1])
    # The expands' intent is saved (else they are not sent), the commit after them is not.
    flag = _failing_saves(service, but_expand_intents=True)
    with pytest.raises(RequestTimeoutError):
        await _request_generation(service)
    return flag


def test_a_generation_grant_whose_caller_stopped_waiting_stays_and_answers_a_retry(
    scheduler_service: ServiceBuilder,
) -> None:
    """Generation ranks granted while saves fail are not given back when the caller stops
    waiting (their expand was sent; the planner may still shrink them): the retry is answered
    from them once saved, and nothing is left pending."""

    async def go() -> None:
        service = scheduler_service(request_timeout_s=0.6)
        flag = await _generation_granted_unsaved(service)
        assert service._state.active_ranks[INFER]
        flag["failing"] = False
        await _until(lambda: not service._durable.held, "the deferred answer")
        got = await asyncio.wait_for(_request_generation(service), 5)
        assert got and INFER not in service._state.pending
        check_state(service._state)
        await service.stop()

    asyncio.run(asyncio.wait_for(go(), 60))


def test_a_retry_answered_from_unsaved_ranks_waits_for_a_save(
    scheduler_service: ServiceBuilder,
) -> None:
    """The retry of a generation request whose ranks were activated by a commit that could not
    be saved was answered at once from those ranks: a restart then would restore the state
    before that commit while the pipeline generates on them. It now waits for a save (and
    fails, typed, when none succeeds within the request timeout)."""

    async def go() -> None:
        service = scheduler_service(request_timeout_s=0.6)
        flag = await _generation_granted_unsaved(service)
        assert service._state.active_ranks[INFER] and not service._durable.saved
        with pytest.raises(CoordinatorUnavailableError, match="could not save"):
            await _request_generation(service)
        retry = asyncio.create_task(_request_generation(service))
        await asyncio.sleep(0.2)
        assert not retry.done()  # not answered while nothing is saved
        flag["failing"] = False
        assert await asyncio.wait_for(retry, 5)
        assert service._durable.saved
        check_state(service._state)
        await service.stop()

    asyncio.run(asyncio.wait_for(go(), 60))


# ====================================================================== item 2: registrations
def _state() -> SchedulerState:
    return SchedulerState(Topology(1, 4))


def _register(state: SchedulerState, pid: str, **mappings: list[int]) -> None:
    state.register(
        validate_registration(
            state.topology,
            pipeline_id=pid,
            ray_namespace=f"pipeline_{pid}_NS",
            cluster_tp_configs={name: 1 for name in mappings},
            cluster_device_mappings=mappings,
        )
    )


def test_the_planner_stamps_the_registration_of_every_pipeline_it_touches() -> None:
    state = _state()
    _register(state, PID, actor_infer=[0, 1])
    _register(state, OTHER, actor_train=[2, 3])
    _register(state, "ft_review500003", actor_train=[2, 3])  # touched by nothing
    state.submit_request(INFER, Priority.GENERATION, now=0.0, step_target_estimate=8)
    state.submit_request(OTHER_TRAIN, Priority.ACTOR_TRAINING, now=0.0)
    plan = DemandSharePlanner().plan(state, 1.0)
    assert plan.expands and plan.grants
    assert dict(plan.registrations) == {
        PID: state.registrations[PID],
        OTHER: state.registrations[OTHER],
    }
    check_plan(state, plan)


def test_a_pipeline_registered_again_under_its_id_gets_a_new_registration() -> None:
    state = _state()
    _register(state, PID, actor_infer=[0, 1])
    first = state.registrations[PID]
    state.unregister(PID)
    assert PID not in state.registrations
    _register(state, PID, actor_infer=[0, 1])  # the same spec: still a new registration
    assert state.registrations[PID] != first


@pytest.mark.parametrize("what", ["expand", "grant"])
def test_a_commit_applies_nothing_to_a_successor_under_the_same_id(what: str) -> None:
    """Planned for one registration, committed after it unregistered and a new pipeline
    registered under the same id with the same clusters (and, for a grant, a request of its
    own queued): the old plan's expand or grant used to be applied to the successor, which
    never asked for it (shards never woken; a grant nobody would answer)."""
    state = _state()
    _register(state, PID, actor_infer=[0, 1], actor_train=[0, 1])
    _register(state, OTHER, actor_train=[2, 3])
    if what == "expand":
        state.submit_request(INFER, Priority.GENERATION, now=0.0, step_target_estimate=8)
    else:
        state.submit_request(TRAIN, Priority.ACTOR_TRAINING, now=0.0)
    state.submit_request(OTHER_TRAIN, Priority.ACTOR_TRAINING, now=0.0)
    plan = DemandSharePlanner().plan(state, 1.0)
    check_plan(state, plan)
    state.unregister(PID)
    _register(state, PID, actor_infer=[0, 1], actor_train=[0, 1])
    if what == "grant":
        state.submit_request(TRAIN, Priority.ACTOR_TRAINING, now=2.0)
    with pytest.raises(InvariantViolation, match="P8"):
        check_plan(state, plan)  # the plan is not for the state as it is now
    result = state.commit(plan, now=3.0)
    assert result.stale == (PID,)
    # The other pipeline's part of the same plan is applied.
    assert result.granted == {OTHER_TRAIN: (2, 3)}
    assert state.active_ranks[INFER] == {} and TRAIN not in state.holdings
    assert [o and o.cluster_id for o in state.owner] == [None, None, OTHER_TRAIN, OTHER_TRAIN]
    if what == "grant":
        assert TRAIN in state.pending, "the successor's own request is still queued"
    check_state(state)


def test_a_plan_without_registrations_is_applied_as_before() -> None:
    """Recovery and the simulator's policies commit a plan as soon as it is made, with no
    token: nothing is checked for them."""
    state = _state()
    _register(state, PID, actor_infer=[0, 1])
    result = state.commit(Plan(state.revision, expands=(RankMove(INFER, 0, (0,)),)), now=0.0)
    assert result.expanded == ((INFER, 0),) and result.stale == ()


@pytest.mark.parametrize(
    "registrations",
    [((PID,),), ((PID, "1"),), ((PID, True),), ((7, 1),), ((PID, 1), (PID, 1)), (PID,)],
    ids=["short", "str-token", "bool-token", "int-id", "twice", "bare-id"],
)
def test_a_malformed_registration_list_is_refused_with_nothing_changed(
    registrations: tuple[object, ...],
) -> None:
    state = _state()
    _register(state, PID, actor_train=[0, 1])
    state.submit_request(TRAIN, Priority.ACTOR_TRAINING, now=0.0)
    plan = Plan(
        state.revision,
        grants=(Grant(TRAIN, (0, 1)),),
        registrations=registrations,  # type: ignore[arg-type]
    )
    before = (state.revision, list(state.owner), dict(state.pending), dict(state.holdings))
    with pytest.raises(RequestStateError, match="registration"):
        state.commit(plan, now=1.0)
    assert (state.revision, list(state.owner), dict(state.pending), dict(state.holdings)) == (
        before
    )
