"""Snapshot and restore of the allocation state (for a coordinator restart).

Pure: plain JSON-able dicts in and out; no Ray, no clock, no I/O. What is kept: the registry,
who holds which GPUs (whole-cluster holdings and active generation ranks), demand (progress
streams and estimates), what the planner's timed rules read (holding durations, since when a
generation cluster has had no rank) and the revision. What is NOT kept: pending requests and
planned releases. Their callers were blocked in the actor that died; Ray retries those calls on the
restarted actor (or the client retries them), so restoring them would make the retry collide
with a ghost of itself.

A plan whose RPCs were in flight when the actor died is settled conservatively by
:func:`settle_inflight`: shrinks that were confirmed are applied, expands that may have happened
are treated as having happened (a GPU may only ever be counted as owned too long, never too
short).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from rlix_plugins.coordinator.core.invariants import InvariantViolation, check_state
from rlix_plugins.coordinator.core.model import GpuOwner, Topology
from rlix_plugins.coordinator.core.plan import Plan, RankMove, ShrinkReason
from rlix_plugins.coordinator.core.registration import validate_registration
from rlix_plugins.coordinator.core.state import SchedulerState
from rlix_plugins.errors import CorruptStateError, ProtocolError
from rlix_plugins.protocol.types import Priority, coerce_progress_report
from rlix_plugins.values import is_int

SNAPSHOT_VERSION = 1


def _json_safe(value: Any) -> Any:
    """Metrics are free-form: keep what JSON can hold, stringify the rest."""
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        if isinstance(value, Mapping):
            return {str(k): _json_safe(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [_json_safe(v) for v in value]
        return str(value)


def snapshot(state: SchedulerState) -> dict[str, Any]:
    """A JSON-able dict from which :func:`restore` rebuilds the allocation state."""
    pipelines = []
    for pid in sorted(state.pipelines):
        spec = state.pipelines[pid]
        pipelines.append(
            {
                "pipeline_id": pid,
                "ray_namespace": spec.ray_namespace,
                "weight": spec.weight,
                "clusters": [
                    {"name": c.name, "tp": c.tp, "gpus": list(c.gpus)} for c in spec.clusters
                ],
            }
        )
    progress = {
        pid: [
            {
                "pipeline_id": r.pipeline_id,
                "step_target_trajectories": r.step_target_trajectories,
                "fifo_timestamp": r.fifo_timestamp,
                "metrics": _json_safe(r.metrics) if r.metrics is not None else None,
            }
            for r in streams.values()
        ]
        for pid, streams in state.progress.items()
    }
    return {
        "version": SNAPSHOT_VERSION,
        "topology": [state.topology.num_nodes, state.topology.gpus_per_node],
        "revision": state.revision,
        "pipelines": pipelines,
        "holdings": {cid: int(p) for cid, p in state.holdings.items()},
        "active_ranks": {
            cid: [[r, t] for r, t in sorted(ranks.items())]
            for cid, ranks in state.active_ranks.items()
            if ranks
        },
        "progress": progress,
        "estimates": dict(state.estimates),
        "warming": sorted([cid, r] for cid, r in state.warming),
        # What the reservation rule plans with (EASY backfill needs each cluster's expected
        # holding) and the pipelines frozen until they are confirmed dead (P7).
        "held_since": dict(state.held_since),
        "last_hold_s": dict(state.last_hold_s),
        "fenced": sorted(state.fenced),
        "runs_over": sorted(state.runs_over),
        # A restart must not reset how long a pipeline has starved (the planner's guard).
        "starving_since": dict(state.starving_since),
    }


def restore(data: Mapping[str, Any], topology: Topology | None = None) -> SchedulerState:
    """Rebuild a :class:`SchedulerState` from :func:`snapshot` output and check its invariants.

    ``topology`` must match the snapshot's when given (a coordinator restarted on a different
    cluster shape cannot trust the old GPU ids). A snapshot that is not one (missing or
    malformed fields, unknown clusters) raises :class:`CorruptStateError`.
    """
    if not isinstance(data, Mapping):
        raise CorruptStateError(f"a snapshot is a JSON object, got {type(data).__name__}")
    try:
        return _restore(data, topology)
    except ProtocolError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, InvariantViolation) as exc:
        raise CorruptStateError(
            f"snapshot is malformed ({type(exc).__name__}: {exc})"
        ) from None


def _restore(data: Mapping[str, Any], topology: Topology | None) -> SchedulerState:
    if data.get("version") != SNAPSHOT_VERSION:
        raise ProtocolError(
            f"snapshot version {data.get('version')!r} is not supported; expected "
            f"{SNAPSHOT_VERSION}"
        )
    nodes, per_node = data["topology"]
    saved = Topology(int(nodes), int(per_node))
    if topology is not None and topology != saved:
        raise ProtocolError(f"snapshot topology {saved} differs from the cluster's {topology}")
    state = SchedulerState(saved)
    for p in data["pipelines"]:
        state.register(
            validate_registration(
                saved,
                pipeline_id=p["pipeline_id"],
                ray_namespace=p["ray_namespace"],
                cluster_tp_configs={c["name"]: c["tp"] for c in p["clusters"]},
                cluster_device_mappings={c["name"]: list(c["gpus"]) for c in p["clusters"]},
                weight=p["weight"],
            )
        )
    for cid, prio in data["holdings"].items():
        spec = state.clusters[cid]
        priority = Priority(prio)
        state.holdings[cid] = priority
        for g in spec.gpus:
            state.owner[g] = GpuOwner(cid, None, priority)
    for cid, ranks in data["active_ranks"].items():
        spec = state.clusters[cid]
        for rank, activated_at in ranks:
            state.active_ranks[cid][int(rank)] = float(activated_at)
            for g in spec.rank_gpus(int(rank)):
                state.owner[g] = GpuOwner(cid, int(rank), Priority.GENERATION)
    # Demand is read back with the wire checks: a malformed report would otherwise break
    # every planning cycle, and demand of a pipeline that is not registered would be
    # inherited by one registering later under that id.
    for pid, streams in data["progress"].items():
        state.pipeline(pid)
        for r in streams:
            try:
                report = coerce_progress_report(r)
            except ProtocolError as exc:
                raise ValueError(f"progress of {pid!r}: {exc}") from None
            if report.pipeline_id != pid:
                raise ValueError(f"progress of {report.pipeline_id!r} filed under {pid!r}")
            state.progress.setdefault(pid, {})[report.stream_key] = report
    for pid, estimate in data["estimates"].items():
        state.pipeline(pid)
        if not is_int(estimate) or estimate < 0:
            raise ValueError(f"estimate of {pid!r} must be an int >= 0, got {estimate!r}")
        state.estimates[pid] = estimate
    # Background expands in flight at the crash (absent from older snapshots): still warming;
    # the restarted service sends them again (``resize_infer`` is idempotent per rank).
    state.warming = {
        (str(cid), int(r))
        for cid, r in data.get("warming", [])
        if int(r) in state.active_ranks.get(str(cid), {})
    }
    # Absent from older snapshots: a restart then forgets them, as it used to.
    state.held_since = {
        str(c): float(t) for c, t in data.get("held_since", {}).items() if c in state.holdings
    }
    state.last_hold_s = {
        str(c): float(t) for c, t in data.get("last_hold_s", {}).items() if c in state.clusters
    }
    for pid in data.get("fenced", []):
        if pid in state.pipelines:
            state.fence(str(pid))
    # Absent from older snapshots: those pipelines' runs count as running.
    state.runs_over = {str(p) for p in data.get("runs_over", []) if p in state.pipelines}
    # Absent from older snapshots: the next commit starts their clocks again.
    state.starving_since = {
        str(c): float(t)
        for c, t in data.get("starving_since", {}).items()
        if c in state.active_ranks and not state.active_ranks[c]
    }
    # Revisions must keep growing across a restart so a client comparing them is not fooled.
    state.revision = int(data["revision"]) + 1
    check_state(state)
    return state


def settle_inflight(
    state: SchedulerState,
    *,
    confirmed_shrinks: Iterable[tuple[str, int]],
    possible_expands: Iterable[tuple[str, int]],
    now: float,
) -> None:
    """Settle a plan that was being applied when the coordinator died.

    ``confirmed_shrinks`` answered success before the death: their GPUs are free.
    ``possible_expands`` were sent (or about to be) without a known answer: their ranks are
    counted as active so their GPUs are never handed to someone else while the shard may run;
    if the shard did not actually wake, a later shrink of that rank is a no-op for it.
    Unknown clusters (pipelines dropped meanwhile) are ignored. A record that is not a
    ``(cluster_id: str, dp_rank: int)`` pair raises :class:`CorruptStateError` naming it, with
    the state unchanged.
    """
    # Every record is checked before anything is applied: a bad one must not leave half a
    # plan committed, nor surface as a bare TypeError/ValueError from the arithmetic below.
    shrink_records = _inflight_records("confirmed_shrinks", confirmed_shrinks)
    expand_records = _inflight_records("possible_expands", possible_expands)
    shrinks = tuple(
        RankMove(cid, r, state.clusters[cid].rank_gpus(r), ShrinkReason.PLANNED_RELEASE)
        for cid, r in shrink_records
        if cid in state.clusters
    )
    expands = tuple(
        RankMove(cid, r, state.clusters[cid].rank_gpus(r))
        for cid, r in expand_records
        if cid in state.clusters and 0 <= r < state.clusters[cid].dp_size
    )
    state.commit(Plan(state.revision, shrinks=shrinks, expands=expands), now=now)
    check_state(state)


def _inflight_records(what: str, records: Iterable[object]) -> list[tuple[str, int]]:
    """``records`` as ``(cluster_id, dp_rank)`` pairs (JSON gives lists), or
    :class:`CorruptStateError` naming the first one that is not such a pair."""
    out: list[tuple[str, int]] = []
    for record in records:
        pair: tuple[object, ...] = (
            tuple(record) if isinstance(record, (tuple, list)) else (record,)
        )
        cid, rank = pair if len(pair) == 2 else (None, None)
        # bool is an int subclass: True would be read as rank 1
        if not isinstance(cid, str) or not is_int(rank):
            raise CorruptStateError(
                f"in-flight record {record!r} in {what} is malformed; each record must be a "
                "(cluster_id: str, dp_rank: int) pair"
            )
        out.append((cid, rank))
    return out
