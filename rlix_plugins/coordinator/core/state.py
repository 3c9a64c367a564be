"""Allocation state of the scheduling core and the events that change it.

Pure: no Ray, no clock, no I/O. Time enters only as the ``now`` argument. Every event method
validates its input first and raises a typed error with the state unchanged; only then does it
mutate. GPUs are assigned ONLY by :meth:`SchedulerState.commit` of a plan, and plans are computed
and committed one at a time, so the events that may interleave between a plan and its commit
(registrations, releases, progress, new requests, deaths) can only free GPUs, never take them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field

from rlix_plugins.coordinator.core.model import (
    ClusterSpec,
    GpuOwner,
    PendingRequest,
    PipelineSpec,
    Topology,
)
from rlix_plugins.coordinator.core.plan import Plan
from rlix_plugins.errors import (
    OwnershipError,
    RegistrationError,
    RequestStateError,
    RunOverError,
    UnknownClusterError,
    UnknownPipelineError,
)
from rlix_plugins.protocol.names import parse_cluster_id, validate_pipeline_id
from rlix_plugins.protocol.types import Priority, ProgressReport
from rlix_plugins.values import is_int

StreamKey = tuple[str, str | None]


@dataclass(frozen=True, slots=True)
class ImmediateGrant:
    """A request that is already satisfied when it arrives (no planning needed)."""

    cluster_id: str
    gpus: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class CommitResult:
    """What a commit actually did (items whose preconditions vanished are skipped)."""

    granted: dict[str, tuple[int, ...]] = field(default_factory=dict)
    shrunk: tuple[tuple[str, int], ...] = ()
    expanded: tuple[tuple[str, int], ...] = ()
    released: tuple[str, ...] = ()
    #: pipelines whose part of the plan was skipped: the registration it was planned for
    #: no longer exists (unregistered, perhaps registered again under the same id)
    stale: tuple[str, ...] = ()


class SchedulerState:
    """Registry, GPU ownership, pending requests and demand of every pipeline."""

    def __init__(self, topology: Topology) -> None:
        self.topology = topology
        self.pipelines: dict[str, PipelineSpec] = {}
        self.clusters: dict[str, ClusterSpec] = {}
        self.owner: list[GpuOwner | None] = [None] * topology.num_gpus
        #: generation cluster -> {dp_rank: activated_at}
        self.active_ranks: dict[str, dict[int, float]] = {}
        #: whole-cluster holdings -> priority they were granted at
        self.holdings: dict[str, Priority] = {}
        #: whole-cluster holdings -> when they were granted (unknown after a restart)
        self.held_since: dict[str, float] = {}
        #: cluster -> how long its last completed holding lasted (grant to release): what the
        #: planner expects its next holding to last (an RL step repeats the same work)
        self.last_hold_s: dict[str, float] = {}
        self.pending: dict[str, PendingRequest] = {}
        #: generation clusters whose ranks must all be shrunk (``await_release_gpus``)
        self.planned_releases: dict[str, float] = {}
        self.progress: dict[str, dict[StreamKey, ProgressReport]] = {}
        #: step_target_estimate of a pipeline's last granted GENERATION request: its demand
        #: until it reports progress (so a pipeline that never reports is still visible).
        self.estimates: dict[str, int] = {}
        #: active ranks committed while their expand (wake + sync) still runs, when the
        #: service commits a cycle once its shrinks are done and lets expands finish in the
        #: background (:meth:`commit` ``expands_pending``). Such a rank may be preempted for a
        #: training request (the shrink then waits for the wake) but is not a rebalance donor
        #: until it serves (:meth:`expand_done`).
        self.warming: set[tuple[str, int]] = set()
        #: pipelines that failed and whose actors are being killed: what they hold stays as it
        #: is (nobody can shrink their shards) until they are unregistered, and nothing is
        #: planned for them (:meth:`fence`)
        self.fenced: set[str] = set()
        #: pipelines whose training run has ended (:meth:`end_run`): no demand, their progress
        #: reports are ignored and their GENERATION requests refused until they unregister
        self.runs_over: set[str] = set()
        #: pipeline -> token of its current registration: unique within this state's life (a
        #: pipeline registered again under the same id gets a new one), so a plan names the
        #: registrations it was made for (:meth:`stamp`, :attr:`Plan.registrations`)
        self.registrations: dict[str, int] = {}
        #: generation cluster -> the first commit at which it wanted ranks (a pending GENERATION
        #: request or remaining demand) and had none; updated by :meth:`note_starving`. The
        #: planner forces such a cluster's guaranteed rank once it has waited
        #: ``PolicyConfig.starve_after_s`` (a starvation guard for shares that never move).
        self.starving_since: dict[str, float] = {}
        self._registration_seq = 0
        self.revision = 0
        self._seq = 0

    # ------------------------------------------------------------------ lookups
    def cluster(self, cluster_id: object) -> ClusterSpec:
        """The registered cluster, or :class:`UnknownClusterError` / ProtocolError."""
        pipeline_id, _ = parse_cluster_id(cluster_id)
        assert isinstance(cluster_id, str)
        spec = self.clusters.get(cluster_id)
        if spec is None:
            known = "registered" if pipeline_id in self.pipelines else "not registered"
            raise UnknownClusterError(
                f"cluster {cluster_id!r} is not registered (pipeline {pipeline_id!r} is {known})"
            )
        return spec

    def pipeline(self, pipeline_id: str) -> PipelineSpec:
        """The registered pipeline; ProtocolError for a malformed id, else
        :class:`UnknownPipelineError` when it is not registered."""
        if not isinstance(pipeline_id, str):
            validate_pipeline_id(pipeline_id)  # raises (an unhashable id is no TypeError)
        spec = self.pipelines.get(pipeline_id)
        if spec is None:
            raise UnknownPipelineError(
                f"pipeline {pipeline_id!r} is not registered; registered: "
                f"{sorted(self.pipelines)[:20]}"
            )
        return spec

    def held_gpus(self, cluster_id: str) -> tuple[int, ...]:
        """GPUs a cluster holds now (whole grant or its active ranks), sorted."""
        spec = self.clusters[cluster_id]
        if cluster_id in self.holdings:
            return spec.gpus
        ranks = self.active_ranks.get(cluster_id, {})
        return tuple(g for r in sorted(ranks) for g in spec.rank_gpus(r))

    def demand(self, pipeline_id: str) -> int | None:
        """Remaining trajectories of a pipeline: progress streams, else its last estimate
        (0 once its run is over)."""
        if pipeline_id in self.runs_over:
            return 0
        streams = self.progress.get(pipeline_id)
        if streams:
            return sum(r.remaining for r in streams.values())
        pending = self.pending.get(f"{pipeline_id}_actor_infer")
        if pending is not None and pending.step_target_estimate is not None:
            return pending.step_target_estimate
        return self.estimates.get(pipeline_id)

    def collecting(self, pipeline_id: str) -> bool:
        """The pipeline reported remaining demand for its step: it is generating even when
        every rank it had was preempted (no pending request then)."""
        streams = self.progress.get(pipeline_id) or {}
        return any(r.remaining > 0 for r in streams.values())

    def outstanding(self, pipeline_id: str) -> int | None:
        """Requests a pipeline has admitted and not finished, over every step its staleness
        bound lets it generate (``outstanding`` progress metric); None when it reports none.

        An async pipeline generates for the next step while the oldest is still open, so its
        GPU need can exceed the oldest step's ``remaining``. Malformed values are ignored.
        """
        total: int | None = None
        for report in (self.progress.get(pipeline_id) or {}).values():
            if (n := report.outstanding) is not None:
                total = (total or 0) + n
        return total

    def idle_gpus(self) -> list[int]:
        return [g for g, o in enumerate(self.owner) if o is None]

    def _bump(self) -> None:
        self.revision += 1

    # ------------------------------------------------------------------ registry
    def register(self, spec: PipelineSpec) -> None:
        """Add a validated pipeline (:func:`.registration.validate_registration`); refuse,
        with :class:`RegistrationError` and nothing changed, a duplicate or GPU ids outside
        the topology."""
        if spec.pipeline_id in self.pipelines:
            raise RegistrationError(f"pipeline {spec.pipeline_id!r} is already registered")
        n = self.topology.num_gpus
        for c in spec.clusters:
            bad = [g for g in c.gpus if not 0 <= g < n]
            if bad:
                raise RegistrationError(
                    f"cluster {c.cluster_id!r} maps GPUs {bad} outside 0..{n - 1}"
                )
        self.pipelines[spec.pipeline_id] = spec
        self._registration_seq += 1
        self.registrations[spec.pipeline_id] = self._registration_seq
        for c in spec.clusters:
            self.clusters[c.cluster_id] = c
            if c.is_generation:
                self.active_ranks[c.cluster_id] = {}
        self._bump()

    def unregister(self, pipeline_id: str) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """Forget a pipeline and return ``(freed GPUs, cancelled pending cluster ids)``."""
        spec = self.pipeline(pipeline_id)
        freed: list[int] = []
        cancelled: list[str] = []
        for c in spec.clusters:
            freed.extend(self.held_gpus(c.cluster_id))
            for g in self.held_gpus(c.cluster_id):
                self.owner[g] = None
            self.clusters.pop(c.cluster_id, None)
            self.active_ranks.pop(c.cluster_id, None)
            self.starving_since.pop(c.cluster_id, None)
            self._forget_warming(c.cluster_id)
            self.holdings.pop(c.cluster_id, None)
            self.held_since.pop(c.cluster_id, None)
            self.last_hold_s.pop(c.cluster_id, None)
            self.planned_releases.pop(c.cluster_id, None)
            if self.pending.pop(c.cluster_id, None) is not None:
                cancelled.append(c.cluster_id)
        self.pipelines.pop(pipeline_id)
        self.registrations.pop(pipeline_id, None)
        self.progress.pop(pipeline_id, None)
        self.estimates.pop(pipeline_id, None)
        self.fenced.discard(pipeline_id)
        self.runs_over.discard(pipeline_id)
        self._bump()
        return tuple(sorted(freed)), tuple(cancelled)

    def fence(self, pipeline_id: str) -> tuple[str, ...]:
        """A pipeline failed: cancel its pending requests and planned releases, forget its
        demand, and freeze what it holds until it is unregistered (once it is known dead).

        Its shards may still run and cannot be told to sleep, so the planner neither expands
        its clusters nor shrinks their ranks for anyone (invariant P7). Idempotent. Returns the
        cluster ids whose pending request was cancelled.
        """
        spec = self.pipeline(pipeline_id)
        if pipeline_id in self.fenced:
            return ()
        cancelled: list[str] = []
        for c in spec.clusters:
            if self.pending.pop(c.cluster_id, None) is not None:
                cancelled.append(c.cluster_id)
            self.planned_releases.pop(c.cluster_id, None)
        self.progress.pop(pipeline_id, None)
        self.estimates.pop(pipeline_id, None)
        self.fenced.add(pipeline_id)
        self._bump()
        return tuple(cancelled)

    def end_run(self, pipeline_id: str) -> tuple[str, ...]:
        """The pipeline's training run is over (its loop ended: last step, early stop or
        error) while it stays registered to save, shut down and unregister: forget its demand
        and cancel its pending GENERATION requests. From now on its progress reports are
        ignored (a trajectory collector still running until it is killed would otherwise
        report demand again) and GENERATION requests are refused (:class:`RunOverError`).
        Its active ranks stay until another pipeline needs them (with no demand they are the
        first donors) or it unregisters; training requests are served as before.

        Idempotent. Returns the cluster ids whose pending request was cancelled.
        """
        spec = self.pipeline(pipeline_id)
        if pipeline_id in self.runs_over:
            return ()
        cancelled: list[str] = []
        for c in spec.clusters:
            req = self.pending.get(c.cluster_id)
            if req is not None and req.priority is Priority.GENERATION:
                del self.pending[c.cluster_id]
                cancelled.append(c.cluster_id)
        self.progress.pop(pipeline_id, None)
        self.estimates.pop(pipeline_id, None)
        self.runs_over.add(pipeline_id)
        self._bump()
        return tuple(cancelled)

    def _check_not_fenced(self, spec: ClusterSpec, what: str) -> None:
        if spec.pipeline_id in self.fenced:
            raise RequestStateError(
                f"pipeline {spec.pipeline_id!r} has failed (fenced): no {what} for "
                f"{spec.cluster_id!r} until it is unregistered"
            )

    # ------------------------------------------------------------------ requests
    def check_owner(self, cluster_id: str, caller_pipeline_id: str | None) -> ClusterSpec:
        """Resolve a cluster and check the caller (if known) is the pipeline that owns it."""
        spec = self.cluster(cluster_id)
        if caller_pipeline_id is not None and caller_pipeline_id != spec.pipeline_id:
            raise OwnershipError(
                f"pipeline {caller_pipeline_id!r} may not act on cluster {cluster_id!r} of "
                f"pipeline {spec.pipeline_id!r}"
            )
        return spec

    def submit_request(
        self,
        cluster_id: str,
        priority: Priority,
        *,
        now: float,
        global_step: int | None = None,
        step_target_estimate: int | None = None,
        lora_name: str | None = None,
    ) -> ImmediateGrant | PendingRequest:
        """Queue a request, or answer at once when the cluster already has what it asks for."""
        spec = self.cluster(cluster_id)
        self._check_not_fenced(spec, "request")
        if priority is Priority.GENERATION and not spec.is_generation:
            raise RequestStateError(
                f"cluster {cluster_id!r} is not a generation cluster; GENERATION priority is only "
                "valid for actor_infer"
            )
        if step_target_estimate is not None and (
            not is_int(step_target_estimate) or step_target_estimate < 0
        ):
            raise RequestStateError(
                f"step_target_estimate must be an int >= 0 or None, got {step_target_estimate!r}"
            )
        if global_step is not None and (not is_int(global_step) or global_step < 0):
            raise RequestStateError(f"global_step must be an int >= 0 or None, got {global_step!r}")
        if lora_name is not None and not isinstance(lora_name, str):
            raise RequestStateError(f"lora_name must be a str or None, got {lora_name!r}")
        if priority is Priority.GENERATION and spec.pipeline_id in self.runs_over:
            raise RunOverError(
                f"pipeline {spec.pipeline_id!r} ended its training run (end_run); GENERATION "
                "requests are refused until it registers again (training requests are served)"
            )
        if cluster_id in self.pending:
            raise RequestStateError(
                f"cluster {cluster_id!r} already has a pending request "
                f"({self.pending[cluster_id].priority.name}); release or wait for it first"
            )
        if cluster_id in self.holdings:
            if priority is Priority.GENERATION:
                raise RequestStateError(
                    f"cluster {cluster_id!r} holds its whole mapping at "
                    f"{self.holdings[cluster_id].name}; release it before requesting GENERATION"
                )
            self.holdings[cluster_id] = priority
            for g in spec.gpus:
                self.owner[g] = GpuOwner(cluster_id, None, priority)
            self._bump()
            return ImmediateGrant(cluster_id, spec.gpus)
        if priority is Priority.GENERATION and self.active_ranks.get(cluster_id):
            if step_target_estimate is not None:
                self.estimates[spec.pipeline_id] = step_target_estimate
                self._bump()
            return ImmediateGrant(cluster_id, self.held_gpus(cluster_id))
        if priority is not Priority.GENERATION and self.active_ranks.get(cluster_id):
            raise RequestStateError(
                f"cluster {cluster_id!r} has active generation ranks; release them before a "
                f"{priority.name} request for the whole cluster"
            )
        self._seq += 1
        req = PendingRequest(
            cluster_id=cluster_id,
            priority=priority,
            seq=self._seq,
            submitted_at=now,
            global_step=global_step,
            step_target_estimate=step_target_estimate,
            lora_name=lora_name,
        )
        self.pending[cluster_id] = req
        self._bump()
        return req

    def cancel_request(self, cluster_id: str) -> bool:
        """Drop a pending request (caller gave up); True if there was one."""
        if self.pending.pop(cluster_id, None) is None:
            return False
        self._bump()
        return True

    def release(self, cluster_id: str, *, now: float | None = None) -> tuple[int, ...]:
        """The pipeline released a cluster (its ranks are already asleep): free its GPUs.

        With ``now``, a whole-cluster holding's duration is kept as the cluster's expected
        next holding (:attr:`last_hold_s`, what the planner backfills against). A fenced
        pipeline's GPUs stay owned until it is unregistered (:class:`RequestStateError`).
        """
        self._check_not_fenced(self.cluster(cluster_id), "release")
        freed = self.held_gpus(cluster_id)
        for g in freed:
            self.owner[g] = None
        self.holdings.pop(cluster_id, None)
        since = self.held_since.pop(cluster_id, None)
        if since is not None and now is not None:
            self.last_hold_s[cluster_id] = max(0.0, now - since)
        if cluster_id in self.active_ranks:
            self.active_ranks[cluster_id] = {}
        self._forget_warming(cluster_id)
        self.planned_releases.pop(cluster_id, None)
        self._bump()
        return freed

    def _forget_warming(self, cluster_id: str) -> None:
        if self.warming:
            self.warming = {k for k in self.warming if k[0] != cluster_id}

    def plan_release(self, cluster_id: str, *, now: float) -> bool:
        """``await_release_gpus``: shrink every active rank of a generation cluster.

        Returns True when nothing is active (done at once); otherwise the next plan shrinks them.
        """
        spec = self.cluster(cluster_id)
        if not spec.is_generation:
            raise RequestStateError(
                f"await_release_gpus is for generation clusters only, got {cluster_id!r}"
            )
        self._check_not_fenced(spec, "planned release")
        if not self.active_ranks.get(cluster_id):
            return True
        self.planned_releases.setdefault(cluster_id, now)
        self._bump()
        return False

    # ------------------------------------------------------------------ background expands
    def expand_done(self, cluster_id: str, dp_rank: int, *, now: float) -> bool:
        """A warming rank serves now: it stops warming and its hold time
        (``PolicyConfig.min_hold_s``) counts from ``now``. False, and no change, when the rank
        is not warming (shrunk, released or unregistered meanwhile)."""
        key = (cluster_id, dp_rank)
        if key not in self.warming:
            return False
        self.warming.discard(key)
        self.active_ranks[cluster_id][dp_rank] = now
        self._bump()
        return True

    # ------------------------------------------------------------------ demand
    def report_progress(self, report: ProgressReport) -> bool:
        """Record a progress stream's report; False (nothing recorded) once the pipeline's
        run is over (:meth:`end_run`)."""
        self.pipeline(report.pipeline_id)
        if report.pipeline_id in self.runs_over:
            return False
        self.progress.setdefault(report.pipeline_id, {})[report.stream_key] = report
        self._bump()
        return True

    def clear_progress(self, pipeline_id: str, stream: StreamKey | None = None) -> None:
        self.pipeline(pipeline_id)
        streams = self.progress.get(pipeline_id)
        if streams is None:
            return
        if stream is None:
            self.progress.pop(pipeline_id)
        else:
            streams.pop(stream, None)
        self._bump()

    # ------------------------------------------------------------------ commit
    def note_starving(self, now: float) -> bool:
        """Record since when each generation cluster wants ranks and has none (kept while it
        starves, dropped once it has a rank or wants none); True if a record changed. Every
        :meth:`commit` calls it; a service that skips the commit of an empty plan calls it
        instead (and saves the state when it returns True)."""
        changed = False
        for cid, ranks in self.active_ranks.items():
            spec = self.clusters[cid]
            pid = spec.pipeline_id
            req = self.pending.get(cid)
            asked = req is not None and req.priority is Priority.GENERATION
            wants = asked or self.collecting(pid)
            # A fenced pipeline is frozen, a holding or a planned release is not short of GPUs.
            frozen = pid in self.fenced or cid in self.holdings or cid in self.planned_releases
            if ranks or not wants or frozen:
                changed |= self.starving_since.pop(cid, None) is not None
            elif cid not in self.starving_since:
                self.starving_since[cid] = now
                changed = True
        return changed

    def stamp(self, plan: Plan) -> Plan:
        """``plan`` naming the current registration of every pipeline it touches (what a
        planner returns: its commit then applies nothing to a later registration)."""
        pids = sorted(p for p in plan.pipeline_ids() if p in self.registrations)
        return dataclasses.replace(
            plan, registrations=tuple((p, self.registrations[p]) for p in pids)
        )

    def _planned_registrations(self, plan: Plan) -> dict[str, int]:
        """The plan's registration tokens by pipeline; :class:`RequestStateError` (nothing
        changed) for a malformed entry or a pipeline named twice."""
        tokens: dict[str, int] = {}
        for entry in plan.registrations:
            pair = tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)
            pid, token = pair if len(pair) == 2 else (None, None)
            if not isinstance(pid, str) or not is_int(token):
                raise RequestStateError(
                    f"plan registration {entry!r} is malformed; each entry must be a "
                    "(pipeline_id: str, token: int) pair"
                )
            if pid in tokens:
                raise RequestStateError(f"plan names pipeline {pid!r}'s registration twice")
            tokens[pid] = token
        return tokens

    def commit(
        self,
        plan: Plan,
        *,
        now: float,
        failed_shrinks: Iterable[str] = (),
        failed_expands: Iterable[str] = (),
        expands_pending: bool = False,
    ) -> CommitResult:
        """Apply a plan after its RPCs ran; skip what failed or no longer applies.

        A shrink whose RPC failed leaves its ranks owned (the shard's state is unknown, so its
        GPUs must not be handed on); whatever depended on those GPUs waits for a later cycle.
        With ``expands_pending`` the expands are committed before their RPCs run: each
        expanded rank is active (its GPUs owned) and warming until :meth:`expand_done` (or
        until it is shrunk, released or its pipeline unregistered).

        Nothing is applied for a pipeline whose registration token in the plan
        (:attr:`Plan.registrations`) is not its current one: it unregistered since (its GPUs
        were given back then) and may be registered again under the same id; that successor
        asked for none of it (:attr:`CommitResult.stale`). A malformed token list is refused
        with :class:`RequestStateError` and nothing changed.
        """
        tokens = self._planned_registrations(plan)
        stale = {p for p, t in tokens.items() if self.registrations.get(p) != t}

        def current(cid: str) -> bool:
            return not stale or parse_cluster_id(cid)[0] not in stale

        failed_s = set(failed_shrinks)
        failed_e = set(failed_expands)
        shrunk: list[tuple[str, int]] = []
        for move in plan.shrinks:
            if move.cluster_id in failed_s or not current(move.cluster_id):
                continue
            ranks = self.active_ranks.get(move.cluster_id)
            spec = self.clusters.get(move.cluster_id)
            if ranks is None or spec is None or move.dp_rank not in ranks:
                continue
            del ranks[move.dp_rank]
            self.warming.discard((move.cluster_id, move.dp_rank))
            for g in spec.rank_gpus(move.dp_rank):
                self.owner[g] = None
            shrunk.append((move.cluster_id, move.dp_rank))
        released = tuple(
            c
            for c in plan.completed_releases
            if c in self.planned_releases and not self.active_ranks.get(c) and current(c)
        )
        for c in released:
            del self.planned_releases[c]
        granted: dict[str, tuple[int, ...]] = {}
        for grant in plan.grants:
            req = self.pending.get(grant.cluster_id)
            spec = self.clusters.get(grant.cluster_id)
            if req is None or spec is None or any(self.owner[g] is not None for g in spec.gpus):
                continue
            if req.priority is Priority.GENERATION:
                # The request it was planned for was withdrawn and a GENERATION one made since:
                # that one is answered by ranks, never by a whole-mapping holding (no shard of
                # it would be woken).
                continue
            if not current(grant.cluster_id):
                continue
            for g in spec.gpus:
                self.owner[g] = GpuOwner(grant.cluster_id, None, req.priority)
            self.holdings[grant.cluster_id] = req.priority
            self.held_since[grant.cluster_id] = now
            del self.pending[grant.cluster_id]
            granted[grant.cluster_id] = spec.gpus
        expanded: list[tuple[str, int]] = []
        for move in plan.expands:
            spec = self.clusters.get(move.cluster_id)
            ranks = self.active_ranks.get(move.cluster_id)
            if move.cluster_id in failed_e or spec is None or ranks is None:
                continue
            if not current(move.cluster_id):
                continue
            gpus = spec.rank_gpus(move.dp_rank)
            if move.dp_rank in ranks or any(self.owner[g] is not None for g in gpus):
                continue
            ranks[move.dp_rank] = now
            if expands_pending:
                self.warming.add((move.cluster_id, move.dp_rank))
            for g in gpus:
                self.owner[g] = GpuOwner(move.cluster_id, move.dp_rank, Priority.GENERATION)
            expanded.append((move.cluster_id, move.dp_rank))
        for cid, req in list(self.pending.items()):
            if req.priority is Priority.GENERATION and self.active_ranks.get(cid):
                del self.pending[cid]
                spec = self.clusters[cid]
                if req.step_target_estimate is not None:
                    self.estimates[spec.pipeline_id] = req.step_target_estimate
                granted[cid] = self.held_gpus(cid)
        self.note_starving(now)
        self._bump()
        return CommitResult(
            granted=granted,
            shrunk=tuple(shrunk),
            expanded=tuple(expanded),
            released=released,
            stale=tuple(sorted(stale)),
        )
