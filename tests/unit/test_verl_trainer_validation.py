"""The RLix veRL trainer's validation and last-step hooks: what the adapter is told, in which
order. veRL's real step loop runs in ``tests/integration/test_verl_trainer_loop.py`` (veRL venv);
the adapter's effect at the real coordinator in ``test_verl_adapter_lifecycle.py``."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest

from rlix_plugins.patches.verl_trainer import rlix_trainer_class, validation_size


class FakeVerlTrainer:
    """FAKE veRL v1 trainer: only the attributes and hooks the RLix mixin calls."""

    def __init__(self, *, total_steps: int, val_prompts: int | None, val_n: Any) -> None:
        rollout = SimpleNamespace(val_kwargs=SimpleNamespace(n=val_n),
                                  checkpoint_engine=SimpleNamespace(backend="naive"))
        self.config = SimpleNamespace(actor_rollout_ref=SimpleNamespace(
            actor=SimpleNamespace(strategy="fsdp"), rollout=rollout))
        if val_prompts is not None:
            self.val_dataloader = SimpleNamespace(dataset=[{}] * val_prompts)
        self.total_training_steps = total_steps
        self.global_steps = 1
        self.calls: list[tuple[Any, ...]] = []

    def on_step_end(self) -> None:
        self.calls.append(("veRL on_step_end",))

    def on_validate_begin(self) -> None:
        self.calls.append(("veRL on_validate_begin",))

    def on_validate_end(self) -> None:
        self.calls.append(("veRL on_validate_end",))


class RecordingAdapter:
    """FAKE pipeline adapter: records what the hooks tell it."""

    def __init__(self, calls: list[tuple[Any, ...]]) -> None:
        self.calls = calls

    def end_steps(self, step: int) -> None:
        self.calls.append(("end_steps", step))

    def after_training(self, step: int) -> None:
        self.calls.append(("after_training", step))

    def begin_validation(self, step: int, target: int) -> None:
        self.calls.append(("begin_validation", step, target))

    def end_validation(self, step: int) -> None:
        self.calls.append(("end_validation", step))


def _trainer(total_steps: int = 3, val_prompts: int | None = 5, val_n: Any = 2) -> Any:
    t = rlix_trainer_class(FakeVerlTrainer)(
        total_steps=total_steps, val_prompts=val_prompts, val_n=val_n)
    t._rlix_adapter = RecordingAdapter(t.calls)
    return t


def test_only_the_last_step_ends_the_rollouts_demand_before_its_release() -> None:
    t = _trainer(total_steps=2)
    t.on_step_end()
    t.global_steps = 2
    t.on_step_end()
    assert t.calls == [
        ("veRL on_step_end",), ("after_training", 1),
        ("veRL on_step_end",), ("end_steps", 2), ("after_training", 2),
    ]


def test_a_validation_is_demand_while_it_runs() -> None:
    t = _trainer(val_prompts=5, val_n=2)
    t.global_steps = 3
    t.on_validate_begin()
    t.on_validate_end()
    assert t.calls == [
        ("veRL on_validate_begin",), ("begin_validation", 3, 10),
        ("veRL on_validate_end",), ("end_validation", 3),
    ]


class FailingEndTrainer(FakeVerlTrainer):
    """FAKE trainer whose own ``on_validate_end`` raises."""

    def on_validate_end(self) -> None:
        raise RuntimeError("veRL's hook failed")


def test_a_validation_ends_its_demand_even_when_veRLs_end_hook_raises() -> None:
    t = rlix_trainer_class(FailingEndTrainer)(total_steps=3, val_prompts=5, val_n=2)
    t._rlix_adapter = RecordingAdapter(t.calls)
    t.on_validate_begin()
    with pytest.raises(RuntimeError, match="veRL's hook failed"):
        t.on_validate_end()
    assert t.calls[-1] == ("end_validation", 1)


@pytest.mark.parametrize(
    ("prompts", "n"), [(None, 2), (5, None), (5, 0), (5, True), (5, "2")]
)
def test_an_unreadable_validation_size_reports_no_demand(
    prompts: int | None, n: Any, caplog: pytest.LogCaptureFixture
) -> None:
    t = _trainer(val_prompts=prompts, val_n=n)
    assert validation_size(t) is None
    with caplog.at_level(logging.WARNING):
        t.on_validate_begin()
    assert t.calls == [("veRL on_validate_begin",)]
    assert "reports no demand" in caplog.text


def test_without_an_adapter_the_hooks_are_veRLs_own() -> None:
    t = _trainer(total_steps=1)
    t._rlix_adapter = None
    t.on_step_end()
    t.on_validate_begin()
    t.on_validate_end()
    assert t.calls == [
        ("veRL on_step_end",), ("veRL on_validate_begin",), ("veRL on_validate_end",)
    ]
