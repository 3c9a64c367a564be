"""Failures in the scheduler service: a fenced pipeline's GPUs stay where they are until it is
dead and nothing is planned for it; a commit whose save failed is answered only once a save
succeeds (Ray-free service from tests/fixtures/scheduler_service.py; the fenced pipeline's FAKE
coordinator keeps answering probes, as one on an unreachable node is never confirmed dead)."""

from __future__ import annotations

import asyncio

from rlix_plugins.coordinator.core import PolicyConfig
from rlix_plugins.protocol import Priority, ProgressReport
from tests.fixtures.scheduler_service import (
    FakePipelineCoordinator,
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
        store = service._store
        save = store.save
        failing = True

        def flaky_save(record: object) -> None:
            if failing:
                raise OSError("disk full (test)")
            save(record)  # type: ignore[arg-type]

        store.save = flaky_save  # type: ignore[method-assign]
        train = asyncio.create_task(
            service.request_gpus(cluster_id=f"{B}_actor_train", priority=Priority.ACTOR_TRAINING)
        )
        await asyncio.sleep(0.5)
        # Granted in memory, but a restart would not know it: the caller must not either.
        assert not train.done()
        failing = False
        assert await asyncio.wait_for(train, 5) == [0, 1]
        await service.stop(clear_state=False)

    asyncio.run(asyncio.wait_for(go(), 60))
