"""Our mechanism (design.md, "The mechanism, end to end"): an async partial-overlap pipeline.

The NeMo RL / veRL async-GRPO pipelines our adapters drive, as opposed to the ROLL call
sequence of :mod:`rlix_plugins.sim.pipeline_model`:

* init: ``request_gpus(INITIALIZATION)`` per cluster -> load -> release, then ONE
  ``request_gpus(actor_infer, GENERATION)``; generation then runs for the whole job on whatever
  ranks the coordinator activates. There is no ``await_release_gpus`` per step.
* the inference span covers a superset of the training GPUs (partial overlap). When a batch
  is complete, training asks for ITS training GPUs only (OLD_LOG_PROBS -> REF_LOG_PROBS ->
  ACTOR_TRAINING); the coordinator shrinks only the overlapping shards (of any pipeline).
* an aborted request is re-dispatched by the generation router to another active shard and
  CONTINUES from its partial tokens: what is lost is at most the in-flight decode step
  (neglected) plus a re-prefill of prompt + partial output on the new shard, modelled as
  ``JobSpec.redispatch_prefill_s`` solo-seconds of extra work (an assumption each workload
  names).
* after the train step: snapshot to the CPU bucket cache + offload (``train_offload_s``), the
  training GPUs are released (``after_training``), the weight version advances; shards that
  are active get it by an "active refresh" (routing paused for ``sync_weight_s``, nothing
  aborted), shards the coordinator wakes get it by selective sync (``gen_wake_s`` +
  ``sync_weight_s``, as in the ROLL kind).
* async GRPO: generation for step N+1 runs while step N trains, within
  ``max_trajectory_age_steps`` (the staleness bound; 0 = synchronous).
* migration (``EngineConfig.migrate_on_activate``, our router's feature): when a shard becomes
  ACTIVE after wake + selective sync, queued requests go to it first, then running requests
  move to it from shards above the mean load (:func:`plan_migration`); a moved request keeps
  its partial tokens and pays ``redispatch_prefill_s`` on the new shard, like a re-dispatch.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Callable, Mapping
from typing import Any

from rlix_plugins.generation.migration import MigrationCandidate
from rlix_plugins.generation.migration import plan_migration as router_plan_migration
from rlix_plugins.protocol.types import OUTSTANDING_METRIC, Priority
from rlix_plugins.sim.pipeline_model import SimPipeline, _Rank, _Traj

log = logging.getLogger(__name__)

#: the router's minimum benefit: no request moves when the most loaded shard runs fewer than
#: this many requests more than the new shard (a move of one would only swap the imbalance)
MIN_MIGRATION_GAP = 2
#: migrations per request at most (the router's ``max_per_request``: no ping-pong)
MAX_MIGRATIONS = 1


def plan_migration(
    loads: Mapping[int, int],
    new: int,
    movable: Mapping[int, int],
    capacity: int,
    *,
    min_gap: int = MIN_MIGRATION_GAP,
) -> list[int]:
    """Donor shard of each request moved onto the newly active shard ``new``, in order.

    Runs the router's own rule (:func:`rlix_plugins.generation.migration.plan_migration`) on
    the simulator's counts: ``loads`` are the requests running per ACTIVE shard (``new``
    included), ``movable`` how many of them may still move (migrated fewer than
    ``MAX_MIGRATIONS`` times), ``capacity`` how many more ``new`` may take (``max_seqs`` minus
    what it runs). The rule is greedy, one request at a time, so cutting its moves at
    ``capacity`` is what it would do with that cap. The simulator does not know tokens left
    per request, so every movable request is a candidate (the router's ``min_remaining_tokens``
    filter is not modelled). Pure.
    """
    if new not in loads:
        raise ValueError(f"shard {new} is not among the active shards {sorted(loads)}")
    if capacity < 0:
        raise ValueError(f"capacity must be >= 0, got {capacity}")
    size = max(loads) + 1
    per_rank = [loads.get(r, 0) for r in range(size)]
    candidates = [
        MigrationCandidate(key=f"{d}:{i}", rank=d, remaining_tokens=1)
        for d, k in movable.items()
        if d != new and d in loads
        for i in range(min(k, loads[d]))
    ]
    moves = router_plan_migration(
        per_rank,
        loads.keys(),
        [new],
        candidates,
        min_gap=min_gap,
        min_remaining_tokens=0,
        max_per_request=MAX_MIGRATIONS,
    )
    return [m.source for m in moves[:capacity]]


class AsyncOverlapPipeline(SimPipeline):
    """One NeMo RL / veRL async-GRPO job under the coordinator (see module docstring)."""

    kind = "async"
    #: the adapters' ``before_training`` asks for ACTOR_TRAINING directly
    train_priority = Priority.ACTOR_TRAINING
    relabel_phases = False
    #: report per-shard load with progress (``rank_load`` metric)
    report_rank_load = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: shards whose engine has loaded the model once
        self._loaded: set[int] = set()

    # ------------------------------------------------------------------ init
    def _init_done(self, cid: str, gpus: tuple[int, ...]) -> None:
        """Training cluster loaded (and the CPU cache built). Our adapters issue no
        INITIALIZATION for the inference span: engines start asleep and a shard's first wake
        loads the model (``init_load_s`` instead of ``gen_wake_s``, see :meth:`on_expand`)."""
        self.cluster.tenure_end(gpus, f"{cid}@init", self.now)
        self.cluster.release(cid)
        self.phase = "generating"
        self._materialize()
        self._request_generation()
        self._report(force=True)
        self._check_batch()

    def _request_generation(self) -> None:
        """``request_gpus(actor_infer, GENERATION)`` as the adapters do after every train step:
        answered at once while a shard is active, else pending until one is."""
        state = self.cluster.state
        if self.infer_cid in state.pending or state.active_ranks.get(self.infer_cid):
            return
        self.cluster.request(
            self.infer_cid, Priority.GENERATION, step_target_estimate=self.job.batch
        )

    def on_expand(self, dp_rank: int) -> float:
        """Wake + selective sync; a shard's first wake starts its engine (model load).
        Returns when it serves."""
        r = self.ranks[dp_rank]
        first = r.dp_rank not in self._loaded
        self._loaded.add(r.dp_rank)
        load = self.costs.init_load_s if first else self.costs.gen_wake_s
        start = self.cluster.ledger.ready_time(r.gpus, self.now)
        self.cluster.tenure_begin(r.gpus, r.who, start, self.pid, "init" if first else "gen")
        r.state = "waking"
        wake = load + self.job.phases.sync_weight_s
        r.serves_at = start + wake
        r.wake_timer = self.cluster.clock.at(start + wake, lambda: self._activate(r))
        return start + wake

    def _activate(self, r: _Rank) -> None:
        """The shard serves: queued requests first, then (with migration on) running requests
        move to it from the more loaded shards."""
        super()._activate(r)
        if self.cluster.config.migrate_on_activate and r.state == "active":
            self._migrate_to(r)

    def _migrate_to(self, new: _Rank) -> None:
        """Move running requests onto ``new`` by :func:`plan_migration`. Each keeps its
        partial tokens (and weight version) and re-prefills prompt + partial output there;
        nothing is lost or generated twice. As the router does, a donor gives up the requests
        with the most token budget left, i.e. (one budget per job here) the fewest generated
        so far; the router cannot see how long a request will really run."""
        active = {x.dp_rank: x for x in self.ranks if x.state == "active"}
        loads = {d: len(x.running) for d, x in active.items()}
        movable = {
            d: sum(1 for t in x.running.values() if t.migrations < MAX_MIGRATIONS)
            for d, x in active.items()
        }
        donors = plan_migration(loads, new.dp_rank, movable, self.job.max_seqs - loads[new.dp_rank])
        if not donors:
            return
        counts: dict[int, int] = {}
        for d in donors:
            counts[d] = counts.get(d, 0) + 1
        self._advance(new)
        prefill = self.job.redispatch_prefill_s
        counter = self.cluster.counter
        for d, k in counts.items():
            src = active[d]
            self._advance(src)
            progress = {
                t.tid: t.kept + (src.service - t.service_at_start) for t in src.running.values()
            }
            eligible = [t for t in src.running.values() if t.migrations < MAX_MIGRATIONS]
            moved = sorted(eligible, key=lambda t: (progress[t.tid], t.tid))[:k]
            for t in moved:
                del src.running[t.tid]
                # Tokens served so far survive (re-prefill service included, capped by what
                # the request still needed); the new shard re-prefills once more.
                t.kept = min(progress[t.tid], t.work + t.extra)
                t.extra += prefill
                t.migrations += 1
                t.service_at_start = new.service
                new.running[t.tid] = t
                heapq.heappush(new.finish_heap, (new.service + t.work + t.extra - t.kept, t.tid))
                counter.migrated += 1
                counter.migration_s += prefill
                counter.waste(prefill, self.job.infer_tp, self.job.n_sat)
            gone = {t.tid for t in moved}
            # A stale finish entry would complete the request early if it ever came back here.
            src.finish_heap = [e for e in src.finish_heap if e[1] not in gone]
            heapq.heapify(src.finish_heap)
            self._reschedule(src)
        self._reschedule(new)

    # ------------------------------------------------------------------ step loop
    def _train_done(self, gpus: tuple[int, ...]) -> None:
        """Weights are in the CPU cache and training state is offloaded: release the training
        GPUs, advance the version, refresh the active shards and carry on generating."""
        self._record_step()
        self.cluster.tenure_end(gpus, self.train_cid, self.now)
        self.train_tenure = False
        self.holding_train = False
        self.cluster.release(self.train_cid)
        if self.step >= self.job.steps:
            self._finish()
            return
        self.phase = "generating"
        self._materialize()
        self._request_generation()
        self._active_refresh()
        self._dispatch()
        self._report(force=True)
        self._check_batch()

    def _active_refresh(self) -> None:
        """Active shards take the new version in place: routing pauses for ``sync_weight_s``
        (no new dispatch, running requests make no progress), nothing is aborted."""
        pause = self.job.phases.sync_weight_s
        for r in self.ranks:
            if r.state != "active":
                continue  # waking shards sync the newest version from the cache anyway
            self._advance(r)
            if r.timer is not None:
                r.timer.cancel()
                r.timer = None
            r.state = "refreshing"
            r.wake_timer = self.cluster.clock.after(pause, self._refresh_done(r))

    def _refresh_done(self, r: _Rank) -> Callable[[], None]:
        def done() -> None:
            r.wake_timer = None
            r.state = "active"
            r.last_t = self.now
            self._dispatch()
            self._reschedule(r)

        return done

    # ------------------------------------------------------------------ demand
    def _collect_step(self) -> int:
        """The oldest step whose batch is not complete (generation never stops for training)."""
        s = self.step
        while self.done.get(s, 0) >= self.job.batch:
            s += 1
        return s

    def _extra_metrics(self) -> dict[str, object]:
        """``rank_load``: requests running per active shard, sent with each bucket report (the
        router knows it), so the coordinator can take lightly loaded shards first; and
        ``outstanding``: every admitted, unfinished request (running or queued, any step), so
        the coordinator sizes the job by all the work it can do now."""
        if not self.report_rank_load:
            return {}
        running = {r.dp_rank: len(r.running) for r in self.ranks if r.state != "off"}
        return {
            "rank_load": running,
            OUTSTANDING_METRIC: len(self.queue) + sum(running.values()),
        }

    # ------------------------------------------------------------------ aborts
    def _abort_trajectory(self, t: _Traj, progress: float) -> float:
        """Re-dispatch continues from the partial output: every generated token is kept and
        the new shard re-prefills prompt + partial output (``redispatch_prefill_s``). With
        ``EngineConfig.restart_on_abort`` (NeMo RL's RESTART) it runs again from the prompt:
        the ``progress`` solo-seconds generated so far are lost and generated again."""
        if self.cluster.config.restart_on_abort:
            t.kept = 0.0
            return progress
        # ``progress`` counts against ``work + extra`` (re-prefills of earlier re-dispatches
        # included), as in a migration: capping at ``work`` would serve that prefill twice.
        t.kept = min(progress, t.work + t.extra)
        prefill = self.job.redispatch_prefill_s
        t.extra += prefill
        return prefill
