"""Why Megatron's 17 NCCL groups take about 3 s to destroy where 17 plain groups take 0.5 s.

``run.py`` measured ``MegatronParallelLifecycle.destroy`` at 3.0 s on an H100 (every second of
it inside ``destroy_process_group`` of the NCCL groups, 0.01-0.48 s each), and
``nccl_teardown.py`` measured 17 plain ``dist.new_group([0])`` groups at 0.5 s. The two set-ups
differ in what Megatron passes to ``new_group`` (a ``timeout``, a ``group_desc``), in the order
the groups are destroyed, and in what the groups carried (``run.py`` reduced one float per group,
``nccl_teardown.py`` 4 MiB). Each variant below changes one of these, in its own process (world
of one rank: NCCL refuses two ranks of one communicator on one GPU), and records every group's
destroy time with its name, so the slow groups and the cause show.

Result (H100, 2026-11-26, ``results/megatron_teardown.json``): the order. Globals order 3.0 s,
creation order 0.49 s, newest first 8.1 s; Megatron's ``new_group`` arguments, the reduce size
and a pause before the teardown changed nothing. The lifecycle now destroys oldest first;
``--only "MegatronParallelLifecycle.destroy()"`` re-measures its own path
(``results/megatron_teardown_lifecycle.json``: median 0.50 s against 3.0 s).

Run on a machine with one CUDA GPU and megatron-core:
``python benchmarks/gpu/megatron_teardown.py`` writes ``results/megatron_teardown.json`` and
``.png``; ``--plot-only`` redraws the PNG (no GPU needed).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.gpu.processes import free_port, machine, run_in_process  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
logger = logging.getLogger("bench.megatron_teardown")


@dataclass(frozen=True, slots=True)
class Variant:
    """One way of creating, using and destroying the groups."""

    #: "megatron": initialize_model_parallel's groups; "plain": dist.new_group([0]) x count;
    #: "lifecycle": MegatronParallelLifecycle's initialize / destroy (the package's own path)
    source: str
    #: floats in the all_reduce each group runs once (a communicator exists only once used)
    floats: int = 1
    #: plain groups: new_group's timeout in minutes (None: torch's default)
    timeout_min: float | None = None
    #: plain groups: pass a group_desc as Megatron does
    group_desc: bool = False
    #: destroy order: "module" (parallel_state's globals, the lifecycle's order),
    #: "created" (creation order), "reversed" (reverse creation order)
    order: str = "module"
    #: seconds to wait after the last collective before the teardown
    settle_s: float = 0.0
    #: extra environment for the process
    env: tuple[tuple[str, str], ...] = ()


VARIANTS: dict[str, Variant] = {
    "MegatronParallelLifecycle.destroy()": Variant("lifecycle"),
    "megatron (lifecycle order, 1 float)": Variant("megatron"),
    "megatron, creation order": Variant("megatron", order="created"),
    "megatron, reversed creation order": Variant("megatron", order="reversed"),
    "megatron, 4 MiB reduce": Variant("megatron", floats=1 << 20),
    "megatron, 2 s settle before teardown": Variant("megatron", settle_s=2.0),
    "plain (1 float)": Variant("plain"),
    "plain, 4 MiB reduce": Variant("plain", floats=1 << 20),
    "plain, timeout 30 min + group_desc": Variant("plain", timeout_min=30.0, group_desc=True),
}


def _megatron_groups(ps: Any, dist: Any) -> tuple[list[tuple[str, Any]], list[Any]]:
    """(name, group) in parallel_state's globals order; and creation order (torch's map)."""
    from rlix_plugins.training.nccl_lifecycle import backend_name, group_slots

    named: dict[int, tuple[str, Any]] = {}
    for path, pg in group_slots(ps).items():
        if backend_name(pg) == "nccl":
            named.setdefault(id(pg), (".".join(map(str, path)), pg))
    world = dist.distributed_c10d._world
    created = [pg for pg in world.pg_map if id(pg) in named]
    return list(named.values()), created


def _child(name: str, variant: Variant, port: int, count: int, cycles: int, queue: Any) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **dict(variant.env))
    import datetime

    import torch
    import torch.distributed as dist

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda:0"))
    x = torch.ones(variant.floats, device="cuda")
    dist.all_reduce(x)
    torch.cuda.synchronize()
    ps: Any = None
    if variant.source == "megatron":
        import megatron.core.parallel_state as megatron_ps

        ps = megatron_ps
    rows: list[dict[str, Any]] = []
    try:
        if variant.source == "lifecycle":
            rows = _lifecycle_cycles(dist, x, cycles)
        for cycle in range(cycles if variant.source != "lifecycle" else 0):
            if variant.source == "megatron":
                ps.initialize_model_parallel(tensor_model_parallel_size=1)
                named, created = _megatron_groups(ps, dist)
            else:
                kw: dict[str, Any] = {"backend": "nccl"}
                if variant.timeout_min is not None:
                    kw["timeout"] = datetime.timedelta(minutes=variant.timeout_min)
                named = []
                for i in range(count):
                    if variant.group_desc:
                        kw["group_desc"] = f"PLAIN_GROUP_{i}"
                    named.append((f"plain_{i}", dist.new_group([0], **kw)))
                created = [pg for _, pg in named]
            for _, g in named:
                dist.all_reduce(x, group=g)
            torch.cuda.synchronize()
            if variant.settle_s:
                time.sleep(variant.settle_s)
            by_id = {id(pg): n for n, pg in named}
            if variant.order == "module":
                order = named
            else:
                seq = created if variant.order == "created" else list(reversed(created))
                order = [(by_id[id(pg)], pg) for pg in seq]
            per: list[tuple[str, float]] = []
            started = time.perf_counter()
            for group_name, g in order:
                t0 = time.perf_counter()
                dist.destroy_process_group(g)
                per.append((group_name, time.perf_counter() - t0))
            total = time.perf_counter() - started
            if ps is not None:
                ps.destroy_model_parallel()  # the gloo groups and the module's globals
            dist.all_reduce(x)  # the world group must survive
            torch.cuda.synchronize()
            rows.append({"cycle": cycle, "teardown_s": total, "groups": per,
                         "world_group_ok": bool(x[0].item() == 1.0)})
        queue.put({"rows": rows, "variant": asdict(variant)})
    except Exception as exc:  # reported to the parent, which records it per variant
        queue.put({"status": f"failed: {type(exc).__name__}: {exc}", "rows": rows})
    finally:
        dist.destroy_process_group()


def _lifecycle_cycles(dist: Any, x: Any, cycles: int) -> list[dict[str, Any]]:
    """The package's path: every group the lifecycle destroys is timed where torch does it."""
    import torch

    from rlix_plugins.training.nccl_lifecycle import (
        MegatronParallelLifecycle,
        ParallelConfig,
        backend_name,
    )

    lc = MegatronParallelLifecycle(ParallelConfig.of(tensor_model_parallel_size=1))
    real = dist.destroy_process_group
    per: list[tuple[str, float]] = []

    def timed_destroy(group: Any = None) -> None:
        t0 = time.perf_counter()
        name = backend_name(group) if group is not None else "world"
        real(group)
        per.append((name, time.perf_counter() - t0))

    rows: list[dict[str, Any]] = []
    for cycle in range(cycles):
        if cycle == 0:
            lc.initialize()
        else:
            lc.reinitialize()
        named, _ = _megatron_groups(lc.ps, dist)
        for _, g in named:
            dist.all_reduce(x, group=g)
        torch.cuda.synchronize()
        per.clear()
        dist.destroy_process_group = timed_destroy
        try:
            report = lc.destroy()
        finally:
            dist.destroy_process_group = real
        dist.all_reduce(x)  # the world group must survive
        torch.cuda.synchronize()
        rows.append({"cycle": cycle, "teardown_s": report.seconds,
                     "groups": [(n, s) for n, s in per if n == "nccl"],
                     "destroyed": report.destroyed,
                     "world_group_ok": bool(x[0].item() == 1.0)})
    return rows


def measure(count: int, cycles: int, only: list[str] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, variant in VARIANTS.items():
        if only and name not in only:
            continue
        out[name] = run_in_process(_child, (name, variant, free_port(), count, cycles),
                                   90 + 30 * cycles)
        rows = out[name].get("rows", [])
        logger.info("%s: teardown %s s", name, [round(r["teardown_s"], 3) for r in rows])
        for r in rows[-1:]:
            logger.info("   last cycle per group: %s",
                        ", ".join(f"{n}={s:.3f}" for n, s in r["groups"]))
    return out


def plot(data: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 4.5))
    names = [v for v, r in data["variants"].items() if r.get("rows")]
    for i, name in enumerate(names):
        ys = [row["teardown_s"] for row in data["variants"][name]["rows"]]
        ax.scatter([i] * len(ys), ys, color=f"C{i}")
        ax.bar(i, statistics.median(ys), color=f"C{i}", alpha=0.35)
        per = [s for row in data["variants"][name]["rows"] for _, s in row["groups"]]
        bx.scatter([i] * len(per), per, color=f"C{i}", s=10)
    for a in (ax, bx):
        a.set_xticks(range(len(names)), [n.replace(", ", ",\n") for n in names], fontsize=6,
                     rotation=30, ha="right")
    ax.set_ylabel("teardown of all NCCL groups (s); bar = median")
    bx.set_ylabel("destroy_process_group of one group (s)")
    m = data["machine"]
    fig.suptitle(f"world of 1 rank, {m['gpu']}, torch {m['torch']}, NCCL {m['nccl']}, "
                 f"megatron-core {m['megatron_core']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=17, help="plain groups (Megatron's count)")
    parser.add_argument("--cycles", type=int, default=3)
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument("--plot-only", action="store_true")
    parser.add_argument("--only", action="append", choices=list(VARIANTS),
                        help="run just this variant (repeatable)")
    args = parser.parse_args()
    json_path = args.output / "megatron_teardown.json"
    png_path = args.output / "megatron_teardown.png"
    if args.plot_only:
        plot(json.loads(json_path.read_text()), png_path)
        return
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    import torch

    if not torch.cuda.is_available():
        logger.error("no CUDA GPU here: these figures need one")
        raise SystemExit(2)
    import megatron.core

    data = {
        "machine": {**machine(), "megatron_core": megatron.core.__version__},
        "groups": args.groups,
        "cycles": args.cycles,
        "variants": measure(args.groups, args.cycles, args.only),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    args.output.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(data, indent=1))
    plot(data, png_path)


if __name__ == "__main__":
    main()
