"""veRL's pools and workers on the coordinator's shared per-node groups (``verl_placement``).

Real Ray (2 logical GPUs), the real coordinator (its ROLL-compatible resource manager owns one
group ``{GPU: 2}``), veRL's real ``ResourcePoolManager`` and ``RayWorkerGroup`` with RLix's
patch applied, workers of a real veRL ``Worker`` subclass reporting what the process sees.
Logical GPUs: Ray's accounting and the environment it gives each worker are real; no CUDA
device is touched (on a GPU box the same environment selects the physical GPU).
"""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.verl]


def _probe_class(ray: Any) -> Any:
    """A veRL ``Worker`` reporting the GPU environment, as veRL's server launch reads it."""
    from verl.single_controller.base import Worker

    class Probe(Worker):  # type: ignore[misc]
        def report(self) -> dict[str, Any]:
            import os

            ctx = ray.get_runtime_context()
            return {
                "cuda_visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
                "accelerator_ids": list(ctx.get_accelerator_ids()["GPU"]),
                "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
                "rank": self._rank,
                "world": self._world_size,
                "placement_group": ctx.get_placement_group_id(),
                "resources": ctx.get_assigned_resources(),
                # what veRL's vLLM rollout adapter (node rank) and Worker (device) read
                "local_world_size": os.environ.get("RAY_LOCAL_WORLD_SIZE"),
                "local_rank": os.environ.get("LOCAL_RANK"),
            }

    return ray.remote(Probe)


def _group(ray: Any, pool: Any, prefix: str, **kw: Any) -> Any:
    from verl.single_controller.ray import RayClassWithInitArgs, RayWorkerGroup

    return RayWorkerGroup(resource_pool=pool, ray_cls_with_init=RayClassWithInitArgs(
        cls=_probe_class(ray)), name_prefix=prefix, device_name="cpu", **kw)


def _reports(ray: Any, group: Any) -> list[dict[str, Any]]:
    return list(ray.get([w.report.remote() for w in group.workers], timeout=120))


@pytest.fixture
def pinned(patched: Any, coordinator_2gpu: Any) -> Any:
    """veRL patched, the coordinator up; pins cleared after the test."""
    from rlix_plugins.patches.verl_placement import set_pins

    yield coordinator_2gpu
    set_pins(None)


def _layout(**kw: int) -> Any:
    from rlix_plugins.adapters.verl import VerlLayout

    fields = {"train_gpus": 1, "tp": 1, "hybrid_replicas": 1, "standalone_replicas": 1, **kw}
    return VerlLayout(**fields)


def test_pools_place_each_worker_on_its_layout_gpu_of_the_shared_group(
    verl_ray: Any, pinned: Any
) -> None:
    from ray.util.placement_group import placement_group, placement_group_table
    from verl.single_controller.ray.base import RayResourcePool, ResourcePoolManager

    from rlix_plugins.patches.verl_placement import (
        PinnedResourcePool,
        pin_pipeline,
        set_pins,
    )

    pins = pin_pipeline(_layout())
    assert pins is not None
    assert dict(pins.pools) == {"global_pool": (0,), "rollout_pool_1": (1,)}
    (shared,) = pins.groups.placement_groups
    assert placement_group_table(shared)["name"] == "rlix_pg_node0"

    # The trainer's pool (veRL's spec) and standalone replica 1's (as init_standalone builds
    # it), through veRL's own manager.
    trainer = ResourcePoolManager(resource_pool_spec={"global_pool": [1]}, mapping={})
    trainer.create_resource_pool()
    replica = ResourcePoolManager(resource_pool_spec={"rollout_pool_1": [1]}, mapping=None,
                                  max_colocate_count=2)
    replica.create_resource_pool()
    pools = [trainer.resource_pool_dict["global_pool"],
             replica.resource_pool_dict["rollout_pool_1"]]
    assert all(isinstance(p, PinnedResourcePool) for p in pools)

    first = [_reports(verl_ray, _group(verl_ray, p, f"a{i}_")) for i, p in enumerate(pools)]
    for gpu, (report,) in enumerate(first):
        # Pinned to its layout GPU: the environment, Ray's ids (what veRL's vLLM server launch
        # reads as the engine's CUDA_VISIBLE_DEVICES) and veRL's rank all agree.
        assert report["cuda_visible"] == str(gpu), report
        assert report["accelerator_ids"] == [str(gpu)], report
        assert report["gpu_ids"] == [str(gpu)], report
        assert (report["rank"], report["world"]) == (0, 1)
        # On the coordinator's group, a sliver of GPU, no CPU.
        assert report["placement_group"] == shared.id.hex(), report
        assert report["resources"].get("GPU") == pytest.approx(0.01), report
        assert not report["resources"].get("CPU"), report

    # A second pipeline on the same two GPUs places too while the first one's workers live:
    # Ray's accounting no longer stops two pipelines from sharing a GPU.
    set_pins(None)
    assert pin_pipeline(_layout(train_gpus=2, hybrid_replicas=2, standalone_replicas=0))
    other = ResourcePoolManager(resource_pool_spec={"global_pool": [2]}, mapping={})
    other.create_resource_pool()
    second = _reports(verl_ray, _group(verl_ray, other.resource_pool_dict["global_pool"], "b_"))
    assert [(r["rank"], r["cuda_visible"], r["accelerator_ids"]) for r in second] == [
        (0, "0", ["0"]), (1, "1", ["1"])]

    # What stock veRL would reserve (a whole-GPU bundle) cannot be placed beside them.
    stock = placement_group([{"CPU": 1, "GPU": 1}])
    try:
        assert not stock.wait(timeout_seconds=3)
    finally:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(stock)

    # Unpinned, veRL's own manager runs again: its pool is a plain one, and its free-GPU
    # check finds none (the shared groups hold both), as a stock veRL job on this cluster.
    set_pins(None)
    own = ResourcePoolManager(resource_pool_spec={"global_pool": [1]}, mapping={})
    with pytest.raises(ValueError, match="Total available GPUs 0 is less than"):
        own.create_resource_pool()
    assert type(own.resource_pool_dict["global_pool"]) is RayResourcePool


def test_pools_outside_the_layout_are_refused_before_any_is_made(pinned: Any) -> None:
    from verl.single_controller.ray.base import ResourcePoolManager

    from rlix_plugins.adapters.shared_groups import PlacementError
    from rlix_plugins.patches.verl_placement import pin_pipeline

    assert pin_pipeline(_layout())
    with_reward = ResourcePoolManager(
        resource_pool_spec={"global_pool": [1], "reward_pool": [1]}, mapping={})
    with pytest.raises(PlacementError, match="'reward_pool' is not part of the pipeline"):
        with_reward.create_resource_pool()
    assert with_reward.resource_pool_dict == {}
    wider = ResourcePoolManager(resource_pool_spec={"global_pool": [2]}, mapping={})
    with pytest.raises(PlacementError, match=r"asks for 2 workers.*gives it 1 GPUs"):
        wider.create_resource_pool()
    assert wider.resource_pool_dict == {}


def test_a_layout_beyond_the_groups_or_a_second_pin_is_refused(
    pinned: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rlix_plugins.adapters.shared_groups import PlacementError
    from rlix_plugins.errors import SettingsError
    from rlix_plugins.patches.verl_placement import (
        ENV_VERL_FIRST_GPU,
        active_pins,
        first_gpu,
        pin_pipeline,
    )

    with pytest.raises(PlacementError, match=r"GPU 2 does not exist.*0\.\.1"):
        pin_pipeline(_layout(first_gpu=1))
    assert active_pins() is None
    pins = pin_pipeline(_layout())
    with pytest.raises(PlacementError, match="pinned already"):
        pin_pipeline(_layout(train_gpus=2, hybrid_replicas=2, standalone_replicas=0))
    assert active_pins() is pins

    monkeypatch.setenv(ENV_VERL_FIRST_GPU, "1")
    assert first_gpu() == 1
    for bad in ("-1", "one", "1.5"):
        monkeypatch.setenv(ENV_VERL_FIRST_GPU, bad)
        with pytest.raises(SettingsError, match=f"{ENV_VERL_FIRST_GPU}="):
            first_gpu()


def test_without_the_coordinator_nothing_is_pinned(
    patched: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rlix_plugins.patches.verl_placement import active_pins, pin_pipeline

    monkeypatch.delenv("RLIX_CONTROL_PLANE", raising=False)
    assert pin_pipeline(_layout()) is None
    assert active_pins() is None


def test_pool_gpus_follow_the_layout(verl_env: Any) -> None:
    from rlix_plugins.patches.verl_placement import pool_gpus

    # Hybrid replica 0 lives in the trainer's workers; standalone replicas 1, 2 after them.
    assert pool_gpus(_layout(train_gpus=2, tp=2, standalone_replicas=2, first_gpu=4)) == {
        "global_pool": (4, 5), "rollout_pool_1": (6, 7), "rollout_pool_2": (8, 9)}
    # hybrid_engine=false: no hybrid replica, standalone ranks from 0 after the trainer GPUs.
    assert pool_gpus(_layout(train_gpus=2, hybrid_replicas=0, standalone_replicas=2)) == {
        "global_pool": (0, 1), "rollout_pool_0": (2,), "rollout_pool_1": (3,)}


def test_a_split_of_a_pinned_pool_is_refused_naming_it(verl_ray: Any, pinned: Any) -> None:
    """veRL's colocated reward model (``reward_model.enable`` without its own pool) splits the
    trainer's pool (``split_resource_pool``) into ``SubRayResourcePool`` objects, whose workers
    veRL places by bundle index (``_init_with_subresource_pool``), past the wrappers: on the
    shared group's one bundle that fails in Ray (no CPU in the bundle, no bundle 1) or would
    place a worker unpinned. Refused by name instead, before any sub-pool exists."""
    from verl.single_controller.ray.base import ResourcePoolManager, split_resource_pool

    from rlix_plugins.adapters.shared_groups import PlacementError
    from rlix_plugins.patches.verl_placement import pin_pipeline

    assert pin_pipeline(_layout(train_gpus=2, hybrid_replicas=2, standalone_replicas=0))
    trainer = ResourcePoolManager(resource_pool_spec={"global_pool": [2]}, mapping={})
    trainer.create_resource_pool()
    pool = trainer.resource_pool_dict["global_pool"]
    with pytest.raises(PlacementError, match=r"'global_pool'.*split"):
        split_resource_pool(pool, split_size=1)


def test_pinned_workers_keep_verls_per_node_counts(verl_ray: Any, pinned: Any) -> None:
    """veRL's spec ``[1, 1]`` (nnodes=2 x n_gpus_per_node=1) on two GPUs of one node: each
    worker's ``RAY_LOCAL_WORLD_SIZE`` is veRL's per-node count (1), as stock veRL gives it.
    veRL's vLLM rollout adapter takes its server's node rank as ``rollout rank //
    RAY_LOCAL_WORLD_SIZE``, and its server launch chunks a replica by ``n_gpus_per_node``: a
    count from the physical node (2) would send rank 1 to node 0's server."""
    from verl.single_controller.ray.base import ResourcePoolManager

    from rlix_plugins.patches.verl_placement import pin_pipeline

    assert pin_pipeline(_layout(train_gpus=2, tp=2, hybrid_replicas=1, standalone_replicas=0))
    trainer = ResourcePoolManager(resource_pool_spec={"global_pool": [1, 1]}, mapping={})
    trainer.create_resource_pool()
    pool = trainer.resource_pool_dict["global_pool"]
    assert pool.store == [1, 1]
    reports = _reports(verl_ray, _group(verl_ray, pool, "lws_"))
    assert [(r["rank"], r["cuda_visible"], r["local_world_size"]) for r in reports] == [
        (0, "0", "1"), (1, "1", "1")], reports


def test_a_noset_flag_reaching_pinned_workers_is_switched_off(
    verl_ray: Any, pinned: Any
) -> None:
    """``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1`` set for the whole job (a cluster's or
    the user's ``runtime_env``; here through veRL's ``worker_env``, as this session's job env
    is fixed) would send a pinned veRL ``Worker`` down its NOSET path: ``LOCAL_RANK`` = Ray's
    GPU id ``g`` and ``set_device(g)`` in a process that sees only GPU ``g``. Pinned workers
    switch the flag off: each starts, sees its GPU as device 0 (``LOCAL_RANK`` 0)."""
    from verl.single_controller.ray.base import ResourcePoolManager

    from rlix_plugins.patches.verl_placement import pin_pipeline

    assert pin_pipeline(_layout(train_gpus=2, hybrid_replicas=2, standalone_replicas=0))
    trainer = ResourcePoolManager(resource_pool_spec={"global_pool": [2]}, mapping={})
    trainer.create_resource_pool()
    group = _group(verl_ray, trainer.resource_pool_dict["global_pool"], "noset_",
                   worker_env={"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"})
    reports = _reports(verl_ray, group)
    assert [(r["rank"], r["cuda_visible"], r["accelerator_ids"], r["local_rank"])
            for r in reports] == [(0, "0", ["0"], "0"), (1, "1", ["1"], "0")], reports


def test_a_job_with_a_reward_model_is_refused_before_anything_is_pinned(pinned: Any) -> None:
    from omegaconf import OmegaConf

    from rlix_plugins.adapters.shared_groups import PlacementError
    from rlix_plugins.patches.verl_placement import active_pins, pin_pipeline

    config = OmegaConf.create({"reward": {"reward_model": {"enable": True}}})
    with pytest.raises(PlacementError, match=r"reward\.reward_model\.enable=true.*valid"):
        pin_pipeline(_layout(), config)
    assert active_pins() is None
    config.reward.reward_model.enable = False
    assert pin_pipeline(_layout(), config) is not None


def test_a_job_that_cannot_claim_is_refused_on_a_shared_cluster(
    pinned: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rlix_plugins.adapters.shared_groups import PlacementError
    from rlix_plugins.patches.verl_placement import refuse_unclaimed

    # Disaggregated replicas: no layout before veRL builds them, so no claim and no pin.
    with pytest.raises(PlacementError, match=r"cannot be told before veRL builds it.*valid"):
        refuse_unclaimed()
    monkeypatch.delenv("RLIX_CONTROL_PLANE")
    refuse_unclaimed()  # without the control plane veRL places as it always did
