"""GPU timelines of a gate run: who owned each GPU when, and when it did useful work."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class Interval:
    """``gpu`` was held by ``owner`` (a pipeline id) for ``stage`` from ``start`` to ``end``."""

    gpu: int
    owner: str
    stage: str
    start: float
    end: float

    def overlaps(self, other: Interval) -> bool:
        return self.start < other.end and other.start < self.end


@dataclass(slots=True)
class RunRecord:
    """What one pipeline's step loop did in a gate run (filled in as it runs)."""

    pipeline_id: str
    label: str
    mode: str
    steps_target: int
    steps_done: int = 0
    error: str | None = None
    start: float = 0.0
    end: float = 0.0
    busy: list[Interval] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Overlap:
    """Two owners on one GPU at once (a failed gate criterion)."""

    gpu: int
    first: Interval
    second: Interval


def double_ownership(intervals: Iterable[Interval], *, tolerance_s: float = 0.0) -> list[Overlap]:
    """Pairs of intervals of DIFFERENT owners that overlap on the same GPU by > tolerance."""
    by_gpu: dict[int, list[Interval]] = defaultdict(list)
    for iv in intervals:
        by_gpu[iv.gpu].append(iv)
    found: list[Overlap] = []
    for gpu, ivs in by_gpu.items():
        ivs.sort(key=lambda iv: iv.start)
        for i, a in enumerate(ivs):
            for b in ivs[i + 1 :]:
                if b.start >= a.end:
                    break
                overlap = min(a.end, b.end) - b.start
                if a.owner != b.owner and overlap > tolerance_s:
                    found.append(Overlap(gpu, a, b))
    return found


def busy_share(busy: Sequence[Interval], num_gpus: int, start: float, end: float) -> float:
    """Fraction of GPU-seconds in [start, end] covered by busy intervals (merged per GPU)."""
    if end <= start or num_gpus <= 0:
        return 0.0
    by_gpu: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for iv in busy:
        s, e = max(iv.start, start), min(iv.end, end)
        if e > s:
            by_gpu[iv.gpu].append((s, e))
    total = 0.0
    for spans in by_gpu.values():
        spans.sort()
        cur_s, cur_e = spans[0]
        for s, e in spans[1:]:
            if s > cur_e:
                total += cur_e - cur_s
                cur_s, cur_e = s, e
            else:
                cur_e = max(cur_e, e)
        total += cur_e - cur_s
    return total / (num_gpus * (end - start))


def intervals_from_trace(trace: Mapping[str, Any]) -> tuple[list[Interval], float]:
    """Ownership intervals from the coordinator's Chrome trace (``get_trace()``).

    Returns the intervals (unix seconds; owner = cluster id, stage = priority name) and the
    trace's ``t0`` (unix seconds).
    """
    t0 = float((trace.get("otherData") or {}).get("t0_unix_s", 0.0))
    out: list[Interval] = []
    for ev in trace.get("traceEvents", []):
        if ev.get("ph") != "X":
            continue
        args = ev.get("args") or {}
        start = t0 + float(ev["ts"]) / 1e6
        out.append(Interval(int(ev["tid"]), str(args.get("cluster_id", ev.get("name"))),
                            str(args.get("stage", ev.get("cat", ""))), start,
                            start + float(ev.get("dur", 0.0)) / 1e6))
    return out, t0


def pipeline_of(owner: str) -> str:
    """The pipeline id of a cluster id (``{pipeline_id}_{cluster}``; a bare id is returned)."""
    for suffix in ("_actor_train", "_actor_infer", "_critic", "_reference"):
        if owner.endswith(suffix):
            return owner[: -len(suffix)]
    return owner


def to_chrome_trace(
    tracks: Mapping[str, Sequence[Interval]], *, t0: float, num_gpus: int
) -> dict[str, Any]:
    """One Perfetto/Chrome trace with a process per track set (e.g. "coordinator ownership",
    "rehearsal busy") and a thread per GPU; times relative to ``t0`` (unix seconds)."""
    events: list[dict[str, Any]] = []
    for pid, (label, intervals) in enumerate(tracks.items(), start=1):
        events.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": label}})
        for gpu in range(num_gpus):
            events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": gpu,
                           "args": {"name": f"GPU {gpu}"}})
        for iv in intervals:
            events.append({
                "name": f"{iv.owner} {iv.stage}", "cat": iv.stage, "ph": "X", "pid": pid,
                "tid": iv.gpu, "ts": round((iv.start - t0) * 1e6, 1),
                "dur": round(max(0.0, iv.end - iv.start) * 1e6, 1),
                "args": {"owner": iv.owner, "stage": iv.stage},
            })
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"t0_unix_s": t0}}
