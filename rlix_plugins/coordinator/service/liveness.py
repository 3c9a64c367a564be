"""Is a pipeline still there? Name lookups and probes of its coordinator actor.

Every Ray actor answers ``__ray_ready__``, so the probe needs nothing from the pipeline (ROLL's
coordinator actor works as is). A probe that times out means "busy", never "dead": only Ray's
own verdict (the actor died, or its name is gone after it was seen) counts as death.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from typing import Any

import ray

from rlix_plugins.protocol.names import (
    pipeline_actor,
    pipeline_coordinator_actor,
    pipeline_namespace,
)

logger = logging.getLogger(__name__)


class Liveness(str, enum.Enum):
    ALIVE = "alive"
    DEAD = "dead"
    #: no verdict: the actor never appeared (yet), or it did not answer in time
    UNKNOWN = "unknown"


def _lookup(name: str, namespace: str) -> Any:
    try:
        return ray.get_actor(name, namespace=namespace)
    except ValueError:
        return None


async def lookup_actor(name: str, namespace: str) -> Any:
    """The named actor's handle, or None. Runs in a thread: the lookup is a blocking GCS call
    and must not stall the scheduler's event loop."""
    return await asyncio.to_thread(_lookup, name, namespace)


async def lookup_coordinator(pipeline_id: str, ray_namespace: str | None = None) -> Any:
    """Handle of ``rlix:coordinator:{pipeline_id}`` (in the pipeline's namespace), or None."""
    return await lookup_actor(
        pipeline_coordinator_actor(pipeline_id), ray_namespace or pipeline_namespace(pipeline_id)
    )


async def probe(handle: Any, timeout_s: float) -> Liveness:
    """Ask a resolved actor whether it is alive."""

    async def ready() -> Any:
        return await handle.__ray_ready__.remote()

    try:
        await asyncio.wait_for(ready(), timeout_s)
        return Liveness.ALIVE
    except asyncio.TimeoutError:
        return Liveness.UNKNOWN
    except ray.exceptions.ActorUnavailableError:
        return Liveness.UNKNOWN  # restarting or unreachable for now: not a verdict
    except ray.exceptions.RayActorError:
        return Liveness.DEAD


async def kill_pipeline_actors(pipeline_id: str, ray_namespace: str | None = None) -> list[str]:
    """Fence a failed pipeline: kill its coordinator and pipeline actors (never anything else).

    Killing the pipeline actor also ends the workers it owns (Ray fate-sharing), so a shard whose
    shrink failed stops using its GPU. Returns the names that were killed.
    """
    namespace = ray_namespace or pipeline_namespace(pipeline_id)
    killed = []
    for name in (pipeline_coordinator_actor(pipeline_id), pipeline_actor(pipeline_id)):
        handle = await lookup_actor(name, namespace)
        if handle is None:
            continue
        try:
            ray.kill(handle, no_restart=True)
            killed.append(name)
        except Exception:  # already gone: that is what we wanted
            logger.debug("kill of %s failed", name, exc_info=True)
    return killed
