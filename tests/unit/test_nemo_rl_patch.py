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
    from rlix_plugins.adapters.nemo_rl import CollectorTracker
    from rlix_plugins.protocol import ProgressReport

    sent: list[ProgressReport] = []
    tracker = CollectorTracker("ft_000000000001", sent.append, step_target=4)
    tracker.begin_version(3)
    tracker.record(1, weight_version=3)  # a group intended for step 3
    tracker.record(1, weight_version=4)  # intended for a later step: not this demand
    assert sent[0].metrics is not None and sent[0].metrics["new_batch"] is True
    assert sent[-1].completed == 1 and sent[-1].step_target_trajectories == 4


# ------------------------------------------------------------------ placement plan (pure)


def _bundles(*gpus: int, node: str = "n0") -> list[object]:
    from rlix_plugins.adapters.nemo_rl_placement_plan import BundleGpu

    return [BundleGpu(i, node, g) for i, g in enumerate(gpus)]


def test_plan_follows_where_ray_put_each_bundle() -> None:
    from rlix_plugins.adapters.nemo_rl_placement_plan import plan_placement

    # Ray put bundle 0 on GPU 1 and bundle 1 on GPU 0: ranks follow GPU order, not bundles.
    plan = plan_placement([0, 1], [0], _bundles(1, 0), {"n0": 0}, 2)  # type: ignore[arg-type]
    assert plan.infer.bundles == (1, 0) and plan.train.bundles == (1,)
    assert plan.device_mappings() == {"actor_infer": [0, 1], "actor_train": [0]}
    assert plan.infer.bundle_groups(1) == [(0, [1]), (0, [0])]
    assert plan.infer.bundle_groups(2) == [(0, [1, 0])]
    assert plan.global_gpu_of_bundle(0) == 1


def test_plan_global_ids_use_the_node_rank() -> None:
    from rlix_plugins.adapters.nemo_rl_placement_plan import BundleGpu, plan_placement

    bundles = [BundleGpu(0, "b", 0), BundleGpu(1, "a", 1)]
    plan = plan_placement([1, 2], [2], bundles, {"a": 0, "b": 1}, 2)
    assert plan.infer.gpus == (1, 2) and plan.infer.bundles == (1, 0)
    assert plan.train.bundles == (0,) and plan.infer.node_indices == (0, 1)


def test_plan_refuses_what_ray_did_not_give() -> None:
    from rlix_plugins.adapters.nemo_rl_placement_plan import PlacementError, plan_placement

    with pytest.raises(PlacementError, match=r"inference on GPUs \[0\] but Ray placed the "
                       r"shared bundles on GPUs \[1\] \(bundle 0 -> GPU 1\)"):
        plan_placement([0], [0], _bundles(1), {"n0": 0}, 2)  # type: ignore[arg-type]
    with pytest.raises(PlacementError, match="subset of the inference GPUs"):
        plan_placement([0], [1], _bundles(0), {"n0": 0}, 2)  # type: ignore[arg-type]
    with pytest.raises(PlacementError, match="both report GPU 0"):
        plan_placement([0, 1], [0], _bundles(0, 0), {"n0": 0}, 2)  # type: ignore[arg-type]
    with pytest.raises(PlacementError, match="has no node rank"):
        plan_placement([0], [0], _bundles(0, node="x"), {"n0": 0}, 2)  # type: ignore[arg-type]


def test_worker_and_device_mapping_checks_name_the_mismatch() -> None:
    from rlix_plugins.adapters.nemo_rl_placement_plan import (
        PlacementError,
        WorkerGpu,
        check_device_mappings,
        check_worker_gpus,
        plan_placement,
    )

    plan = plan_placement([0, 1], [0], _bundles(0, 1), {"n0": 0}, 2)  # type: ignore[arg-type]
    check_worker_gpus(plan, "actor_infer", [WorkerGpu(0, (0,), "0", "n0"),
                                            WorkerGpu(1, (1,), "1", "n0")])
    with pytest.raises(PlacementError, match=r"rank 0: on GPU \[1\].*planned GPU 0"):
        check_worker_gpus(plan, "actor_train", [WorkerGpu(0, (1,), "1", "n0")])
    with pytest.raises(PlacementError, match="rank 1: no report"):
        check_worker_gpus(plan, "actor_infer", [WorkerGpu(0, (0,), "0", "n0")])
    check_device_mappings(plan, {"actor_infer": [1, 0], "actor_train": [0]})
    with pytest.raises(PlacementError, match=r"actor_train: coordinator told \[1\], workers "
                       r"placed on \[0\]"):
        check_device_mappings(plan, {"actor_infer": [0, 1], "actor_train": [1]})


def test_layout_gpus_reads_policy_generation_rlix() -> None:
    from rlix_plugins.adapters.nemo_rl_placement_plan import PlacementError, layout_gpus

    assert layout_gpus({"rlix": {"infer_gpus": [0, 1], "train_gpus": [0]}}, 1, 1) == (
        (0, 1), (0,))
    assert layout_gpus({"rlix": {"infer_gpus": [0, 1, 2, 3], "train_gpu_count": 2}}, 1, 2) == (
        (0, 1, 2, 3), (0, 1))
    assert layout_gpus({}, 2, 1) == ((0, 1), (0,))  # defaults: stock size, train on the first
    with pytest.raises(PlacementError, match="not a multiple of tp"):
        layout_gpus({}, 3, 2)


def test_placement_plug_points_are_declared() -> None:
    targets = {p.target: p for p in NemoRlPatch.plug_points}
    for target, kind in (
        ("nemo_rl.algorithms.grpo:RayVirtualCluster", PlugKind.ATTRIBUTE),
        ("nemo_rl.models.generation.vllm.vllm_generation:RayWorkerGroup", PlugKind.ATTRIBUTE),
        ("nemo_rl.models.policy.lm_policy:RayWorkerGroup", PlugKind.ATTRIBUTE),
        ("nemo_rl.distributed.virtual_cluster:RayVirtualCluster.__init__", PlugKind.SUBCLASS),
        ("nemo_rl.distributed.worker_groups:RayWorkerGroup.__init__", PlugKind.SUBCLASS),
        ("nemo_rl.distributed.virtual_cluster:get_reordered_bundle", PlugKind.READ),
        ("nemo_rl.distributed.worker_groups:RayWorkerGroup._create_workers_from_bundle_indices",
         PlugKind.READ),
    ):
        assert targets[target].kind is kind


def test_pinned_plan_on_the_coordinators_per_node_groups() -> None:
    from rlix_plugins.adapters.nemo_rl_placement_plan import (
        PlacementError,
        WorkerGpu,
        check_worker_gpus,
        pinned_worker_env,
        plan_pinned,
    )

    plan = plan_pinned([3, 0, 2], [2], ["n0", "n1"], 2)
    assert plan.pinned and plan.infer.gpus == (0, 2, 3)
    # Every worker takes bundle 0 of its node's group; node rank = GPU // gpus_per_node.
    assert plan.infer.bundles == (0, 0, 0) and plan.infer.node_indices == (0, 1, 1)
    assert [plan.local_gpu("actor_infer", r) for r in range(3)] == [0, 0, 1]
    assert plan.infer.bundle_groups(1) == [(0, [0]), (1, [0]), (1, [0])]
    assert pinned_worker_env(1) == {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1",
                                    "CUDA_VISIBLE_DEVICES": "1"}
    # The check is what the worker sees: its CUDA_VISIBLE_DEVICES and node.
    check_worker_gpus(plan, "actor_train", [WorkerGpu(0, (0,), "0", "n1")])
    with pytest.raises(PlacementError, match="sees CUDA_VISIBLE_DEVICES=1 on node n1"):
        check_worker_gpus(plan, "actor_train", [WorkerGpu(0, (0,), "1", "n1")])
    with pytest.raises(PlacementError, match="on node n0"):
        check_worker_gpus(plan, "actor_train", [WorkerGpu(0, (0,), "0", "n0")])
    with pytest.raises(PlacementError, match=r"GPUs \[4\] do not exist"):
        plan_pinned([0, 4], [0], ["n0", "n1"], 2)
    with pytest.raises(PlacementError, match="subset"):
        plan_pinned([0], [1], ["n0"], 2)
    with pytest.raises(PlacementError, match="one bundle per node"):
        plan.global_gpu_of_bundle(0)
