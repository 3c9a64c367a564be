"""The simulator's own physics checks: GPU tenancy, utilisation bounds, trajectory counts.

These run on every event that touches a GPU and on every step, independently of the
scheduling core's invariants (which the engine also checks every cycle): the core can only say
who *owns* a GPU; the ledger says who physically *uses* it, including switch times.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlix_plugins.errors import RlixPluginsError

_EPS = 1e-6


class PhysicsViolation(RlixPluginsError, AssertionError):
    """The simulated cluster did something physically impossible."""


@dataclass(frozen=True, slots=True)
class Tenure:
    """One occupant's stay on a GPU: from its start until ``end`` (None while open)."""

    who: str
    start: float
    end: float | None


class GpuLedger:
    """Physical occupancy of every GPU: at most one tenant at a time, no overlap in time."""

    def __init__(self, num_gpus: int) -> None:
        self.num_gpus = num_gpus
        self.current: list[Tenure | None] = [None] * num_gpus
        #: time each GPU is physically free (end of its last tenure)
        self.free_at: list[float] = [0.0] * num_gpus
        #: busy (useful compute) GPU-seconds per GPU, and GPU-seconds of all tenures
        self.useful: list[float] = [0.0] * num_gpus
        self.tenured: list[float] = [0.0] * num_gpus
        #: end of the last interval credited as useful per GPU: credits never overlap in time
        #: (a cumulative bound alone lets a GPU idle early on be credited twice later)
        self.credited_until: list[float] = [0.0] * num_gpus
        self.tenures = 0

    def ready_time(self, gpus: tuple[int, ...], now: float) -> float:
        """Earliest time all of ``gpus`` are physically free."""
        return max([now, *(self.free_at[g] for g in gpus)])

    def begin(self, gpus: tuple[int, ...], who: str, start: float) -> None:
        """``who`` occupies ``gpus`` from ``start``; raise if someone is still there."""
        for g in gpus:
            cur = self.current[g]
            if cur is not None and (cur.end is None or cur.end > start + _EPS):
                raise PhysicsViolation(
                    f"GPU {g}: {who} starts at {start:.3f} while {cur.who} still occupies it "
                    f"(until {cur.end})"
                )
            if start + _EPS < self.free_at[g]:
                raise PhysicsViolation(
                    f"GPU {g}: {who} starts at {start:.3f} before it is free ({self.free_at[g]})"
                )
            self.current[g] = Tenure(who, start, None)
        self.tenures += 1

    def end(self, gpus: tuple[int, ...], who: str, end: float) -> None:
        """``who`` leaves ``gpus`` at ``end`` (may be in the future: a sleep in progress); not
        before the compute credited to it (credits lie inside their tenure, so everything
        credited after this tenure began is ``who``'s)."""
        for g in gpus:
            cur = self.current[g]
            if cur is None or cur.who != who or cur.end is not None:
                raise PhysicsViolation(f"GPU {g}: {who} leaves but the tenant is {cur}")
            if end + _EPS < cur.start:
                raise PhysicsViolation(f"GPU {g}: {who} leaves at {end} before it came")
            if end + _EPS < self.credited_until[g]:
                raise PhysicsViolation(
                    f"GPU {g}: {who} leaves at {end:.3f} but is credited until "
                    f"{self.credited_until[g]:.3f}"
                )
            self.current[g] = Tenure(who, cur.start, end)
            self.free_at[g] = end
            self.tenured[g] += end - cur.start

    def occupant(self, gpu: int) -> str | None:
        cur = self.current[gpu]
        return None if cur is None or cur.end is not None else cur.who

    def add_useful(
        self, gpus: tuple[int, ...], who: str, seconds: float, at: float, until: float | None = None
    ) -> None:
        """Credit useful compute to ``gpus``; the tenant must be ``who`` (no GPU serves two).

        The credit must lie inside ``who``'s tenure (from its start to its end, once closed).
        With ``until``, the credit covers ``[at, until)``, holds at most ``until - at``
        seconds, and must not overlap an interval credited before on the same GPU (100% per
        GPU at every instant, not only cumulatively).
        """
        if seconds < -_EPS:
            raise PhysicsViolation(f"{who}: negative useful time {seconds}")
        if until is not None and until + _EPS < at:
            raise PhysicsViolation(f"{who}: credit interval [{at}, {until}) ends before it starts")
        if until is not None and seconds > until - at + _EPS:
            raise PhysicsViolation(
                f"{who}: {seconds:.3f} useful s in [{at:.3f}, {until:.3f}) (> 100% of the GPU)"
            )
        for g in gpus:
            cur = self.current[g]
            if cur is None or cur.who != who or (cur.end is not None and cur.end < at - _EPS):
                raise PhysicsViolation(f"GPU {g}: {who} computes at {at:.3f}; tenant is {cur}")
            if at + _EPS < cur.start:
                raise PhysicsViolation(
                    f"GPU {g}: {who} computes from {at:.3f}, before its tenure began "
                    f"({cur.start:.3f})"
                )
            if until is not None and cur.end is not None and until > cur.end + _EPS:
                raise PhysicsViolation(
                    f"GPU {g}: {who} computes until {until:.3f}, after its tenure ended "
                    f"({cur.end:.3f})"
                )
            if until is not None and seconds > _EPS:
                if at + _EPS < self.credited_until[g]:
                    raise PhysicsViolation(
                        f"GPU {g}: {who} credited from {at:.3f}, but it was already credited "
                        f"until {self.credited_until[g]:.3f} (two computations at once)"
                    )
                self.credited_until[g] = max(self.credited_until[g], until)
            self.useful[g] += seconds

    def check_bounds(self, horizon: float) -> None:
        """Utilisation per GPU never above 100% of the elapsed time."""
        for g in range(self.num_gpus):
            if self.useful[g] > horizon + 1e-3:
                raise PhysicsViolation(
                    f"GPU {g}: {self.useful[g]:.3f} useful GPU-s in {horizon:.3f} s (> 100%)"
                )


class TrajectoryCounter:
    """Every trajectory is generated exactly once and consumed by exactly one step."""

    def __init__(self) -> None:
        self.created = 0
        self.completed: set[int] = set()
        self.consumed = 0
        self.aborted = 0
        #: generation work (solo-seconds) lost to aborts: regenerated tokens + re-prefills
        self.lost_s = 0.0
        #: running requests moved to a newly active shard, and their re-prefill solo-seconds
        self.migrated = 0
        self.migration_s = 0.0
        #: GPU-seconds those solo-seconds (lost work + migration re-prefills) keep GPUs busy
        #: (``tp / n_sat`` per solo-second on any rank): credited, but not useful work
        self.wasted_gpu_s = 0.0

    def waste(self, solo_s: float, tp: int, n_sat: int) -> None:
        """``solo_s`` solo-seconds of generation served twice or re-prefilled on ``tp`` GPUs."""
        self.wasted_gpu_s += solo_s * tp / n_sat

    def create(self, n: int) -> range:
        ids = range(self.created, self.created + n)
        self.created += n
        return ids

    def complete(self, tid: int) -> None:
        if tid in self.completed:
            raise PhysicsViolation(f"trajectory {tid} generated twice")
        if not 0 <= tid < self.created:
            raise PhysicsViolation(f"trajectory {tid} was never created")
        self.completed.add(tid)

    def consume(self, n: int, done_for_step: int, batch: int) -> None:
        if done_for_step != batch or n != batch:
            raise PhysicsViolation(f"a step consumed {n} of {done_for_step} done, batch {batch}")
        self.consumed += n

    def check_final(self, expected: int) -> None:
        """At the end: exactly ``expected`` trajectories consumed, and every one created was
        generated and consumed (none left queued or running when its job finished)."""
        if (
            self.consumed != expected
            or len(self.completed) != self.consumed
            or self.created != self.consumed
        ):
            raise PhysicsViolation(
                f"trajectories: expected {expected} consumed, got {self.consumed}; "
                f"completed {len(self.completed)} of {self.created} created"
            )
