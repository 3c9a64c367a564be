"""Failures: dead pipelines, lost leases, failed resizes, a coordinator crash."""

from __future__ import annotations

from typing import Any

import pytest
import ray

from rlix_plugins.errors import PipelineFailedError
from rlix_plugins.protocol.types import Priority
from tests.support.roll_pipeline import (
    GpuLedger,
    RollPipelineDriver,
    register_pipeline,
    wait_until,
)

pytestmark = pytest.mark.integration



def _holds(plane: Any, pipeline_id: str) -> set[int]:
    return {g.gpu for g in plane.status().gpus if g.owner_pipeline == pipeline_id}


def test_killed_pipeline_returns_its_gpus_and_the_other_finishes(coordinator: Any) -> None:
    ledger = GpuLedger.remote()
    a = RollPipelineDriver(coordinator, ledger, train=[0, 1], infer=[0, 1, 2, 3, 4, 5], steps=4)
    b = RollPipelineDriver(
        coordinator, ledger, train=[4, 5], infer=[2, 3, 4, 5, 6, 7], steps=50, tick_s=0.05
    )
    a.setup()
    b.setup()
    b.start()
    b.wait_for_step(1, 60)
    a.start()
    wait_until(lambda: bool(_holds(coordinator, b.pipeline_id)), 30)
    b.kill_actors()
    took = wait_until(lambda: coordinator.status().pipeline(b.pipeline_id) is None, 10)
    print(f"GPUs of the killed pipeline back after {took:.2f}s")
    assert not _holds(coordinator, b.pipeline_id)
    # Found dead by its probe (not by a lapsed lease): the reason tells which.
    dead = {d.pipeline_id: d.reason for d in coordinator.status().dead_pipelines}
    assert "died" in dead[b.pipeline_id], dead[b.pipeline_id]
    rb = b.join(60)
    assert isinstance(rb.error, (PipelineFailedError, ray.exceptions.RayActorError)), rb.error
    ra = a.join(90)
    assert ra.error is None, repr(ra.error)
    assert ra.steps_done == 4
    violations, _, _ = ray.get(ledger.report.remote())
    assert violations == []


def test_lease_expiry_unregisters_and_fails_waiters(coordinator: Any) -> None:
    holder, leased = "ft_holder000001", "ft_leased000001"
    register_pipeline(coordinator, holder, {"actor_train": [2, 3]})
    register_pipeline(coordinator, leased, {"actor_train": [0, 1], "critic": [3]})
    sched = coordinator.scheduler
    ray.get(sched.request_gpus.remote(cluster_id=f"{holder}_actor_train", priority=1))
    ray.get(sched.heartbeat.remote(leased))
    assert ray.get(sched.request_gpus.remote(cluster_id=f"{leased}_actor_train", priority=1)) == [
        0,
        1,
    ]
    blocked = sched.request_gpus.remote(cluster_id=f"{leased}_critic", priority=2)
    # ROLL-style pipeline (never beats) is not subject to the lease.
    # Failed by the lease (its message says so), well before the 15 s wait would give up.
    with pytest.raises(PipelineFailedError, match="lease expired"):
        ray.get(blocked, timeout=15)
    # Fenced at once (its waiters fail), unregistered by the same liveness pass once its probe
    # answers: the probe awaits Ray, so a status read right after the waiter fails may land
    # in between (seen once in a clean CI run).
    wait_until(lambda: coordinator.status().pipeline(leased) is None, 5)
    status = coordinator.status()
    assert status.pipeline(leased) is None
    assert status.owners()[0] is None and status.owners()[1] is None
    assert status.pipeline(holder) is not None, "a pipeline that never beat keeps its GPUs"
    with pytest.raises(PipelineFailedError, match=f"pipeline '{leased}' was declared dead"):
        ray.get(sched.heartbeat.remote(leased))


def test_failed_shrink_fences_the_pipeline_and_only_then_hands_its_gpu_on(
    coordinator: Any,
) -> None:
    ledger = GpuLedger.remote()
    victim = RollPipelineDriver(coordinator, ledger, train=[0], infer=[0, 1, 2, 3], steps=1)
    victim.setup()
    sched = coordinator.scheduler
    ray.get(
        sched.request_gpus.remote(
            cluster_id=victim.infer_cluster, priority=Priority.GENERATION, step_target_estimate=64
        )
    )
    wait_until(lambda: _holds(coordinator, victim.pipeline_id) == {0, 1, 2, 3}, 10)
    ray.get(victim.coordinator.set_failure.remote("shrink"))
    other = "ft_trainer00001"
    register_pipeline(coordinator, other, {"actor_train": [2, 3]})
    got = ray.get(
        sched.request_gpus.remote(cluster_id=f"{other}_actor_train", priority=1), timeout=20
    )
    assert got == [2, 3]
    status = coordinator.status()
    assert status.pipeline(victim.pipeline_id) is None
    dead = {d.pipeline_id: d.reason for d in status.dead_pipelines}
    assert "resize_infer" in dead[victim.pipeline_id]
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(victim.coordinator.active_ranks.remote())  # fenced: its actor was killed
    violations, _, _ = ray.get(ledger.report.remote())
    assert violations == []


def test_scheduler_crash_recovers_state_and_drops_pipelines_that_died_meanwhile(
    coordinator: Any,
) -> None:
    ledger = GpuLedger.remote()
    a = RollPipelineDriver(coordinator, ledger, train=[0, 1], infer=[0, 1, 2, 3], steps=6)
    gone = RollPipelineDriver(coordinator, ledger, train=[6], infer=[6, 7], steps=1)
    a.setup()
    gone.setup()
    sched = coordinator.scheduler
    ray.get(
        sched.request_gpus.remote(
            cluster_id=gone.infer_cluster, priority=Priority.GENERATION, step_target_estimate=8
        )
    )
    wait_until(lambda: bool(_holds(coordinator, gone.pipeline_id)), 10)
    a.start()
    a.wait_for_step(2, 60)
    before = coordinator.status()
    ray.kill(sched, no_restart=False)  # crash; Ray restarts it (max_restarts=-1)
    gone.kill_actors()  # dies while there is no scheduler to notice
    ray.get(sched.ping.remote(), timeout=60)  # Ray retries the call on the restarted actor
    recovered = coordinator.status()
    assert recovered.revision > before.revision
    assert recovered.pipeline(a.pipeline_id) is not None
    wait_until(lambda: coordinator.status().pipeline(gone.pipeline_id) is None, 10)
    ra = a.join(120)
    assert ra.error is None, repr(ra.error)
    assert ra.steps_done == 6
    violations, _, _ = ray.get(ledger.report.remote())
    assert violations == []
    assert coordinator.status().idle_gpus == tuple(range(8))


@ray.remote(num_cpus=0)
class _HungScheduler:
    """FAKE scheduler whose progress calls never answer (a hung coordinator process): the
    real one answers them at once, so it cannot be made to hang on demand."""

    def report_progress(self, report: Any) -> None:
        import time

        time.sleep(3600)

    def clear_progress(self, *, pipeline_id: str) -> None:
        import time

        time.sleep(3600)


def test_a_hung_scheduler_cannot_block_progress_forwarding(ray_session: Any) -> None:
    """The pipeline coordinator forwards a rollout scheduler's progress while holding its
    progress lock; without a bound, a scheduler that never answers blocked that call (and
    every later one) for good."""
    from rlix_plugins.adapters.pipeline_coordinator import PipelineCoordinator
    from rlix_plugins.errors import CoordinatorUnavailableError
    from rlix_plugins.protocol.names import SCHEDULER_ACTOR
    from rlix_plugins.protocol.types import ProgressReport

    namespace = "rlix_hung_scheduler_test"
    hung = _HungScheduler.options(  # type: ignore[attr-defined]
        name=SCHEDULER_ACTOR, namespace=namespace
    ).remote()
    try:
        coord = PipelineCoordinator(
            "ft_hung", lambda pid: None, control_namespace=namespace, call_timeout_s=0.5
        )
        report = ProgressReport("ft_hung", 8, None, {"completed": 1, "mode": "train"})
        with pytest.raises(CoordinatorUnavailableError, match=r"no answer within 0\.5s"):
            coord.report_progress_from_scheduler(report)
        # The lock was released: the next call is refused the same way, not blocked.
        with pytest.raises(CoordinatorUnavailableError):
            coord.clear_progress_stream(mode="train")
    finally:
        ray.kill(hung)


def test_the_orchestrator_finds_a_scheduler_created_anew(coordinator: Any, tmp_path: Any) -> None:
    """A scheduler killed for good and started again is a new actor: the orchestrator's
    cached handle to the old one failed every registration until the orchestrator too was
    restarted."""
    from rlix_plugins.coordinator.service.client import connect
    from tests.fixtures.ray_cluster import coordinator_config

    orch = coordinator.orchestrator
    assert ray.get(orch.shutdown.remote()) == 0  # the orchestrator now holds a handle
    ray.kill(coordinator.scheduler, no_restart=True)
    wait_until(lambda: _dead(coordinator.scheduler), 30)
    cfg = coordinator_config(tmp_path / "again")
    plane = connect(namespace=coordinator.namespace, config=cfg)  # creates the scheduler only
    assert plane.orchestrator._actor_id == orch._actor_id
    assert ray.get(orch.shutdown.remote()) == 0
    register_pipeline(plane, "ft_afterrestart", {"actor_train": [0], "actor_infer": [0, 1]})
    assert plane.status().pipeline("ft_afterrestart") is not None


def _dead(handle: Any) -> bool:
    try:
        ray.get(handle.ping.remote(), timeout=5)
    except ray.exceptions.RayActorError:
        return True
    return False
