"""The orchestrator actor, ``rlix:orchestrator``: pipeline ids, registration and admission.

It holds no state of its own: the registry lives in the scheduler (one owner), so the
orchestrator forwards to ``rlix:scheduler`` and can be restarted freely.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import ray

from rlix_plugins.errors import UnknownPipelineError
from rlix_plugins.protocol.names import SCHEDULER_ACTOR, new_pipeline_id

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class AdmitResponse:
    """Answer of ``admit_pipeline``: the scheduler handle the pipeline should call."""

    success: bool
    pipeline_id: str
    scheduler: Any
    namespace: str


class OrchestratorService:
    """Undecorated implementation; served as a detached async Ray actor by :mod:`.client`."""

    def __init__(self, namespace: str = "rlix") -> None:
        self.namespace = namespace
        self._scheduler: Any = None

    def _sched(self) -> Any:
        # Looked up lazily and cached: the scheduler keeps its actor id across Ray restarts.
        if self._scheduler is None:
            self._scheduler = ray.get_actor(SCHEDULER_ACTOR, namespace=self.namespace)
        return self._scheduler

    async def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """``method`` on the scheduler; a scheduler stopped and created anew (a new actor id:
        ``rlix-plugins coordinator start`` after a kill) is looked up again once, or every
        later call would fail on the dead handle."""
        for attempt in (0, 1):
            try:
                return await getattr(self._sched(), method).remote(*args, **kwargs)
            except ray.exceptions.RayActorError:
                self._scheduler = None
                if attempt:
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    async def allocate_pipeline_id(self, pipeline_type: str) -> str:
        """A fresh ``{ft|lora}_{12 hex}`` id."""
        return new_pipeline_id(pipeline_type)

    async def register_pipeline(
        self,
        *,
        pipeline_id: str,
        ray_namespace: str,
        cluster_tp_configs: dict[str, int],
        cluster_device_mappings: dict[str, list[int]],
        weight: float = 1.0,
    ) -> None:
        """Validate and register (raises RegistrationError with the state unchanged)."""
        await self._call(
            "register_pipeline",
            pipeline_id=pipeline_id,
            ray_namespace=ray_namespace,
            cluster_tp_configs=cluster_tp_configs,
            cluster_device_mappings=cluster_device_mappings,
            weight=weight,
        )

    async def admit_pipeline(self, *, pipeline_id: str) -> AdmitResponse:
        """Admit a registered pipeline; the response carries the scheduler handle."""
        await self._call("admit_pipeline", pipeline_id=pipeline_id)
        return AdmitResponse(True, pipeline_id, self._sched(), self.namespace)

    async def unregister_pipeline(self, pipeline_id: str) -> tuple[int, ...]:
        """Forget a pipeline (it stopped using its GPUs); returns the GPUs freed."""
        freed: tuple[int, ...] = await self._call("unregister_pipeline", pipeline_id)
        return freed

    async def kill_pipeline(self, pipeline_id: str) -> None:
        """Kill a pipeline's actors; its GPUs return once Ray confirms it dead."""
        await self._call("kill_pipeline", pipeline_id)

    async def shutdown(self, *, force: bool = False, reason: str | None = None, **_: Any) -> int:
        """End every pipeline's scheduling (unlike RLix, Ray itself keeps running).

        ``force`` also kills the pipelines' actors. The control-plane actors stay up; stop
        them with ``rlix-plugins coordinator stop``. Returns how many pipelines were ended
        (one that went away meanwhile, e.g. declared dead, is skipped, not an error).
        """
        status = await self._call("get_status")
        ended = 0
        for p in status.pipelines:
            try:
                if force:
                    await self._call("kill_pipeline", p.pipeline_id)
                else:
                    await self._call("unregister_pipeline", p.pipeline_id)
            except UnknownPipelineError:
                logger.info("shutdown: pipeline %s was already gone", p.pipeline_id)
                continue
            ended += 1
        logger.warning("shutdown (%s): ended %d pipeline(s)", reason, ended)
        return ended

    async def ping(self) -> bool:
        return True
