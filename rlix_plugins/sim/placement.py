"""Where a job's clusters land: dedicated GPUs (exclusive), spans (shared) or explicit maps."""

from __future__ import annotations

from typing import Protocol

from rlix_plugins.sim.workloads import JobSpec, Placement


class Placer(Protocol):
    """Chooses device mappings when a job arrives; None = wait (FIFO admission queue)."""

    def place(self, index: int, job: JobSpec) -> Placement | None: ...

    def release(self, index: int) -> None: ...


def _aligned_free_block(free: list[bool], size: int, align: int) -> int | None:
    for start in range(0, len(free) - size + 1, align):
        if all(free[start : start + size]):
            return start
    return None


class ExclusivePlacer:
    """Each job gets ``train_gpus + infer_gpus`` dedicated GPUs (disjoint train/infer)."""

    def __init__(self, num_gpus: int, gpus_per_node: int) -> None:
        self.free = [True] * num_gpus
        self.gpus_per_node = gpus_per_node
        self.held: dict[int, tuple[int, ...]] = {}

    def place(self, index: int, job: JobSpec) -> Placement | None:
        align = job.infer_tp
        if job.train_gpus % align:
            raise ValueError(f"job {job.name}: train_gpus must be a multiple of infer_tp")
        start = _aligned_free_block(self.free, job.footprint, align)
        if start is None:
            return None
        block = tuple(range(start, start + job.footprint))
        for g in block:
            self.free[g] = False
        self.held[index] = block
        return Placement(block[: job.train_gpus], block[job.train_gpus :])

    def release(self, index: int) -> None:
        for g in self.held.pop(index, ()):
            self.free[g] = True


class SpanPlacer:
    """Shared deployment: training on the least-used aligned block, inference on a span.

    "Least-used": the fewest training clusters on the block's busiest GPU, then the fewest
    over the whole block (a block half free beats one fully covered by another job's
    training), then the lowest index. The inference span is ``span_factor`` x the job's
    exclusive footprint (node-aligned, whole cluster at most) and contains the training block
    (partial overlap), as calibration.md describes RLix deployments. Every job is admitted at
    once.
    """

    def __init__(self, num_gpus: int, gpus_per_node: int, span_factor: float) -> None:
        self.num_gpus = num_gpus
        self.gpus_per_node = gpus_per_node
        self.span_factor = span_factor
        self.train_use = [0] * num_gpus
        self.held: dict[int, tuple[int, ...]] = {}

    def place(self, index: int, job: JobSpec) -> Placement:
        gpn = self.gpus_per_node
        size = job.train_gpus
        align = max(job.infer_tp, 1)
        use = self.train_use

        def load(s: int) -> tuple[int, int, int]:
            return max(use[s : s + size]), sum(use[s : s + size]), s

        start = min(range(0, self.num_gpus - size + 1, align), key=load)
        train = tuple(range(start, start + size))
        for g in train:
            self.train_use[g] += 1
        self.held[index] = train
        span = min(self.num_gpus, max(gpn, int(self.span_factor * job.footprint)))
        span = -(-span // gpn) * gpn
        lo = (start // gpn) * gpn - ((span - size) // 2 // gpn) * gpn
        if start + size > lo + span:  # a block straddling nodes near the span's end
            lo = -(-(start + size - span) // gpn) * gpn
        lo = max(0, min(lo, self.num_gpus - span))
        infer = tuple(range(lo, lo + span))
        return Placement(train, infer)

    def release(self, index: int) -> None:
        for g in self.held.pop(index, ()):
            self.train_use[g] -= 1


class StaticPlacer:
    """Explicit mappings per job (scenario files, PlexRL's shared training pool)."""

    def __init__(self, placements: tuple[Placement, ...]) -> None:
        self.placements = placements

    def place(self, index: int, job: JobSpec) -> Placement:
        return self.placements[index]

    def release(self, index: int) -> None:
        return None
