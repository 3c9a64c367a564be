"""The scheduler service when Ray's lookups or the state store misbehave, and when a pipeline
comes back under its id while a probe of its old actor is still out (Ray-free service from
tests/fixtures/scheduler_service.py; pipeline coordinators are its FAKE actors)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import ray

from rlix_plugins.coordinator.service import resizer
from rlix_plugins.errors import CoordinatorUnavailableError, UnknownPipelineError
from rlix_plugins.protocol import Priority
from tests.fixtures.scheduler_service import (
    FakePipelineCoordinator,
    FakeRemote,
    ServiceBuilder,
    register_pipeline,
)

A, B, C = "ft_lookupaaaa01", "ft_lookupbbbb01", "ft_lookupcccc01"


def _flaky_lookups(monkeypatch: pytest.MonkeyPatch, fakes: dict[str, FakePipelineCoordinator],
                   failing: set[str]) -> None:
    """Lookups of the pipelines in ``failing`` raise as a GCS timeout would."""

    async def lookup(pipeline_id: str, ray_namespace: str | None = None) -> Any:
        if pipeline_id in failing:
            raise TimeoutError("GCS did not answer (test)")
        return fakes.setdefault(pipeline_id, FakePipelineCoordinator())

    monkeypatch.setattr(resizer, "lookup_coordinator", lookup)


def _held(status: Any) -> dict[int, str]:
    """GPU -> owning pipeline, owned GPUs only."""
    return {g: p for g, p in status.owners().items() if p is not None}


def test_a_failed_lookup_neither_aborts_the_cycle_nor_hands_on_gpus_under_awake_shards(
    scheduler_service: ServiceBuilder, fake_coordinators: dict[str, FakePipelineCoordinator],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def go() -> None:
        failing = {C}
        _flaky_lookups(monkeypatch, fake_coordinators, failing)
        service = scheduler_service(liveness_interval_s=10.0)
        await register_pipeline(service, A, infer=[0, 1])
        await register_pipeline(service, C, infer=[2, 3])
        await register_pipeline(service, B, train=[0, 1])
        # One cycle expands A (sent) and C (its lookup raises): A's expand is committed, C's
        # is not sent and not committed, and nobody is fenced for a lookup that failed.
        a = asyncio.create_task(service.request_gpus(
            cluster_id=f"{A}_actor_infer", priority=Priority.GENERATION, step_target_estimate=9))
        c = asyncio.create_task(service.request_gpus(
            cluster_id=f"{C}_actor_infer", priority=Priority.GENERATION, step_target_estimate=9))
        assert await asyncio.wait_for(a, 5)
        status = await service.get_status()
        assert _held(status) == {0: A, 1: A}
        assert fake_coordinators[A].calls == [{"dp_ranks_to_remove": [], "dp_ranks_to_add": [0, 1]}]
        assert not status.fenced_pipelines and not c.done()
        # A's shards are awake on GPUs 0 and 1: B's training gets them only through shrinks.
        train = asyncio.create_task(service.request_gpus(
            cluster_id=f"{B}_actor_train", priority=Priority.ACTOR_TRAINING))
        assert await asyncio.wait_for(train, 5) == [0, 1]
        assert fake_coordinators[A].calls[-1] == {"dp_ranks_to_remove": [0, 1],
                                                  "dp_ranks_to_add": []}
        failing.clear()  # Ray answers again: C's expand goes out and its request is answered
        assert await asyncio.wait_for(c, 5)
        assert _held(await service.get_status()) == {0: B, 1: B, 2: C, 3: C}
        await service.stop()

    asyncio.run(asyncio.wait_for(go(), 60))


def test_a_shrink_whose_lookup_failed_keeps_its_ranks_and_is_sent_again(
    scheduler_service: ServiceBuilder, fake_coordinators: dict[str, FakePipelineCoordinator],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def go() -> None:
        failing: set[str] = set()
        _flaky_lookups(monkeypatch, fake_coordinators, failing)
        service = scheduler_service(liveness_interval_s=10.0)
        await register_pipeline(service, A, infer=[0, 1])
        await register_pipeline(service, B, train=[0])
        await service.request_gpus(cluster_id=f"{A}_actor_infer", priority=Priority.GENERATION,
                                   step_target_estimate=9)
        service._handles.clear()  # a restarted scheduler: no handle cached yet
        failing.add(A)
        train = asyncio.create_task(service.request_gpus(
            cluster_id=f"{B}_actor_train", priority=Priority.ACTOR_TRAINING))
        await asyncio.sleep(0.3)  # several cycles, each failing to look A up
        status = await service.get_status()
        assert not train.done() and _held(status) == {0: A, 1: A}
        assert not status.fenced_pipelines
        failing.clear()
        assert await asyncio.wait_for(train, 5) == [0]
        assert {"dp_ranks_to_remove": [0], "dp_ranks_to_add": []} in fake_coordinators[A].calls
        await service.stop()

    asyncio.run(asyncio.wait_for(go(), 60))


def test_expands_are_not_sent_while_their_intent_cannot_be_saved(
    scheduler_service: ServiceBuilder, fake_coordinators: dict[str, FakePipelineCoordinator],
    tmp_path: Path,
) -> None:
    async def go() -> None:
        service = scheduler_service(liveness_interval_s=10.0)
        await register_pipeline(service, A, infer=[0, 1])
        await asyncio.sleep(0.1)
        store_save = service._store.save

        def broken(record: Any) -> None:
            raise OSError("disk full (test)")

        service._store.save = broken  # type: ignore[method-assign]
        gen = asyncio.create_task(service.request_gpus(
            cluster_id=f"{A}_actor_infer", priority=Priority.GENERATION, step_target_estimate=9))
        await asyncio.sleep(0.3)
        # A restart now would restore the last saved record: no shard may be awake that it
        # does not know of.
        assert fake_coordinators.get(A) is None or fake_coordinators[A].calls == []
        assert not gen.done()
        saved = json.loads((tmp_path / "scheduler_state.json").read_text())
        assert A in json.dumps(saved)
        service._store.save = store_save  # type: ignore[method-assign]
        assert await asyncio.wait_for(gen, 5)
        assert fake_coordinators[A].calls == [{"dp_ranks_to_remove": [], "dp_ranks_to_add": [0, 1]}]
        await service.stop()

    asyncio.run(asyncio.wait_for(go(), 60))


def test_a_probe_verdict_on_a_pipelines_old_actor_spares_its_new_registration(
    scheduler_service: ServiceBuilder, fake_coordinators: dict[str, FakePipelineCoordinator],
) -> None:
    async def go() -> None:
        service = scheduler_service(probe_timeout_s=5.0)
        await register_pipeline(service, A, infer=[0, 1])
        await asyncio.sleep(0.2)  # probed alive: its handle is cached
        old = fake_coordinators[A]
        asked, answer = asyncio.Event(), asyncio.Event()

        async def dying() -> bool:  # the old actor is being killed as the pipeline restarts
            asked.set()
            await answer.wait()
            raise ray.exceptions.RayActorError()

        old.__ray_ready__ = FakeRemote(dying)
        await asked.wait()
        await service.unregister_pipeline(A)
        fake_coordinators[A] = FakePipelineCoordinator()  # its new coordinator actor
        await register_pipeline(service, A, infer=[0, 1])
        answer.set()  # the old actor's "died" arrives for the new registration's id
        await asyncio.sleep(0.3)
        status = await service.get_status()
        assert status.pipeline(A) is not None
        assert all(d.pipeline_id != A for d in status.dead_pipelines)
        await service.stop()

    asyncio.run(asyncio.wait_for(go(), 60))


def test_a_retried_registration_is_answered_only_once_saved(
    scheduler_service: ServiceBuilder, tmp_path: Path,
) -> None:
    async def go() -> None:
        service = scheduler_service(request_timeout_s=0.3, liveness_interval_s=10.0)
        store_save = service._store.save

        def broken(record: Any) -> None:
            raise OSError("disk full (test)")

        service._store.save = broken  # type: ignore[method-assign]
        with pytest.raises(CoordinatorUnavailableError):
            await register_pipeline(service, A, train=[0])
        with pytest.raises(CoordinatorUnavailableError):  # the retry too, while unsaved
            await register_pipeline(service, A, train=[0])
        service._store.save = store_save  # type: ignore[method-assign]
        await register_pipeline(service, A, train=[0])
        assert A in (tmp_path / "scheduler_state.json").read_text()
        await service.stop()

    asyncio.run(asyncio.wait_for(go(), 60))


def test_a_retried_unregistration_gets_the_first_calls_answer_once_saved(
    scheduler_service: ServiceBuilder, tmp_path: Path,
) -> None:
    async def go() -> None:
        service = scheduler_service(request_timeout_s=0.3, liveness_interval_s=10.0)
        await register_pipeline(service, A, train=[0, 1])
        assert await service.request_gpus(
            cluster_id=f"{A}_actor_train", priority=Priority.ACTOR_TRAINING) == [0, 1]
        store_save = service._store.save

        def broken(record: Any) -> None:
            raise OSError("disk full (test)")

        service._store.save = broken  # type: ignore[method-assign]
        with pytest.raises(CoordinatorUnavailableError):
            await service.unregister_pipeline(A)
        with pytest.raises(CoordinatorUnavailableError):  # the retry too, while unsaved
            await service.unregister_pipeline(A)
        service._store.save = store_save  # type: ignore[method-assign]
        # the error told the caller to retry: the retry is answered as the first call
        assert await service.unregister_pipeline(A) == (0, 1)
        saved = json.loads((tmp_path / "scheduler_state.json").read_text())
        assert A not in json.dumps(saved["state"])  # saved as unregistered
        assert saved["unregistered"] == {A: [0, 1]}  # a retry after a restart gets its answer
        with pytest.raises(UnknownPipelineError):  # never registered: still refused
            await service.unregister_pipeline(C)
        await register_pipeline(service, A, train=[0])  # the id is free again
        assert await service.unregister_pipeline(A) == ()  # this registration held nothing
        await service.stop()

    asyncio.run(asyncio.wait_for(go(), 60))
