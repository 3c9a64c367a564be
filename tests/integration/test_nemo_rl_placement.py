"""Partial-overlap placement against NeMo RL's real source on a real local Ray (2 logical GPUs).

The scenarios run in one child process (``tests/support/nemo_rl_placement_run.py``) with its
own ``ray.init(num_gpus=2, num_cpus=8)``, since this session may already run a Ray with other
resources. In it: NeMo RL's real ``RayVirtualCluster`` (both clusters grpo.setup builds in
non-colocated mode, with the gate-1 arguments), NeMo RL's real ``VllmGeneration.__init__``,
``RayWorkerBuilder`` and ``RayWorkerGroup`` machinery start small real actors; only the GPU
workers are fakes (they load no model; the inference fake uses the real vLLM worker's
``configure_worker``). ``grpo.setup`` and ``Policy.__init__`` cannot run here (Python >= 3.12;
mlflow/wandb), so the training group is built with the call ``Policy.__init__`` makes.

Skipped with a loud reason without NEMO_RL_SRC (the shared ``nemo_rl_src`` fixture).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rlix_plugins import activation
from rlix_plugins.settings import load_settings
from tests.support.scenario_results import ok, read_results

pytestmark = [pytest.mark.nemo_rl, pytest.mark.integration]

VGEN = "nemo_rl.models.generation.vllm.vllm_generation"
WGROUP = "nemo_rl.distributed.worker_groups"


@pytest.fixture(scope="module")
def scenarios(nemo_rl_src: Path) -> dict[str, Any]:
    """Run every scenario once; {name: {"ok": result} | {"failed": reason}}."""
    return read_results("tests.support.nemo_rl_placement_run", nemo_rl_src)


def _gpu_share(worker: dict[str, Any]) -> float:
    # ray.get_runtime_context().get_assigned_resources() in the worker.
    return float(worker["assigned"].get("GPU", 0.0))


def test_training_on_gpu0_inference_on_gpus_0_and_1_same_bundles(
    scenarios: dict[str, Any],
) -> None:
    r = ok(scenarios, "overlap")
    infer, train = r["infer_workers"], r["train_workers"]
    # What each worker process sees: Ray's GPU ids and CUDA_VISIBLE_DEVICES.
    assert [w["gpu_ids"] for w in infer] == [[0], [1]]
    assert [w["cuda_visible_devices"] for w in infer] == ["0", "1"]
    assert [w["gpu_ids"] for w in train] == [[0]]
    assert [w["cuda_visible_devices"] for w in train] == ["0"]
    train_gpus = {g for w in train for g in w["gpu_ids"]}
    infer_gpus = {g for w in infer for g in w["gpu_ids"]}
    assert train_gpus < infer_gpus  # partial overlap: a strict subset, same physical GPU
    # One placement group shared by both roles; each worker holds half of its bundle's GPU.
    pg_ids = {w["pg_id"] for w in infer + train}
    assert len(pg_ids) == 1 and set(r["shared_pg"]) == pg_ids
    assert all(_gpu_share(w) == pytest.approx(0.5) for w in infer + train)
    assert r["max_colocated"] == [2, 2]
    # The coordinator's device mappings are the GPUs the workers report.
    assert r["plan"]["device_mappings"] == {"actor_infer": [0, 1], "actor_train": [0]}
    assert r["plan"]["train_bundles"][0] in r["plan"]["infer_bundles"]
    # NeMo RL's own view: dp=2 over the 2 inference GPUs, policy world size 1.
    assert r["generation"]["dp_size"] == 2 and r["generation"]["world_size"] == 2
    assert r["policy_world_size"] == 1
    assert r["generation"]["worker_group_class"] == "RLixRayWorkerGroup"
    # Shard r's leader reports GPU sorted(infer)[r] through VllmGeneration's own init calls.
    assert [d["gpu_ids"] for d in r["generation"]["reported"]] == [[0], [1]]
    # The group outlives the first cluster's shutdown (called twice: counted once) and goes
    # with the second; the pair is then reset for a later round, and shutting down again is a
    # no-op.
    assert r["pg_after_train_shutdown"] == list(pg_ids)
    assert r["pg_states_after"] == ["REMOVED"]
    assert r["pair_after_shutdown"] == {"placement_cleared": True, "released": []}


def test_tensor_parallel_shard_and_training_on_the_second_gpu(
    scenarios: dict[str, Any],
) -> None:
    r = ok(scenarios, "tp2")
    # vLLM's tp=2 path: NeMo RL ties 2 workers per shard; they ask Ray for no GPU (vLLM
    # places its own workers on the group's bundles), so only the bundles are checked there.
    assert r["generation"]["dp_size"] == 1 and r["generation"]["world_size"] == 2
    assert [w["gpu_ids"] for w in r["infer_workers"]] == [[], []]
    assert {w["pg_id"] for w in r["infer_workers"]} == {w["pg_id"] for w in r["train_workers"]}
    assert r["plan"]["infer_bundles"] == sorted(
        r["plan"]["infer_bundles"], key=lambda b: r["plan"]["bundle_gpu"][str(b)]
    )
    # Training on GPU 1 only: the bundle Ray put on GPU 1, whatever its index.
    assert [w["gpu_ids"] for w in r["train_workers"]] == [[1]]
    assert r["plan"]["bundle_gpu"][str(r["plan"]["train_bundles"][0])] == 1
    assert r["plan"]["device_mappings"] == {"actor_infer": [0, 1], "actor_train": [1]}


def test_a_layout_ray_cannot_honour_is_refused_with_the_gpus_named(
    scenarios: dict[str, Any],
) -> None:
    r = ok(scenarios, "gpu_taken")
    held = r["held"][0]
    assert r["error_type"] == "PlacementError"
    assert f"inference on GPUs [{held}]" in r["error"]
    assert f"on GPUs [{1 - held}]" in r["error"]
    assert "unbound" not in r["error"]
    assert "before the pipeline layout was bound" in r["unbound_error"]
    free = 1 - held
    assert r["free_plan"] == {"actor_infer": [free], "actor_train": [free]}


def test_gate_off_placement_is_not_patched(
    nemo_rl_src: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(activation, "_hooked", False)
    vgen = __import__(VGEN, fromlist=["x"])
    wgroup = __import__(WGROUP, fromlist=["x"])
    assert activation.activate(load_settings({})) is False
    assert vgen.RayWorkerGroup is wgroup.RayWorkerGroup
    assert "nemo_rl" not in activation.applied_patches()


def test_gate_on_replaces_the_worker_group_and_reverts(nemo_rl_src: Path) -> None:
    from rlix_plugins.adapters.nemo_rl_placement import RLixRayWorkerGroup
    from rlix_plugins.patches.nemo_rl import NemoRlPatch

    vgen = __import__(VGEN, fromlist=["x"])
    wgroup = __import__(WGROUP, fromlist=["x"])
    patch = NemoRlPatch()
    patch.apply()
    try:
        assert vgen.RayWorkerGroup is RLixRayWorkerGroup
        assert issubclass(RLixRayWorkerGroup, wgroup.RayWorkerGroup)
    finally:
        patch.revert()
    assert vgen.RayWorkerGroup is wgroup.RayWorkerGroup


def test_a_plain_cluster_is_left_to_nemo_rl(nemo_rl_src: Path) -> None:
    from rlix_plugins.adapters.nemo_rl_placement import RLixPlacementCluster, bind_cluster

    # A cluster grpo.setup builds for something else (e.g. a reward model) is NeMo RL's.
    other = RLixPlacementCluster(bundle_ct_per_node_list=[1], name="reward_model_cluster")
    assert other.rlix_role is None
    assert bind_cluster(other, {"rlix": {"infer_gpus": [0, 1]}}) is None
    assert other.world_size() == 1


def test_two_pipelines_share_the_coordinators_groups_each_worker_pinned(
    scenarios: dict[str, Any],
) -> None:
    """Gate 2 layout under RLIX_CONTROL_PLANE=rlix with the real coordinator running: both
    pipelines infer on GPUs 0,1, A trains on GPU 0 and B on GPU 1, all placed at once."""
    r = ok(scenarios, "shared_two")
    shared = set(r["shared_pgs"])
    # Under the coordinator the first bind claims the pipeline's GPUs for its setup.
    assert r["owners_after_a"] == ["gate2_a", "gate2_a"]
    for name, train_gpu in (("a", 0), ("b", 1)):
        p = r[name]
        assert p["pinned"] is True
        assert p["device_mappings"] == {"actor_infer": [0, 1], "actor_train": [train_gpu]}
        # What each worker sees: CUDA_VISIBLE_DEVICES is exactly its layout GPU.
        assert [w["cuda_visible_devices"] for w in p["infer_workers"]] == ["0", "1"]
        assert [w["cuda_visible_devices"] for w in p["train_workers"]] == [str(train_gpu)]
        workers = p["infer_workers"] + p["train_workers"]
        # On the coordinator's group, never a group of the pipeline's own.
        assert {w["pg_id"] for w in workers} <= shared
        assert all(_gpu_share(w) == pytest.approx(0.01) for w in workers)
        assert p["max_colocated"] == [100, 100]
        # Distinct seeds/ports per engine although all share bundle 0 (told their GPU).
        assert [w["vllm_port"] for w in p["infer_workers"]] == ["7000", "7100"]
        assert [d["cuda_visible_devices"] for d in p["reported"]] == ["0", "1"]
    # Six workers at once on 2 GPUs: Ray's accounting holds only their small shares.
    assert r["shared_gpu_total"] == pytest.approx(2.0)
    assert r["shared_gpu_free_while_both"] == pytest.approx(2.0 - 6 * 0.01)
    # Nothing of the pipelines' is left reserved: no group of their own was ever made, the
    # shared groups are whole again and stay the coordinator's until it stops.
    assert r["own_pgs_made"] == 0
    assert r["shared_gpu_free_after"] == pytest.approx(2.0)
    assert r["shared_pg_states_before_stop"] == ["CREATED"]
    assert r["stopped"] is True
    assert r["gpu_free_after_stop"] == pytest.approx(2.0)
    assert r["shared_pg_states_after_stop"] == ["REMOVED"]
