"""Load a small scenario file (JSON or TOML) into a :class:`Workload`.

For comparing the simulator with a real run (e.g. the gate-2 CPU rehearsal: two pipelines
time-sharing GPUs on Ray). A scenario names the cluster, each pipeline's device mappings and
phase times; anything omitted takes the :class:`JobSpec` defaults below::

    {"name": "gate2", "gpus_per_node": 2, "nodes": 1,
     "pipelines": [
       {"name": "ft_000000000001", "train": [0], "infer": [0, 1], "infer_tp": 1,
        "steps": 3, "batch": 8, "max_age": 1,
        "lengths": {"kind": "lognormal", "a": 2.0, "b": 0.5, "cap_s": 8.0},
        "phases": {"old_log_probs_s": 0.5, "ref_log_probs_s": 0.5,
                   "update_actor_s": 2.0, "sync_weight_s": 0.3},
        "costs": {"gen_sleep_s": 0.2, "gen_wake_s": 0.3, "init_load_s": 1.0}}]}

With explicit mappings the shared policies use them as given; the exclusive baseline gives
each pipeline ``len(train) + len(infer without train)`` dedicated GPUs, each count rounded up to
a multiple of ``infer_tp`` (the exclusive placer aligns blocks to the TP size, so a TP-2 job
with one training GPU holds two there), on a cluster large enough to hold them all.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rlix_plugins.coordinator.core import Topology, validate_registration
from rlix_plugins.errors import RegistrationError, RlixPluginsError
from rlix_plugins.protocol.names import ACTOR_INFER, ACTOR_TRAIN, pipeline_namespace
from rlix_plugins.sim.placement import ExclusivePlacer
from rlix_plugins.sim.workloads import (
    PIPELINE_KINDS,
    JobSpec,
    LengthDistribution,
    PhaseTimes,
    Placement,
    SwitchCosts,
    Workload,
)
from rlix_plugins.values import is_int


class ScenarioError(RlixPluginsError, ValueError):
    """A scenario file is malformed; the message names the field."""


#: the fields a pipeline entry may have (a misspelled one would silently take its default)
PIPELINE_FIELDS = frozenset({
    "name", "kind", "train", "infer", "infer_tp", "steps", "batch", "max_age", "n_sat",
    "max_seqs", "lengths", "phases", "costs", "turn_s", "arrival_s", "weight",
    "redispatch_prefill_s",
})


def _get(d: Mapping[str, Any], key: str, kind: type, where: str, default: Any = ...) -> Any:
    if key not in d:
        if default is ...:
            raise ScenarioError(f"{where}: missing field {key!r}")
        return default
    value = d[key]
    if kind is float and is_int(value):
        value = float(value)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise ScenarioError(f"{where}: {key!r} must be {kind.__name__}, got {value!r}")
    return value


def _record(cls: type, d: object, where: str) -> Any:
    if not isinstance(d, Mapping):
        raise ScenarioError(f"{where}: expected a table/object")
    fields = getattr(cls, "__dataclass_fields__", {})
    unknown = sorted(set(d) - set(fields))
    if unknown:
        raise ScenarioError(f"{where}: unknown fields {unknown}; expected {sorted(fields)}")
    flags = sorted(k for k, v in d.items() if isinstance(v, bool))
    if flags:  # true/false would read as 1.0/0.0
        raise ScenarioError(f"{where}: {flags[0]!r} must be a number, got {d[flags[0]]!r}")
    try:
        return cls(**{k: float(v) if isinstance(v, int) else v for k, v in d.items()})
    except (TypeError, ValueError) as exc:
        raise ScenarioError(f"{where}: {exc}") from None


def _number(
    p: Mapping[str, Any], key: str, where: str, default: float, *, positive: bool = False
) -> float:
    """A finite float field, ``>= 0`` (or ``> 0`` with ``positive``)."""
    value: float = _get(p, key, float, where, default)
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        bound = "> 0" if positive else ">= 0"
        raise ScenarioError(f"{where}: {key} must be a finite number {bound}, got {value!r}")
    return value


def _gpu_ids(p: Mapping[str, Any], key: str, where: str, num_gpus: int) -> tuple[int, ...]:
    """A non-empty list of distinct integer GPU ids in ``0..num_gpus-1``."""
    raw = _get(p, key, list, where)
    if not raw or not all(is_int(g) for g in raw):
        raise ScenarioError(
            f"{where}: {key!r} must be a non-empty list of integer GPU ids, got {raw!r}"
        )
    if len(set(raw)) != len(raw) or not all(0 <= g < num_gpus for g in raw):
        raise ScenarioError(
            f"{where}: {key!r} must list distinct GPU ids in 0..{num_gpus - 1} "
            f"(gpus_per_node x nodes), got {raw!r}"
        )
    return tuple(raw)


def _exclusive_nodes(jobs: list[JobSpec], gpus_per_node: int) -> int:
    """Nodes that hold every job's dedicated GPUs at once, packed as the exclusive placer packs
    them (each block starts on a multiple of its ``infer_tp``), so no job queues there."""
    placer = ExclusivePlacer(sum(j.footprint + j.infer_tp for j in jobs), gpus_per_node)
    used = 0
    for i, job in enumerate(jobs):
        placed = placer.place(i, job)
        assert placed is not None  # the cluster above has room for any alignment gaps
        used = max(used, *placed.train, *placed.infer)
    return -(-(used + 1) // gpus_per_node)


def _load_toml(text: str) -> dict[str, Any]:
    try:
        import tomllib  # Python >= 3.11
    except ModuleNotFoundError:
        raise ScenarioError(
            "TOML scenarios need Python >= 3.11 (tomllib); use a .json scenario on 3.10"
        ) from None
    return tomllib.loads(text)


def load_scenario(source: str | Path | Mapping[str, Any]) -> Workload:
    """Parse a scenario (path to .json/.toml, or an already-parsed mapping)."""
    if isinstance(source, Mapping):
        data: Mapping[str, Any] = source
    else:
        path = Path(source)
        text = path.read_text()
        data = _load_toml(text) if path.suffix == ".toml" else json.loads(text)
    if not isinstance(data, Mapping):
        raise ScenarioError(
            f"scenario: expected a table/object at the top (name, gpus_per_node, nodes, "
            f"pipelines), got {type(data).__name__}"
        )
    name = _get(data, "name", str, "scenario", "scenario")
    gpn = _get(data, "gpus_per_node", int, "scenario")
    nodes = _get(data, "nodes", int, "scenario")
    if gpn < 1 or nodes < 1:
        raise ScenarioError(f"scenario: gpus_per_node and nodes must be >= 1, got {gpn}, {nodes}")
    pipes = _get(data, "pipelines", list, "scenario")
    if not pipes:
        raise ScenarioError("scenario: needs at least one pipeline")
    jobs: list[JobSpec] = []
    placements: list[Placement] = []
    names: dict[str, int] = {}
    for i, p in enumerate(pipes):
        where = f"pipelines[{i}]"
        if not isinstance(p, Mapping):
            raise ScenarioError(f"{where}: expected a table/object")
        unknown = sorted(str(k) for k in set(p) - PIPELINE_FIELDS)
        if unknown:
            raise ScenarioError(
                f"{where}: unknown fields {unknown}; expected {sorted(PIPELINE_FIELDS)}"
            )
        train = _gpu_ids(p, "train", where, gpn * nodes)
        infer = _gpu_ids(p, "infer", where, gpn * nodes)
        tp = _get(p, "infer_tp", int, where, 1)
        if tp < 1 or len(infer) % tp:
            raise ScenarioError(
                f"{where}: infer_tp must be >= 1 and divide the {len(infer)} infer GPUs, got {tp}"
            )
        batch = _get(p, "batch", int, where)
        ranks = max(1, len(infer) // tp)
        dedicated_infer = len([g for g in infer if g not in train]) or len(infer)
        dedicated_infer = -(-dedicated_infer // tp) * tp
        turn = _get(p, "turn_s", float, where, math.inf)
        kind = _get(p, "kind", str, where, "roll")
        if kind not in PIPELINE_KINDS:
            raise ScenarioError(f"{where}: kind {kind!r} is not one of {PIPELINE_KINDS}")
        job_name = _get(p, "name", str, where, f"ft_{i + 1:012x}")
        if job_name in names:
            raise ScenarioError(
                f"{where}: name {job_name!r} is used by pipelines {names[job_name]} and {i}; "
                "each pipeline needs its own name"
            )
        names[job_name] = i
        try:
            job = JobSpec(
                name=job_name,
                arrival_s=_number(p, "arrival_s", where, 0.0),
                steps=_get(p, "steps", int, where),
                batch=batch,
                train_gpus=-(-len(train) // tp) * tp,
                infer_gpus=dedicated_infer,
                infer_tp=tp,
                n_sat=_get(p, "n_sat", int, where, -(-batch // ranks)),
                max_seqs=_get(p, "max_seqs", int, where, 2 * -(-batch // ranks)),
                lengths=_record(LengthDistribution, _get(p, "lengths", dict, where), where),
                turn_s=turn,
                phases=_record(PhaseTimes, _get(p, "phases", dict, where), where),
                costs=_record(SwitchCosts, _get(p, "costs", dict, where, {}), where),
                max_age=_get(p, "max_age", int, where, 0),
                weight=_number(p, "weight", where, 1.0, positive=True),
                source=f"scenario {name}",
                kind=kind,
                redispatch_prefill_s=_number(p, "redispatch_prefill_s", where, 1.0),
            )
        except ScenarioError:
            raise
        except ValueError as exc:  # a JobSpec field out of range
            raise ScenarioError(f"{where}: {exc}") from None
        try:  # what the shared deployments register: refused here, not after other runs
            validate_registration(
                Topology(nodes, gpn),
                pipeline_id=job.name,
                ray_namespace=pipeline_namespace(job.name),
                cluster_tp_configs={ACTOR_TRAIN: 1, ACTOR_INFER: tp},
                cluster_device_mappings={ACTOR_TRAIN: list(train), ACTOR_INFER: list(infer)},
                weight=job.weight,
            )
        except RegistrationError as exc:
            raise ScenarioError(f"{where}: {exc}") from None
        jobs.append(job)
        placements.append(Placement(train, infer))
    return Workload(
        name=name,
        description=_get(data, "description", str, "scenario", f"scenario {name}"),
        jobs=tuple(jobs),
        gpus_per_node=gpn,
        exclusive_nodes=_exclusive_nodes(jobs, gpn),
        shared_nodes=nodes,
        shared_placements=tuple(placements),
        sources=(f"scenario {name}",),
    )
