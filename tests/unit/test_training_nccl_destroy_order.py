"""Process groups come down oldest first.

On an H100 (NCCL 2.28) a group destroyed after a younger one took about 0.48 s and one destroyed
in creation order 0.015 s: Megatron's 17 groups took 3.0 s in parallel_state's globals order and
0.49 s oldest first (benchmarks/gpu/megatron_teardown.py, results/megatron_teardown.json). The
order is what this machine can check: real megatron-core ``parallel_state`` on one real gloo
rank (a spawned process), every ``destroy_process_group`` recorded.
"""

from __future__ import annotations

from typing import Any

from tests.fixtures.distributed import run_world


def _record_destroys(dist: Any) -> list[int]:
    order: list[int] = []
    real = dist.destroy_process_group

    def destroy(group: Any = None) -> None:
        order.append(id(group))
        real(group)

    dist.destroy_process_group = destroy
    return order


def _lifecycle_order(rank: int, world_size: int) -> dict[str, Any]:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from torch.distributed import distributed_c10d

    from rlix_plugins.training.nccl_lifecycle import MegatronParallelLifecycle, ParallelConfig

    lc = MegatronParallelLifecycle(ParallelConfig.of())
    lc.initialize()
    world = dist.GroupMember.WORLD
    created = [id(pg) for pg in distributed_c10d._world.pg_map if pg is not world]
    # parallel_state's globals list the tensor-parallel group before the data-parallel groups
    # Megatron created first: the old order (the globals') was not the creation order
    module_first = id(ps.get_tensor_model_parallel_group())
    order = _record_destroys(dist)
    report = lc.destroy()
    return {"order": order, "created": created, "destroyed": report.destroyed,
            "module_first_was_created_first": module_first == created[0]}


def test_the_lifecycle_destroys_megatron_groups_in_creation_order() -> None:
    (r,) = run_world(_lifecycle_order, 1, timeout_s=300)
    assert r["module_first_was_created_first"] is False  # the test can tell the orders apart
    # the lifecycle's own destroys come first (then destroy_model_parallel's, if any)
    own = r["order"][: r["destroyed"]]
    assert len(own) > 10
    assert own == [g for g in r["created"] if g in set(own)]


def _worker_order(rank: int, world_size: int) -> dict[str, Any]:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from rlix_plugins.patches.megatron import RLixMegatronWorkerMixin

    ps.initialize_model_parallel(tensor_model_parallel_size=1)  # what the host did at init
    w = RLixMegatronWorkerMixin()
    # NeMo RL's _get_replica_group: built lazily after Megatron's groups, so the youngest
    w._replica_group_cache = dist.new_group(ranks=[0])  # type: ignore[attr-defined]
    lazy = id(w._replica_group_cache)  # type: ignore[attr-defined]
    order = _record_destroys(dist)
    w.rlix_destroy_parallel_state()
    return {"last_is_lazy": order[-1] == lazy, "count": len(order),
            "lazy_once": order.count(lazy) == 1}


def test_the_worker_destroys_its_lazily_built_group_after_megatrons() -> None:
    (r,) = run_world(_worker_order, 1, timeout_s=300)
    assert r == {"last_is_lazy": True, "count": r["count"], "lazy_once": True}
    assert r["count"] > 10
