"""Megatron process-group destroy/re-init on real multi-process torch.distributed (gloo).

World size 2, real megatron-core ``parallel_state``, TP / PP / DP layouts. Each cycle checks
that the destroyed groups left torch's world map, that collectives on the new groups give the
right sums, and records live groups, fds, threads and RSS; the parent asserts they stay flat.
Default run: 20 cycles per layout; ``-m slow``: 100 cycles per layout.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from tests.fixtures.distributed import run_world

pytestmark = pytest.mark.integration

LAYOUTS: dict[str, dict[str, int]] = {
    "tp2": {"tensor_model_parallel_size": 2},
    "pp2": {"pipeline_model_parallel_size": 2},
    "dp2": {},
}


def _sample() -> dict[str, int]:
    from torch.distributed import distributed_c10d

    status = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            status[key] = value.split()[0] if value.split() else "0"
    return {
        "groups": len(distributed_c10d._world.pg_map),
        "fds": len(os.listdir("/proc/self/fd")),
        "threads": int(status["Threads"]),
        "rss_kb": int(status["VmRSS"]),
    }


def _check_collectives(ps: Any, rank: int, layout: dict[str, int]) -> None:
    import torch
    import torch.distributed as dist

    sizes = {
        "tp": layout.get("tensor_model_parallel_size", 1),
        "pp": layout.get("pipeline_model_parallel_size", 1),
    }
    sizes["dp"] = 2 // (sizes["tp"] * sizes["pp"])
    groups = {
        "tp": ps.get_tensor_model_parallel_group(),
        "pp": ps.get_pipeline_model_parallel_group(),
        "dp": ps.get_data_parallel_group(),
        "mp": ps.get_model_parallel_group(),
        "dp_cp": ps.get_data_parallel_group(with_context_parallel=True),
        "dp_gloo": ps.get_data_parallel_group_gloo(),
    }
    for name, group in groups.items():
        ranks = dist.get_process_group_ranks(group)
        if name in sizes:
            assert len(ranks) == sizes[name], (name, ranks)
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t, group=group)
        assert t.item() == sum(r + 1 for r in ranks), (name, ranks, t.item())


def _cycles(rank: int, world_size: int, layouts: list[str], cycles: int) -> dict[str, Any]:
    from megatron.core import parallel_state as ps

    from rlix_plugins.training.nccl_lifecycle import (
        MegatronParallelLifecycle,
        ParallelConfig,
        _world,
        backend_name,
        groups_in_module,
    )

    out: dict[str, Any] = {}
    for name in layouts:
        layout = LAYOUTS[name]
        lc = MegatronParallelLifecycle(ParallelConfig.of(**layout))
        lc.initialize()
        _check_collectives(ps, rank, layout)
        samples = [_sample()]
        reports = []
        for _ in range(cycles):
            old = groups_in_module(ps)
            assert old and all(backend_name(g) == "gloo" for g in old)
            report = lc.cycle()
            pg_map = _world().pg_map
            assert not any(g in pg_map for g in old), "a destroyed group is still in the world map"
            del old
            _check_collectives(ps, rank, layout)
            samples.append(_sample())
            reports.append((report.destroyed, dict(report.by_backend)))
        lc.destroy()
        assert not groups_in_module(ps) and not ps.model_parallel_is_initialized()
        assert len(_world().pg_map) == 1  # only the default group is left
        out[name] = {"samples": samples, "reports": reports}
    return out


def _cycles_then_control(
    rank: int, world_size: int, layouts: list[str], cycles: int, control_cycles: int
) -> tuple[dict[str, Any], list[int]]:
    # one pair of processes for both (spawning ranks that import megatron costs ~15 s here);
    # the control runs last because it leaks groups on purpose
    return _cycles(rank, world_size, layouts, cycles), _control(rank, world_size, control_cycles)


def _control(rank: int, world_size: int, cycles: int) -> list[int]:
    """Megatron's own destroy_model_parallel() alone: the same measurement must see a leak."""
    from megatron.core import parallel_state as ps

    counts = []
    for _ in range(cycles):
        ps.initialize_model_parallel(tensor_model_parallel_size=2)
        ps.destroy_model_parallel()
        counts.append(_sample()["groups"])
    return counts


def _assert_flat(result: dict[str, Any], cycles: int) -> None:
    for name, data in result.items():
        samples = data["samples"]
        assert len(samples) == cycles + 1
        steady = samples[2:]  # the first cycles may grow caches (allocator, thread pools)
        groups = {s["groups"] for s in samples}
        assert len(groups) == 1, (name, groups)  # exactly flat
        fds = [s["fds"] for s in steady]
        threads = [s["threads"] for s in steady]
        rss = [s["rss_kb"] for s in steady]
        assert max(fds) - min(fds) <= 4, (name, fds)
        assert max(threads) - min(threads) <= 2, (name, threads)
        assert rss[-1] - rss[0] <= 24 * 1024, (name, rss[0], rss[-1])  # kB
        destroyed = {d for d, _ in data["reports"]}
        assert len(destroyed) == 1 and destroyed.pop() > 10, data["reports"][:2]


def test_destroy_reinit_keeps_groups_fds_threads_rss_flat_and_control_leaks() -> None:
    cycles = 20
    results = run_world(_cycles_then_control, 2, list(LAYOUTS), cycles, 4)
    for per_rank, control in results:
        _assert_flat(per_rank, cycles)
        # control: megatron's destroy_model_parallel() alone, same measurement, must leak
        assert control[-1] > control[0], control


@pytest.mark.slow
def test_destroy_reinit_100_cycles_per_layout() -> None:
    results = run_world(_cycles, 2, list(LAYOUTS), 100, timeout_s=1800)
    for per_rank in results:
        _assert_flat(per_rank, 100)
