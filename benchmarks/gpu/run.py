"""GPU-only figures of the training side: what the CPU box cannot show.

Run on a machine with one CUDA GPU (megatron-core and pyzmq installed):
``python benchmarks/gpu/run.py [--total-mib 2048] [--bucket-mib 256] [--cycles 5]``.
Writes ``results/gpu.json`` and ``results/gpu.png`` next to this file; refuses to run (exit 2)
without a GPU.

Measured in one run on one GPU, each figure beside its baseline from the same run:

* host <-> device copies of one bucket, pinned vs pageable host memory (the reason the cache
  pins its buckets when a GPU exists);
* the Fletcher-64 checksum computed on the GPU equals the host's (the receiver verifies CUDA
  IPC / NCCL buckets on the GPU) and its throughput against a device-to-device copy;
* building a cache version from GPU tensors against one plain D2H copy of the same bytes into
  pinned memory, with the buckets staged and checksummed on the GPU (the default) and without
  (packed straight into pinned memory, checksummed on the host);
* a selective sync over CUDA IPC to a receiver PROCESS whose weights are on the same GPU,
  against one pinned H2D copy of the same bytes; the sender's extra GPU memory during the
  sync (its peak allocation rise) against one bucket; every byte checked after each sync;
* Megatron's process groups on real NCCL (world of one rank: NCCL refuses two ranks of one
  communicator on one GPU): the GPU memory the communicators hold and what
  ``MegatronParallelLifecycle.destroy`` gives back, over several destroy/re-init cycles.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.gpu.processes import free_port, run_in_process  # noqa: E402
from rlix_plugins.training.bucket_cache import BucketCache, CacheConfig  # noqa: E402
from rlix_plugins.training.checksum import (  # noqa: E402
    ChecksumKind,
    checksum_tensor,
    fletcher64_numpy,
    tensor_fingerprint,
)
from rlix_plugins.training.process_receiver import SpawnedReceiver  # noqa: E402
from rlix_plugins.training.sync import SyncOptions, sync_version  # noqa: E402
from rlix_plugins.training.transports.selection import (  # noqa: E402
    ReceiverLocation,
    SenderLocation,
)

RESULTS = Path(__file__).resolve().parent / "results"
logger = logging.getLogger("bench.gpu")
GB = 1e9


def _timed(fn: Callable[[], object], repeats: int) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``fn`` (GPU work synchronised)."""
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return out


def _gbps(nbytes: int, seconds: list[float]) -> float:
    return nbytes / statistics.median(seconds) / GB


def _used_bytes() -> int:
    free, total = torch.cuda.mem_get_info()
    return int(total - free)


def bench_copies(nbytes: int, repeats: int) -> dict[str, Any]:
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    pageable = torch.empty(nbytes, dtype=torch.uint8)
    pageable.fill_(1)  # touched: first-touch page faults are not a copy cost
    pinned.fill_(1)
    dev2 = torch.empty_like(dev)
    out = {
        "bytes": nbytes,
        "h2d_pinned_gbps": _gbps(nbytes, _timed(lambda: dev.copy_(pinned, non_blocking=True),
                                                repeats)),
        "h2d_pageable_gbps": _gbps(nbytes, _timed(lambda: dev.copy_(pageable), repeats)),
        "d2h_pinned_gbps": _gbps(nbytes, _timed(lambda: pinned.copy_(dev, non_blocking=True),
                                                repeats)),
        "d2h_pageable_gbps": _gbps(nbytes, _timed(lambda: pageable.copy_(dev), repeats)),
        "d2d_gbps": _gbps(nbytes, _timed(lambda: dev2.copy_(dev), repeats)),
    }
    out["h2d_pinned_over_pageable"] = out["h2d_pinned_gbps"] / out["h2d_pageable_gbps"]
    out["d2h_pinned_over_pageable"] = out["d2h_pinned_gbps"] / out["d2h_pageable_gbps"]
    return out


def bench_checksum(nbytes: int, repeats: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    mismatches = []
    sizes = [0, 1, 7, 8, 4099, 32768 + 5, (1 << 20) + 13, nbytes + 3]
    for n in sizes:
        host = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
        on_gpu = checksum_tensor(host.cuda(), ChecksumKind.FLETCHER64)
        on_host = fletcher64_numpy(host.numpy())
        if on_gpu != on_host:
            mismatches.append({"bytes": n, "gpu": f"{on_gpu:x}", "host": f"{on_host:x}"})
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(data)
    return {
        "sizes_checked": sizes,
        "gpu_equals_host": not mismatches,
        "mismatches": mismatches,
        "gpu_checksum_gbps": _gbps(
            nbytes, _timed(lambda: checksum_tensor(data, ChecksumKind.FLETCHER64), repeats)
        ),
        "d2d_copy_gbps": _gbps(nbytes, _timed(lambda: dst.copy_(data), repeats)),
    }


def make_gpu_weights(total: int, tensor_bytes: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    n = max(1, total // tensor_bytes)
    return {
        f"layers.{i}.weight": torch.randn(tensor_bytes // 2, generator=g, device="cuda").to(
            torch.bfloat16
        )
        for i in range(n)
    }


def _fingerprints(w: dict[str, torch.Tensor]) -> dict[str, str]:
    """What ``SpawnedReceiver.param_checksums`` reports for ``w`` (checksummed on the GPU)."""
    return {k: tensor_fingerprint(v) for k, v in w.items()}


def _one_copy_baselines(nbytes: int, repeats: int) -> tuple[list[float], list[float]]:
    """Seconds of one D2H and one H2D copy of ``nbytes`` between the GPU and pinned memory."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    d2h = _timed(lambda: host.copy_(dev, non_blocking=True), repeats)
    h2d = _timed(lambda: dev.copy_(host, non_blocking=True), repeats)
    return d2h, h2d


def _host_checksum_builds(
    sets: list[dict[str, torch.Tensor]], bucket: int, repeats: int
) -> list[float]:
    """Seconds of each build with ``stage_on_gpu=False`` (the first one a warm-up)."""
    cfg = CacheConfig(bucket_bytes=bucket + 4096, ram_reserve_bytes=0, stage_on_gpu=False)
    cache = BucketCache("bench-gpu-host-checksum", cfg)
    out = []
    try:
        for i in range(repeats + 1):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            cache.build(i + 1, sets[i % 2].items())
            if i:
                out.append(time.perf_counter() - t0)
    finally:
        cache.close()
    return out


def bench_cache_and_ipc(total: int, bucket: int, repeats: int) -> dict[str, Any]:
    sets = [make_gpu_weights(total, 64 << 20, s) for s in (1, 2)]
    fps = [_fingerprints(w) for w in sets]
    nbytes = sum(int(t.numel()) * t.element_size() for t in sets[0].values())
    # + 4 KiB: whole 64 MiB tensors and their alignment fit each bucket
    cache = BucketCache("bench-gpu", CacheConfig(bucket_bytes=bucket + 4096, ram_reserve_bytes=0))
    storage = cache.resolve_storage(nbytes)
    d2h_s, h2d_s = _one_copy_baselines(nbytes, repeats)
    torch.cuda.empty_cache()  # the baselines' buffers are gone: give their memory back
    host_build_s = _host_checksum_builds(sets, bucket, repeats)
    layout = {k: ("bfloat16", tuple(v.shape)) for k, v in sets[0].items()}
    uuid = str(getattr(torch.cuda.get_device_properties(0), "uuid", "gpu0"))
    receiver = SpawnedReceiver("gpu-shard", layout, ReceiverLocation(gpu_uuid=uuid), device="cuda")
    build_s: list[float] = []
    sync_s: list[float] = []
    sender_extra: list[int] = []
    build_extra: list[int] = []
    correct: list[bool] = []
    transports: set[str] = set()
    try:
        for i in range(repeats + 1):  # the first of each is a warm-up
            which = i % 2
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            t0 = time.perf_counter()
            cache.build(i + 1, sets[which].items())
            t1 = time.perf_counter()
            build_extra.append(int(torch.cuda.max_memory_allocated() - base))
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            t2 = time.perf_counter()
            report = sync_version(
                cache, i + 1, [receiver], sender=SenderLocation(gpu_uuid=uuid, cuda=True),
                options=SyncOptions(ack_timeout_s=120),
            )
            t3 = time.perf_counter()
            peak = torch.cuda.max_memory_allocated() - base
            transports.update(o.transport.value for o in report.outcomes)
            ok = report.succeeded == ("gpu-shard",) and receiver.param_checksums() == fps[which]
            if i:
                build_s.append(t1 - t0)
                sync_s.append(t3 - t2)
                sender_extra.append(int(peak))
                correct.append(ok)
            elif not ok:
                correct.append(ok)
    finally:
        receiver.close()
        cache.close()
    return {
        "version_bytes": nbytes,
        "bucket_bytes": bucket,
        "cache_storage": storage.value,
        "transport": sorted(transports),
        "repeats": repeats,
        "d2h_pinned_one_copy_gbps": _gbps(nbytes, d2h_s),
        "h2d_pinned_one_copy_gbps": _gbps(nbytes, h2d_s),
        "cache_build_gbps": _gbps(nbytes, build_s),
        "cache_build_fraction_of_d2h": statistics.median(d2h_s) / statistics.median(build_s),
        "cache_build_host_checksum_gbps": _gbps(nbytes, host_build_s),
        "cache_build_host_checksum_fraction_of_d2h":
            statistics.median(d2h_s) / statistics.median(host_build_s),
        "cache_build_peak_extra_gpu_bytes_max": max(build_extra),
        "cuda_ipc_sync_gbps": _gbps(nbytes, sync_s),
        "cuda_ipc_sync_fraction_of_h2d": statistics.median(h2d_s) / statistics.median(sync_s),
        "cuda_ipc_sync_seconds": sync_s,
        "sender_peak_extra_gpu_bytes_max": max(sender_extra),
        "sender_peak_extra_in_buckets": max(sender_extra) / (bucket + 4096),
        "every_sync_byte_exact": all(correct) and len(correct) == repeats,
        "method": "each timed sync is of a newly built version (two alternating weight sets "
        "on the GPU); the receiver is a separate process with its weights on the same GPU "
        "and checks every byte (its Fletcher-64 on the GPU against the sender's) after each "
        "sync, untimed; sync time = sync_version end to end (offer, per-bucket H2D into the "
        "sender's staging buffer, receiver's GPU checksum + copy, ack)",
    }


class _DestroyClock:
    """Where a destroy's time goes: wraps torch's barrier and destroy_process_group and
    Megatron's destroy_model_parallel (the lifecycle calls them through their modules)."""

    def __init__(self, dist: Any, ps: Any, backend_name: Callable[[Any], str]) -> None:
        self.parts: dict[str, float] = {}
        self.groups: list[tuple[str, float]] = []
        self._inside: set[str] = set()
        real_destroy, real_barrier = dist.destroy_process_group, dist.barrier
        real_dmp = ps.destroy_model_parallel

        def destroy(group: Any = None) -> None:
            name = backend_name(group) + (" in dmp" if "dmp" in self._inside else "")
            t = time.perf_counter()
            real_destroy(group)
            self.groups.append((name, time.perf_counter() - t))

        def barrier(*a: Any, **kw: Any) -> Any:
            return self._time("barrier", lambda: real_barrier(*a, **kw))

        def destroy_model_parallel() -> Any:
            self._inside.add("dmp")
            try:
                return self._time("destroy_model_parallel", real_dmp)
            finally:
                self._inside.discard("dmp")

        dist.destroy_process_group, dist.barrier = destroy, barrier
        ps.destroy_model_parallel = destroy_model_parallel

    def _time(self, part: str, fn: Callable[[], Any]) -> Any:
        t = time.perf_counter()
        try:
            return fn()
        finally:
            self.parts[part] = self.parts.get(part, 0.0) + time.perf_counter() - t

    def reset(self) -> None:
        self.parts.clear()
        self.groups.clear()

    def breakdown(self, total: float) -> dict[str, float]:
        """Seconds per part; groups Megatron destroys itself ("in dmp") are shown but counted
        once, inside destroy_model_parallel."""
        out = dict(self.parts)
        for name, seconds in self.groups:
            key = f"destroy_process_group[{name}]"
            out[key] = out.get(key, 0.0) + seconds
        counted = sum(v for k, v in out.items() if "in dmp" not in k)
        out["other"] = total - counted
        return out


def _nccl_child(port: int, cycles: int, env: dict[str, str], queue: Any) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    os.environ.update(env)
    import torch.distributed as dist

    from rlix_plugins.training.nccl_lifecycle import (
        MegatronParallelLifecycle,
        ParallelConfig,
        backend_name,
        groups_in_module,
    )

    try:
        torch.cuda.set_device(0)
        torch.cuda.init()  # type: ignore[no-untyped-call]
        context = _used_bytes()
        dist.init_process_group(
            "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
            device_id=torch.device("cuda", 0),
        )
        one = torch.ones(1, device="cuda")
        dist.all_reduce(one)
        torch.cuda.synchronize()
        world = _used_bytes()
        lc = MegatronParallelLifecycle(ParallelConfig.of(tensor_model_parallel_size=1))
        clock = _DestroyClock(dist, lc.ps, backend_name)
        rows: list[dict[str, Any]] = []
        for c in range(cycles):
            t0 = time.perf_counter()
            if c == 0:
                lc.initialize()
            else:
                lc.reinitialize()
            groups = {id(g): g for g in groups_in_module(lc.ps)}
            nccl = [g for g in groups.values() if backend_name(g) == "nccl"]
            for g in nccl:  # communicators are created lazily: use each group once
                dist.all_reduce(one, group=g)
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            held = _used_bytes()
            clock.reset()
            report = lc.destroy()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            after = _used_bytes()
            rows.append({
                "nccl_groups": len(nccl),
                "groups_destroyed": report.destroyed,
                "by_backend": dict(report.by_backend),
                "used_with_groups_bytes": held,
                "used_after_destroy_bytes": after,
                "freed_bytes": held - after,
                "init_and_first_use_s": t1 - t0,
                "destroy_s": t2 - t1,
                "destroy_breakdown_s": clock.breakdown(t2 - t1),
                "destroy_group_s": clock.groups,
            })
        dist.destroy_process_group()
        torch.cuda.synchronize()
        queue.put({
            "status": "measured",
            "env": env,
            "layout": "world 1 (one GPU), tensor_model_parallel_size=1",
            "used_cuda_context_bytes": context,
            "used_with_world_group_bytes": world,
            "used_after_world_destroyed_bytes": _used_bytes(),
            "cycles": rows,
            "drift_bytes_last_vs_first_after_destroy":
                rows[-1]["used_after_destroy_bytes"] - rows[0]["used_after_destroy_bytes"],
            "method": "device memory in use (cudaMemGetInfo: total - free, whole GPU, this "
            "process alone on it) after every Megatron group was used by one all_reduce, and "
            "after MegatronParallelLifecycle.destroy(); the world group stays (it is the "
            "host's)",
        })
    except BaseException as exc:  # report, do not hang the parent
        queue.put({"status": f"failed: {type(exc).__name__}: {exc}"})


def bench_nccl_lifecycle(cycles: int, env: dict[str, str] | None = None) -> dict[str, Any]:
    return run_in_process(_nccl_child, (free_port(), cycles, env or {}), 300)


def _section(name: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run one part; a failure is recorded in the results (device time is scarce: the other
    parts still report)."""
    try:
        result = fn()
    except Exception as exc:
        logger.exception("%s failed", name)
        return {"status": f"failed: {type(exc).__name__}: {exc}"}
    result.setdefault("status", "measured")
    logger.info("%s: %s", name, {k: v for k, v in result.items() if k != "method"})
    return result


def _bandwidth_bars(ax: Any, data: dict[str, Any]) -> None:
    c, s = data["copies"], data["cache_and_ipc"]
    labels = ["H2D pinned", "H2D pageable", "D2H pinned", "D2H pageable",
              "cache build\n(GPU-staged)", "cache build\n(host checksum)",
              "CUDA IPC sync\n(end to end)"]
    values = [c["h2d_pinned_gbps"], c["h2d_pageable_gbps"], c["d2h_pinned_gbps"],
              c["d2h_pageable_gbps"], s["cache_build_gbps"], s["cache_build_host_checksum_gbps"],
              s["cuda_ipc_sync_gbps"]]
    ax.bar(labels, values, color=["C0", "C7", "C0", "C7", "C2", "C8", "C3"])
    ax.set_ylabel("GB/s (median)")
    ax.set_title(f"{data['machine']['gpu']}: copies of {c['bytes'] >> 20} MiB, "
                 f"cache/sync of {s['version_bytes'] >> 20} MiB", fontsize=9)
    ax.tick_params(axis="x", labelsize=7, labelrotation=25)


def _nccl_memory(ax: Any, n: dict[str, Any]) -> None:
    xs = range(1, len(n["cycles"]) + 1)
    ax.plot(xs, [r["used_with_groups_bytes"] / 2**20 for r in n["cycles"]], "o-",
            label="Megatron groups live and used")
    ax.plot(xs, [r["used_after_destroy_bytes"] / 2**20 for r in n["cycles"]], "s-",
            label="after destroy()")
    ax.axhline(n["used_with_world_group_bytes"] / 2**20, color="C7", ls="--",
               label="world group only")
    ax.set_xlabel("destroy / re-init cycle")
    ax.set_ylabel("GPU memory in use (MiB)")
    ax.legend(fontsize=8)
    ax.set_title(f"NCCL groups: {n['cycles'][0]['nccl_groups']} per cycle ({n['layout']})",
                 fontsize=9)


def plot(data: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    c, s, n = data["copies"], data["cache_and_ipc"], data["nccl_lifecycle"]
    if c["status"] == "measured" and s["status"] == "measured":
        _bandwidth_bars(ax1, data)
    else:
        ax1.text(0.5, 0.5, f"copies: {c['status']}\nsync: {s['status']}", ha="center", wrap=True)
    if n["status"] == "measured":
        _nccl_memory(ax2, n)
    else:
        ax2.text(0.5, 0.5, n["status"], ha="center", wrap=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def machine() -> dict[str, Any]:
    """The host, the software and GPU 0 a run measured on (also used by the GPU tests that
    save figures)."""
    props = torch.cuda.get_device_properties(0)
    return {
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())),  # type: ignore[no-untyped-call]
        "gpu": props.name,
        "gpu_memory_bytes": int(props.total_memory),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--total-mib", type=int, default=2048)
    parser.add_argument("--bucket-mib", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cycles", type=int, default=5)
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument("--plot-only", action="store_true",
                        help="redraw the PNG from the JSON in --output (no GPU needed)")
    args = parser.parse_args()
    if args.plot_only:
        plot(json.loads((args.output / "gpu.json").read_text()), args.output / "gpu.png")
        return
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("rlix_plugins").setLevel(logging.WARNING)
    if not torch.cuda.is_available():
        logger.error("no CUDA GPU here: these figures need one")
        raise SystemExit(2)
    bucket = args.bucket_mib << 20
    # the NCCL part first: its own process, on an otherwise idle GPU
    nccl = _section("nccl lifecycle", lambda: bench_nccl_lifecycle(args.cycles))
    # is the destroy time torch's watchdog/heartbeat threads winding down? (same run, one knob)
    nccl_no_monitor = _section(
        "nccl lifecycle, TORCH_NCCL_ENABLE_MONITORING=0",
        lambda: bench_nccl_lifecycle(args.cycles, {"TORCH_NCCL_ENABLE_MONITORING": "0"}),
    )
    copies = _section("copies", lambda: bench_copies(bucket, args.repeats))
    checksum = _section("checksum", lambda: bench_checksum(bucket, args.repeats))
    ipc = _section(
        "cache and ipc", lambda: bench_cache_and_ipc(args.total_mib << 20, bucket, args.repeats)
    )
    data = {
        "machine": machine(),
        "copies": copies,
        "checksum": checksum,
        "cache_and_ipc": ipc,
        "nccl_lifecycle": nccl,
        "nccl_lifecycle_monitoring_off": nccl_no_monitor,
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / "gpu.json").write_text(json.dumps(data, indent=2))
    plot(data, args.output / "gpu.png")
    logger.info("wrote %s", args.output)


if __name__ == "__main__":
    main()
