"""The 4-method hook protocol a host training loop calls around each step."""

from __future__ import annotations

import logging
from typing import Protocol, runtime_checkable

from rlix_plugins.errors import ProtocolError
from rlix_plugins.values import count

logger = logging.getLogger(__name__)

#: Progress stream (``mode`` of :meth:`RLixHooks.report_progress`) of a validation run: the
#: coordinator counts it with the rollouts' ``train`` stream (a pipeline's demand is the sum
#: of its streams), so a validation keeps or wakes ranks as a rollout does.
VALIDATION_MODE = "val"


@runtime_checkable
class RLixHooks(Protocol):
    """What a host (NeMo RL, veRL) calls; the coordinator-backed implementation acts on it.

    ``before_training`` blocks until the training GPUs are granted (inference shards on them
    have been preempted). ``after_training`` runs after the weights are cached and the training
    GPU state is offloaded; it releases the GPUs so shards can be woken and synced.
    """

    def before_training(self, step: int) -> None: ...

    def after_training(self, step: int) -> None: ...

    def report_progress(
        self,
        *,
        step_target_trajectories: int,
        collected: int,
        current_train_step: int,
        new_batch: bool = False,
        mode: str = "train",
        adapter_id: str | None = None,
        outstanding: int | None = None,
    ) -> None: ...

    def clear_progress(self) -> None: ...


@runtime_checkable
class SetupHold(Protocol):
    """Hooks that can hold a pipeline's GPUs while its host loads models, beyond the four
    methods (:class:`~rlix_plugins.hooks.coordinator_hooks.CoordinatorHooks`): the clusters
    named (default the inference cluster) at INITIALIZATION until released."""

    def hold_for_setup(self, cluster: str = ..., *others: str) -> tuple[int, ...]: ...

    @property
    def holding_for_setup(self) -> bool: ...

    def release_setup_hold(self) -> None: ...


class NoOpRLixHooks:
    """Hooks of a standalone job (``RLIX_CONTROL_PLANE`` unset or ``off``): do nothing."""

    def before_training(self, step: int) -> None:
        del step

    def after_training(self, step: int) -> None:
        del step

    def report_progress(
        self,
        *,
        step_target_trajectories: int,
        collected: int,
        current_train_step: int,
        new_batch: bool = False,
        mode: str = "train",
        adapter_id: str | None = None,
        outstanding: int | None = None,
    ) -> None:
        del step_target_trajectories, collected, current_train_step, new_batch, mode, adapter_id
        del outstanding

    def clear_progress(self) -> None:
        return None


def validation_count(name: str, value: object) -> int:
    """A validation's step or trajectory count as an int >= 0, else :class:`ProtocolError`
    naming it (checked before anything is sent)."""
    return count(value, ProtocolError, f"validation {name}")


def report_validation(
    hooks: RLixHooks, pipeline_id: str, *, step: int, done: int, target: int, new_batch: bool
) -> None:
    """Report a validation's progress on its own stream (:data:`VALIDATION_MODE`): ``done`` of
    ``target`` trajectories, the rest outstanding. Advisory: a failed report is logged, never
    raised (the validation must not fail for it)."""
    try:
        hooks.report_progress(
            step_target_trajectories=target, collected=done, current_train_step=step,
            new_batch=new_batch, mode=VALIDATION_MODE, outstanding=target - done,
        )
    except Exception:
        logger.warning("pipeline %s: validation demand (%d of %d done) not reported",
                       pipeline_id, done, target, exc_info=True)
