"""How to tear NCCL process groups down between training steps: destroy or abort (one GPU).

``MegatronParallelLifecycle.destroy`` gives every Megatron NCCL group back after each step
(``dist.destroy_process_group`` per group: a graceful ``shutdown``, NCCL finalize + destroy).
On an H100 that took about 3 s for Megatron's 17 groups (``run.py``, ``gpu.json``). The
question here is whether aborting the communicators (``ncclCommAbort``, local, no flush) is a
cheaper teardown worth offering. Each variant runs in its own process, world of one rank
(NCCL refuses two ranks of one communicator on one GPU), on ``--groups`` fresh NCCL groups that
were each used once, over ``--cycles`` create/teardown cycles; it records the teardown time,
the GPU memory the groups held and what is left after, and checks the world group still works.

Run on a machine with one CUDA GPU: ``python benchmarks/gpu/nccl_teardown.py`` writes
``results/nccl_teardown.json`` and ``.png``; ``--plot-only`` redraws the PNG (no GPU needed).
What one rank cannot show: whether an abort is safe while another rank is still inside a
collective of the same communicator (the lifecycle destroys after a barrier either way).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.gpu.processes import free_port, machine, run_in_process  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
logger = logging.getLogger("bench.nccl_teardown")

#: variant -> extra environment for its process
VARIANTS: dict[str, dict[str, str]] = {
    "destroy": {},
    "abort": {},
    "abort (TORCH_NCCL_ASYNC_ERROR_HANDLING=0)": {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"},
    "abort, one NCCL group call": {},
}


def _teardown(variant: str, groups: list[Any]) -> list[float]:
    """Tear ``groups`` down the way ``variant`` says; seconds per group where it is per group."""
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    per: list[float] = []
    if variant.startswith("abort, one NCCL group call"):
        # torch's own whole-world abort wraps the aborts in ncclGroupStart/End
        world: Any = dist.GroupMember.WORLD
        backend: Any = world._get_backend(torch.device("cuda"))
        backend._group_start()
        for g in groups:
            g.abort()
        backend._group_end()
        for g in groups:
            dist.destroy_process_group(g)
        return per
    for g in groups:
        started = time.perf_counter()
        if variant.startswith("abort"):
            c10d._abort_process_group(g)
        else:
            dist.destroy_process_group(g)
        per.append(time.perf_counter() - started)
    return per


def _child(variant: str, port: int, n_groups: int, cycles: int, queue: Any) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **VARIANTS[variant])
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda:0"))
    x = torch.ones(1 << 20, device="cuda")
    dist.all_reduce(x)
    torch.cuda.synchronize()

    def used() -> int:
        free, total = torch.cuda.mem_get_info()
        return int(total - free)

    base = used()
    rows = []
    for cycle in range(cycles):
        groups = [dist.new_group([0], backend="nccl") for _ in range(n_groups)]
        for g in groups:
            dist.all_reduce(x, group=g)  # a communicator exists only once used
        torch.cuda.synchronize()
        held = used()
        dist.barrier()
        torch.cuda.synchronize()
        started = time.perf_counter()
        per = _teardown(variant, groups)
        seconds = time.perf_counter() - started
        torch.cuda.synchronize()
        after = used()
        dist.all_reduce(x)  # the world group must survive the teardown of the others
        torch.cuda.synchronize()
        rows.append({
            "cycle": cycle,
            "teardown_s": seconds,
            "slowest_group_s": max(per) if per else None,
            "held_by_groups_bytes": held - base,
            "left_after_teardown_bytes": after - base,
            "groups_still_in_world_map": sum(g in c10d._world.pg_map for g in groups),
            "world_group_ok": bool(x[0].item() == 1.0),
        })
    queue.put({"rows": rows, "env": VARIANTS[variant]})
    dist.destroy_process_group()


def measure(n_groups: int, cycles: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for variant in VARIANTS:
        out[variant] = run_in_process(_child, (variant, free_port(), n_groups, cycles),
                                      60 + 30 * cycles)
        logger.info("%s: %s", variant, out[variant])
    return out


def plot(data: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    names = [v for v, r in data["variants"].items() if "rows" in r]
    for i, name in enumerate(names):
        ys = [row["teardown_s"] for row in data["variants"][name]["rows"]]
        ax.scatter([i] * len(ys), ys, color=f"C{i}")
        ax.bar(i, sorted(ys)[len(ys) // 2], color=f"C{i}", alpha=0.35)
    ax.set_xticks(range(len(names)), [n.replace(" (", "\n(") for n in names], fontsize=7)
    ax.set_ylabel("teardown of all groups (s); bar = median")
    m = data["machine"]
    ax.set_title(f"{data['groups']} NCCL groups, world of 1 rank, {m['gpu']}, "
                 f"torch {m['torch']}, NCCL {m['nccl']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=17, help="Megatron's count at TP=1")
    parser.add_argument("--cycles", type=int, default=3)
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument("--plot-only", action="store_true")
    args = parser.parse_args()
    json_path, png_path = args.output / "nccl_teardown.json", args.output / "nccl_teardown.png"
    if args.plot_only:
        plot(json.loads(json_path.read_text()), png_path)
        return
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    import torch

    if not torch.cuda.is_available():
        logger.error("no CUDA GPU here: these figures need one")
        raise SystemExit(2)
    data = {
        "machine": machine(),
        "groups": args.groups,
        "cycles": args.cycles,
        "variants": measure(args.groups, args.cycles),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    args.output.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(data, indent=1))
    plot(data, png_path)


if __name__ == "__main__":
    main()
