"""What a restarted scheduler answers for the calls and resizes its crash interrupted: a
background expand sent again when Ray's lookup of the pipeline's actor fails for a while (no
verdict on the pipeline), an unregistration retried by Ray (Ray-free service from
tests/fixtures/scheduler_service.py; FAKE pipeline coordinators)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from rlix_plugins.coordinator.service import resizer
from rlix_plugins.errors import UnknownPipelineError
from rlix_plugins.protocol import Priority
from tests.fixtures.scheduler_service import (
    FakePipelineCoordinator,
    ServiceBuilder,
    register_pipeline,
)

A = "ft_restartexp01"


def test_a_failed_lookup_at_restart_does_not_fence_a_pipeline_whose_expand_is_resent(
    scheduler_service: ServiceBuilder,
    fake_coordinators: dict[str, FakePipelineCoordinator],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def go() -> None:
        service = scheduler_service(background_expands=True, liveness_interval_s=10.0)
        await register_pipeline(service, A, infer=[0, 1])
        fake = fake_coordinators.setdefault(A, FakePipelineCoordinator())
        fake.gate = asyncio.Event()  # the wake runs until the scheduler dies
        gen = asyncio.create_task(service.request_gpus(
            cluster_id=f"{A}_actor_infer", priority=Priority.GENERATION, step_target_estimate=9))
        for _ in range(100):
            if fake.calls:
                break
            await asyncio.sleep(0.02)
        assert fake.calls == [{"dp_ranks_to_remove": [], "dp_ranks_to_add": [0, 1]}]
        await service.stop(clear_state=False)  # the crash: the ranks are saved as warming
        gen.cancel()
        fake.gate.set()
        # Restarted while Ray's name lookups time out for a while (a GCS hiccup).
        failing = {A}

        async def lookup(pipeline_id: str, ray_namespace: str | None = None) -> Any:
            if pipeline_id in failing:
                raise TimeoutError("GCS did not answer (test)")
            return fake_coordinators.setdefault(pipeline_id, FakePipelineCoordinator())

        monkeypatch.setattr(resizer, "lookup_coordinator", lookup)
        restarted = scheduler_service(background_expands=True, liveness_interval_s=0.05)
        await asyncio.sleep(0.3)
        status = await restarted.get_status()
        assert not status.fenced_pipelines, "a lookup that failed fenced a healthy pipeline"
        assert A in restarted._state.pipelines
        failing.clear()  # Ray answers again: the expand goes out and the ranks serve
        for _ in range(100):
            if not restarted._state.warming:
                break
            await asyncio.sleep(0.05)
        assert not restarted._state.warming
        assert fake.calls[-1] == {"dp_ranks_to_remove": [], "dp_ranks_to_add": [0, 1]}
        assert not (await restarted.get_status()).fenced_pipelines
        await restarted.stop()

    asyncio.run(asyncio.wait_for(go(), 60))


def test_an_unregistration_retried_after_a_restart_gets_the_first_calls_answer(
    scheduler_service: ServiceBuilder,
) -> None:
    """Ray retries a call in flight when the scheduler dies on the restarted actor: an
    unregistration that was saved but not answered must not then fail as unknown."""

    async def go() -> None:
        service = scheduler_service(liveness_interval_s=10.0)
        await register_pipeline(service, A, train=[0, 1])
        await service.request_gpus(cluster_id=f"{A}_actor_train", priority=Priority.ACTOR_TRAINING)
        assert await service.unregister_pipeline(A) == (0, 1)
        await service.stop(clear_state=False)  # died before its answer reached the caller
        restarted = scheduler_service(liveness_interval_s=10.0)
        try:
            assert await restarted.unregister_pipeline(A) == (0, 1)  # was UnknownPipelineError
            # Registering the id again forgets it, as before a restart.
            await register_pipeline(restarted, A, train=[2])
            assert await restarted.unregister_pipeline(A) == ()
            with pytest.raises(UnknownPipelineError):
                await restarted.unregister_pipeline("ft_neverthere01")
        finally:
            await restarted.stop()

    asyncio.run(asyncio.wait_for(go(), 60))
