"""A NeMo RL pipeline holds its GPUs while it sets up, on real Ray against the real coordinator.

NeMo RL's ``grpo.setup`` loads the policy and the vLLM engines onto the pipeline's GPUs before
its first refit. Under the coordinator the pipeline first claims them (INITIALIZATION, as
ROLL's init does): another pipeline's training on them finishes first, its generation ranks
there are shrunk, and nothing is woken on them until the first refit has put the shards to
sleep and offloaded the policy.

The other pipeline is the ROLL-sequence driver of the coordinator tests, whose simulated shards
and training claim GPUs on the ``GpuLedger`` (the independent witness that no GPU has two
users); the NeMo RL pipeline's model loads are claims on the same ledger. Its policy and shard
controller are FAKES (they record calls; the real ones need NeMo RL's workers on GPUs,
``tests/integration/test_nemo_rl_pipeline.py`` runs the driver with real vLLM engines); the
adapter, its hooks, the coordinator and the ledger are real.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Sequence
from types import SimpleNamespace
from typing import Any

import pytest
import ray

from rlix_plugins.adapters import nemo_rl
from rlix_plugins.adapters.nemo_rl import NemoRlLayout, NemoRlPipeline
from rlix_plugins.errors import ProtocolError, RegistrationError
from rlix_plugins.hooks import make_hooks
from rlix_plugins.protocol.names import ACTOR_INFER, cluster_id
from rlix_plugins.settings import ENV_PIPELINE_ID, load_settings
from tests.support.recording_policy import RecordingPolicy
from tests.support.roll_pipeline import (
    GpuLedger,
    RollPipelineDriver,
    assert_finished_without_sharing,
    gpu_owners,
    wait_until,
)

pytestmark = pytest.mark.integration

PID = "ft_0000005e7a0d"


class LedgerPolicy(RecordingPolicy):
    """FAKE NeMo RL policy: records the adapter's calls; its model is on the ledger's GPUs
    from construction until ``offload_after_refit`` (when the adapter moves it off)."""

    def __init__(self, ledger: Any, owner: str, gpus: Sequence[int]) -> None:
        super().__init__()
        self.ledger, self.owner, self.gpus = ledger, owner, list(gpus)
        ray.get(ledger.claim.remote(owner, self.gpus))  # setup loads the models

    def offload_after_refit(self) -> None:
        super().offload_after_refit()
        ray.get(self.ledger.release.remote(self.owner, self.gpus))


class RecordingController:
    """FAKE shard controller: records which shards the init refit put to sleep."""

    def __init__(self) -> None:
        self.shrunk: list[int] = []

    def shrink(self, ranks: Sequence[int]) -> None:
        self.shrunk += list(ranks)

    def close(self) -> None:
        """Nothing to stop."""


@pytest.fixture
def rlix_env(coordinator: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    monkeypatch.setenv("RLIX_CONTROL_PLANE", "rlix")
    monkeypatch.setenv("RLIX_NAMESPACE", coordinator.namespace)
    monkeypatch.delenv(ENV_PIPELINE_ID, raising=False)
    for name in ("_pipeline", "_claimed", "_pending_policy"):
        monkeypatch.setattr(nemo_rl, name, None)
    yield coordinator
    claim = nemo_rl._claimed
    for pipeline in (nemo_rl._pipeline, claim.pipeline if claim is not None else None):
        if pipeline is not None:
            pipeline.shutdown()


def test_setup_waits_for_anothers_training_holds_both_gpus_and_gives_them_back_at_the_refit(
    rlix_env: Any,
) -> None:
    plane = rlix_env
    ledger = GpuLedger.remote()
    # Pipeline A (ROLL's sequence) generates on GPUs 0,1 and trains on GPU 0, six steps.
    other = RollPipelineDriver(plane, ledger, train=[0], infer=[0, 1], steps=6, train_s=0.2,
                               timeout_s=120).start()
    other.wait_for_step(1, 60)
    settings = load_settings()
    pipeline = NemoRlPipeline(settings, None, NemoRlLayout((0, 1), (1,)),
                              make_hooks(settings, pipeline_id=PID, heartbeat=False), PID)
    try:
        pipeline.claim()
        # Both GPUs are this pipeline's while it sets up: A's training on GPU 0 ended first
        # and its shards there were shrunk.
        assert gpu_owners(plane, (0, 1)) == [PID, PID]
        # ... at INITIALIZATION, which is what `rlix-plugins status` shows for them.
        assert {g.stage for g in plane.status().gpus if g.gpu in (0, 1)} == {"INITIALIZATION"}
        assert pipeline.hooks.holding_for_setup
        done = other.steps_completed
        pipeline.policy = LedgerPolicy(ledger, cluster_id(PID, ACTOR_INFER), (0, 1))
        controller = RecordingController()
        pipeline._controller = controller  # type: ignore[assignment]
        requested: list[int] = []
        pipeline._request_generation = lambda: requested.append(pipeline.step)  # type: ignore[method-assign]
        # Training GPUs touched before the first refit are covered by the hold: nothing is
        # requested (a request would wait for the pipeline's own hold).
        pipeline.before_training()
        assert not pipeline._holding_train and pipeline.policy.calls == []
        time.sleep(1.0)
        # A cannot generate or train anywhere meanwhile (both its GPUs are held).
        assert other.steps_completed == done
        metrics = pipeline.after_training()  # NeMo RL's initial refit
        assert metrics == {"rlix/cached_version": 0.0}
        # Shards asleep, the policy off the GPUs and its groups destroyed, then the hold ends,
        # then generation is asked for.
        assert controller.shrunk == [0, 1]
        assert pipeline.policy.calls == ["rlix_build_cache", "offload_before_refit",
                                         "offload_after_refit", "rlix_destroy_parallel_state"]
        assert not pipeline.hooks.holding_for_setup
        assert requested == [0]
        assert PID not in gpu_owners(plane, (0, 1))
        assert_finished_without_sharing(other, ledger, 6)
    finally:
        pipeline.shutdown()
        if other.running:
            other.join(120)
    assert plane.status().pipeline(PID) is None


def _generation(dp_size: int) -> Any:
    """Stand-in for NeMo RL's VllmGeneration: the attributes the adapter reads."""
    attached: list[str] = []
    return SimpleNamespace(
        cfg={}, dp_size=dp_size, model_parallel_size=1, worker_group=SimpleNamespace(cluster=None),
        attached=attached,
        rlix_attach=lambda state, **kw: attached.append(kw["pipeline_id"]),
    )


def test_the_first_bind_claims_and_the_generation_attaches_to_the_claimed_pipeline(
    rlix_env: Any,
) -> None:
    plane = rlix_env
    nemo_rl.claim_setup(NemoRlLayout((0, 1), (0,)))
    claim = nemo_rl._claimed
    assert claim is not None and nemo_rl.current_pipeline() is None
    claimed = claim.pipeline
    assert gpu_owners(plane, (0, 1)) == [claimed.pipeline_id] * 2
    nemo_rl.claim_setup(NemoRlLayout((0, 1), (0,)))  # the other role's bind: no second claim
    assert nemo_rl._claimed is claim
    gen = _generation(2)
    nemo_rl.attach_generation(gen)
    assert nemo_rl.current_pipeline() is claimed and nemo_rl._claimed is None
    assert gen.attached == [claimed.pipeline_id]
    assert len(plane.status().pipelines) == 1
    # Still held: only the first refit ends the setup hold.
    assert gpu_owners(plane, (0, 1)) == [claimed.pipeline_id] * 2


def test_a_generation_built_for_another_layout_than_the_claim_is_refused_and_the_gpus_freed(
    rlix_env: Any,
) -> None:
    plane = rlix_env
    nemo_rl.claim_setup(NemoRlLayout((0, 1, 2), (0,)))
    assert nemo_rl._claimed is not None
    claimed = nemo_rl._claimed.pipeline
    assert os.environ[ENV_PIPELINE_ID] == claimed.pipeline_id
    with pytest.raises(RegistrationError, match=r"built for .* but its setup was claimed for"):
        nemo_rl.attach_generation(_generation(2))
    assert nemo_rl.current_pipeline() is None and nemo_rl._claimed is None
    assert ENV_PIPELINE_ID not in os.environ  # the id of a pipeline that left
    wait_until(lambda: plane.status().pipeline(claimed.pipeline_id) is None, 10)
    assert set(plane.status().owners().values()) == {None}


def test_the_hold_is_taken_once_and_given_back_once(rlix_env: Any) -> None:
    plane = rlix_env
    settings = load_settings()
    hooks = make_hooks(settings, pipeline_id=PID, heartbeat=False)
    pipeline = NemoRlPipeline(settings, None, NemoRlLayout((0, 1), (0,)), hooks, PID)
    try:
        pipeline.claim()
        # Held: asked again, answered from the hold (no second request waits in the queue).
        assert hooks.hold_for_setup(ACTOR_INFER) == (0, 1)
        assert plane.status().wait_queue == ()
        with pytest.raises(ProtocolError, match=rf"{PID}_actor_infer is already held for setup"):
            hooks.hold_for_setup("actor_train")
        assert gpu_owners(plane, (0, 1)) == [PID, PID]
        hooks.release_setup_hold()
        assert not hooks.holding_for_setup and gpu_owners(plane, (0, 1)) == [None, None]
        hooks.release_setup_hold()  # nothing held: a no-op
        assert plane.status().pipeline(PID) is not None
    finally:
        pipeline.shutdown()
