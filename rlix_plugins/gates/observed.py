"""The weights, requests, ownership and memory criteria judged from the jobs' observation records.

GPU mode reads them from ``{--out}/observe`` (``RLIX_OBSERVE_DIR`` of the jobs it launched);
the CPU rehearsals write the same records and are judged by the same functions, so this code
runs in CI. Records come from :mod:`rlix_plugins.adapters.observability`.

Weights, per record (a sync event of one pipeline):

* every shard the event synced and that is active now serves exactly ``trainer_version``;
* every other active shard serves ``trainer_version`` too, with one exception: it may still
  serve an OLDER version when an active refresh of that pipeline to ``trainer_version`` or
  newer is recorded later (an expand that lands between the cache build and the refresh of
  the same step syncs the new version into the woken shard first; the refresh follows);
* no active shard reports an unknown version (None) or one newer than the trainer's.

Requests, per pipeline: the last record of every router copy, summed: no request lost, none
duplicated, none still in flight at the copy's last record, completed == submitted - cancelled
(a request its caller cancelled is reported, not counted as lost), and > 0 requests completed.

Memory (GPU-mode gate 1), per training release: the training GPUs' memory in use, read by the
hooks right before the release (after the host's offload and NCCL destroy, the shards on
those GPUs asleep), below the gate's limit; one record per release of each pipeline.

No records at all = FAILED "not observed".
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rlix_plugins.adapters.observability import (
    BusyObserved,
    LifecycleObserved,
    ObservationError,
    Observations,
    RouterCountersObserved,
    ShardVersionsObserved,
    read_observations,
)
from rlix_plugins.gates.criteria import CriterionResult, no_double_ownership, reactivations
from rlix_plugins.gates.timeline import Interval
from rlix_plugins.protocol.names import ACTOR_INFER, ACTOR_TRAIN

WEIGHTS_REQUIREMENT = ("after each sync every active shard serves the trainer's current "
                       "version (engine-reported, from the jobs' records)")
OWNERSHIP_REQUIREMENT = ("no GPU used by two pipelines' stages at once (the jobs' own records "
                         "of when each shard had requests running and each train step held "
                         "its GPUs)")
GIB = 1 << 30
#: gate 1's limit on the training GPU after sleep(2) + NCCL destroy (gates/nemo_rl_gate1.yaml)
MEMORY_LIMIT_BYTES = 2 * GIB
REQUESTS_REQUIREMENT = ("zero lost or duplicated requests (router bookkeeping from the jobs' "
                        "records: completed == submitted - cancelled, none in flight at the end)")


@dataclass(frozen=True, slots=True)
class StaleShard:
    """One shard whose reported version broke the weights rule."""

    label: str
    pipeline_id: str
    event: str
    step: int | None
    dp_rank: int
    served: int | None
    trainer_version: int
    synced: bool

    def describe(self) -> str:
        step = "" if self.step is None else f" step {self.step}"
        how = "synced" if self.synced else "active"
        served = "no version" if self.served is None else f"v{self.served}"
        return (f"{self.label}{self.pipeline_id}{step} after {self.event}: {how} shard "
                f"{self.dp_rank} serves {served}, trainer v{self.trainer_version}")


def _label(label: str) -> str:
    return f"{label}/" if label else ""


def stale_shards(
    label: str, records: Sequence[ShardVersionsObserved]
) -> tuple[int, list[StaleShard]]:
    """(shard checks made, failures) over one run's records (file order per pipeline)."""
    by_pipeline: dict[str, list[ShardVersionsObserved]] = defaultdict(list)
    for rec in records:
        by_pipeline[rec.pipeline_id].append(rec)
    checks = 0
    bad: list[StaleShard] = []
    for pid, recs in by_pipeline.items():
        for i, rec in enumerate(recs):
            refreshed_later = any(
                later.event == "refresh" and later.trainer_version >= rec.trainer_version
                for later in recs[i + 1:])
            for rank, served in sorted(rec.shard_versions.items()):
                checks += 1
                synced = rank in rec.synced
                ok = served == rec.trainer_version or (
                    not synced and served is not None and served < rec.trainer_version
                    and refreshed_later)
                if not ok:
                    bad.append(StaleShard(_label(label), pid, rec.event, rec.step, rank, served,
                                          rec.trainer_version, synced))
    return checks, bad


def weights_from_records(
    runs: Sequence[tuple[str, Observations]], *, name: str = "weights",
    expected_pipelines: int | None = None,
) -> CriterionResult:
    """The weights criterion from ``(label, observations)`` of one or more runs."""
    checks = 0
    bad: list[StaleShard] = []
    events: dict[str, int] = defaultdict(int)
    pipelines: set[str] = set()
    records = 0
    for label, obs in runs:
        n, b = stale_shards(label, obs.shard_versions)
        checks += n
        bad.extend(b)
        records += len(obs.shard_versions)
        pipelines.update(r.pipeline_id for r in obs.shard_versions)
        for r in obs.shard_versions:
            events[r.event] += 1
    where = ", ".join(str(o.directory) for _, o in runs)
    if not records:
        return CriterionResult(name, WEIGHTS_REQUIREMENT,
                               f"not observed: no shard-version records in {where}", False)
    ev = ", ".join(f"{k} {v}" for k, v in sorted(events.items()))
    measured = (f"{checks} engine-reported shard versions in {records} sync records ({ev}) of "
                f"{len(pipelines)} pipeline(s)")
    gaps = _coverage_gaps(
        [(label, {r.pipeline_id for r in obs.shard_versions}) for label, obs in runs],
        expected_pipelines, "shard-version")
    missing = bool(gaps)
    if missing:
        measured += "; " + "; ".join(gaps)
    if bad:
        measured += f"; {len(bad)} stale, first: {bad[0].describe()}"
    else:
        measured += ", all current"
    return CriterionResult(name, WEIGHTS_REQUIREMENT, measured,
                           checks > 0 and not bad and not missing)


@dataclass(frozen=True, slots=True)
class RequestTotals:
    """Sum over a pipeline's router copies (each copy's last record)."""

    label: str
    pipeline_id: str
    copies: int
    submitted: int
    completed: int
    lost: int
    duplicated: int
    cancelled: int
    in_flight: int
    redispatched: int

    @property
    def ok(self) -> bool:
        return (self.completed > 0 and self.lost == 0 and self.duplicated == 0
                and self.in_flight == 0 and self.completed == self.submitted - self.cancelled)

    def describe(self) -> str:
        return (f"{self.label}{self.pipeline_id}: {self.completed}/{self.submitted} completed, "
                f"{self.lost} lost, {self.duplicated} dup, {self.in_flight} in flight at the "
                f"end, {self.cancelled} cancelled by the caller, {self.redispatched} "
                f"re-dispatched ({self.copies} router cop{'y' if self.copies == 1 else 'ies'})")


def request_totals(label: str, records: Sequence[RouterCountersObserved]) -> list[RequestTotals]:
    """Per pipeline: the last record of each router copy, summed."""
    last: dict[tuple[str, str], RouterCountersObserved] = {}
    for rec in records:  # file order: a later line of a copy supersedes the earlier ones
        key = (rec.pipeline_id, rec.copy_id)
        prev = last.get(key)
        if prev is None or (rec.submitted, rec.time) >= (prev.submitted, prev.time):
            last[key] = rec
    by_pipeline: dict[str, list[RouterCountersObserved]] = defaultdict(list)
    for (pid, _), rec in sorted(last.items()):
        by_pipeline[pid].append(rec)
    return [
        RequestTotals(
            _label(label), pid, len(recs), sum(r.submitted for r in recs),
            sum(r.completed for r in recs), sum(r.lost for r in recs),
            sum(r.duplicated for r in recs), sum(r.cancelled for r in recs),
            sum(r.in_flight for r in recs), sum(r.redispatched for r in recs))
        for pid, recs in sorted(by_pipeline.items())
    ]


def requests_from_records(
    runs: Sequence[tuple[str, Observations]], *, name: str = "requests",
    expected_pipelines: int | None = None,
) -> CriterionResult:
    """The requests criterion from ``(label, observations)`` of one or more runs."""
    totals = [t for label, obs in runs for t in request_totals(label, obs.router_counters)]
    where = ", ".join(str(o.directory) for _, o in runs)
    if not totals:
        return CriterionResult(name, REQUESTS_REQUIREMENT,
                               f"not observed: no router-counter records in {where}", False)
    gaps = _coverage_gaps(
        [(label, {r.pipeline_id for r in obs.router_counters}) for label, obs in runs],
        expected_pipelines, "router-counter")
    missing = bool(gaps)
    measured = "; ".join(t.describe() for t in totals)
    if missing:
        measured += "; " + "; ".join(gaps)
    return CriterionResult(name, REQUESTS_REQUIREMENT, measured,
                           all(t.ok for t in totals) and not missing)


def _read_run(directory: Path, name: str, requirement: str) -> Observations | CriterionResult:
    """One run's records, or the criterion FAILED with the reader's message (file, line)."""
    try:
        return read_observations(directory)
    except ObservationError as exc:
        return CriterionResult(name, requirement, f"unreadable records: {exc}", False)


def ownership_from_records(directory: Path, *, expected_pipelines: int | None = None,
                           name: str = "ownership_observed") -> CriterionResult:
    """No GPU used by two pipelines' stages at once, judged from the jobs' own busy records
    (generation shards with requests running, train steps between grant and release) of ONE
    run: evidence independent of the coordinator's bookkeeping. No records, or records of
    fewer pipelines than expected, fail."""
    obs = _read_run(directory, name, OWNERSHIP_REQUIREMENT)
    if isinstance(obs, CriterionResult):
        return obs
    intervals = [
        Interval(g, f"{r.pipeline_id}_{ACTOR_INFER if r.stage == 'generation' else ACTOR_TRAIN}",
                 r.stage, r.start, r.end)
        for r in obs.busy for g in r.gpus
    ]
    result = no_double_ownership(name, intervals,
                                 source=f"the jobs' busy records in {directory}")
    stages = {(r.pipeline_id, r.stage) for r in obs.busy}
    pipelines = {p for p, _ in stages}
    gaps = []
    if expected_pipelines is not None and len(pipelines) < expected_pipelines:
        gaps.append(f"busy records of {len(pipelines)} of {expected_pipelines} pipelines")
    untrained = sorted(p for p in pipelines if (p, "train") not in stages)
    if untrained:
        gaps.append(f"no train records of {untrained}")
    ungenerated = sorted(p for p in pipelines if (p, "generation") not in stages)
    if ungenerated:
        gaps.append(f"no generation records of {ungenerated}")
    measured = result.measured + ("; " + "; ".join(gaps) if gaps else "")
    return CriterionResult(name, OWNERSHIP_REQUIREMENT, measured, result.passed and not gaps)


def train_steps_from_records(directory: Path) -> dict[str, int]:
    """Train steps each pipeline recorded in ONE run, by pipeline id: one train busy record
    per step (the hooks write it at each release of the training GPUs; the overlap and memory
    criteria count steps and releases the same way). Evidence that a job trained, which its
    exit code is not.

    Raises:
        ObservationError: a record is unreadable (names the file and line).
    """
    obs = read_observations(directory)
    return dict(Counter(b.pipeline_id for b in obs.busy if b.stage == "train"))


def memory_requirement(limit_bytes: int) -> str:
    return (f"training GPUs below {limit_bytes / GIB:g} GiB in use (every process, NVML) at "
            "each release, after the shards' sleep and the NCCL destroy (the jobs' records)")


def memory_from_records(directory: Path, *, limit_bytes: int = MEMORY_LIMIT_BYTES,
                        expected_pipelines: int | None = None,
                        name: str = "memory_released") -> CriterionResult:
    """Every training release of ONE run measured (one memory record per train busy record of
    the pipeline), every reading present and below ``limit_bytes``. No records, a reading
    that failed, or fewer records than releases fail."""
    requirement = memory_requirement(limit_bytes)
    obs = _read_run(directory, name, requirement)
    if isinstance(obs, CriterionResult):
        return obs
    if not obs.memory:
        return CriterionResult(name, requirement, f"not observed: no memory records in "
                               f"{directory} (RLIX_OBSERVE_GPU_MEMORY=1 unset?)", False)
    problems: list[str] = []
    readings: list[tuple[int, str]] = []  # (bytes, where)
    for rec in obs.memory:
        for gpu, used in zip(rec.gpus, rec.used_bytes, strict=True):
            where = f"{rec.pipeline_id} step {rec.step} GPU {gpu}"
            if used is None:
                problems.append(f"{where} not read: {rec.error}")
            else:
                readings.append((used, where))
                if used >= limit_bytes:
                    problems.append(f"{where}: {used / GIB:.2f} GiB")
    releases = Counter(b.pipeline_id for b in obs.busy if b.stage == "train")
    measured_per = Counter(rec.pipeline_id for rec in obs.memory)
    for pid, n in sorted(releases.items()):
        got = measured_per[pid]
        if got < n:
            problems.append(f"{pid}: {got} memory records for {n} releases")
    if expected_pipelines is not None and len(measured_per) < expected_pipelines:
        problems.append(f"memory records of {len(measured_per)} of {expected_pipelines} "
                        "pipelines")
    measured = (f"{len(readings)} readings in {len(obs.memory)} releases of "
                f"{len(measured_per)} pipeline(s)")
    if readings:
        top, where = max(readings)
        measured += f", max {top / GIB:.2f} GiB ({where})"
    if problems:
        measured += f"; {len(problems)} problem(s), first: {problems[0]}"
    return CriterionResult(name, requirement, measured, bool(readings) and not problems)


OVERLAP_REQUIREMENT = (
    "the shard on the training GPUs preempted for a train step and woken+synced+activated "
    "again after it (>= 1 cycle; every preemption but the last followed by a wake); the NCCL "
    "groups destroyed before every release of the training GPUs and re-initialised in every "
    "step that follows a destroy (the jobs' records)")


@dataclass(frozen=True, slots=True)
class OverlapCycle:
    """One pipeline's overlap cycle as its records show it."""

    pipeline_id: str
    train_steps: int
    overlap_ranks: tuple[int, ...]
    preemptions: int
    for_training: int
    reactivations: int
    destroys_missing: int
    reinits_missing: int

    @property
    def ok(self) -> bool:
        return (self.for_training >= 1 and self.reactivations >= 1
                and self.reactivations >= self.preemptions - 1
                and self.destroys_missing == 0 and self.reinits_missing == 0)

    def describe(self) -> str:
        return (f"{self.pipeline_id}: overlap shard(s) {list(self.overlap_ranks)}: "
                f"{self.preemptions} preemptions ({self.for_training} before a train step), "
                f"{self.reactivations} followed by wake+sync+activate; {self.train_steps} train "
                f"steps, {self.destroys_missing} without an NCCL destroy before the release, "
                f"{self.reinits_missing} without a re-init after an earlier destroy")


def overlap_cycle(pipeline_id: str, train: Sequence[BusyObserved],
                  lifecycle: Sequence[LifecycleObserved],
                  expands: Sequence[ShardVersionsObserved]) -> OverlapCycle:
    """Gate 1's overlap cycle of one pipeline from its records of ONE run.

    Overlap ranks: ranks whose shrink records name a GPU of a train busy record. A shrink of
    such a rank before its first expand is the host's setup (NeMo RL loads every shard, the
    first refit puts them to sleep), not a preemption for training. A preemption counts as
    for a train step when a train step on the rank's GPUs starts after it and before the
    rank's next expand. NCCL: every train step's interval (grant to release) holds a destroy,
    and every step after a destroy holds a re-init (the first step may use groups made at
    start-up)."""
    train = sorted(train, key=lambda b: b.start)
    train_gpus = {g for b in train for g in b.gpus}
    shrinks = [r for r in lifecycle if r.event == "shrink" and r.rank is not None]
    rank_gpus: dict[int, set[int]] = defaultdict(set)
    for r in shrinks:
        if r.rank is not None:
            rank_gpus[r.rank] |= set(r.gpus)
    overlap = {rank for rank, gpus in rank_gpus.items() if gpus & train_gpus}
    events: list[tuple[float, str, int]] = [(r.time, "preempt", r.rank) for r in shrinks
                                            if r.rank in overlap]
    events += [(e.time, "expand", rank) for e in expands if e.event == "expand"
               for rank in e.synced if rank in overlap]
    events.sort()
    seen_expand: set[int] = set()
    counted: list[tuple[float, str, int]] = []
    for t, kind, rank in events:
        if kind == "expand":
            seen_expand.add(rank)
        elif rank not in seen_expand:
            continue  # the host's setup sleep: the coordinator never woke this shard yet
        counted.append((t, kind, rank))
    preempts = [(t, rank) for t, kind, rank in counted if kind == "preempt"]
    for_training = 0
    for t, rank in preempts:
        nxt = min((t2 for t2, k2, r2 in counted if k2 == "expand" and r2 == rank and t2 > t),
                  default=float("inf"))
        if any(t <= b.start < nxt and set(b.gpus) & rank_gpus[rank] for b in train):
            for_training += 1
    destroys = sorted(r.time for r in lifecycle if r.event == "nccl_destroy")
    reinits = sorted(r.time for r in lifecycle if r.event == "nccl_reinit")
    nccl = sorted((r.time, r.event) for r in lifecycle if r.event != "shrink")

    def ends_destroyed(b: BusyObserved) -> bool:
        """The step's last NCCL event before its release is a destroy (a re-init after the
        destroy would leave the groups alive on released GPUs)."""
        inside = [e for t, e in nccl if b.start <= t <= b.end]
        return bool(inside) and inside[-1] == "nccl_destroy"

    destroys_missing = sum(1 for b in train if not ends_destroyed(b))
    reinits_missing = sum(1 for b in train
                          if any(t < b.start for t in destroys)
                          and not any(b.start <= t <= b.end for t in reinits))
    return OverlapCycle(pipeline_id, len(train), tuple(sorted(overlap)), len(preempts),
                        for_training, reactivations([(k, r) for _, k, r in counted], overlap),
                        destroys_missing, reinits_missing)


def overlap_from_records(directory: Path, *, steps: int | None = None,
                         expected_pipelines: int | None = None,
                         name: str = "overlap_cycle") -> CriterionResult:
    """:func:`overlap_cycle` of every pipeline with train records in ``directory`` (one run);
    fewer train steps than ``steps``, no overlap shard or fewer pipelines than expected fail."""
    obs = _read_run(directory, name, OVERLAP_REQUIREMENT)
    if isinstance(obs, CriterionResult):
        return obs
    pipelines = sorted({b.pipeline_id for b in obs.busy if b.stage == "train"})
    if not pipelines:
        return CriterionResult(name, OVERLAP_REQUIREMENT,
                               f"not observed: no train records in {directory}", False)
    cycles = [overlap_cycle(
        pid, [b for b in obs.busy if b.pipeline_id == pid and b.stage == "train"],
        [r for r in obs.lifecycle if r.pipeline_id == pid],
        [r for r in obs.shard_versions if r.pipeline_id == pid]) for pid in pipelines]
    gaps = [f"{c.pipeline_id}: {c.train_steps} of {steps} train steps recorded"
            for c in cycles if steps is not None and c.train_steps < steps]
    gaps += [f"{c.pipeline_id}: no shard on its training GPUs was ever shrunk"
             for c in cycles if not c.overlap_ranks]
    if expected_pipelines is not None and len(cycles) < expected_pipelines:
        gaps.append(f"train records of {len(cycles)} of {expected_pipelines} pipelines")
    measured = "; ".join(c.describe() for c in cycles) + (
        "; " + "; ".join(gaps) if gaps else "")
    return CriterionResult(name, OVERLAP_REQUIREMENT, measured,
                           all(c.ok for c in cycles) and not gaps)


def _coverage_gaps(
    runs: Sequence[tuple[str, set[str]]], expected_pipelines: int | None, kind: str
) -> list[str]:
    """What is missing run by run: every run (the shared one and its exclusive baseline,
    which use the same pipeline ids) must have records of its own, of every pipeline, so
    records of one run never stand in for another that wrote none."""
    gaps = []
    for label, pipelines in runs:
        run = label or "the run"
        if not pipelines:
            gaps.append(f"no {kind} records of {run}")
        elif expected_pipelines is not None and len(pipelines) < expected_pipelines:
            gaps.append(f"{run}: records of {len(pipelines)} of {expected_pipelines} pipelines")
    return gaps


def observed_criteria(
    runs: Sequence[tuple[str, Path]], *, expected_pipelines: int | None = None,
    names: tuple[str, str] = ("weights", "requests"),
) -> list[CriterionResult]:
    """Both criteria from ``(label, directory)`` pairs; an unreadable record fails both with
    the reader's message (file and line)."""
    try:
        loaded = [(label, read_observations(d)) for label, d in runs]
    except ObservationError as exc:
        return [CriterionResult(names[0], WEIGHTS_REQUIREMENT, f"unreadable records: {exc}",
                                False),
                CriterionResult(names[1], REQUESTS_REQUIREMENT, f"unreadable records: {exc}",
                                False)]
    return [weights_from_records(loaded, name=names[0], expected_pipelines=expected_pipelines),
            requests_from_records(loaded, name=names[1], expected_pipelines=expected_pipelines)]


__all__ = [
    "MEMORY_LIMIT_BYTES",
    "OverlapCycle",
    "RequestTotals",
    "StaleShard",
    "memory_from_records",
    "observed_criteria",
    "overlap_cycle",
    "overlap_from_records",
    "ownership_from_records",
    "request_totals",
    "requests_from_records",
    "stale_shards",
    "train_steps_from_records",
    "weights_from_records",
]
