"""What saving the scheduler's state costs per commit, next to the planning cycle it follows.

The service saves its state after every commit and registry change, on its event loop, before
it answers (``service/durability.py``): the core's ``snapshot`` and ``json.dumps`` (every
store pays them), then the store's write (the default Ray KV store: one GCS put; the file
store: a temporary file, fsync, rename, fsync of the directory). Measured on
``run.py``'s states (same builder, same seed), in the same run as one ``DemandSharePlanner.plan``
on that state, so the ratio save / plan does not depend on how loaded this shared box is:

* ``snapshot_ms``: snapshot + ``json.dumps``, CPU time of this thread;
* ``file_save_ms``: a whole ``FileStateStore.save`` of that snapshot into a temporary
  directory, wall time (its fsyncs wait for the disk);
* ``plan_ms``: the planning cycle, CPU time (as ``run.py``).

Run: python benchmarks/scheduler_latency/save.py [--repeats N] [--scales N] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.scheduler_latency.run import RESULTS, SCALES, build_state  # noqa: E402
from rlix_plugins.coordinator.core import DemandSharePlanner  # noqa: E402
from rlix_plugins.coordinator.core.snapshot import snapshot  # noqa: E402
from rlix_plugins.coordinator.service.persistence import FileStateStore  # noqa: E402


@dataclass(frozen=True, slots=True)
class SaveRow:
    pipelines: int
    gpus: int
    plan_ms: float
    snapshot_ms: float
    file_save_ms: float
    state_kb: float
    snapshot_vs_plan: float
    file_save_vs_plan: float


def measure(pipelines: int, gpus: int, repeats: int, seed: int = 0) -> SaveRow:
    """Medians over ``repeats`` of plan, snapshot + JSON, and a file save, interleaved."""
    state = build_state(pipelines, gpus, seed)
    planner = DemandSharePlanner()
    planner.plan(state, 100.0)  # warm-up (the rank-order cache)
    plans: list[float] = []
    dumps: list[float] = []
    files: list[float] = []
    size = 0
    with tempfile.TemporaryDirectory() as tmp:
        store = FileStateStore(Path(tmp) / "state.json")
        for _ in range(repeats):
            t0 = time.thread_time()
            planner.plan(state, 100.0)
            t1 = time.thread_time()
            record = snapshot(state)
            size = len(json.dumps(record))
            t2 = time.thread_time()
            w0 = time.perf_counter()
            store.save(record)
            files.append((time.perf_counter() - w0) * 1e3)
            plans.append((t1 - t0) * 1e3)
            dumps.append((t2 - t1) * 1e3)
    # Ratios of the times as reported (rounded to the microsecond), so the JSON agrees with
    # itself: from the unrounded medians they could differ in the last digit.
    plan, dump, file = (round(statistics.median(x), 3) for x in (plans, dumps, files))
    plan = max(plan, 0.001)
    return SaveRow(pipelines, gpus, plan, dump, file, round(size / 1024, 1),
                   round(dump / plan, 2), round(file / plan, 2))


def plot(rows: list[SaveRow], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r.pipelines}x{r.gpus}" for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(x, [r.plan_ms for r in rows], "o-", label="plan (one cycle)")
    ax.plot(x, [r.snapshot_ms for r in rows], "d-.", label="save: snapshot + JSON")
    ax.plot(x, [r.file_save_ms for r in rows], "v-.", label="save: whole file save (fsync)")
    ax.set_xticks(list(x), labels)
    ax.set_yscale("log")
    ax.set_xlabel("pipelines x GPUs")
    ax.set_ylabel("ms (median)")
    ax.set_title("State save per commit vs planning cycle (same run)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--scales", type=int, default=len(SCALES), choices=range(1, 5),
                        help="measure the first N of run.py's scales (default: all 4)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    rows = [measure(p, g, args.repeats) for p, g in SCALES[:args.scales]]
    for r in rows:
        print(f"{r.pipelines:5d} pipelines x {r.gpus:6d} GPUs: plan {r.plan_ms:8.2f} ms, "
              f"snapshot+JSON {r.snapshot_ms:7.2f} ms ({r.snapshot_vs_plan:.2f}x plan), "
              f"file save {r.file_save_ms:7.2f} ms ({r.file_save_vs_plan:.2f}x), "
              f"{r.state_kb:.0f} KB")
    args.out.mkdir(parents=True, exist_ok=True)
    out = {
        "benchmark": "scheduler_state_save",
        "machine": platform.platform(),
        "python": platform.python_version(),
        "repeats": args.repeats,
        "rows": [asdict(r) for r in rows],
    }
    (args.out / "save.json").write_text(json.dumps(out, indent=2))
    plot(rows, args.out / "save.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
