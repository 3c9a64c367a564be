"""Background expands (``RLIX_BACKGROUND_EXPANDS=1``): a slow wake does not hold other grants.

Real Ray, real scheduler actor, real pipeline coordinator actors and ``resize_infer`` calls.
The shards are a named fake (no GPU here): ``GatedShards`` claim their GPUs in the shared
``GpuLedger`` (the independent witness that no GPU has two users) and an expand blocks until
the test opens a gate, so "the wake is still running" is a state the test controls, not a
timing. Each test runs under both cycle modes and checks what differs:

* blocking expands (RLix's cycle, the default): a training request for idle GPUs waits until
  the slow expand of another pipeline returns;
* background expands: it is granted while that expand still runs, the slow pipeline's own
  generation request is answered only once a rank serves, and a shrink of the still-waking
  rank is sent only after its expand returned.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import pytest
import ray

from rlix_plugins.adapters.pipeline_coordinator import start_pipeline_coordinator
from rlix_plugins.errors import PipelineFailedError
from rlix_plugins.gates.timeline import intervals_from_trace, pipeline_of
from rlix_plugins.protocol.names import cluster_id
from rlix_plugins.protocol.types import Priority
from tests.support.roll_pipeline import GpuLedger, register_pipeline

pytestmark = pytest.mark.integration


@ray.remote(num_cpus=0)
class Gate:
    """Opened by the test; expands wait on it."""

    def __init__(self) -> None:
        self.opened = False
        self.calls: list[str] = []

    def open(self) -> None:
        self.opened = True

    def is_open(self) -> bool:
        return self.opened

    def record(self, call: str) -> None:
        self.calls.append(call)

    def log(self) -> list[str]:
        return list(self.calls)


class GatedShards:
    """FAKE shard controller (no GPU): ranks claim their GPUs in the ledger; an expand returns
    only once the gate is open (a wake + sync that takes as long as the test wants)."""

    def __init__(
        self, pipeline_id: str, gpus: Sequence[int], ledger: Any, gate: Any, fail: bool
    ) -> None:
        self.cluster = cluster_id(pipeline_id, "actor_infer")
        self.gpus = list(gpus)
        self.ledger = ledger
        self.gate = gate
        self.fail = fail

    def expand(self, dp_ranks: Sequence[int]) -> None:
        ray.get(self.gate.record.remote(f"expand {sorted(dp_ranks)} start"))
        while not ray.get(self.gate.is_open.remote()):
            time.sleep(0.02)
        if self.fail:
            raise RuntimeError("simulated wake failure")
        for r in dp_ranks:
            ray.get(self.ledger.claim.remote(self.cluster, [self.gpus[r]]))
        ray.get(self.gate.record.remote(f"expand {sorted(dp_ranks)} done"))

    def shrink(self, dp_ranks: Sequence[int]) -> None:
        ray.get(self.gate.record.remote(f"shrink {sorted(dp_ranks)}"))
        for r in dp_ranks:
            ray.get(self.ledger.release.remote(self.cluster, [self.gpus[r]]))


class GatedFactory:
    def __init__(self, gpus: Sequence[int], ledger: Any, gate: Any, fail: bool) -> None:
        self.gpus, self.ledger, self.gate, self.fail = list(gpus), ledger, gate, fail

    def __call__(self, pipeline_id: str) -> GatedShards:
        return GatedShards(pipeline_id, self.gpus, self.ledger, self.gate, self.fail)


def _slow_pipeline(plane: Any, ledger: Any, gate: Any, pid: str, fail: bool = False) -> Any:
    """A pipeline whose two generation ranks (GPUs 0, 1) wake only when the gate opens (and
    then fail to, with ``fail``)."""
    actor = start_pipeline_coordinator(
        pid, GatedFactory([0, 1], ledger, gate, fail), control_namespace=plane.namespace
    )
    ray.get(actor.__ray_ready__.remote())
    register_pipeline(plane, pid, {"actor_infer": [0, 1]})
    return actor


def _wait_for(gate: Any, entry: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while entry not in ray.get(gate.log.remote()):
        assert time.monotonic() < deadline, f"{entry!r} not in {ray.get(gate.log.remote())}"
        time.sleep(0.02)


def _slow_wake_started(
    plane: Any, slow: str, other: str, other_train: list[int], fail: bool = False
) -> tuple[Any, Any, Any, Any]:
    """``slow``'s generation request is being expanded (its wake blocked on the gate) and
    ``other`` is registered with ``other_train``: (ledger, gate, slow's actor, request ref).
    Keep the actor handle: the actor lives as long as it does."""
    ledger, gate = GpuLedger.remote(), Gate.remote()
    actor = _slow_pipeline(plane, ledger, gate, slow, fail)
    register_pipeline(plane, other, {"actor_train": other_train})
    gen = plane.scheduler.request_gpus.remote(
        cluster_id=f"{slow}_actor_infer", priority=Priority.GENERATION, step_target_estimate=8
    )
    _wait_for(gate, "expand [0, 1] start")
    return ledger, gate, actor, gen


def test_a_slow_wake_holds_other_grants_only_under_blocking_expands(
    coordinator_any_expands: tuple[Any, bool],
) -> None:
    plane, background = coordinator_any_expands
    other = "ft_otherjob00001"
    ledger, gate, actor, gen = _slow_wake_started(plane, "ft_slowwake00001", other, [2, 3])
    sched = plane.scheduler
    train = sched.request_gpus.remote(
        cluster_id=f"{other}_actor_train", priority=Priority.ACTOR_TRAINING
    )
    # The gate stays closed until the test opens it, so waiting long here cannot make the
    # background case pass for the wrong reason; the blocking case must not answer at all.
    ready, _ = ray.wait([train], timeout=30.0 if background else 3.0)
    if background:
        assert ready, "training on idle GPUs waited for another pipeline's wake"
        assert ray.get(train) == [2, 3]
        # The slow pipeline's own request is answered only once a rank serves.
        assert ray.wait([gen], timeout=0.5)[0] == []
    else:
        assert not ready, "a blocking cycle answered before its expand returned"
    ray.get(gate.open.remote())
    assert sorted(ray.get(gen, timeout=30)) == [0, 1]
    assert ray.get(train, timeout=30) == [2, 3]
    violations, _, _ = ray.get(ledger.report.remote())
    assert violations == []
    del actor


def test_a_shrink_of_a_waking_rank_waits_for_its_wake(
    coordinator_any_expands: tuple[Any, bool],
) -> None:
    plane, _ = coordinator_any_expands
    trainer = "ft_trainer000002"
    ledger, gate, actor, gen = _slow_wake_started(plane, "ft_slowwake00002", trainer, [0])
    sched = plane.scheduler
    # Training needs GPU 0, where rank 0 is still waking: granted only after the wake
    # returned and the rank was shrunk (never two users of GPU 0).
    train = sched.request_gpus.remote(
        cluster_id=f"{trainer}_actor_train", priority=Priority.ACTOR_TRAINING
    )
    assert ray.wait([train], timeout=1.0)[0] == []
    ray.get(gate.open.remote())
    assert ray.get(train, timeout=30) == [0]
    ray.get(ledger.claim.remote(f"{trainer}_actor_train", [0]))
    log = ray.get(gate.log.remote())
    assert log.index("expand [0, 1] done") < log.index("shrink [0]"), log
    assert ray.get(gen, timeout=30) in ([0, 1], [1])
    violations, claims, _ = ray.get(ledger.report.remote())
    assert violations == []
    assert claims[0] == f"{trainer}_actor_train"
    del actor


def test_a_failed_wake_fences_its_pipeline_and_keeps_its_gpus_until_it_is_dead(
    coordinator_any_expands: tuple[Any, bool],
) -> None:
    plane, _ = coordinator_any_expands
    slow, trainer = "ft_failwake00003", "ft_trainer000003"
    _, gate, actor, gen = _slow_wake_started(plane, slow, trainer, [0], fail=True)
    train = plane.scheduler.request_gpus.remote(
        cluster_id=f"{trainer}_actor_train", priority=Priority.ACTOR_TRAINING
    )
    ray.get(gate.open.remote())
    # The waiting generation request fails with the pipeline; GPU 0 (state unknown after the
    # failed wake) goes to the trainer only once the fenced pipeline is confirmed dead.
    with pytest.raises(PipelineFailedError, match=f"pipeline '{slow}' failed: .*wake failure"):
        ray.get(gen, timeout=30)
    assert ray.get(train, timeout=30) == [0]
    dead = {d.pipeline_id: d.at for d in plane.status()
            .dead_pipelines}
    assert slow in dead
    # The ownership timeline: the fenced pipeline held GPU 0 until it was declared dead
    # (checked on the record, not on a status read that may land before or after the death).
    intervals, _ = intervals_from_trace(ray.get(plane.scheduler.get_trace.remote()))
    held = [iv for iv in intervals if iv.gpu == 0 and pipeline_of(iv.owner) == slow]
    assert held, intervals
    assert max(iv.end for iv in held) >= dead[slow], (
        "a fenced pipeline's GPU was handed on before death", held, dead[slow])
    del actor


def test_a_scheduler_crash_during_a_background_expand_sends_it_again(
    background_coordinator: Any,
) -> None:
    """The crash loses the expand's answer: the restarted scheduler restores the ranks as
    warming and sends the expand again (idempotent per rank; the pipeline runs it after the
    first). The generation request, retried by Ray, is answered only once the ranks serve, and
    a training request on rank 0's GPU only after the shrink that follows."""
    plane = background_coordinator
    slow, trainer = "ft_crashwake0004", "ft_trainer000004"
    ledger, gate, actor, gen = _slow_wake_started(plane, slow, trainer, [0])
    sched = plane.scheduler
    ray.kill(sched, no_restart=False)  # crash; Ray restarts it (max_restarts=-1)
    ray.get(sched.ping.remote(), timeout=60)
    owners = ray.get(sched.get_status.remote()).owners()
    assert owners[0] == owners[1] == slow, "the waking ranks must stay owned across the crash"
    train = sched.request_gpus.remote(
        cluster_id=f"{trainer}_actor_train", priority=Priority.ACTOR_TRAINING
    )
    assert ray.wait([gen, train], timeout=2.0)[0] == []
    ray.get(gate.open.remote())
    assert sorted(ray.get(gen, timeout=60)) in ([0, 1], [1])
    assert ray.get(train, timeout=60) == [0]
    log = ray.get(gate.log.remote())
    assert log.count("expand [0, 1] start") == 2, log  # the first call, and the one re-sent
    assert log.index("expand [0, 1] done") < log.index("shrink [0]"), log
    violations, _, _ = ray.get(ledger.report.remote())
    assert violations == []
    del actor
