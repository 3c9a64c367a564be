"""RLix-compatible Ray names, namespaces and id formats (see shared protocol.md)."""

from __future__ import annotations

import re
import secrets
from typing import Final

from rlix_plugins.errors import ProtocolError

CONTROL_PLANE_NAMESPACE: Final = "rlix"
ORCHESTRATOR_ACTOR: Final = "rlix:orchestrator"
SCHEDULER_ACTOR: Final = "rlix:scheduler"
RESOURCE_MANAGER_ACTOR: Final = "rlix:resource_manager"
ROLL_RESOURCE_MANAGER_ACTOR: Final = "rlix:roll_resource_manager"

ACTOR_TRAIN: Final = "actor_train"
ACTOR_INFER: Final = "actor_infer"
CRITIC: Final = "critic"
REFERENCE: Final = "reference"
REWARD: Final = "reward"
#: Clusters the scheduler knows; ``reward`` is CPU-only and never scheduled.
GPU_CLUSTER_NAMES: Final = (ACTOR_TRAIN, ACTOR_INFER, CRITIC, REFERENCE)
GENERATION_CLUSTER: Final = ACTOR_INFER

PIPELINE_TYPES: Final = ("ft", "lora")
_PIPELINE_ID_RE: Final = re.compile(r"[A-Za-z0-9_.\-]+")


def new_pipeline_id(pipeline_type: str) -> str:
    """Allocate ``"{ft|lora}_{12 hex}"`` as RLix does."""
    if pipeline_type not in PIPELINE_TYPES:
        raise ProtocolError(
            f"pipeline_type {pipeline_type!r} is not valid; expected one of {PIPELINE_TYPES}"
        )
    return f"{pipeline_type}_{secrets.token_hex(6)}"


def validate_pipeline_id(pipeline_id: object) -> str:
    """Return ``pipeline_id`` if it is a usable id (non-empty, no ``:``), else raise."""
    if not isinstance(pipeline_id, str) or not pipeline_id:
        raise ProtocolError(f"pipeline_id must be a non-empty str, got {pipeline_id!r}")
    # fullmatch: ``$`` in a plain match also accepts a trailing newline
    if not _PIPELINE_ID_RE.fullmatch(pipeline_id):
        raise ProtocolError(
            f"pipeline_id {pipeline_id!r} has invalid characters; "
            "allowed: letters, digits, '_', '.', '-' (never ':')"
        )
    return pipeline_id


def pipeline_namespace(pipeline_id: str) -> str:
    return f"pipeline_{pipeline_id}_NS"


def pipeline_coordinator_actor(pipeline_id: str) -> str:
    return f"rlix:coordinator:{pipeline_id}"


def pipeline_actor(pipeline_id: str) -> str:
    return f"rlix:pipeline:{pipeline_id}"


def model_update_service_actor(pipeline_id: str) -> str:
    return f"{pipeline_id}_model_update_service"


def cluster_id(pipeline_id: str, cluster_name: str) -> str:
    """``f"{pipeline_id}_{cluster_name}"`` for a known GPU cluster name."""
    validate_pipeline_id(pipeline_id)
    if cluster_name not in GPU_CLUSTER_NAMES:
        raise ProtocolError(
            f"cluster name {cluster_name!r} is not a GPU cluster; expected one of "
            f"{GPU_CLUSTER_NAMES}"
        )
    return f"{pipeline_id}_{cluster_name}"


def parse_cluster_id(value: object) -> tuple[str, str]:
    """Split a cluster id into ``(pipeline_id, cluster_name)`` by its known suffix."""
    if not isinstance(value, str):
        raise ProtocolError(f"cluster_id must be a str, got {value!r}")
    for name in GPU_CLUSTER_NAMES:
        suffix = "_" + name
        if value.endswith(suffix) and len(value) > len(suffix):
            pipeline_id = value[: -len(suffix)]
            validate_pipeline_id(pipeline_id)
            return pipeline_id, name
    raise ProtocolError(
        f"cluster_id {value!r} does not end in a known cluster name; expected "
        f"'{{pipeline_id}}_{{name}}' with name in {GPU_CLUSTER_NAMES}"
    )
