"""The end of a pipeline's training run while it stays registered (``end_run``).

NeMo RL's driver ends its run (``checkpointer.shutdown()``) well before it unregisters: it
finalises a checkpoint, kills its trajectory collector and shuts its generation down first.
Before ``end_run`` the driver could only ``clear_progress``, and two things outlived it:

* the collector, still generating until it is killed, reported demand again at its next 2%
  bucket, and the planner gave the pipeline its share of generation ranks back;
* the generation request the driver makes after every training (for the next step, which
  never comes after the last one) stayed queued, was guaranteed a rank and took one from a
  pipeline with real demand.

The core tests use the pure state and planner; the service tests the Ray-free scheduler
service (tests/fixtures/scheduler_service.py, FAKE pipeline coordinators).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from rlix_plugins.coordinator.core import InvariantViolation, check_state
from rlix_plugins.coordinator.core.snapshot import restore, snapshot
from rlix_plugins.coordinator.core.status import build_status, format_status
from rlix_plugins.errors import RequestStateError, RunOverError, UnknownPipelineError
from rlix_plugins.protocol import Priority, ProgressReport
from tests.core_builders import active, cycle, new_state, observable, progress, register
from tests.fixtures.scheduler_service import ServiceBuilder, register_pipeline

GEN = Priority.GENERATION
A_INFER = "ft_a_actor_infer"


def _two_on_four() -> Any:
    """``ft_a`` and ``ft_b`` generate on GPUs 0-3 (``ft_a`` trains on 4-5); ``ft_b`` has
    demand and holds all four ranks."""
    state = new_state(1, 8)
    register(state, "ft_a", train=[4, 5], infer=[0, 1, 2, 3])
    register(state, "ft_b", infer=[0, 1, 2, 3])
    progress(state, "ft_b", 64, 0)
    cycle(state, 0.0)
    assert len(active(state, "ft_b")) == 4
    return state


# ====================================================================== core


@pytest.mark.parametrize("ended", [False, True])
def test_the_request_after_the_last_training_takes_no_rank_once_the_run_is_over(
        ended: bool) -> None:
    state = _two_on_four()
    # the driver's request for the next step, made as the last training ends
    state.submit_request(A_INFER, GEN, now=1.0, step_target_estimate=8)
    if ended:
        assert state.end_run("ft_a") == (A_INFER,)
    for t in (100.0, 200.0):
        cycle(state, t)
    # before end_run (clear_progress only) the request stayed and was given a rank of ft_b's
    assert (len(active(state, "ft_a")), len(active(state, "ft_b"))) == ((0, 4) if ended else (1, 3))
    assert A_INFER not in state.pending or not ended


def test_a_collector_reporting_after_the_end_gets_no_ranks_back() -> None:
    state = new_state(1, 8)
    register(state, "ft_a", infer=[0, 1, 2, 3])
    register(state, "ft_b", infer=[0, 1, 2, 3])
    progress(state, "ft_a", 64, 0)
    cycle(state, 0.0)
    assert len(active(state, "ft_a")) == 4
    state.end_run("ft_a")
    revision = state.revision
    # the collector runs until NeMo RL kills it: its next bucket arrives after the end
    assert state.report_progress(ProgressReport("ft_a", 64, None, {"completed": 40})) is False
    assert state.revision == revision and "ft_a" not in state.progress
    assert state.demand("ft_a") == 0
    progress(state, "ft_b", 64, 0)
    for t in (100.0, 200.0, 300.0):
        cycle(state, t)
    assert (len(active(state, "ft_a")), len(active(state, "ft_b"))) == (0, 4)


def test_generation_is_refused_after_the_end_and_training_is_served() -> None:
    state = new_state(1, 8)
    register(state, "ft_a", train=[4, 5], infer=[0, 1, 2, 3])
    progress(state, "ft_a", 8, 0)
    cycle(state, 0.0)
    state.end_run("ft_a")
    before = observable(state)
    with pytest.raises(RunOverError, match="ended its training run") as err:
        state.submit_request(A_INFER, GEN, now=1.0, step_target_estimate=8)
    assert isinstance(err.value, RequestStateError)  # callers catching the broader type
    assert observable(state) == before
    # the final checkpoint may still train (save) on its GPUs
    state.submit_request("ft_a_actor_train", Priority.ACTOR_TRAINING, now=2.0)
    cycle(state, 3.0)
    assert "ft_a_actor_train" in state.holdings


def test_end_run_is_idempotent_and_needs_a_registered_pipeline() -> None:
    state = _two_on_four()
    state.end_run("ft_a")
    before, revision = observable(state), state.revision
    assert state.end_run("ft_a") == ()
    assert observable(state) == before and state.revision == revision
    with pytest.raises(UnknownPipelineError, match="ft_zz"):
        state.end_run("ft_zz")
    assert observable(state) == before


def test_a_new_registration_runs_again() -> None:
    state = _two_on_four()
    state.end_run("ft_a")
    state.unregister("ft_a")
    assert not state.runs_over
    register(state, "ft_a", infer=[0, 1, 2, 3])
    progress(state, "ft_a", 8, 0)
    assert state.demand("ft_a") == 8
    state.submit_request(A_INFER, GEN, now=5.0, step_target_estimate=8)


def test_the_mark_survives_a_restart_and_shows_in_status() -> None:
    state = _two_on_four()
    state.end_run("ft_a")
    back = restore(snapshot(state))
    assert back.runs_over == {"ft_a"}
    with pytest.raises(RunOverError):
        back.submit_request(A_INFER, GEN, now=1.0)
    # a snapshot from before the mark existed restores every run as running
    old = snapshot(state)
    del old["runs_over"]
    assert restore(old).runs_over == set()
    status = build_status(state, 10.0)
    (a,) = [p for p in status.pipelines if p.pipeline_id == "ft_a"]
    assert a.run_over and a.demand == 0
    assert "ft_a  RUN OVER" in format_status(status)


def test_invariant_s7_a_run_over_pipeline_has_no_demand_and_no_generation_request() -> None:
    state = _two_on_four()
    state.end_run("ft_a")
    check_state(state)
    state.progress["ft_a"] = {}  # an empty stream table is no demand
    check_state(state)
    bypass = _two_on_four()
    bypass.submit_request(A_INFER, GEN, now=1.0)
    bypass.runs_over.add("ft_a")  # marked without end_run: the request stayed
    with pytest.raises(InvariantViolation, match="S7"):
        check_state(bypass)


# ====================================================================== service


PID, OTHER = "ft_runover00001", "ft_runover00002"
INFER, OTHER_TRAIN = f"{PID}_actor_infer", f"{OTHER}_actor_train"


def test_the_service_fails_the_waiting_request_and_ignores_late_reports(
        scheduler_service: ServiceBuilder) -> None:
    async def go() -> None:
        service = scheduler_service()
        await register_pipeline(service, PID, infer=[0, 1])
        await register_pipeline(service, OTHER, train=[0, 1])
        got = await asyncio.wait_for(service.request_gpus(
            cluster_id=OTHER_TRAIN, priority=Priority.ACTOR_TRAINING), 5)
        assert got == [0, 1]
        # PID's request waits: OTHER trains on its GPUs
        waiting = asyncio.ensure_future(service.request_gpus(
            cluster_id=INFER, priority=GEN, step_target_estimate=8))
        for _ in range(100):
            if INFER in service._state.pending:
                break
            await asyncio.sleep(0.01)
        assert INFER in service._state.pending
        await service.end_run(pipeline_id=PID)
        with pytest.raises(RunOverError, match="cancelled"):
            await asyncio.wait_for(waiting, 5)
        assert INFER not in service._state.pending and INFER not in service._waiters
        revision = service._state.revision
        await service.report_progress(ProgressReport(PID, 8, None, {"completed": 0}))
        assert service._state.revision == revision and PID not in service._state.progress
        with pytest.raises(RunOverError):
            await service.request_gpus(cluster_id=INFER, priority=GEN)
        await service.end_run(pipeline_id=PID)  # idempotent
        saved = service._store.load()
        assert saved is not None and saved["state"]["runs_over"] == [PID]
        await service.stop()

    asyncio.run(asyncio.wait_for(go(), 60))
