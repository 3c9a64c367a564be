"""Round-trip time of an uncontended ``request_gpus`` (+ release) through Ray.

Measures, on a local Ray (2 CPUs, 8 logical GPUs) in the same run:
  * request_gpus(actor_train, ACTOR_TRAINING) on idle GPUs: RPC + event + one scheduling cycle
    (plan, check, commit, persist to Ray's KV) + wake-up of the waiter;
  * notify_release_gpus: RPC + release + persist;
  * a no-op call on a plain async actor (Ray's floor), and ``ping`` on the scheduler actor.
Writes results/rtt.json and results/rtt.png.

    python benchmarks/scheduler_latency/rtt.py [--n 500] [--warmup 50]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import ray  # noqa: E402

from rlix_plugins.coordinator.core.model import Topology  # noqa: E402
from rlix_plugins.coordinator.service.client import connect, stop_coordinator  # noqa: E402
from rlix_plugins.coordinator.service.config import ServiceConfig  # noqa: E402
from rlix_plugins.protocol.names import pipeline_namespace  # noqa: E402
from rlix_plugins.protocol.types import Priority  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


class NoOp:
    """The cheapest async actor call Ray can make."""

    async def noop(self) -> None:
        return None


def summary(samples_s: list[float]) -> dict[str, float]:
    ms = sorted(s * 1e3 for s in samples_s)
    return {
        "median_ms": statistics.median(ms),
        "p99_ms": ms[min(len(ms) - 1, round(0.99 * (len(ms) - 1)))],
        "mean_ms": statistics.fmean(ms),
        "min_ms": ms[0],
        "max_ms": ms[-1],
    }


def timed(ref_fn: Any) -> float:
    t0 = time.perf_counter()
    ray.get(ref_fn())
    return time.perf_counter() - t0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=500)
    parser.add_argument("--warmup", type=int, default=50)
    args = parser.parse_args()

    ray.init(num_cpus=2, num_gpus=8, include_dashboard=False, log_to_driver=False)
    namespace = f"rlix_bench_{uuid.uuid4().hex[:8]}"
    config = ServiceConfig(namespace=namespace, topology=Topology(1, 8))
    try:
        plane = connect(namespace=namespace, config=config)
        noop = ray.remote(NoOp).options(num_cpus=0).remote()
        ray.get(noop.noop.remote())
        sched = plane.scheduler
        pid = "ft_benchmark001"
        ray.get(
            plane.orchestrator.register_pipeline.remote(
                pipeline_id=pid,
                ray_namespace=pipeline_namespace(pid),
                cluster_tp_configs={"actor_train": 1},
                cluster_device_mappings={"actor_train": [0, 1]},
            )
        )
        cid = f"{pid}_actor_train"

        def request() -> Any:
            return sched.request_gpus.remote(
                cluster_id=cid, priority=Priority.ACTOR_TRAINING, global_step=0
            )

        def release() -> Any:
            return sched.notify_release_gpus.remote(cluster_id=cid)

        req, rel, both, nop, ping = [], [], [], [], []
        for i in range(args.warmup + args.n):
            t_req = timed(request)
            t_rel = timed(release)
            t_nop = timed(noop.noop.remote)
            t_ping = timed(sched.ping.remote)
            if i >= args.warmup:
                req.append(t_req)
                rel.append(t_rel)
                both.append(t_req + t_rel)
                nop.append(t_nop)
                ping.append(t_ping)
        status = ray.get(sched.get_status.remote())
        assert status.idle_gpus == tuple(range(8)), "every request was released"
    finally:
        stop_coordinator(namespace)
        ray.shutdown()

    result = {
        "n": args.n,
        "warmup": args.warmup,
        "request_gpus": summary(req),
        "notify_release_gpus": summary(rel),
        "request_plus_release": summary(both),
        "noop_actor_call": summary(nop),
        "scheduler_ping": summary(ping),
        "ratio_request_vs_noop_median": statistics.median(req) / statistics.median(nop),
        "ratio_request_plus_release_vs_noop_median": statistics.median(both)
        / statistics.median(nop),
        "environment": {
            "python": platform.python_version(),
            "ray": ray.__version__,
            "cpus": os.cpu_count(),
            "machine": platform.machine(),
            "note": "local Ray, num_cpus=2, num_gpus=8 logical; state persisted to Ray's KV",
        },
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "rtt.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(
        {
            "request_gpus": req,
            "notify_release_gpus": rel,
            "no-op actor call": nop,
            "scheduler ping": ping,
        },
        RESULTS / "rtt.png",
    )
    print(json.dumps({k: v for k, v in result.items() if k != "environment"}, indent=2))
    return 0


def plot(series: dict[str, list[float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, samples in series.items():
        ms = sorted(s * 1e3 for s in samples)
        frac = [(i + 1) / len(ms) for i in range(len(ms))]
        ax.plot(ms, frac, label=f"{name} (median {statistics.median(ms):.2f} ms)")
    ax.set_xscale("log")
    ax.set_xlabel("round-trip time (ms, log scale)")
    ax.set_ylabel("fraction of calls")
    ax.set_title("Uncontended coordinator calls through Ray (CDF)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
