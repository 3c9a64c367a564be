"""A pipeline that drives the coordinator exactly as a ROLL full-finetune pipeline does.

Real Ray actors, real coordinator, real ``resize_infer`` calls; only the GPU work is simulated
(shards "run" by claiming their GPUs in a :class:`GpuLedger`, generation produces trajectories at
a rate proportional to the active ranks). The ledger is the independent witness that no GPU is
ever used by two owners: every claim made while another live owner holds the GPU is recorded as
a violation. A dead pipeline's claims are void (its processes, and so its GPU memory, are gone).

Used by tests/integration/test_coordinator_*.py and by the validation gates.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import ray

from rlix_plugins.adapters.pipeline_coordinator import (
    PipelineCoordinator,
    start_pipeline_coordinator,
)
from rlix_plugins.protocol.names import (
    cluster_id,
    parse_cluster_id,
    pipeline_coordinator_actor,
    pipeline_namespace,
)
from rlix_plugins.protocol.types import Priority, ProgressReport


class GpuLedgerImpl:
    """Who is using which GPU, as reported by the (simulated) workers themselves."""

    def __init__(self) -> None:
        self.claims: dict[int, str] = {}
        self.violations: list[str] = []
        self.claim_count = 0

    async def _alive(self, owner_cluster: str) -> bool:
        import asyncio

        pid, _ = parse_cluster_id(owner_cluster)

        def lookup() -> bool:
            try:
                ray.get_actor(pipeline_coordinator_actor(pid), namespace=pipeline_namespace(pid))
                return True
            except ValueError:
                return False

        return await asyncio.to_thread(lookup)

    async def claim(self, owner: str, gpus: Sequence[int]) -> None:
        for g in gpus:
            cur = self.claims.get(g)
            if cur is not None and cur != owner and await self._alive(cur):
                self.violations.append(f"GPU {g} claimed by {owner} while held by {cur}")
            self.claims[g] = owner
            self.claim_count += 1

    async def release(self, owner: str, gpus: Sequence[int]) -> None:
        for g in gpus:
            if self.claims.get(g) == owner:
                del self.claims[g]

    async def report(self) -> tuple[list[str], dict[int, str], int]:
        return list(self.violations), dict(self.claims), self.claim_count


GpuLedger = ray.remote(num_cpus=0)(GpuLedgerImpl)


class SimulatedShards:
    """ShardController whose ranks "run" by claiming their GPUs in the ledger.

    ``fail`` makes the next shrink raise (``"shrink"``) or hang (``"hang"``), to exercise the
    coordinator's handling of failed and timed-out resizes.
    """

    def __init__(self, pipeline_id: str, infer_gpus: Sequence[int], tp: int, ledger: Any) -> None:
        self.cluster = cluster_id(pipeline_id, "actor_infer")
        self.gpus = list(infer_gpus)
        self.tp = tp
        self.ledger = ledger
        self.active: set[int] = set()
        self.fail: str | None = None

    def _rank_gpus(self, rank: int) -> list[int]:
        return self.gpus[rank * self.tp : (rank + 1) * self.tp]

    def shrink(self, dp_ranks: Sequence[int]) -> None:
        if self.fail == "shrink":
            raise RuntimeError("simulated shard failure during shrink")
        if self.fail == "hang":
            time.sleep(3600)
        for r in dp_ranks:
            if r in self.active:
                ray.get(self.ledger.release.remote(self.cluster, self._rank_gpus(r)))
                self.active.discard(r)

    def expand(self, dp_ranks: Sequence[int]) -> None:
        for r in dp_ranks:
            if r not in self.active:
                ray.get(self.ledger.claim.remote(self.cluster, self._rank_gpus(r)))
                self.active.add(r)


@dataclass(frozen=True, slots=True)
class ShardFactory:
    """Builds the SimulatedShards inside the coordinator actor's process."""

    infer_gpus: tuple[int, ...]
    tp: int
    ledger: Any

    def __call__(self, pipeline_id: str) -> SimulatedShards:
        return SimulatedShards(pipeline_id, self.infer_gpus, self.tp, self.ledger)


class RollPipelineCoordinator(PipelineCoordinator):
    """The pipeline coordinator plus a test knob to make its shards fail."""

    def set_failure(self, mode: str | None) -> None:
        assert isinstance(self.shards, SimulatedShards)
        self.shards.fail = mode


@dataclass(slots=True)
class RunResult:
    """What a driver run did."""

    pipeline_id: str
    steps_done: int = 0
    error: BaseException | None = None
    generation_ranks_seen: list[int] = field(default_factory=list)


class RollPipelineDriver:
    """Registers a pipeline and runs ROLL's per-step call sequence against the coordinator.

    ``report_cls`` is the ProgressReport class to send (RLix's own, from ``rlix.protocol.types``,
    to test duck typing); default is ours.
    """

    def __init__(
        self,
        plane: Any,
        ledger: Any,
        *,
        train: Sequence[int],
        infer: Sequence[int],
        infer_tp: int = 1,
        steps: int = 3,
        target: int = 32,
        per_rank_per_tick: int = 2,
        tick_s: float = 0.02,
        train_s: float = 0.05,
        report_cls: Any = ProgressReport,
        pipeline_type: str = "ft",
        timeout_s: float = 60.0,
    ) -> None:
        self.plane = plane
        self.ledger = ledger
        self.train = list(train)
        self.infer = list(infer)
        self.infer_tp = infer_tp
        self.steps = steps
        self.target = target
        self.per_rank_per_tick = per_rank_per_tick
        self.tick_s = tick_s
        self.train_s = train_s
        self.report_cls = report_cls
        self.timeout_s = timeout_s
        self.pipeline_id: str = ray.get(
            plane.orchestrator.allocate_pipeline_id.remote(pipeline_type)
        )
        self.train_cluster = cluster_id(self.pipeline_id, "actor_train")
        self.infer_cluster = cluster_id(self.pipeline_id, "actor_infer")
        self.coordinator: Any = None
        self.scheduler: Any = None
        self.step_done = threading.Condition()
        self.steps_completed = 0
        self._holds_train = False
        self._thread: threading.Thread | None = None
        self.result = RunResult(self.pipeline_id)

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        """Start the coordinator actor, register and admit (ROLL's order)."""
        self.coordinator = start_pipeline_coordinator(
            self.pipeline_id,
            ShardFactory(tuple(self.infer), self.infer_tp, self.ledger),
            control_namespace=self.plane.namespace,
            cls=RollPipelineCoordinator,
        )
        ray.get(self.coordinator.__ray_ready__.remote())
        ray.get(
            self.plane.orchestrator.register_pipeline.remote(
                pipeline_id=self.pipeline_id,
                ray_namespace=pipeline_namespace(self.pipeline_id),
                cluster_tp_configs={"actor_train": 1, "actor_infer": self.infer_tp},
                cluster_device_mappings={"actor_train": self.train, "actor_infer": self.infer},
            )
        )
        admitted = ray.get(
            self.plane.orchestrator.admit_pipeline.remote(pipeline_id=self.pipeline_id)
        )
        self.scheduler = admitted.scheduler

    # ------------------------------------------------------------------ calls
    def _get(self, ref: Any) -> Any:
        return ray.get(ref, timeout=self.timeout_s)

    def _claim_train(self) -> None:
        self._get(self.ledger.claim.remote(self.train_cluster, self.train))
        self._holds_train = True

    def _unclaim_train(self) -> None:
        if self._holds_train:
            self._get(self.ledger.release.remote(self.train_cluster, self.train))
            self._holds_train = False

    def _init_clusters(self) -> None:
        for cid, gpus in ((self.train_cluster, self.train), (self.infer_cluster, self.infer)):
            self._get(
                self.scheduler.request_gpus.remote(
                    cluster_id=cid, priority=Priority.INITIALIZATION, global_step=None
                )
            )
            self._get(self.ledger.claim.remote(cid, gpus))  # load / build cache / sleep
            time.sleep(self.train_s)
            self._get(self.ledger.release.remote(cid, gpus))
            self._get(self.scheduler.notify_release_gpus.remote(cluster_id=cid, global_step=None))

    def _report(self, completed: int, step: int, new_batch: bool) -> None:
        report = self.report_cls(
            pipeline_id=self.pipeline_id,
            step_target_trajectories=self.target,
            fifo_timestamp=time.time(),
            metrics={
                "mode": "train",
                "completed": min(completed, self.target),
                "bucket": min(50, completed * 50 // self.target),
                "new_batch": new_batch,
                "current_train_step": step,
                "adapter_id": None,
            },
        )
        self._get(self.coordinator.report_progress_from_scheduler.remote(report))

    def _generate(self, step: int) -> None:
        completed = 0
        self._report(0, step, new_batch=True)
        deadline = time.monotonic() + self.timeout_s
        while completed < self.target:
            active = self._get(self.coordinator.active_ranks.remote())
            self.result.generation_ranks_seen.append(len(active))
            completed += len(active) * self.per_rank_per_tick
            self._report(completed, step, new_batch=False)
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.pipeline_id}: generation of step {step} stalled")
            time.sleep(self.tick_s)  # simulated decode time
        self._get(self.coordinator.clear_progress_stream.remote(mode="train", adapter_id=None))

    def _step(self, step: int) -> None:
        if step > 0:
            self._get(
                self.scheduler.await_release_gpus.remote(
                    cluster_id=self.infer_cluster, global_step=step
                )
            )
        self._unclaim_train()
        gpus = self._get(
            self.scheduler.notify_release_then_request_gpus.remote(
                release_cluster_id=self.train_cluster,
                release_global_step=step,
                request_cluster_id=self.infer_cluster,
                request_priority=Priority.GENERATION,
                request_global_step=step,
                request_step_target_estimate=self.target,
            )
        )
        assert gpus, "a GENERATION grant returns at least one active rank's GPUs"
        self._generate(step)
        self._get(
            self.scheduler.request_gpus.remote(
                cluster_id=self.train_cluster, priority=Priority.OLD_LOG_PROBS, global_step=step
            )
        )
        self._claim_train()
        time.sleep(self.train_s / 2)  # old log probs
        self._get(
            self.scheduler.request_gpus.remote(
                cluster_id=self.train_cluster, priority=Priority.ACTOR_TRAINING, global_step=step
            )
        )
        time.sleep(self.train_s)  # train, then cache version `step`; keep actor_train

    def _finish(self) -> None:
        self._unclaim_train()
        self._get(
            self.scheduler.notify_release_gpus.remote(
                cluster_id=self.train_cluster, global_step=None
            )
        )
        self._get(self.scheduler.await_release_gpus.remote(cluster_id=self.infer_cluster))

    # ------------------------------------------------------------------ run
    def run(self) -> RunResult:
        """Init, N steps, release everything. Errors end the run and are kept in the result."""
        try:
            if self.scheduler is None:
                self.setup()
            self._init_clusters()
            for step in range(self.steps):
                self._step(step)
                with self.step_done:
                    self.steps_completed = step + 1
                    self.result.steps_done = step + 1
                    self.step_done.notify_all()
            self._finish()
        except BaseException as exc:
            self.result.error = exc
        finally:
            with self.step_done:
                self.step_done.notify_all()
        return self.result

    def start(self) -> RollPipelineDriver:
        """Run in a background thread (see :meth:`join`)."""
        self._thread = threading.Thread(target=self.run, name=f"driver-{self.pipeline_id}")
        self._thread.start()
        return self

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def join(self, timeout: float | None = None) -> RunResult:
        assert self._thread is not None
        self._thread.join(timeout)
        assert not self._thread.is_alive(), f"{self.pipeline_id} did not finish in {timeout}s"
        return self.result

    def wait_for_step(self, n: int, timeout: float) -> None:
        """Block until ``n`` steps are done (or the run ended)."""
        with self.step_done:
            ok = self.step_done.wait_for(
                lambda: (
                    self.steps_completed >= n
                    or self.result.error is not None
                    or (self._thread is not None and not self._thread.is_alive())
                ),
                timeout,
            )
        assert ok, f"{self.pipeline_id}: step {n} not reached in {timeout}s"

    def kill_actors(self) -> None:
        """Kill this pipeline's coordinator actor (its simulated shards die with it)."""
        ray.kill(self.coordinator, no_restart=True)


def register_pipeline(plane: Any, pid: str, maps: dict[str, list[int]]) -> None:
    """Register ``pid`` with tp=1 clusters ``{name: GPUs}`` through the orchestrator."""
    ray.get(
        plane.orchestrator.register_pipeline.remote(
            pipeline_id=pid,
            ray_namespace=pipeline_namespace(pid),
            cluster_tp_configs={name: 1 for name in maps},
            cluster_device_mappings=maps,
        )
    )


def wait_until(predicate: Any, timeout: float, interval: float = 0.05) -> float:
    """Poll an external condition (e.g. coordinator status) until true; return seconds taken.

    Used only where no event exists to await (another process's state).
    """
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"condition not met within {timeout}s")
        time.sleep(interval)
    return time.monotonic() - start


def gpu_owners(plane: Any, gpus: Sequence[int]) -> list[str | None]:
    """The pipeline id holding each of ``gpus`` in the coordinator's status (None: free)."""
    owners = plane.status().owners()
    return [owners[g] for g in gpus]


def assert_finished_without_sharing(driver: RollPipelineDriver, ledger: Any, steps: int,
                                    timeout: float = 120.0) -> None:
    """``driver`` ran its ``steps`` without error and the ledger saw no GPU with two users."""
    result = driver.join(timeout)
    assert result.error is None and result.steps_done == steps, result
    violations, _, _ = ray.get(ledger.report.remote())
    assert violations == []
