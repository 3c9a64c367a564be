"""Failures in the scheduler service: a fenced pipeline's GPUs stay where they are until it is
dead and nothing is planned for it; a commit whose save failed is answered only once a save
succeeds (Ray-free service from tests/fixtures/scheduler_service.py; the fenced pipeline's FAKE
coordinator keeps answering probes, as one on an unreachable node is never confirmed dead)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from rlix_plugins.coordinator.core import PolicyConfig
from rlix_plugins.protocol import Priority, ProgressReport
from tests.fixtures.scheduler_service import (
    FakePipelineCoordinator,
    FakeRemote,
    ServiceBuilder,
    register_pipeline,
)

A, B = "ft_fenced000001", "ft_healthy00001"


def test_a_fenced_pipeline_is_frozen_until_it_is_gone(
    scheduler_service: ServiceBuilder, fake_coordinators: dict[str, FakePipelineCoordinator]
) -> None:
    async def go() -> None:
        service = scheduler_service(request_timeout_s=20.0)
        await register_pipeline(service, A, infer=[0, 1, 2, 3])
        await register_pipeline(service, B, train=[0], infer=[0, 1, 2, 3])
        await service.request_gpus(
            cluster_id=f"{A}_actor_infer", priority=Priority.GENERATION, step_target_estimate=100
        )
        await asyncio.sleep(0.3)
        assert set((await service.get_status()).owners().values()) == {A}
        await service.kill_pipeline(A)  # fenced; the FAKE kill leaves it "alive"
        a_calls = len(fake_coordinators[A].calls)
        gen = asyncio.create_task(
            service.request_gpus(
                cluster_id=f"{B}_actor_infer", priority=Priority.GENERATION,
                step_target_estimate=100,
            )
        )
        train = asyncio.create_task(
            service.request_gpus(cluster_id=f"{B}_actor_train", priority=Priority.ACTOR_TRAINING)
        )
        await asyncio.sleep(0.5)  # ten scheduling ticks
        # A's shards can no longer be told to sleep: none is shrunk (for B's starving
        # generation or its training) and B gets nothing until A is gone.
        assert fake_coordinators[A].calls[a_calls:] == [], "a fenced pipeline was resized"
        assert set((await service.get_status()).owners().values()) == {A}
        assert not gen.done() and not train.done()
        await service.unregister_pipeline(A)  # confirmed dead: its GPUs go back
        assert await asyncio.wait_for(train, 10) == [0]
        assert await asyncio.wait_for(gen, 10)
        await service.stop()

    asyncio.run(asyncio.wait_for(go(), 60))


def test_no_healthy_rank_is_given_up_for_a_fenced_pipeline(
    scheduler_service: ServiceBuilder, fake_coordinators: dict[str, FakePipelineCoordinator]
) -> None:
    async def go() -> None:
        # min_hold_s 0: ranks may move at once (the default only delays the same move by 5 s)
        service = scheduler_service(policy=PolicyConfig(min_hold_s=0.0))
        for pid in (A, B):
            await register_pipeline(service, pid, infer=[0, 1, 2, 3])
            await service.request_gpus(
                cluster_id=f"{pid}_actor_infer",
                priority=Priority.GENERATION,
                step_target_estimate=100,
            )
            await asyncio.sleep(0.3)
        held = (await service.get_status()).owners()
        assert sorted(held.values()) == [A, A, B, B]
        await service.kill_pipeline(A)
        b_calls = len(fake_coordinators[B].calls)
        # B is almost done: were A still planned for (its last estimate, 100), B's ranks
        # would be shrunk to grow A's, whose expands are never sent (GPUs left idle).
        await service.report_progress(ProgressReport(B, 100, None, {"completed": 99}))
        await asyncio.sleep(0.5)
        assert fake_coordinators[B].calls[b_calls:] == []
        assert (await service.get_status()).owners() == held
        await service.stop()

    asyncio.run(asyncio.wait_for(go(), 60))


def test_a_grant_is_answered_only_once_it_is_saved(scheduler_service: ServiceBuilder) -> None:
    async def go() -> None:
        service = scheduler_service(request_timeout_s=20.0)
        await register_pipeline(service, B, train=[0, 1])
        flag = _failing_saves(service)
        train = asyncio.create_task(
            service.request_gpus(cluster_id=f"{B}_actor_train", priority=Priority.ACTOR_TRAINING)
        )
        await asyncio.sleep(0.5)
        # Granted in memory, but a restart would not know it: the caller must not either.
        assert not train.done()
        flag["failing"] = False
        assert await asyncio.wait_for(train, 5) == [0, 1]
        await service.stop(clear_state=False)

    asyncio.run(asyncio.wait_for(go(), 60))


def _failing_saves(service: object, *, but_expand_intents: bool = False) -> dict[str, bool]:
    """Make the service's state store fail while ``flag["failing"]``; returns the flag.
    ``but_expand_intents``: a record announcing expands about to be sent is still saved (so
    they are sent), and the commit after them is not."""
    store = service._store  # type: ignore[attr-defined]
    save = store.save
    flag = {"failing": True}

    def flaky_save(record: dict[str, Any]) -> None:
        intent = record.get("inflight") or {}
        if flag["failing"] and not (but_expand_intents and intent.get("expands")):
            raise OSError("disk full (test)")
        save(record)

    store.save = flaky_save
    return flag


def test_a_release_and_a_registration_are_answered_only_once_saved(
    scheduler_service: ServiceBuilder,
) -> None:
    """Answered before their save, a restart undid them while the caller acted on them: the
    released cluster still held its GPUs (its next GENERATION request was refused), the
    registered pipeline was unknown."""

    async def go() -> None:
        service = scheduler_service(request_timeout_s=20.0)
        await register_pipeline(service, B, train=[0, 1])
        cid = f"{B}_actor_train"
        assert await service.request_gpus(cluster_id=cid, priority=Priority.ACTOR_TRAINING)
        flag = _failing_saves(service)
        release = asyncio.create_task(service.notify_release_gpus(cluster_id=cid))
        register = asyncio.create_task(register_pipeline(service, A, train=[2]))
        await asyncio.sleep(0.5)
        assert not release.done() and not register.done()
        flag["failing"] = False
        await asyncio.wait_for(asyncio.gather(release, register), 5)
        await service.stop(clear_state=False)
        restarted = scheduler_service(request_timeout_s=20.0)
        assert restarted._state.holdings == {}
        assert A in restarted._state.pipelines
        await restarted.stop()

    asyncio.run(asyncio.wait_for(go(), 60))


def test_a_release_whose_state_is_never_saved_fails_with_a_typed_error(
    scheduler_service: ServiceBuilder,
) -> None:
    from rlix_plugins.errors import CoordinatorUnavailableError

    async def go() -> None:
        service = scheduler_service(request_timeout_s=1.0)
        await register_pipeline(service, B, train=[0, 1])
        cid = f"{B}_actor_train"
        assert await service.request_gpus(cluster_id=cid, priority=Priority.ACTOR_TRAINING)
        _failing_saves(service)
        try:
            await service.notify_release_gpus(cluster_id=cid)
        except CoordinatorUnavailableError as exc:
            assert "could not save its state" in str(exc)
        else:
            raise AssertionError("a release that was never saved was answered")
        await service.stop(clear_state=False)

    asyncio.run(asyncio.wait_for(go(), 60))


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ('{"state": {"version": 1', "not valid JSON"),
        ("[]", "JSON list, not an object"),
        ('{"inflight": null}', "no 'state' object"),
        ('{"state": {"version": 1}}', "snapshot is malformed"),
        ('{"state": {"version": 1}, "unregistered": {"ft_a": [true]}}', "'unregistered'"),
    ],
)
def test_a_corrupt_saved_state_is_a_typed_error_naming_the_cure(
    scheduler_service: ServiceBuilder, tmp_path: Path, text: str, needle: str
) -> None:
    from rlix_plugins.errors import CorruptStateError

    (tmp_path / "scheduler_state.json").write_text(text)

    async def go() -> None:
        with pytest.raises(CorruptStateError, match=needle) as err:
            scheduler_service()
        assert "rlix-plugins coordinator stop" in str(err.value)

    asyncio.run(asyncio.wait_for(go(), 30))


def _empty_snapshot() -> dict[str, object]:
    from rlix_plugins.coordinator.core import SchedulerState, Topology
    from rlix_plugins.coordinator.core.snapshot import snapshot

    return snapshot(SchedulerState(Topology(1, 4)))  # the fixture's topology


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"inflight": [["c", 0]]}, "in-flight record is list, not an object"),
        ({"inflight": {"expands": 3}}, "'expands' is int, not a list"),
        ({"inflight": {"expands": [["ft_x_actor_infer", "0"]]}}, r"\['ft_x_actor_infer', '0'\]"),
        ({"dead": [{"pipeline_id": "ft_a"}]}, "dead pipeline .* is malformed"),
        ({"dead": {"ft_a": "gone"}}, "'dead' is dict, not a list"),
        ({"seen": ["ft_a", 7]}, "'seen' holds non-string 7"),
        ({"leased": "ft_a"}, "'leased' is str, not a list"),
        ({"fencing": ["ft_a"]}, "'fencing' must map pipeline ids to reasons"),
    ],
)
def test_a_damaged_service_field_is_a_typed_error_naming_it(
    scheduler_service: ServiceBuilder, tmp_path: Path, fields: dict[str, object], needle: str
) -> None:
    """The record beside the core's snapshot is read strictly too: a damaged field used to
    surface as a KeyError, TypeError or ValueError from deep in recovery."""
    import json

    from rlix_plugins.errors import CorruptStateError

    (tmp_path / "scheduler_state.json").write_text(
        json.dumps({"state": _empty_snapshot(), **fields})
    )

    async def go() -> None:
        with pytest.raises(CorruptStateError, match=needle) as err:
            scheduler_service()
        assert "rlix-plugins coordinator stop" in str(err.value)

    asyncio.run(asyncio.wait_for(go(), 30))


def test_an_intact_saved_record_still_restores(
    scheduler_service: ServiceBuilder, tmp_path: Path
) -> None:
    import json

    (tmp_path / "scheduler_state.json").write_text(json.dumps({
        "state": _empty_snapshot(),
        "inflight": {"confirmed_shrinks": [], "expands": []},
        "dead": [{"pipeline_id": "ft_gone", "reason": "actor died", "at": 12.5}],
        "seen": [], "leased": [], "fencing": {},
    }))

    async def go() -> None:
        service = scheduler_service()
        status = await service.get_status()
        assert [(d.pipeline_id, d.reason, d.at) for d in status.dead_pipelines] == [
            ("ft_gone", "actor died", 12.5)
        ]
        await service.stop()

    asyncio.run(asyncio.wait_for(go(), 30))


def test_completed_shrinks_are_saved_before_the_commit(
    scheduler_service: ServiceBuilder, fake_coordinators: dict[str, FakePipelineCoordinator]
) -> None:
    """A crash between a cycle's shrinks and its commit must restore those ranks as asleep;
    a plan with shrinks and no expands (a preemption for a grant) used to save nothing
    in between."""

    async def go() -> None:
        service = scheduler_service(request_timeout_s=20.0)
        await register_pipeline(service, A, infer=[0, 1, 2, 3])
        await register_pipeline(service, B, train=[0])
        await service.request_gpus(
            cluster_id=f"{A}_actor_infer", priority=Priority.GENERATION, step_target_estimate=100
        )
        await asyncio.sleep(0.3)
        saved: list[object] = []
        store = service._store
        save = store.save

        def spy(record: dict[str, object]) -> None:
            saved.append(record.get("inflight"))
            save(record)

        store.save = spy  # type: ignore[method-assign]
        await service.request_gpus(cluster_id=f"{B}_actor_train", priority=Priority.ACTOR_TRAINING)
        assert {"confirmed_shrinks": [[f"{A}_actor_infer", 0]], "expands": []} in saved
        await service.stop()

    asyncio.run(asyncio.wait_for(go(), 60))


def test_one_probe_failing_oddly_does_not_stop_the_others_being_judged(
    scheduler_service: ServiceBuilder, fake_coordinators: dict[str, FakePipelineCoordinator]
) -> None:
    """A's probe raises an error the probe does not classify; B's actor is dead (Ray says
    so): B is still declared dead and its GPUs freed, A stays (no verdict on it)."""
    import ray

    async def odd() -> bool:
        raise ray.exceptions.RaySystemError("GCS hiccup")

    async def dead() -> bool:
        raise ray.exceptions.RayActorError()

    async def go() -> None:
        service = scheduler_service()
        await register_pipeline(service, A, infer=[0, 1])
        await register_pipeline(service, B, infer=[2, 3])
        await asyncio.sleep(0.2)  # both probed alive (seen) at least once
        fake_coordinators[A].__ray_ready__ = FakeRemote(odd)
        fake_coordinators[B].__ray_ready__ = FakeRemote(dead)
        for _ in range(100):
            if B not in {p.pipeline_id for p in (await service.get_status()).pipelines}:
                break
            await asyncio.sleep(0.05)
        ids = {p.pipeline_id for p in (await service.get_status()).pipelines}
        assert B not in ids and A in ids
        await service.stop()

    asyncio.run(asyncio.wait_for(go(), 60))
