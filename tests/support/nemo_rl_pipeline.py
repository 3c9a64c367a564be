"""A NeMo RL driver pipeline over FAKE parts, shared by the NeMo RL adapter review tests:
a FAKE policy (the caller's base, through the adapter's real ``make_policy_class``), a FAKE
shard-state view with shard 1 active, the caller's FAKE shard controller and no scheduler
(generation requests are recorded in the hooks' calls)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from rlix_plugins.adapters import nemo_rl
from rlix_plugins.adapters.nemo_rl import NemoRlLayout
from rlix_plugins.settings import load_settings
from tests.support.recording_hooks import FakeHooks

PID = "ft_000000000042"


def fake_pipeline(monkeypatch: pytest.MonkeyPatch, policy_base: type, controller: Any, *,
                  cached_once: bool, request_with_step: bool = False
                  ) -> tuple[Any, nemo_rl.NemoRlPipeline, FakeHooks]:
    """(policy, pipeline, hooks), the pipeline installed as the driver's; ``cached_once``: the
    init refit is done. A generation request is recorded as ``"request_generation"`` (or
    ``"request_generation:{step}"`` with ``request_with_step``)."""
    monkeypatch.delenv("RLIX_CONTROL_PLANE", raising=False)  # no attach at construction
    policy = nemo_rl.make_policy_class(policy_base)(None, {"megatron_cfg": {}})
    hooks = FakeHooks()
    policy.hooks = hooks
    pipeline = nemo_rl.NemoRlPipeline(load_settings({}), SimpleNamespace(),
                                      NemoRlLayout((0, 1), (0,)), hooks, PID)  # type: ignore[arg-type]
    pipeline.policy = policy
    pipeline.state = SimpleNamespace(snapshot=lambda: SimpleNamespace(active=(1,)))
    pipeline._controller = controller
    pipeline._cached_once = cached_once

    def request_generation() -> None:
        hooks.calls.append(f"request_generation:{pipeline.step}" if request_with_step
                           else "request_generation")

    monkeypatch.setattr(pipeline, "_request_generation", request_generation)
    monkeypatch.setattr(nemo_rl, "_pipeline", pipeline)
    return policy, pipeline, hooks
