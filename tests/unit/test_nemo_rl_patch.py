"""NeMo RL patch and adapter pieces that need no NeMo RL source (always run)."""

from __future__ import annotations

import sys

import pytest

from rlix_plugins import activation
from rlix_plugins.errors import RegistrationError
from rlix_plugins.patches.base import PlugKind
from rlix_plugins.patches.nemo_rl import (
    PART_POINTS,
    SUPPORTED_COMMIT,
    SUPPORTED_VERSION,
    NemoRlPatch,
    factory,
)
from rlix_plugins.settings import load_settings


def test_registered_under_nemo_rl_with_the_pinned_version() -> None:
    assert activation.PATCHES["nemo_rl"] == "rlix_plugins.patches.nemo_rl:factory"
    patch = factory()
    assert isinstance(patch, NemoRlPatch) and patch.module == "nemo_rl"
    assert SUPPORTED_COMMIT.startswith("7ea279abf") and len(SUPPORTED_COMMIT) == 40
    assert patch.version_supported(SUPPORTED_VERSION)
    assert not patch.version_supported("0.5.0") and not patch.version_supported(None)
    assert SUPPORTED_COMMIT[:9] in patch.supported


def test_plug_points_are_declared_per_part_and_seams_come_first() -> None:
    points = list(NemoRlPatch.plug_points)
    assert len(points) == sum(len(p) for p in PART_POINTS.values())
    assert all(p.target.startswith("nemo_rl.") and ":" in p.target for p in points)
    kinds = {p.kind for p in points}
    # Official seams and subclassing; nothing of NeMo RL is wrapped in place.
    assert PlugKind.WRAP not in kinds
    assert {PlugKind.EXTENSION_POINT, PlugKind.SUBCLASS, PlugKind.ATTRIBUTE} <= kinds
    targets = {p.target for p in points}
    for expected in (
        "nemo_rl.algorithms.grpo:VllmGeneration",
        "nemo_rl.distributed.ray_actor_environment_registry:ACTOR_ENVIRONMENT_REGISTRY",
        "nemo_rl.weight_sync.interfaces:WeightSynchronizer",
        "nemo_rl.models.policy.workers.megatron_policy_worker:"
        "MegatronPolicyWorkerImpl._iter_params_with_optional_kv_scales",
    ):
        assert expected in targets


def test_check_never_imports_unimported_host_modules() -> None:
    # In a vLLM worker grpo must never be imported by the patch's own checks.
    before = set(sys.modules)
    statuses = NemoRlPatch().check()
    assert {p.point.target.partition(":")[0] for p in statuses} <= before
    assert "nemo_rl.algorithms.grpo" not in set(sys.modules) - before


def test_apply_part_is_refused_until_the_patch_is_applied() -> None:
    patch = NemoRlPatch()
    assert patch.apply_part("nemo_rl.distributed.ray_actor_environment_registry") is False
    assert patch.parts_applied == frozenset()


def test_gate_off_registers_no_hook(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(activation, "_hooked", False)
    assert activation.activate(load_settings({})) is False
    assert activation.activate(load_settings({"RLIX_CONTROL_PLANE": "off"})) is False
    assert "nemo_rl" not in activation.applied_patches()
    assert activation._hooked is False


def test_layout_requires_partial_overlap() -> None:
    from rlix_plugins.adapters.nemo_rl import NemoRlLayout

    layout = NemoRlLayout((0, 1), (0,))
    assert layout.num_shards == 2
    assert layout.device_mappings() == {"actor_infer": [0, 1], "actor_train": [0]}
    assert layout.tp_configs() == {"actor_infer": 1, "actor_train": 1}
    with pytest.raises(RegistrationError, match="subset of the inference GPUs"):
        NemoRlLayout((0, 1), (2,))
    with pytest.raises(RegistrationError, match="multiple of tp"):
        NemoRlLayout((0, 1, 2), (0,), infer_tp=2)
    derived = NemoRlLayout.from_generation_config({"rlix": {"train_gpu_count": 1}}, 2, 1)
    assert derived == layout


def test_progress_target_and_batches() -> None:
    from rlix_plugins.adapters.nemo_rl import begin_progress_batch
    from rlix_plugins.protocol import ProgressReport
    from rlix_plugins.training.progress import ProgressTracker

    sent: list[ProgressReport] = []
    tracker = ProgressTracker("ft_000000000001", sent.append)
    tracker._rlix_step_target = 4  # type: ignore[attr-defined]
    begin_progress_batch(tracker, 3)
    tracker.record(1, weight_version=3)  # a group intended for step 3
    tracker.record(1, weight_version=4)  # intended for a later step: not this demand
    assert sent[0].metrics is not None and sent[0].metrics["new_batch"] is True
    assert sent[-1].completed == 1 and sent[-1].step_target_trajectories == 4
