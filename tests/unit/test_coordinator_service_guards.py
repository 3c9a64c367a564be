"""The scheduler service refuses bad calls with typed errors and its state unchanged, and
answers nothing once stopped (Ray-free service from tests/fixtures/scheduler_service.py)."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from rlix_plugins.errors import (
    CoordinatorUnavailableError,
    ProtocolError,
    RequestStateError,
)
from rlix_plugins.protocol import Priority
from tests.fixtures.scheduler_service import (
    FakePipelineCoordinator,
    ServiceBuilder,
    register_pipeline,
)

if TYPE_CHECKING:
    from rlix_plugins.coordinator.core.status import CoordinatorStatus
    from rlix_plugins.coordinator.service.scheduler_actor import SchedulerService

PID = "ft_000000000001"
TRAIN = f"{PID}_actor_train"
INFER = f"{PID}_actor_infer"


def run(coro: Coroutine[Any, Any, None]) -> None:
    asyncio.run(asyncio.wait_for(coro, 30))


async def settled_status(service: SchedulerService) -> CoordinatorStatus:
    """The status once the cycles triggered so far are done (the fakes answer at once)."""
    await asyncio.sleep(0.2)
    return await service.get_status()


@pytest.mark.parametrize(
    ("cluster", "priority", "estimate", "match"),
    [
        (TRAIN, Priority.ACTOR_TRAINING, -1, "step_target_estimate"),
        (TRAIN, Priority.ACTOR_TRAINING, 64.0, "step_target_estimate"),
        (TRAIN, Priority.GENERATION, None, "only valid for actor_infer"),
        (INFER, Priority.GENERATION, -5, "step_target_estimate"),
    ],
    ids=["negative-estimate", "float-estimate", "generation-on-train", "infer-negative"],
)
def test_refused_release_then_request_of_one_cluster_releases_nothing(
    scheduler_service: ServiceBuilder,
    cluster: str,
    priority: Priority,
    estimate: object,
    match: str,
) -> None:
    async def go() -> None:
        service = scheduler_service()
        await register_pipeline(service, PID, train=[0, 1], infer=[0, 1, 2, 3])
        if cluster == TRAIN:
            await service.request_gpus(cluster_id=TRAIN, priority=Priority.ACTOR_TRAINING)
        else:
            await service.request_gpus(
                cluster_id=INFER, priority=Priority.GENERATION, step_target_estimate=8
            )
        before = await settled_status(service)
        assert before.idle_gpus == ((2, 3) if cluster == TRAIN else ())
        with pytest.raises(RequestStateError, match=match):
            await service.notify_release_then_request_gpus(
                release_cluster_id=cluster,
                release_global_step=0,
                request_cluster_id=cluster,
                request_priority=priority,
                request_step_target_estimate=estimate,  # type: ignore[arg-type]
            )
        assert await service.get_status() == before
        await service.stop()

    run(go())


@pytest.mark.parametrize("timeout_s", ["5", -1, 0, True, math.inf, math.nan])
def test_await_release_refuses_a_bad_timeout_before_planning_anything(
    scheduler_service: ServiceBuilder, timeout_s: object
) -> None:
    async def go() -> None:
        service = scheduler_service()
        await register_pipeline(service, PID, infer=[0, 1])
        await service.request_gpus(
            cluster_id=INFER, priority=Priority.GENERATION, step_target_estimate=8
        )
        before = await settled_status(service)
        with pytest.raises(ProtocolError, match="timeout_s must be a finite number of seconds"):
            await service.await_release_gpus(cluster_id=INFER, timeout_s=timeout_s)  # type: ignore[arg-type]
        assert await service.get_status() == before  # no release planned
        await service.await_release_gpus(cluster_id=INFER, timeout_s=5)
        assert (await service.get_status()).idle_gpus == (0, 1, 2, 3)
        await service.stop()

    run(go())


@pytest.mark.parametrize("bad", [["ft_000000000001"], {"id": 1}], ids=["list", "dict"])
def test_unregister_refuses_an_unhashable_pipeline_id_with_a_typed_error(
    scheduler_service: ServiceBuilder, bad: object
) -> None:
    async def go() -> None:
        service = scheduler_service()
        await register_pipeline(service, PID, train=[0, 1])
        before = await settled_status(service)
        # Was a bare TypeError ("unhashable type") from the retry lookup.
        with pytest.raises(ProtocolError, match="pipeline_id must be a non-empty str"):
            await service.unregister_pipeline(bad)  # type: ignore[arg-type]
        assert await service.get_status() == before
        await service.stop()

    run(go())


def test_stop_fails_waiting_calls_and_refuses_later_ones(
    scheduler_service: ServiceBuilder, fake_coordinators: dict[str, FakePipelineCoordinator]
) -> None:
    a, b = "ft_00000000000a", "ft_00000000000b"

    async def go() -> None:
        ours = asyncio.all_tasks()
        service = scheduler_service(request_timeout_s=20.0)
        state_file = Path(str(service.cfg.state_file))
        await register_pipeline(service, a, train=[0, 1], infer=[2, 3])
        await register_pipeline(service, b, train=[0, 1])
        await service.request_gpus(cluster_id=f"{a}_actor_train", priority=Priority.ACTOR_TRAINING)
        await service.request_gpus(
            cluster_id=f"{a}_actor_infer", priority=Priority.GENERATION, step_target_estimate=8
        )
        fake_coordinators[a].gate = asyncio.Event()  # a's shrink below never finishes
        request = asyncio.create_task(
            service.request_gpus(cluster_id=f"{b}_actor_train", priority=Priority.ACTOR_TRAINING)
        )
        release = asyncio.create_task(
            service.await_release_gpus(cluster_id=f"{a}_actor_infer", timeout_s=10)
        )
        await asyncio.sleep(0.2)
        assert not request.done() and not release.done() and state_file.exists()

        await service.stop(clear_state=True)
        for waiting in (request, release):
            with pytest.raises(CoordinatorUnavailableError, match="stopping"):
                await waiting
        left = [t for t in asyncio.all_tasks() - ours if not t.done()]
        assert left == []  # the service's cycles, probes and resize calls ended
        assert not state_file.exists()
        late_calls: list[Coroutine[Any, Any, object]] = [
            register_pipeline(service, "ft_00000000000c", train=[2]),
            service.request_gpus(cluster_id=f"{b}_actor_train", priority=Priority.ACTOR_TRAINING),
            service.notify_release_gpus(cluster_id=f"{a}_actor_train"),
            service.report_progress({"pipeline_id": a, "step_target_trajectories": 8}),
            service.heartbeat(a),
            service.ping(),
        ]
        for call in late_calls:
            with pytest.raises(CoordinatorUnavailableError, match="stopping or stopped"):
                await asyncio.wait_for(call, 2)
        assert not state_file.exists()  # nothing wrote the cleared state back

    run(go())
