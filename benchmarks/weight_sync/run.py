"""Weight-sync benchmark: sync bandwidth vs warm memcpy, receiver peak memory, NCCL-cycle time.

Run: ``python benchmarks/weight_sync/run.py [--total-mib 512] [--bucket-mib 64]``.
Writes ``results/weight_sync.json`` and ``results/weight_sync.png`` next to this file.

Measured in one run on one machine:

* warm memcpy bandwidth (numpy ``copyto`` between two preallocated, pre-touched arrays of the
  version's size; first-touch memory is several times slower on this VM, so it is excluded),
  taken once next to every timed sync: fractions are medians of per-repeat ratios;
* CPU transports (shm, zmq, gloo): one cached version streamed bucket by bucket to a receiver
  in a separate process whose destination tensors are preallocated and pre-touched; a warm-up
  sync first, then the median of timed syncs (checksums verified on every bucket);
* the shm floor: map + checksum + copy + unmap of every bucket with no protocol at all;
* the receiver's peak resident-memory rise during a steady-state sync (VmHWM reset per sync);
* Megatron destroy/re-init cycle time on 2 gloo ranks (TP=2).

GPU-only figures (pinned H2D streaming, NVML memory across NCCL cycles) run only where
``torch.cuda.is_available()``; elsewhere they are recorded as not measured.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from rlix_plugins.training.bucket_cache import BucketCache, CacheConfig, StorageKind  # noqa: E402
from rlix_plugins.training.checksum import ChecksumKind  # noqa: E402
from rlix_plugins.training.process_receiver import SpawnedReceiver  # noqa: E402
from rlix_plugins.training.sync import SyncOptions, sync_version  # noqa: E402
from rlix_plugins.training.wire import TransportKind  # noqa: E402

logger = logging.getLogger("weight_sync_bench")
RESULTS = Path(__file__).resolve().parent / "results"


class WarmMemcpy:
    """numpy ``copyto`` between two preallocated, pre-touched arrays of the version's size."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.src = np.ones(nbytes, dtype=np.uint8)
        self.dst = np.zeros(nbytes, dtype=np.uint8)
        np.copyto(self.dst, self.src)  # warm both buffers
        self.seconds: list[float] = []

    def once(self) -> float:
        t0 = time.perf_counter()
        np.copyto(self.dst, self.src)
        dt = time.perf_counter() - t0
        self.seconds.append(dt)
        return dt

    def gbps(self) -> float:
        return self.nbytes / statistics.median(self.seconds) / 1e9


def shm_floor_once(cv: Any, dsts: list[np.ndarray], acc: dict[str, float]) -> None:
    """The shm receiver's unavoidable work for one version, without any protocol: per bucket
    map its file (MAP_POPULATE), checksum it, copy it into a pre-touched destination, unmap."""
    import mmap

    from rlix_plugins.training.checksum import checksum_bytes

    for b, dst in zip(cv.buckets, dsts, strict=True):
        n = b.layout.nbytes
        t0 = time.perf_counter()
        fd = os.open(b.shm_path, os.O_RDONLY)
        mm = mmap.mmap(fd, n, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ)
        os.close(fd)
        src = np.frombuffer(mm, dtype=np.uint8)
        t1 = time.perf_counter()
        if checksum_bytes(src, cv.checksum) != b.layout.checksum:
            raise RuntimeError("floor: checksum mismatch")
        t2 = time.perf_counter()
        np.copyto(dst, src)
        t3 = time.perf_counter()
        del src
        mm.close()
        t4 = time.perf_counter()
        for k, dt in (
            ("map", t1 - t0),
            ("checksum", t2 - t1),
            ("copy", t3 - t2),
            ("unmap", t4 - t3),
        ):
            acc[k] = acc.get(k, 0.0) + dt


def bench_shm_floor(cache: BucketCache, memcpy: WarmMemcpy, repeats: int) -> dict[str, Any]:
    with cache.pinned(1) as cv:
        dsts = [np.ones(b.layout.nbytes, dtype=np.uint8) for b in cv.buckets]
        shm_floor_once(cv, dsts, {})  # warm-up
        parts: list[dict[str, float]] = []
        ratios = []
        for _ in range(repeats):
            m = memcpy.once()
            acc: dict[str, float] = {}
            shm_floor_once(cv, dsts, acc)
            parts.append(acc)
            ratios.append(m / sum(acc.values()))
        total = sum(b.layout.nbytes for b in cv.buckets)
    med = {k: statistics.median(p[k] for p in parts) for k in parts[0]}
    m_med = statistics.median(memcpy.seconds[-repeats:])
    return {
        "what": "map+checksum+copy+unmap per bucket, no protocol (the shm receiver's floor)",
        "seconds_median": sum(med.values()),
        "gbps": total / sum(med.values()) / 1e9,
        "fraction_of_memcpy": statistics.median(ratios),
        "parts_seconds_median": med,
        "parts_in_memcpy_units": {k: v / m_med for k, v in med.items()},
    }


def make_weights(total: int, tensor_bytes: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    n = max(1, total // tensor_bytes)
    elems = tensor_bytes // 2
    return {
        f"layers.{i}.weight": torch.randn(elems, generator=g).to(torch.bfloat16) for i in range(n)
    }


def bench_transport(
    cache: BucketCache,
    layout: dict[str, tuple[str, tuple[int, ...]]],
    kind: TransportKind,
    repeats: int,
    memcpy: WarmMemcpy,
) -> dict[str, Any]:
    """Syncs interleaved with warm memcpys (one each per repeat): the machine is shared and
    noisy, so each sync is compared with a memcpy taken next to it (median of the ratios)."""
    receiver = SpawnedReceiver(f"bench-{kind.value}", layout)
    try:
        opts = SyncOptions(transports={receiver.shard_id: kind}, ack_timeout_s=300)
        sync_version(cache, 1, [receiver], options=opts)  # warm-up
        seconds, recv_seconds, peaks, ratios, recv_ratios = [], [], [], [], []
        total = 0
        for _ in range(repeats):
            m = memcpy.once()
            report = sync_version(cache, 1, [receiver], options=opts)
            seconds.append(report.seconds)
            total = report.total_bytes
            assert receiver.last_stats is not None
            recv_seconds.append(receiver.last_stats.result.seconds)
            peaks.append(receiver.last_stats.peak_extra_bytes)
            ratios.append(m / report.seconds)
            recv_ratios.append(m / recv_seconds[-1])
        med = statistics.median(seconds)
        rmed = statistics.median(recv_seconds)
        return {
            "transport": kind.value,
            "bytes": total,
            "seconds_median": med,
            "seconds_all": seconds,
            "gbps": total / med / 1e9,
            "fraction_of_memcpy": statistics.median(ratios),
            "receiver_seconds_median": rmed,
            "receiver_seconds_all": recv_seconds,
            "receiver_gbps": total / rmed / 1e9,
            "receiver_fraction_of_memcpy": statistics.median(recv_ratios),
            "receiver_peak_extra_bytes_max": max(peaks),
            "receiver_peak_extra_bytes_all": peaks,
        }
    finally:
        receiver.close()


def _cycle_rank(rank: int, port: int, cycles: int, queue: Any) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    from rlix_plugins.training.nccl_lifecycle import MegatronParallelLifecycle, ParallelConfig

    lc = MegatronParallelLifecycle(ParallelConfig.of(tensor_model_parallel_size=2))
    lc.initialize()
    destroy, init = [], []
    groups = 0
    for _ in range(cycles):
        t0 = time.perf_counter()
        report = lc.destroy()
        t1 = time.perf_counter()
        lc.reinitialize()
        t2 = time.perf_counter()
        destroy.append(t1 - t0)
        init.append(t2 - t1)
        groups = report.destroyed
    lc.destroy()
    dist.destroy_process_group()
    queue.put((rank, destroy, init, groups))


def bench_nccl_cycle(cycles: int) -> dict[str, Any]:
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_cycle_rank, args=(r, port, cycles, queue)) for r in range(2)]
    for p in procs:
        p.start()
    out = {}
    for _ in range(2):
        rank, destroy, init, groups = queue.get(timeout=900)
        out[rank] = (destroy, init, groups)
    for p in procs:
        p.join(60)
    destroy, init, groups = out[0]
    cycle = [a + b for a, b in zip(destroy, init, strict=True)]
    return {
        "backend": "gloo (CPU; NCCL communicator teardown not measured here)",
        "layout": "world 2, tensor_model_parallel_size=2",
        "cycles": cycles,
        "groups_per_cycle": groups,
        "destroy_ms_median": 1e3 * statistics.median(destroy),
        "reinit_ms_median": 1e3 * statistics.median(init),
        "cycle_ms_median": 1e3 * statistics.median(cycle),
        "cycle_ms_p90": 1e3 * float(np.percentile(cycle, 90)),
    }


def bench_gpu(total: int) -> dict[str, Any]:
    if not torch.cuda.is_available():
        return {"status": "not measured: no GPU in this task"}
    # pinned host -> device streaming, bucket-sized copies (what CUDA IPC / NCCL staging does)
    src = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(total, dtype=torch.uint8, device="cuda")
    dst.copy_(src)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    h2d = 5 * total / (time.perf_counter() - t0) / 1e9
    result: dict[str, Any] = {"status": "measured", "pinned_h2d_gbps": h2d}
    try:
        import pynvml  # type: ignore[import-not-found,unused-ignore]

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        result["nvml_used_bytes"] = int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)
    except Exception as exc:  # pynvml missing: record why
        result["nvml"] = f"not measured: {exc}"
    return result


def plot(data: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    ts = data["transports"]
    names = [t["transport"] for t in ts] + ["shm floor"]
    x = np.arange(len(names))
    e2e = [100 * t["fraction_of_memcpy"] for t in ts] + [0.0]
    recv = [100 * t["receiver_fraction_of_memcpy"] for t in ts]
    recv.append(100 * data["shm_floor"]["fraction_of_memcpy"])
    ax = axes[0]
    ax.bar(x - 0.2, e2e, 0.4, label="end to end (sender)")
    ax.bar(x + 0.2, recv, 0.4, label="receiver side / floor")
    ax.set_xticks(x, names)
    ax.axhline(50, ls="--", color="red", label="target: 50% of memcpy")
    ax.set_ylabel("% of warm memcpy (same run, interleaved)")
    ax.set_title(
        f"sync of {data['version_bytes'] / 2**20:.0f} MiB, "
        f"{data['bucket_bytes'] / 2**20:.0f} MiB buckets (memcpy {data['memcpy_gbps']:.1f} GB/s)"
    )
    ax.legend(fontsize=8)
    ax = axes[1]
    ax.bar(
        [t["transport"] for t in data["transports"]],
        [t["receiver_peak_extra_bytes_max"] / 2**20 for t in data["transports"]],
    )
    ax.axhline(data["bucket_bytes"] / 2**20, ls="--", color="red", label="one bucket")
    ax.set_ylabel("MiB")
    ax.set_title("receiver peak RSS rise during a sync")
    ax.legend()
    ax = axes[2]
    c = data["nccl_cycle"]
    ax.bar(["destroy", "re-init"], [c["destroy_ms_median"], c["reinit_ms_median"]])
    ax.set_ylabel("ms (median)")
    ax.set_title(f"Megatron group cycle ({c['groups_per_cycle']} groups, gloo)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--total-mib", type=int, default=512)
    parser.add_argument("--bucket-mib", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cycles", type=int, default=20)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(1)
    total = args.total_mib << 20
    bucket = args.bucket_mib << 20
    weights = make_weights(total, tensor_bytes=8 << 20)
    layout = {k: (str(v.dtype).removeprefix("torch."), tuple(v.shape)) for k, v in weights.items()}
    cache = BucketCache(
        "bench",
        CacheConfig(
            bucket_bytes=bucket + 4096, storage=StorageKind.SHARED, ram_reserve_bytes=1 << 30
        ),
    )
    t0 = time.perf_counter()
    cache.build(1, weights.items())
    build_s = time.perf_counter() - t0
    version_bytes = cache.info(1).total_bytes
    del weights
    memcpy = WarmMemcpy(version_bytes)
    transports = []
    for kind in (TransportKind.SHM, TransportKind.ZMQ, TransportKind.GLOO):
        r = bench_transport(cache, layout, kind, args.repeats, memcpy)
        transports.append(r)
        logger.info(
            "%s: %.2f GB/s end to end (%.0f%% of memcpy), receiver side %.2f GB/s (%.0f%%), "
            "receiver peak +%.1f MiB",
            kind.value,
            r["gbps"],
            100 * r["fraction_of_memcpy"],
            r["receiver_gbps"],
            100 * r["receiver_fraction_of_memcpy"],
            r["receiver_peak_extra_bytes_max"] / 2**20,
        )
    floor = bench_shm_floor(cache, memcpy, args.repeats)
    logger.info(
        "shm floor (map+checksum+copy+unmap, no protocol): %.0f%% of memcpy; parts %s",
        100 * floor["fraction_of_memcpy"],
        {k: round(v, 2) for k, v in floor["parts_in_memcpy_units"].items()},
    )
    cache.close()
    # crc32 instead of fletcher64 on the fastest transport: what the stronger checksum costs
    cache32 = BucketCache(
        "bench32",
        CacheConfig(
            bucket_bytes=bucket + 4096,
            storage=StorageKind.SHARED,
            checksum=ChecksumKind.CRC32,
            ram_reserve_bytes=1 << 30,
        ),
    )
    cache32.build(1, make_weights(total, tensor_bytes=8 << 20).items())
    crc = bench_transport(cache32, layout, TransportKind.SHM, args.repeats, memcpy)
    crc["transport"] = "shm+crc32"
    transports.append(crc)
    cache32.close()
    logger.info("shm with crc32: %.2f GB/s", crc["gbps"])
    cycle = bench_nccl_cycle(args.cycles)
    logger.info("megatron cycle: %.1f ms median", cycle["cycle_ms_median"])
    data = {
        "machine": {
            "host": platform.node(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "note": "shared, noisy 2-core VM; figures vary run to run",
        },
        "version_bytes": version_bytes,
        "bucket_bytes": bucket,
        "cache_build_seconds": build_s,
        "memcpy_gbps": memcpy.gbps(),
        "memcpy_seconds_all": memcpy.seconds,
        "ratio_method": "median over repeats of (memcpy time / sync time), each sync next to "
        "its own memcpy; end to end = sender's sync_version time (includes the offer round trip "
        "and the test receiver's post-sync parameter checksums); receiver side = the receiver's "
        "own time from connecting to its final ack",
        "target": "CPU transport >= 50% of warm memcpy",
        "target_met_by": [t["transport"] for t in transports if t["fraction_of_memcpy"] >= 0.5],
        "transports": transports,
        "shm_floor": floor,
        "nccl_cycle": cycle,
        "gpu": bench_gpu(bucket),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "weight_sync.json").write_text(json.dumps(data, indent=2))
    plot(data, RESULTS / "weight_sync.png")
    logger.info("wrote %s", RESULTS)


if __name__ == "__main__":
    main()
