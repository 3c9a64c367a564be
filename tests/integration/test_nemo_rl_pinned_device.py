"""Pinned Megatron workers address their own GPU (the coordinator's shared groups).

On the coordinator's per-node groups (one bundle ``{GPU: gpus_per_node}``, as ROLL's) a NeMo RL
worker is pinned by CUDA_VISIBLE_DEVICES=g. NeMo RL's Megatron policy worker then runs
``torch.cuda.set_device(int(ray.get_gpu_ids()[0]))``, and Ray reports ``[g]``: for g >= 1 that
ordinal does not exist among the one visible device. The extension widens visibility to the
node's GPUs first. Real Ray (logical GPUs) and a real placement group shaped like the
coordinator's; CUDA itself is not here, so the worker records which physical GPU the ordinal
it would pass to ``set_device`` addresses.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from rlix_plugins.adapters.nemo_rl_placement_plan import (
    WorkerGpu,
    check_worker_gpus,
    pinned_worker_env,
    plan_pinned,
    report_worker_gpu,
)
from rlix_plugins.patches.megatron import RLixMegatronWorkerMixin
from rlix_plugins.training.cache_group import cache_group_actor

pytestmark = pytest.mark.integration

GPUS_PER_NODE = 2


class FakeMegatronInitHost:
    """Fake of the first lines of NeMo RL's ``MegatronPolicyWorkerImpl.__init__`` (the real one
    needs megatron-bridge and CUDA): the ordinal it would give ``torch.cuda.set_device``."""

    def __init__(self) -> None:
        import ray

        self.local_rank = int(ray.get_gpu_ids()[0])  # NeMo RL: local_rank = int(gpu_ids[0])
        self.visible = os.environ["CUDA_VISIBLE_DEVICES"].split(",")

    def addressed_gpu(self) -> str | None:
        """Physical GPU that ``set_device(local_rank)`` selects; None: invalid ordinal."""
        if self.local_rank >= len(self.visible):
            return None
        return self.visible[self.local_rank]


class RLixWorker(RLixMegatronWorkerMixin, FakeMegatronInitHost):
    """Our extension over the fake host, in the MRO order ``build_worker_class`` uses."""


@pytest.fixture(scope="module")
def shared_group(ray_session: Any) -> Any:
    from ray.util.placement_group import placement_group, remove_placement_group

    pg = placement_group([{"GPU": GPUS_PER_NODE}])
    ray_session.get(pg.ready(), timeout=60)
    yield pg
    remove_placement_group(pg)


def _start(ray: Any, cls: type, pg: Any, gpu: int) -> Any:
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    # the group the extension's cache methods run in (harmless on the stock host)
    return cache_group_actor(cls).options(
        num_cpus=0, num_gpus=0.01,
        scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0),
        runtime_env={"env_vars": pinned_worker_env(gpu, GPUS_PER_NODE)},
    ).remote()


@pytest.mark.parametrize("gpu", [0, 1])
def test_pinned_megatron_worker_sets_its_own_device(
    ray_session: Any, shared_group: Any, gpu: int
) -> None:
    ray = ray_session
    ours = _start(ray, RLixWorker, shared_group, gpu)
    stock = _start(ray, FakeMegatronInitHost, shared_group, gpu)
    try:
        assert ray.get(ours.addressed_gpu.remote()) == str(gpu)
        # Without the widening, the stock worker's ordinal is wrong on every GPU but 0.
        assert ray.get(stock.addressed_gpu.remote()) == ("0" if gpu == 0 else None)
        # The placement check accepts what the widened worker reports.
        gpus, cvd, node = ray.get(ours.__ray_call__.remote(report_worker_gpu))
        assert cvd == "0,1" and gpus == [gpu]
        plan = plan_pinned([0, 1], [gpu], [node], GPUS_PER_NODE)
        check_worker_gpus(plan, "actor_train", [WorkerGpu(0, tuple(gpus), cvd, node)])
    finally:
        for actor in (ours, stock):
            ray.kill(actor)


def test_widened_report_on_the_wrong_gpu_is_refused() -> None:
    from rlix_plugins.adapters.nemo_rl_placement_plan import PlacementError

    plan = plan_pinned([0, 1], [1], ["n0"], GPUS_PER_NODE)
    with pytest.raises(PlacementError, match="planned GPU 1"):
        check_worker_gpus(plan, "actor_train", [WorkerGpu(0, (0,), "0,1", "n0")])


def test_widening_refuses_a_gpu_outside_the_node_and_leaves_the_env() -> None:
    from rlix_plugins.adapters.nemo_rl_placement_plan import PlacementError, widen_to_node_gpus

    env = {"CUDA_VISIBLE_DEVICES": "3", "RLIX_NODE_GPUS": "0,1"}
    with pytest.raises(PlacementError, match="CUDA_VISIBLE_DEVICES=3 is not one of"):
        widen_to_node_gpus(env)
    assert env["CUDA_VISIBLE_DEVICES"] == "3"
    unpinned = {"CUDA_VISIBLE_DEVICES": "0,1"}
    assert widen_to_node_gpus(unpinned) is None and unpinned["CUDA_VISIBLE_DEVICES"] == "0,1"


@pytest.mark.nemo_rl
def test_nemo_rl_still_takes_rays_gpu_id_as_the_cuda_ordinal(nemo_rl_src: Path) -> None:
    """The widening exists for this line of NeMo RL's worker; if it changes, revisit it."""
    src = (nemo_rl_src / "nemo_rl/models/policy/workers/megatron_policy_worker.py").read_text()
    init = src[src.index("class MegatronPolicyWorkerImpl"):]
    init = init[init.index("def __init__"):]
    assert "local_rank = int(gpu_ids[0])" in init
    assert "torch.cuda.set_device(local_rank)" in init
