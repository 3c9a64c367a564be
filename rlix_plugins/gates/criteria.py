"""Pass criteria of a gate: each one printed with its measured value and verdict."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from rlix_plugins.coordinator.service.wire_log import PipelineWire
from rlix_plugins.gates.timeline import Interval, busy_share, double_ownership, pipeline_of


@dataclass(frozen=True, slots=True)
class CriterionResult:
    """One criterion: what it demands, what was measured, and whether it passed."""

    name: str
    requirement: str
    measured: str
    passed: bool


@dataclass(frozen=True, slots=True)
class GateResult:
    """Everything a gate decides; ``passed`` only when every criterion passed."""

    gate: int
    mode: str
    criteria: tuple[CriterionResult, ...]

    @property
    def passed(self) -> bool:
        return bool(self.criteria) and all(c.passed for c in self.criteria)

    def lines(self) -> list[str]:
        out = [f"gate {self.gate} ({self.mode})"]
        for c in self.criteria:
            verdict = "PASS" if c.passed else "FAIL"
            out.append(f"  [{verdict}] {c.name}: {c.measured} (required: {c.requirement})")
        out.append(f"gate {self.gate}: {'PASSED' if self.passed else 'FAILED'}")
        return out


@dataclass(frozen=True, slots=True)
class RunCount:
    """Steps one pipeline completed out of its target (``error`` when it failed)."""

    label: str
    steps_done: int
    steps_target: int
    error: str | None = None


@dataclass(frozen=True, slots=True)
class RequestCount:
    """One pipeline's request accounting (router + the pipeline's own ledger)."""

    label: str
    submitted: int
    completed: int
    duplicates: int
    lost: int
    aborted_returned: int
    short_samples: int
    redispatched: int
    #: the router's own counters: requests it accepted and completed (must be equal)
    router_requests: int
    router_completed: int


@dataclass(frozen=True, slots=True)
class WeightCheck:
    """One shard's engine-side weight version right after a sync, vs the trainer's."""

    label: str
    step: int
    dp_rank: int
    kind: str
    expected_version: int
    engine_version: int | None
    checksums_match: bool
    #: which parameters differ (:meth:`ChecksumDiff.describe`); empty when they match
    mismatch: str = ""
    #: how many parameters' checksums were compared (0: not recorded)
    params_compared: int = 0

    @property
    def ok(self) -> bool:
        return self.engine_version == self.expected_version and self.checksums_match


@dataclass(frozen=True, slots=True)
class ChecksumDiff:
    """Trainer's parameter checksums vs an engine's, by exact name."""

    #: in the trainer's, absent from the engine's
    missing: tuple[str, ...]
    #: in the engine's, not in the trainer's
    extra: tuple[str, ...]
    #: in both, with different checksums
    different: tuple[str, ...]
    #: parameters present on both sides
    compared: int

    @property
    def ok(self) -> bool:
        # Nothing compared proves nothing: an empty answer is no match.
        return self.compared > 0 and not (self.missing or self.extra or self.different)

    def describe(self, limit: int = 5) -> str:
        """``missing [...]; extra [...]; different [...]`` (at most ``limit`` names each)."""
        parts = []
        for what, names in (("missing", self.missing), ("extra", self.extra),
                            ("different", self.different)):
            if names:
                more = f" (+{len(names) - limit} more)" if len(names) > limit else ""
                parts.append(f"{what} {list(names[:limit])}{more}")
        if not parts and self.compared == 0:
            parts.append("no parameter compared")
        return "; ".join(parts)


def compare_checksums(expected: Mapping[str, str], actual: Mapping[str, str]) -> ChecksumDiff:
    """Compare the exact name sets and every value (a name on one side only never passes)."""
    return ChecksumDiff(
        missing=tuple(sorted(set(expected) - set(actual))),
        extra=tuple(sorted(set(actual) - set(expected))),
        different=tuple(sorted(n for n in expected if n in actual and actual[n] != expected[n])),
        compared=len(set(expected) & set(actual)),
    )


def reactivations(events: Sequence[tuple[str, int]], ranks: set[int]) -> int:
    """How many preemptions of ``ranks`` were followed by an expand of the same rank (a
    wake that no preemption preceded, e.g. the first one, counts for nothing)."""
    down: set[int] = set()
    count = 0
    for kind, rank in events:
        if rank not in ranks:
            continue
        if kind == "preempt":
            down.add(rank)
        elif kind == "expand" and rank in down:
            down.discard(rank)
            count += 1
    return count


def no_double_ownership(
    name: str, intervals: Sequence[Interval], *, source: str, tolerance_s: float = 0.0
) -> CriterionResult:
    """No GPU used by two owners (cluster ids: a pipeline's stage) at once."""
    overlaps = double_ownership(intervals, tolerance_s=tolerance_s)
    gpus = sorted({iv.gpu for iv in intervals})
    if overlaps:
        o = overlaps[0]
        measured = (f"{len(overlaps)} overlap(s) in {source}; first on GPU {o.gpu}: "
                    f"{o.first.owner}/{o.first.stage} and {o.second.owner}/{o.second.stage} for "
                    f"{min(o.first.end, o.second.end) - o.second.start:.3f}s")
    else:
        measured = f"0 overlaps in {len(intervals)} intervals of {source} (GPUs {gpus})"
    return CriterionResult(name, "no GPU held by two pipelines' stages at once",
                           measured, not overlaps and bool(intervals))


def steps_completed(runs: Sequence[RunCount]) -> CriterionResult:
    """Every pipeline finished all its steps without error."""
    parts = [f"{r.label} {r.steps_done}/{r.steps_target}" + (f" ({r.error})" if r.error else "")
             for r in runs]
    ok = bool(runs) and all(r.error is None and r.steps_done == r.steps_target for r in runs)
    return CriterionResult("steps", "every pipeline completes its steps", "; ".join(parts), ok)


def weights_current(checks: Sequence[WeightCheck]) -> CriterionResult:
    """After every sync each synced shard reports the trainer's version and its bytes."""
    bad = [c for c in checks if not c.ok]
    kinds = sorted({c.kind for c in checks})
    if bad:
        b = bad[0]
        measured = (f"{len(bad)}/{len(checks)} checks failed; first: {b.label} step {b.step} "
                    f"shard {b.dp_rank} ({b.kind}) engine v{b.engine_version} vs trainer "
                    f"v{b.expected_version}, checksums "
                    f"{'ok' if b.checksums_match else 'differ'}"
                    + (f" ({b.mismatch})" if b.mismatch else ""))
    else:
        measured = f"{len(checks)} shard checks after syncs ({', '.join(kinds)}), all current"
    return CriterionResult(
        "weights", "after each sync every active shard serves the trainer's current version "
        "(engine version + parameter checksums)", measured, bool(checks) and not bad)


def requests_accounted(counts: Sequence[RequestCount]) -> CriterionResult:
    """submitted == completed in the pipeline's ledger and in the router's counters, no
    duplicate, no lost, no aborted or truncated sample."""
    parts = []
    ok = bool(counts)
    for c in counts:
        parts.append(f"{c.label}: {c.completed}/{c.submitted} completed, {c.duplicates} dup, "
                     f"{c.lost} lost, {c.aborted_returned} aborted, {c.short_samples} short, "
                     f"{c.redispatched} re-dispatched; router {c.router_completed}/"
                     f"{c.router_requests} completed")
        ok = ok and (c.submitted == c.completed and c.submitted > 0 and c.duplicates == 0
                     and c.lost == 0 and c.aborted_returned == 0 and c.short_samples == 0
                     and c.router_requests == c.router_completed and c.router_requests > 0)
    return CriterionResult("requests", "zero lost or duplicated requests (submitted == "
                           "completed in the ledger and the router's counters, no "
                           "aborted/truncated sample)", "; ".join(parts), ok)


@dataclass(frozen=True, slots=True)
class IdleShare:
    """GPU idle share of one run: 1 - busy GPU-seconds / (num_gpus x window)."""

    busy_share: float
    window_s: float
    num_gpus: int

    @property
    def idle_share(self) -> float:
        return 1.0 - self.busy_share


def measure_idle(busy: Sequence[Interval], num_gpus: int, start: float, end: float) -> IdleShare:
    """Idle share of ``busy`` intervals over ``[start, end]`` (see docs/gates.md)."""
    return IdleShare(busy_share(busy, num_gpus, start, end), end - start, num_gpus)


def idle_below_exclusive(shared: IdleShare, exclusive: IdleShare) -> CriterionResult:
    """Time-sharing leaves less GPU time idle than exclusive allocation of the same work.

    A run without busy evidence (no busy interval, no busy sample: 100% idle) fails the
    criterion instead of serving as a baseline that anything beats.
    """
    measured = (f"shared idle {shared.idle_share:.1%} over {shared.window_s:.1f}s vs exclusive "
                f"idle {exclusive.idle_share:.1%} over {exclusive.window_s:.1f}s")
    empty = [run for run, share in (("shared", shared), ("exclusive", exclusive))
             if share.window_s > 0 and share.busy_share <= 0]
    if empty:
        measured += f"; no busy evidence in the {' and the '.join(empty)} run"
    return CriterionResult("idle_share", "GPU idle share below the exclusive-allocation run",
                           measured, shared.window_s > 0 and exclusive.window_s > 0
                           and not empty and shared.idle_share < exclusive.idle_share)


def time_sharing(coordinator: Sequence[Interval], gate: int) -> CriterionResult:
    """Gates 2 and 3: at least one GPU held by two pipelines in turn (coordinator trace)."""
    owners: dict[int, set[str]] = {}
    for iv in coordinator:
        owners.setdefault(iv.gpu, set()).add(pipeline_of(iv.owner))
    shared_gpus = sorted(g for g, p in owners.items() if len(p) >= 2)
    per_gpu = "; ".join(f"GPU {g}: {len(owners[g])} pipeline(s)" for g in sorted(owners))
    desc = "both NeMo RL pipelines" if gate == 2 else "the NeMo RL and the ROLL pipeline"
    return CriterionResult(
        "time_sharing", f"GPUs used by {desc} in turn (coordinator trace; >= 1 GPU)",
        f"{per_gpu or 'no GPU in the trace'}; shared: {shared_gpus}", bool(shared_gpus))


#: RLix's own wire classes, as the coordinator unpickles them (real RLix or its stand-in)
RLIX_PRIORITY_CLASS = "rlix.protocol.types.Priority"
ROLL_PROTOCOL_REQUIREMENT = (
    "the coordinator received the ROLL pipeline's calls in RLix's own classes and refused "
    "none: every priority an rlix.protocol.types.Priority, a GENERATION request per step "
    "(ROLL asks once per step), ACTOR_TRAINING >= 1, >= 1 progress report, >= 1 release"
)


def roll_generation_requests(wire: Mapping[str, PipelineWire]) -> int:
    """GENERATION requests of the ROLL pipeline (the one that sent RLix's own ``Priority``
    class; ROLL asks once per step): its steps as the coordinator saw them (the most of
    several such pipelines, 0 without one)."""
    return max((w.requested("GENERATION") for w in wire.values()
                if RLIX_PRIORITY_CLASS in w.priority_classes), default=0)


def roll_protocol(wire: Mapping[str, PipelineWire], *, expected: int = 1,
                  steps: int = 1, sender_module: str | None = None) -> CriterionResult:
    """Gate 3: the ROLL pipeline's protocol, judged from the coordinator's wire log.

    ROLL pipelines are the ones that sent RLix's own ``Priority`` class (ours send ours);
    exactly ``expected`` must be found, each with at least ``steps`` GENERATION requests.
    ``sender_module``: the module the rehearsal's ROLL stand-in built its reports from (its
    reports reach the scheduler through our pipeline coordinator, which forwards its own
    class); it must be ``rlix.protocol.types``."""
    rolls = sorted(pid for pid, w in wire.items() if RLIX_PRIORITY_CLASS in w.priority_classes)
    gaps: list[str] = []
    if len(rolls) != expected:
        gaps.append(f"{len(rolls)} pipeline(s) sent RLix's Priority class, expected {expected}")
    for pid in rolls:
        w = wire[pid]
        foreign = sorted(c for c in w.priority_classes if c != RLIX_PRIORITY_CLASS)
        if foreign:
            gaps.append(f"{pid}: priorities also of {foreign}")
        if w.requested("GENERATION") < steps:
            gaps.append(f"{pid}: {w.requested('GENERATION')} GENERATION requests for "
                        f"{steps} step(s)")
        if not w.requested("ACTOR_TRAINING"):
            gaps.append(f"{pid}: no ACTOR_TRAINING request")
        if not w.calls.get("report_progress"):
            gaps.append(f"{pid}: no progress report received")
        if not (w.calls.get("notify_release_gpus")
                or w.calls.get("notify_release_then_request_gpus")):
            gaps.append(f"{pid}: no release received")
        if w.failures:
            gaps.append(f"{pid}: refused or failed calls {dict(sorted(w.failures.items()))}")
    if sender_module is not None and sender_module != "rlix.protocol.types":
        gaps.append(f"the ROLL stand-in built its reports from {sender_module or 'nothing'}")
    measured = "; ".join(
        f"{pid}: {sum(wire[pid].calls.values())} calls "
        f"({', '.join(f'{m} {n}' for m, n in sorted(wire[pid].calls.items()))}), reports of "
        f"{sorted(wire[pid].report_classes)}" for pid in rolls) or "no ROLL pipeline"
    return CriterionResult("roll_protocol", ROLL_PROTOCOL_REQUIREMENT,
                           measured + ("; " + "; ".join(gaps) if gaps else ""), not gaps)
