"""Validation of ``register_pipeline`` arguments into an immutable :class:`PipelineSpec`."""

from __future__ import annotations

import math
from collections.abc import Mapping

from rlix_plugins.coordinator.core.model import ClusterSpec, PipelineSpec, Topology
from rlix_plugins.errors import ProtocolError, RegistrationError
from rlix_plugins.protocol.names import (
    GPU_CLUSTER_NAMES,
    REWARD,
    cluster_id,
    validate_pipeline_id,
)
from rlix_plugins.values import is_int

_SMALL_TP = (1, 2, 4, 8)


def _as_float(value: int | float) -> float:
    """``float(value)``; NaN for an int too large for a float (refused like NaN)."""
    try:
        return float(value)
    except OverflowError:
        return math.nan


def _valid_tp(tp: int, gpus_per_node: int) -> bool:
    return tp in _SMALL_TP or (tp > 0 and tp % gpus_per_node == 0)


def validate_cluster(
    topology: Topology, pipeline_id: str, name: str, tp: object, mapping: object
) -> ClusterSpec:
    """Check one cluster's TP size and device mapping; raise :class:`RegistrationError`."""
    where = f"pipeline {pipeline_id!r} cluster {name!r}"
    if not is_int(tp) or not _valid_tp(tp, topology.gpus_per_node):
        raise RegistrationError(
            f"{where}: tp={tp!r} is not valid; expected one of {_SMALL_TP} or a multiple of "
            f"gpus_per_node={topology.gpus_per_node}"
        )
    if not isinstance(mapping, (list, tuple)) or not mapping:
        raise RegistrationError(f"{where}: device mapping must be a non-empty list of GPU ids")
    if not all(is_int(g) for g in mapping):
        raise RegistrationError(f"{where}: device mapping must hold ints, got {mapping!r}")
    gpus = tuple(int(g) for g in mapping)
    bad = [g for g in gpus if not 0 <= g < topology.num_gpus]
    if bad:
        raise RegistrationError(
            f"{where}: GPU ids {bad} are outside 0..{topology.num_gpus - 1} "
            f"({topology.num_nodes} nodes x {topology.gpus_per_node} GPUs)"
        )
    if len(set(gpus)) != len(gpus):
        raise RegistrationError(f"{where}: device mapping lists a GPU twice: {list(gpus)}")
    if list(gpus) != sorted(gpus):
        raise RegistrationError(f"{where}: device mapping must be sorted, got {list(gpus)}")
    if len(gpus) % tp:
        raise RegistrationError(
            f"{where}: {len(gpus)} GPUs is not a multiple of tp={tp}; every TP group needs tp GPUs"
        )
    gpn = topology.gpus_per_node
    for start in range(0, len(gpus), tp):
        group = gpus[start : start + tp]
        if group[-1] - group[0] != tp - 1:
            raise RegistrationError(f"{where}: TP group {list(group)} is not contiguous")
        if tp <= gpn:
            if topology.node_of(group[0]) != topology.node_of(group[-1]):
                raise RegistrationError(
                    f"{where}: TP group {list(group)} crosses a node boundary "
                    f"(gpus_per_node={gpn}); a TP group must stay inside one node"
                )
        elif group[0] % gpn:
            raise RegistrationError(
                f"{where}: TP group {list(group)} spans nodes but does not start on a node "
                f"boundary (gpus_per_node={gpn})"
            )
    return ClusterSpec(
        cluster_id=cluster_id(pipeline_id, name),
        pipeline_id=pipeline_id,
        name=name,
        tp=tp,
        gpus=gpus,
    )


def validate_registration(
    topology: Topology,
    *,
    pipeline_id: object,
    ray_namespace: object,
    cluster_tp_configs: object,
    cluster_device_mappings: object,
    weight: object = 1.0,
) -> PipelineSpec:
    """Turn RLix's ``register_pipeline`` keyword arguments into a :class:`PipelineSpec`.

    ``reward`` (CPU-only, never scheduled) is accepted and ignored, as RLix does.
    """
    try:
        pid = validate_pipeline_id(pipeline_id)
    except ProtocolError as exc:
        raise RegistrationError(str(exc)) from None
    if not isinstance(ray_namespace, str) or not ray_namespace:
        raise RegistrationError(f"ray_namespace must be a non-empty str, got {ray_namespace!r}")
    if not isinstance(cluster_tp_configs, Mapping) or not isinstance(
        cluster_device_mappings, Mapping
    ):
        raise RegistrationError(
            "cluster_tp_configs and cluster_device_mappings must be dicts keyed by cluster name"
        )
    names = set(cluster_device_mappings) - {REWARD}
    unknown = sorted(str(n) for n in names if n not in GPU_CLUSTER_NAMES)
    if unknown:
        raise RegistrationError(
            f"pipeline {pid!r}: unknown cluster names {unknown}; expected names from "
            f"{GPU_CLUSTER_NAMES} (and 'reward', which is not scheduled)"
        )
    missing_tp = sorted(str(n) for n in names if n not in cluster_tp_configs)
    if missing_tp:
        raise RegistrationError(f"pipeline {pid!r}: no tp config for clusters {missing_tp}")
    if not names:
        raise RegistrationError(f"pipeline {pid!r}: registers no GPU cluster")
    if (
        isinstance(weight, bool)
        or not isinstance(weight, (int, float))
        or not 0 < _as_float(weight) < math.inf
    ):
        raise RegistrationError(
            f"pipeline {pid!r}: weight must be a finite number > 0, got {weight!r}"
        )
    clusters = tuple(
        validate_cluster(
            topology, pid, name, cluster_tp_configs[name], cluster_device_mappings[name]
        )
        for name in GPU_CLUSTER_NAMES
        if name in names
    )
    return PipelineSpec(
        pipeline_id=pid, ray_namespace=ray_namespace, clusters=clusters, weight=float(weight)
    )
