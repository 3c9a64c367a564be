"""A veRL pipeline holds its GPUs while veRL builds it, on real Ray against the real coordinator.

veRL's ``init`` builds the training workers and the rollout replicas on the job's GPUs and
syncs the first weights into them. Under the coordinator the pipeline first claims those GPUs
(INITIALIZATION, as ROLL's init and NeMo RL's setup do): another pipeline's training there
finishes first, its generation ranks there are shrunk, and nothing is woken there until
veRL's init is over and every replica of the new pipeline is asleep.

The other pipeline is the ROLL-sequence driver of the coordinator tests, whose simulated shards
and training claim GPUs on the ``GpuLedger`` (the independent witness that no GPU has two
users); veRL's model loads are claims of the new pipeline on the same ledger. Its shard
controller is a FAKE (it gives the ledger's GPUs back on shrink: the real one needs veRL's
replicas; ``tests/integration/test_verl_trainer_loop.py`` runs the real one under veRL's real
step loop); the adapter, its hooks, the coordinator and the ledger are real.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import pytest
import ray

from rlix_plugins.adapters.verl import VerlLayout, VerlPipelineAdapter
from rlix_plugins.errors import RegistrationError
from rlix_plugins.hooks import make_hooks
from rlix_plugins.protocol.names import ACTOR_INFER, cluster_id
from rlix_plugins.settings import load_settings
from tests.support.roll_pipeline import (
    GpuLedger,
    RollPipelineDriver,
    assert_finished_without_sharing,
    gpu_owners,
    wait_until,
)

pytestmark = pytest.mark.integration

#: one trainer GPU hosting a hybrid replica, one standalone replica after it: GPUs 0, 1
LAYOUT = VerlLayout(train_gpus=1, tp=1, hybrid_replicas=1, standalone_replicas=1)


class LedgerController:
    """FAKE shard controller: veRL's replicas are loaded on the ledger's GPUs until a shrink
    puts them to sleep; records the ranks shrunk and whether it was closed."""

    def __init__(self, ledger: Any = None, owner: str = "", gpus: Sequence[int] = ()) -> None:
        self.ledger, self.owner, self.gpus = ledger, owner, list(gpus)
        self.shrunk: list[int] = []
        self.closed = False

    def shrink(self, dp_ranks: Sequence[int]) -> None:
        self.shrunk += list(dp_ranks)
        if self.ledger is not None:
            ray.get(self.ledger.release.remote(self.owner, self.gpus))

    def expand(self, dp_ranks: Sequence[int]) -> None:
        raise AssertionError(f"nothing is woken during setup (asked: {list(dp_ranks)})")

    def close(self) -> None:
        self.closed = True


def _adapter(plane: Any, pipeline_id: str, layout: VerlLayout = LAYOUT) -> VerlPipelineAdapter:
    settings = load_settings({"RLIX_CONTROL_PLANE": "rlix", "RLIX_NAMESPACE": plane.namespace})
    return VerlPipelineAdapter(
        settings=settings, pipeline_id=pipeline_id, layout=layout,
        hooks_factory=lambda: make_hooks(settings, pipeline_id=pipeline_id), step_target=4,
    )


def test_init_waits_for_anothers_training_holds_every_gpu_and_ends_with_replicas_asleep(
    coordinator: Any,
) -> None:
    plane = coordinator
    pid = "ft_0000000ve41d"
    ledger = GpuLedger.remote()
    # Pipeline A (ROLL's sequence) generates on GPUs 0,1 and trains on GPU 0, six steps.
    other = RollPipelineDriver(plane, ledger, train=[0], infer=[0, 1], steps=6, train_s=0.2,
                               timeout_s=120).start()
    other.wait_for_step(1, 60)
    adapter = _adapter(plane, pid)
    try:
        adapter.claim()  # the RLix trainer's _init_resource_pool_mgr, before any worker
        # Both GPUs are this pipeline's while veRL builds it (A's training on GPU 0 ended
        # first, its shards there were shrunk), at INITIALIZATION.
        assert gpu_owners(plane, (0, 1)) == [pid, pid]
        assert {g.stage for g in plane.status().gpus if g.gpu in (0, 1)} == {"INITIALIZATION"}
        # veRL's init: workers and replicas load onto both GPUs (the ledger rejects a GPU
        # with two users) and the first weights are synced.
        infer = cluster_id(pid, ACTOR_INFER)
        ray.get(ledger.claim.remote(infer, [0, 1]))
        done = other.steps_completed
        time.sleep(1.0)
        assert other.steps_completed == done  # A can neither generate nor train meanwhile
        controller = LedgerController(ledger, infer, (0, 1))
        adapter.attach(LAYOUT, controller)  # on_init_end: the replicas exist
        assert adapter.controller is controller
        assert gpu_owners(plane, (0, 1)) == [pid, pid]  # attaching does not end the hold
        adapter.end_setup()
        # Every replica asleep, then the hold given back: A takes the GPUs again.
        assert controller.shrunk == [0, 1]
        assert pid not in gpu_owners(plane, (0, 1))
        adapter.end_setup()  # idempotent: nothing shrunk or released twice
        assert controller.shrunk == [0, 1]
        assert_finished_without_sharing(other, ledger, 6)
    finally:
        adapter.close()
        if other.running:
            other.join(120)
    assert plane.status().pipeline(pid) is None


def test_replicas_built_for_another_layout_than_the_claim_are_refused_and_the_gpus_freed(
    coordinator: Any,
) -> None:
    plane = coordinator
    pid = "ft_0000000ve41e"
    adapter = _adapter(plane, pid)
    adapter.claim()
    assert gpu_owners(plane, (0, 1)) == [pid, pid]
    controller = LedgerController()
    built = VerlLayout(train_gpus=1, tp=1, hybrid_replicas=1, standalone_replicas=0)
    with pytest.raises(RegistrationError, match=r"veRL built .* but the pipeline claimed"):
        adapter.attach(built, controller)
    assert controller.closed and adapter.controller is None
    wait_until(lambda: plane.status().pipeline(pid) is None, 10)
    assert set(plane.status().owners().values()) == {None}


def test_attach_and_end_setup_out_of_order_are_typed_errors(coordinator: Any) -> None:
    plane = coordinator
    adapter = _adapter(plane, "ft_0000000ve41f")
    controller = LedgerController()
    with pytest.raises(RegistrationError, match=r"end_setup before attach"):
        adapter.end_setup()
    with pytest.raises(RegistrationError, match=r"attach before claim"):
        adapter.attach(LAYOUT, controller)
    assert not controller.closed and adapter.controller is None  # nothing changed
    with pytest.raises(RegistrationError, match=r"register\(\) needs the shard controller"):
        adapter.register()
    assert plane.status().pipeline("ft_0000000ve41f") is None
