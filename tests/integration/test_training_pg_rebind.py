"""Rebinding process groups held outside ``parallel_state`` across destroy/re-init (gloo).

World size 2, real megatron-core ``parallel_state`` and its real ``ProcessGroupCollection``
(``use_mpu_process_groups``). megatron-core's ``DistributedDataParallel`` and distributed
optimizer cannot be built here (their param/grad buffers call ``torch.cuda.current_device()``),
so the model and optimizer are holders shaped like them, named as such: modules with group
attributes (one a list, one a tuple), a bucket-group list, a dict of groups, a slots dataclass,
a closure and a ``functools.partial`` keyword. After every cycle each held reference must be
the live group now in ``parallel_state`` and collectives through it must give the right sums.
"""

from __future__ import annotations

import functools
import types
from dataclasses import dataclass
from typing import Any

import pytest

from tests.fixtures.distributed import run_world

pytestmark = pytest.mark.integration

LAYOUTS: dict[str, dict[str, int]] = {
    "tp2": {"tensor_model_parallel_size": 2},
    "pp2": {"pipeline_model_parallel_size": 2},
}
CYCLES = 5


@dataclass(frozen=True, slots=True)
class FrozenGroups:
    """Like a record a host keeps: frozen, slots, groups as fields."""

    tp: Any
    dp: Any


def _current(ps: Any) -> dict[str, Any]:
    return {
        "tp": ps.get_tensor_model_parallel_group(),
        "pp": ps.get_pipeline_model_parallel_group(),
        "dp": ps.get_data_parallel_group(),
        "dp_cp": ps.get_data_parallel_group(with_context_parallel=True),
        "mp": ps.get_model_parallel_group(),
        "dp_gloo": ps.get_data_parallel_group_gloo(),
    }


def _build_holders(ps: Any) -> tuple[dict[str, Any], dict[str, tuple[Any, str]]]:
    """Holder graph shaped like megatron's DDP/buffers/optimizer; returns (roots, accessors)."""
    import torch
    from megatron.core.process_groups_config import ProcessGroupCollection

    g = _current(ps)

    class HolderBucketGroup:  # like _ParamAndGradBucketGroup: plain attributes
        def __init__(self) -> None:
            self.data_parallel_group = g["dp_cp"]
            self.intra_distributed_optimizer_instance_group = g["dp"]

    class HolderBuffer:  # like _ParamAndGradBuffer: __slots__
        __slots__ = ("data_parallel_group", "groups_by_name")

        def __init__(self) -> None:
            self.data_parallel_group = g["dp"]
            self.groups_by_name = {"tp": g["tp"], "mp": g["mp"]}

    class HolderDDP(torch.nn.Module):  # like megatron's DistributedDataParallel
        def __init__(self) -> None:
            super().__init__()
            self.module = torch.nn.Linear(4, 4)
            self.dp_group = g["dp"]
            self.pp_group = [g["pp"]]  # megatron allows a list here
            self.tp_pp = (g["tp"], (g["pp"], 1))  # a tuple attribute, nested
            self.buffers_ = [HolderBuffer()]
            self.bucket_groups = [HolderBucketGroup(), HolderBucketGroup()]
            self.pg_collection = ProcessGroupCollection.use_mpu_process_groups()
            self.record = FrozenGroups(tp=g["tp"], dp=g["dp"])
            dp = g["dp"]

            def reduce_hook(t: Any) -> Any:  # a closure over a group, like grad hooks
                import torch.distributed as dist

                dist.all_reduce(t, group=dp)
                return t

            self.hook = reduce_hook

    class HolderOptimizer:  # like DistributedOptimizer: per-buffer groups, a partial
        def __init__(self, model: Any) -> None:
            self.model_chunks = [model]
            self.data_parallel_group = g["dp"]
            self.data_parallel_group_gloo = g["dp_gloo"]
            import torch.distributed as dist

            self.reduce = functools.partial(dist.all_reduce, group=g["dp_cp"])

    model = HolderDDP()
    optimizer = HolderOptimizer(model)
    # a chain deeper than the interpreter's recursion limit: the walk must not recurse per level
    head = tail = types.SimpleNamespace(next=None, group=None)
    for _ in range(5000):
        tail.next = types.SimpleNamespace(next=None, group=None)
        tail = tail.next
    tail.group = g["mp"]
    accessors: dict[str, tuple[Any, str]] = {
        "model.dp_group": (lambda: model.dp_group, "dp"),
        "model.pp_group[0]": (lambda: model.pp_group[0], "pp"),
        "model.tp_pp[0]": (lambda: model.tp_pp[0], "tp"),
        "model.tp_pp[1][0]": (lambda: model.tp_pp[1][0], "pp"),
        "buffer.dp": (lambda: model.buffers_[0].data_parallel_group, "dp"),
        "buffer.tp": (lambda: model.buffers_[0].groups_by_name["tp"], "tp"),
        "buffer.mp": (lambda: model.buffers_[0].groups_by_name["mp"], "mp"),
        "bucket[1].dp_cp": (lambda: model.bucket_groups[1].data_parallel_group, "dp_cp"),
        "pg_collection.tp": (lambda: model.pg_collection.tp, "tp"),
        "pg_collection.pp": (lambda: model.pg_collection.pp, "pp"),
        "pg_collection.dp_cp": (lambda: model.pg_collection.dp_cp, "dp_cp"),
        "record.tp": (lambda: model.record.tp, "tp"),
        "hook closure": (lambda: model.hook.__closure__[0].cell_contents, "dp"),
        "optimizer.dp_gloo": (lambda: optimizer.data_parallel_group_gloo, "dp_gloo"),
        "optimizer.reduce group": (lambda: optimizer.reduce.keywords["group"], "dp_cp"),
        "deep chain end": (lambda: tail.group, "mp"),
    }
    return {"model": model, "optimizer": optimizer, "deep": head}, accessors


def _check_held(ps: Any, rank: int, accessors: dict[str, tuple[Any, str]]) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    now = _current(ps)
    for label, (get, kind) in accessors.items():
        group = get()
        assert group is now[kind], f"{label} is not the live {kind} group"
        assert group in distributed_c10d._world.pg_map, label
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t, group=group)
        ranks = dist.get_process_group_ranks(group)
        assert t.item() == sum(r + 1 for r in ranks), (label, ranks, t.item())


def _rank(rank: int, world_size: int, cycles: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from torch.distributed import distributed_c10d

    from rlix_plugins.training.nccl_lifecycle import (
        MegatronParallelLifecycle,
        ParallelConfig,
        StaleProcessGroupError,
    )

    out: dict[str, Any] = {}
    for name, layout in LAYOUTS.items():
        lc = MegatronParallelLifecycle(ParallelConfig.of(**layout))
        lc.initialize()
        roots, accessors = _build_holders(ps)
        _check_held(ps, rank, accessors)
        # without a rebind the holders keep destroyed groups: the problem is real
        lc.destroy()
        lc.reinitialize()
        stale = [k for k, (get, _) in accessors.items()
                 if get() not in distributed_c10d._world.pg_map]
        assert sorted(stale) == sorted(accessors), stale
        first = lc.rebind(roots)
        _check_held(ps, rank, accessors)
        replaced, second_walk = [first.replaced], []
        for _ in range(cycles):
            lc.destroy()
            report = lc.reinitialize(roots)
            assert report is not None
            replaced.append(report.replaced)
            _check_held(ps, rank, accessors)
            second_walk.append(lc.rebind(roots).replaced)  # nothing old is left to find
        # the hook closure still reduces over the live dp group
        t = torch.tensor([1.0])
        roots["model"].hook(t)
        assert t.item() == len(dist.get_process_group_ranks(_current(ps)["dp"]))

        # a group inside functools.partial *args* cannot be written back: reported, raised
        roots["optimizer"].positional = functools.partial(dist.barrier, _current(ps)["tp"])
        lc.destroy()
        with pytest.raises(StaleProcessGroupError, match="could not be replaced"):
            lc.reinitialize(roots)
        report = lc.rebind(roots, strict=False)
        out[f"{name}_unreplaceable"] = list(report.unreplaceable)
        del roots["optimizer"].positional
        # a destroyed group with no successor (not parallel_state's) is dead and reachable
        extra = dist.new_group([0, 1], backend="gloo")
        dist.destroy_process_group(extra)
        roots["optimizer"].extra = extra
        with pytest.raises(StaleProcessGroupError, match="dead groups"):
            lc.rebind(roots)
        out[f"{name}_dead"] = list(lc.rebind(roots, strict=False).dead_reachable)
        del roots["optimizer"].extra, extra
        # a tuple inside a list is rebuilt in place; a tuple root has nowhere to go
        old_dp = _current(ps)["dp"]
        box = [(old_dp,)]
        lc.destroy()
        lc.reinitialize(roots)
        lc.rebind([box])
        assert box[0][0] is _current(ps)["dp"] and box[0][0] is not old_dp
        with pytest.raises(StaleProcessGroupError, match="root0"):
            lc.rebind([(old_dp,)])
        del old_dp
        out[name] = {"first": first.replaced, "replaced": replaced, "second": second_walk,
                     "visited": first.objects_visited, "seconds": first.seconds}
        lc.destroy()
    return out


def test_held_groups_rebound_over_cycles_and_unreplaceable_reported() -> None:
    results = run_world(_rank, 2, CYCLES)
    for r in results:
        for name in LAYOUTS:
            data = r[name]
            # 16 probed references plus the rest of ProcessGroupCollection's fields
            assert data["first"] >= 16, data
            assert data["replaced"] == [data["first"]] * (CYCLES + 1), data
            assert data["second"] == [0] * CYCLES, data
            assert r[f"{name}_unreplaceable"] == ["optimizer.positional.args[0]"], r
            assert r[f"{name}_dead"] == ["optimizer.extra"], r
