"""The RLix veRL trainer's init: in which order the claimed pipeline is attached and its setup
hold ended, and that a failed init leaves the coordinator. The claim itself (before veRL's
workers, at the real coordinator) runs in ``tests/integration/test_verl_trainer_loop.py`` and
``test_verl_setup_hold.py``; here the trainer base and the adapter are FAKES."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from rlix_plugins.errors import UnsupportedJobError
from rlix_plugins.patches import verl_trainer
from rlix_plugins.patches.verl_trainer import rlix_trainer_class


class FakeVerlTrainer:
    """FAKE veRL v1 trainer: ``init`` ends with ``on_init_end`` as veRL's does; ``fail`` makes
    the named step raise."""

    def __init__(self, fail: str = "") -> None:
        rollout = SimpleNamespace(checkpoint_engine=SimpleNamespace(backend="naive"))
        self.config = SimpleNamespace(actor_rollout_ref=SimpleNamespace(
            actor=SimpleNamespace(strategy="fsdp"), rollout=rollout))
        self.fail = fail
        self.calls: list[str] = []

    def _init_resource_pool_mgr(self) -> None:
        self.calls.append("veRL maps roles to workers")

    def init(self) -> None:
        self.calls.append("veRL builds workers and replicas")
        if self.fail == "build":
            raise RuntimeError("worker launch failed")
        self.on_init_end()

    def on_init_end(self) -> None:
        self.calls.append("veRL first sync")


class ClaimedAdapter:
    """FAKE claimed pipeline adapter: records attach / end_setup / close."""

    def __init__(self, calls: list[str], fail: str) -> None:
        self.calls, self.fail = calls, fail

    def end_setup(self) -> None:
        self.calls.append("end_setup")
        if self.fail == "end_setup":
            raise RuntimeError("a replica did not go to sleep")

    def close(self) -> None:
        self.calls.append("close")


def _trainer(monkeypatch: pytest.MonkeyPatch, fail: str = "") -> Any:
    t = rlix_trainer_class(FakeVerlTrainer)(fail=fail)
    claimed = ClaimedAdapter(t.calls, fail)
    t._rlix_adapter = claimed  # what _init_resource_pool_mgr's claim left

    def build_adapter(trainer: Any, given: Any = None) -> Any:
        assert given is claimed  # the claimed pipeline is attached, not a second one made
        trainer.calls.append("attach replicas")
        if fail == "attach":
            raise RuntimeError("veRL built another layout")
        return given

    monkeypatch.setattr(verl_trainer, "build_adapter", build_adapter)
    # The managers' swap needs veRL (covered with it by the trainer-loop test).
    for name in ("install_cache_manager", "install_hybrid_manager"):
        monkeypatch.setattr(verl_trainer, name, lambda trainer: False)
    monkeypatch.setattr(verl_trainer.RLixTrainerMixin, "_worker_call",
                        lambda self, method: self.calls.append(method))
    return t


def test_init_ends_with_the_replicas_attached_the_groups_released_and_the_hold_ended(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    t = _trainer(monkeypatch)
    t.init()
    assert t.calls == ["veRL builds workers and replicas", "veRL first sync",
                       "attach replicas", "rlix_release_parallel_state", "end_setup"]
    assert t._rlix_adapter is not None


@pytest.mark.parametrize("fail", ["build", "attach", "end_setup"])
def test_a_failed_init_leaves_the_coordinator(monkeypatch: pytest.MonkeyPatch,
                                              fail: str) -> None:
    t = _trainer(monkeypatch, fail)
    with pytest.raises(RuntimeError):
        t.init()
    assert t.calls[-1] == "close" and t.calls.count("close") == 1
    assert t._rlix_adapter is None


def test_an_unsupported_job_is_refused_before_verl_maps_any_worker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The FAKE trainer's job: veRL's default "naive" backend, no rollout engine named.
    t = rlix_trainer_class(FakeVerlTrainer)()

    def claim(trainer: Any) -> None:
        raise AssertionError("an unsupported job must not claim GPUs")

    monkeypatch.setattr(verl_trainer, "claim_adapter", claim)
    with pytest.raises(UnsupportedJobError) as info:
        t._init_resource_pool_mgr()
    assert [p.key for p in info.value.problems] == [
        "actor_rollout_ref.rollout.name", "actor_rollout_ref.rollout.checkpoint_engine.backend",
        # veRL's defaults keep the actor's state on the trainer GPUs between steps
        "actor_rollout_ref.actor.fsdp_config.param_offload",
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload"]
    assert t.calls == [] and t._rlix_adapter is None
