"""One simulated RL pipeline driving the ROLL call sequence of protocol.md against the core.

init: for each GPU cluster in turn ``request_gpus(INITIALIZATION)`` -> load -> release.
step N: (N>0) ``await_release_gpus(actor_infer)`` -> ``notify_release_then_request_gpus``
(release actor_train, request actor_infer GENERATION with ``step_target_estimate``) -> generate
(expanded ranks generate only after wake + selective sync) -> ``request_gpus(actor_train,
OLD_LOG_PROBS)`` -> REF_LOG_PROBS -> ACTOR_TRAINING -> train -> snapshot/offload -> version N+1,
keeping actor_train until the next step's release-then-request.

Generation: each active rank serves its trajectories by processor sharing; with ``n`` running a
trajectory advances ``min(1, n_sat / n)`` solo-seconds per second, so a rank's throughput is
``min(n, n_sat)`` and its utilisation ``min(n, n_sat) / n_sat``. Trajectories of step ``s`` may
be dispatched once the weights are at version ``>= s - max_age`` (staleness bound). An abort
(shrink) keeps whole turns of progress and re-queues the trajectory.
"""

from __future__ import annotations

import heapq
import logging
import math
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from rlix_plugins.protocol.names import ACTOR_INFER, ACTOR_TRAIN, cluster_id
from rlix_plugins.protocol.types import Priority, ProgressReport, progress_bucket
from rlix_plugins.sim.clock_queue import Timer
from rlix_plugins.sim.physics import PhysicsViolation
from rlix_plugins.sim.records import JobRecord, StepRecord
from rlix_plugins.sim.workloads import JobSpec, Placement

if TYPE_CHECKING:
    from rlix_plugins.sim.engine import SimCluster

log = logging.getLogger(__name__)

_EPS = 1e-9


class _Traj:
    __slots__ = (
        "extra",
        "kept",
        "migrations",
        "service_at_start",
        "step",
        "tid",
        "version",
        "work",
    )

    def __init__(self, tid: int, step: int, work: float) -> None:
        self.tid = tid
        self.step = step
        self.work = work
        #: solo-seconds of work kept across aborts (generated tokens that survive)
        self.kept = 0.0
        #: solo-seconds added by re-dispatches (re-prefill of prompt + partial output)
        self.extra = 0.0
        self.service_at_start = 0.0
        self.version = 0
        #: times the router moved it to a newly active shard (async kind, migration on)
        self.migrations = 0


class _Rank:
    """One generation DP rank: processor-sharing server over its running trajectories."""

    __slots__ = (
        "dp_rank",
        "finish_heap",
        "gpus",
        "last_t",
        "running",
        "serves_at",
        "service",
        "state",
        "timer",
        "wake_timer",
        "who",
    )

    def __init__(self, dp_rank: int, gpus: tuple[int, ...], who: str) -> None:
        self.dp_rank = dp_rank
        self.gpus = gpus
        self.who = who
        #: "off" (no tenure), "waking" (tenure open, not serving), "active", "paused"
        self.state = "off"
        self.running: dict[int, _Traj] = {}
        self.finish_heap: list[tuple[float, int]] = []
        self.service = 0.0
        self.last_t = 0.0
        self.timer: Timer | None = None
        self.wake_timer: Timer | None = None
        #: when the last wake (expand) completes and the rank serves
        self.serves_at = 0.0


class SimPipeline:
    """A job's pipeline: its phases, its generation ranks and its calls into the core."""

    #: pipeline model kind (JobSpec.kind): the ROLL call sequence
    kind = "roll"
    #: priority of the training request when a batch is complete
    train_priority = Priority.OLD_LOG_PROBS
    #: re-request the held training cluster at REF_LOG_PROBS, then ACTOR_TRAINING (ROLL does)
    relabel_phases = True

    def __init__(
        self,
        job: JobSpec,
        placement: Placement,
        cluster: SimCluster,
        rng: np.random.Generator,
        *,
        resident: bool,
        on_finished: Callable[[SimPipeline], None],
    ) -> None:
        self.job = job
        self.pid = job.name
        self.placement = placement
        self.cluster = cluster
        self.rng = rng
        self.resident = resident
        self.costs = cluster.costs_for(job)
        self.on_finished = on_finished
        self.train_cid = cluster_id(self.pid, ACTOR_TRAIN)
        self.infer_cid = cluster_id(self.pid, ACTOR_INFER)
        tp = job.infer_tp
        self.ranks = [
            _Rank(d, placement.infer[d * tp : (d + 1) * tp], f"{self.infer_cid}#{d}")
            for d in range(len(placement.infer) // tp)
        ]
        self.version = 0
        self.step = 0
        self.phase = "arrived"
        self.queue: deque[_Traj] = deque()
        self.done: dict[int, int] = {}
        self.min_version: dict[int, int] = {}
        self.materialized = -1
        self.holding_train = False
        self.train_tenure = False
        self.last_report: tuple[int, int] | None = None
        self.waiting_release = False
        self.release_ready_at = 0.0
        self.admitted_at = 0.0
        self.train_compute = 0.0
        self.gen_useful = 0.0
        self.aborted = 0
        self.steps_done: list[StepRecord] = []

    # ------------------------------------------------------------------ helpers
    @property
    def now(self) -> float:
        return self.cluster.clock.now

    def _later(self, delay: float, action: Callable[[], None]) -> None:
        self.cluster.clock.after(delay, action)

    # ------------------------------------------------------------------ init
    def start(self) -> None:
        """Registered: initialise each GPU cluster in turn (INITIALIZATION priority)."""
        self.admitted_at = self.now
        self.phase = "init_train"
        self.cluster.request(self.train_cid, Priority.INITIALIZATION)

    def on_grant(self, cid: str, gpus: tuple[int, ...]) -> None:
        """The core granted a whole-cluster request (or answered at once)."""
        if cid == self.infer_cid:
            if self.phase != "init_infer":
                return  # a GENERATION grant: ranks arrive through on_expand
            start = self.cluster.ledger.ready_time(gpus, self.now)
            self.cluster.tenure_begin(gpus, f"{cid}@init", start, self.pid, "init")
            self._later(
                start - self.now + self.costs.init_load_s, lambda: self._init_done(cid, gpus)
            )
            return
        if self.phase == "init_train":
            start = self.cluster.ledger.ready_time(gpus, self.now)
            self.cluster.tenure_begin(gpus, f"{cid}@init", start, self.pid, "init")
            self._later(
                start - self.now + self.costs.init_load_s, lambda: self._init_done(cid, gpus)
            )
            return
        if self.phase == "train_wait":
            self._train_granted(gpus)
            return
        if self.phase == "training":
            return  # REF_LOG_PROBS / ACTOR_TRAINING on the cluster it already holds
        raise PhysicsViolation(f"{self.pid}: unexpected grant of {cid} in phase {self.phase}")

    def _init_done(self, cid: str, gpus: tuple[int, ...]) -> None:
        self.cluster.tenure_end(gpus, f"{cid}@init", self.now)
        self.cluster.release(cid)
        if cid == self.train_cid:
            self.phase = "init_infer"
            self.cluster.request(self.infer_cid, Priority.INITIALIZATION)
        else:
            self._step_begin()

    # ------------------------------------------------------------------ step loop
    def _step_begin(self) -> None:
        """``await_release_gpus(actor_infer)`` (N>0), then release-then-request."""
        self.phase = "await_release"
        self._materialize()
        if self.step > 0 or self.cluster.state.active_ranks.get(self.infer_cid):
            done = self.cluster.plan_release(self.infer_cid)
            if not done:
                self.waiting_release = True
                self.release_ready_at = self.now
                return
        self._release_then_request()

    def on_release_done(self, ready_at: float) -> None:
        """The planned release completed in the core; the shards are asleep at ``ready_at``."""
        if not self.waiting_release:
            return
        self.waiting_release = False
        self._later(max(0.0, ready_at - self.now), self._release_then_request)

    def _release_then_request(self) -> None:
        if self.step >= self.job.steps:
            self._finish()
            return
        self.phase = "generating"
        self.cluster.release_then_request(
            release_cid=self.train_cid if self.holding_train else None,
            request_cid=self.infer_cid,
            step_target_estimate=self.job.batch,
        )
        self.holding_train = False
        self._report(force=True)
        self._dispatch()
        self._check_batch()

    def _check_batch(self) -> None:
        if self.phase == "generating" and self.done.get(self.step, 0) >= self.job.batch:
            self.phase = "train_wait"
            self._report(force=True)
            self.cluster.request(self.train_cid, self.train_priority, global_step=self.step)

    def _train_granted(self, gpus: tuple[int, ...]) -> None:
        start = self.cluster.ledger.ready_time(gpus, self.now)
        if not self.train_tenure:
            self.cluster.tenure_begin(gpus, self.train_cid, start, self.pid, "train")
            self.train_tenure = True
        self.holding_train = True
        self.phase = "training"
        setup = self.costs.train_onload_s + self.costs.nccl_reinit_s
        ph = self.job.phases
        gpus_n = len(gpus)

        def compute(seconds: float, then: Callable[[], None]) -> Callable[[], None]:
            def run() -> None:
                t0 = self.now
                self.cluster.credit(gpus, self.train_cid, t0, t0 + seconds, self.pid)
                self.train_compute += seconds * gpus_n
                self._later(seconds, then)

            return run

        def ref() -> None:
            if self.relabel_phases:
                self.cluster.request(self.train_cid, Priority.REF_LOG_PROBS, global_step=self.step)
            compute(ph.ref_log_probs_s, update)()

        def update() -> None:
            if self.relabel_phases:
                self.cluster.request(self.train_cid, Priority.ACTOR_TRAINING, global_step=self.step)
            compute(ph.update_actor_s, offload)()

        def offload() -> None:
            self._later(self.costs.train_offload_s, lambda: self._train_done(gpus))

        self._later(start - self.now + setup, compute(ph.old_log_probs_s, ref))

    def _record_step(self) -> None:
        """The batch of ``self.step`` was trained: consume it, check staleness, bump version."""
        batch = self.job.batch
        self.cluster.counter.consume(batch, self.done.pop(self.step), batch)
        rec = StepRecord(self.pid, self.step, self.now, batch, self.min_version.pop(self.step))
        if self.step - rec.min_version > self.job.max_age:
            raise PhysicsViolation(
                f"{self.pid}: step {self.step} trained on version {rec.min_version} "
                f"(max_trajectory_age_steps={self.job.max_age})"
            )
        self.steps_done.append(rec)
        self.cluster.on_step(rec)
        self.version += 1
        self.step += 1

    def _train_done(self, gpus: tuple[int, ...]) -> None:
        self._record_step()
        if not self.resident or self.step >= self.job.steps:
            # Offloaded: the GPUs are physically free although the cluster is still held
            # (ROLL keeps actor_train until the next release-then-request).
            self.cluster.tenure_end(gpus, self.train_cid, self.now)
            self.train_tenure = False
        self._step_begin()

    def _finish(self) -> None:
        self.phase = "finished"
        if self.holding_train:
            self.cluster.release(self.train_cid)
            self.holding_train = False
        if self.train_tenure:
            self.cluster.tenure_end(self.placement.train, self.train_cid, self.now)
            self.train_tenure = False
        for r in self.ranks:
            for timer in (r.timer, r.wake_timer):
                if timer is not None:
                    timer.cancel()
            r.timer = r.wake_timer = None
            if r.state != "off":
                if r.running:
                    raise PhysicsViolation(f"{self.pid}: finished with trajectories on {r.who}")
                self.cluster.tenure_end(r.gpus, r.who, self.now)
                r.state = "off"
        self.cluster.clear_progress(self.pid)
        self.on_finished(self)

    def record(self) -> JobRecord:
        """This job's record (valid once finished)."""
        return JobRecord(
            job=self.pid,
            arrival=self.job.arrival_s,
            admitted=self.admitted_at,
            finished=self.now,
            steps=self.step,
            trajectories=sum(s.trajectories for s in self.steps_done),
            train_gpus=len(self.placement.train),
            train_compute_gpu_s=self.train_compute,
            gen_useful_gpu_s=self.gen_useful,
            aborted=self.aborted,
        )

    # ------------------------------------------------------------------ demand
    def _collect_step(self) -> int:
        # While a batch is being trained, generation already collects for the next step.
        return self.step + 1 if self.phase in ("train_wait", "training") else self.step

    def _report(self, force: bool = False) -> None:
        """Report progress in 2% buckets, as the pipeline's rollout scheduler does."""
        s = self._collect_step()
        batch = self.job.batch
        if s >= self.job.steps or s > self.version + self.job.max_age:
            completed = batch  # nothing can be generated for it now: no demand
        else:
            completed = min(self.done.get(s, 0), batch)
        bucket = progress_bucket(completed, batch)
        key = (s, bucket)
        if not force and key == self.last_report:
            return
        self.last_report = key
        metrics = {
            "mode": "train",
            "completed": completed,
            "bucket": bucket,
            "new_batch": force,
            "current_train_step": self.step,
            **self._extra_metrics(),
        }
        self.cluster.report(ProgressReport(self.pid, batch, self.now, metrics))

    def _extra_metrics(self) -> dict[str, object]:
        """Pipeline-specific progress metrics (the ROLL sequence reports none)."""
        return {}

    # ------------------------------------------------------------------ trajectories
    def _materialize(self) -> None:
        """Create the trajectories of every step the staleness bound lets us start."""
        top = min(self.job.steps - 1, self.version + self.job.max_age)
        while self.materialized < top:
            s = self.materialized + 1
            lengths = self.job.lengths.sample(self.rng, self.job.batch)
            ids = self.cluster.counter.create(self.job.batch)
            for tid, work in zip(ids, lengths, strict=True):
                self.queue.append(_Traj(tid, s, work))
            self.done.setdefault(s, 0)
            self.min_version[s] = 1 << 60
            self.materialized = s

    def _advance(self, r: _Rank) -> None:
        """Bring rank ``r``'s service clock to now and credit its useful GPU time."""
        now = self.now
        dt = now - r.last_t
        if dt > 0 and r.state == "active" and r.running:
            n = len(r.running)
            r.service += dt * min(1.0, self.job.n_sat / n)
            util = min(n, self.job.n_sat) / self.job.n_sat
            self.cluster.credit(r.gpus, r.who, r.last_t, now, self.pid, util)
            self.gen_useful += util * dt * len(r.gpus)
        r.last_t = now

    def _reschedule(self, r: _Rank) -> None:
        if r.timer is not None:
            r.timer.cancel()
            r.timer = None
        if r.state != "active" or not r.finish_heap:
            return
        fin, _ = r.finish_heap[0]
        rate = min(1.0, self.job.n_sat / len(r.running))
        delay = max(0.0, (fin - r.service) / rate)
        r.timer = self.cluster.clock.after(delay, lambda: self._on_finish(r))

    def _on_finish(self, r: _Rank) -> None:
        r.timer = None
        self._advance(r)
        while r.finish_heap and r.finish_heap[0][0] <= r.service + 1e-7:
            _, tid = heapq.heappop(r.finish_heap)
            t = r.running.pop(tid, None)
            if t is None:
                continue  # lazily deleted (aborted)
            self.cluster.counter.complete(t.tid)
            self.done[t.step] = self.done.get(t.step, 0) + 1
            self.min_version[t.step] = min(self.min_version[t.step], t.version)
        self._dispatch()
        self._reschedule(r)
        self._report()
        self._check_batch()

    def _dispatch(self) -> None:
        if not self.queue:
            return
        active = [r for r in self.ranks if r.state == "active"]
        if not active:
            return
        heap = [(len(r.running), r.dp_rank) for r in active if len(r.running) < self.job.max_seqs]
        heapq.heapify(heap)
        touched: set[int] = set()
        by_rank = {r.dp_rank: r for r in active}
        while self.queue and heap:
            n, d = heapq.heappop(heap)
            r = by_rank[d]
            if d not in touched:
                self._advance(r)
                touched.add(d)
            t = self.queue.popleft()
            if t.kept <= 0.0:  # kept tokens were generated by an older version
                t.version = self.version
            t.service_at_start = r.service
            r.running[t.tid] = t
            heapq.heappush(r.finish_heap, (r.service + t.work + t.extra - t.kept, t.tid))
            if n + 1 < self.job.max_seqs:
                heapq.heappush(heap, (n + 1, d))
        for d in touched:
            self._reschedule(by_rank[d])

    # ------------------------------------------------------------------ resize (from plans)
    def on_expand(self, dp_rank: int) -> float:
        """``resize_infer(add)``: wake + selective sync, then the rank serves requests.
        Returns when it serves (the resize call's return, for a blocking cycle)."""
        r = self.ranks[dp_rank]
        wake = self.costs.gen_wake_s + self.job.phases.sync_weight_s
        if r.state == "paused":  # resident shard: weights updated in place, no wake
            start = self.now
        else:
            start = self.cluster.ledger.ready_time(r.gpus, self.now)
            self.cluster.tenure_begin(r.gpus, r.who, start, self.pid, "gen")
        r.state = "waking"
        r.serves_at = start + wake
        r.wake_timer = self.cluster.clock.at(start + wake, lambda: self._activate(r))
        return start + wake

    def _activate(self, r: _Rank) -> None:
        r.wake_timer = None
        r.state = "active"
        r.last_t = self.now
        self._dispatch()
        self._reschedule(r)

    def on_shrink(self, dp_rank: int) -> float:
        """``resize_infer(remove)``: abort (or pause, if resident) and sleep; returns free time."""
        r = self.ranks[dp_rank]
        self._advance(r)
        # With blocking cycles a rank can still be waking here only under background expands:
        # the service sends the shrink once the expand returned, so the wake completes first.
        # The overlapping engine aborts the wake at once.
        wake_done = self.now
        if r.wake_timer is not None:
            r.wake_timer.cancel()
            r.wake_timer = None
            if self.cluster.config.blocking_cycles:
                wake_done = max(self.now, r.serves_at)
        if r.timer is not None:
            r.timer.cancel()
            r.timer = None
        if self.resident:
            r.state = "paused"  # in-flight requests keep their progress; GPU stays occupied
            return self.now
        aborted = sorted(r.running.values(), key=lambda t: (t.step, t.tid), reverse=True)
        for t in aborted:
            progress = t.kept + (r.service - t.service_at_start)
            lost = self._abort_trajectory(t, progress)
            self.cluster.counter.lost_s += lost
            self.cluster.counter.waste(lost, self.job.infer_tp, self.job.n_sat)
            self.queue.appendleft(t)
            self.aborted += 1
            self.cluster.counter.aborted += 1
        r.running.clear()
        r.finish_heap.clear()
        opened = self.cluster.ledger.current[r.gpus[0]]
        begin = opened.start if opened is not None else self.now
        end = max(wake_done, begin) + self.costs.gen_sleep_s
        self.cluster.tenure_end(r.gpus, r.who, end)
        r.state = "off"
        # Redispatch happens after the whole plan is applied (the engine calls redispatch()).
        return end

    def _abort_trajectory(self, t: _Traj, progress: float) -> float:
        """An in-flight trajectory was aborted after ``progress`` solo-seconds in total.

        ROLL kind: whole turns of ``turn_s`` survive (single-turn: nothing); the rest is
        regenerated from scratch. Returns the solo-seconds of work lost.
        """
        turn = self.job.turn_s
        kept = 0.0 if math.isinf(turn) else math.floor(progress / turn + _EPS) * turn
        t.kept = min(kept, t.work)
        return max(0.0, progress - t.kept)

    def redispatch(self) -> None:
        """Send re-queued trajectories to the ranks still active (ShardPreemptedError path)."""
        self._dispatch()

    def on_generation_granted(self) -> None:
        """The pending GENERATION request was answered (at least one rank active)."""
        return None
