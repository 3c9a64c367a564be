"""Get-or-create the coordinator actors and hand out their handles.

``connect()`` is what every pipeline-side component calls: it returns the control plane's
handles, creating the detached actors when they are absent (so the first pipeline on a fresh
Ray cluster brings the coordinator up). ``stop_coordinator()`` removes them.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any

import ray

from rlix_plugins.coordinator.core.model import Topology
from rlix_plugins.coordinator.core.status import CoordinatorStatus
from rlix_plugins.coordinator.service.config import ServiceConfig
from rlix_plugins.coordinator.service.orchestrator_actor import OrchestratorService
from rlix_plugins.coordinator.service.resource_manager import (
    ResourceManagerService,
    RollResourceManagerService,
)
from rlix_plugins.coordinator.service.scheduler_actor import SchedulerService
from rlix_plugins.errors import CoordinatorUnavailableError
from rlix_plugins.protocol.names import (
    ORCHESTRATOR_ACTOR,
    RESOURCE_MANAGER_ACTOR,
    ROLL_RESOURCE_MANAGER_ACTOR,
    SCHEDULER_ACTOR,
)
from rlix_plugins.settings import Settings, load_settings

logger = logging.getLogger(__name__)

CONTROL_ACTORS = (
    ORCHESTRATOR_ACTOR,
    SCHEDULER_ACTOR,
    RESOURCE_MANAGER_ACTOR,
    ROLL_RESOURCE_MANAGER_ACTOR,
)


# Decorated here, not on the classes: Ray freezes a decorated class's methods, and the
# undecorated classes stay importable and subclassable.
_SchedulerActor = ray.remote(SchedulerService)
_OrchestratorActor = ray.remote(OrchestratorService)
_ResourceManagerActor = ray.remote(ResourceManagerService)
_RollResourceManagerActor = ray.remote(RollResourceManagerService)


@dataclass(frozen=True, slots=True)
class ControlPlane:
    """Handles of one coordinator (all in ``namespace``)."""

    namespace: str
    orchestrator: Any
    scheduler: Any
    resource_manager: Any
    roll_resource_manager: Any

    def status(self, timeout_s: float | None = None) -> CoordinatorStatus:
        """The scheduler's :class:`CoordinatorStatus` (blocks; ``timeout_s`` bounds the call,
        :class:`ray.exceptions.GetTimeoutError` past it)."""
        status: CoordinatorStatus = ray.get(
            self.scheduler.get_status.remote(), timeout=timeout_s
        )
        return status


def _get(name: str, namespace: str) -> Any:
    try:
        return ray.get_actor(name, namespace=namespace)
    except ValueError:
        return None


def _options(name: str, namespace: str) -> dict[str, Any]:
    # num_cpus=0: a control-plane actor must never hold a CPU a worker needs. Restarts are
    # unlimited and in-flight calls are retried on the restarted actor, so a pipeline blocked
    # in request_gpus rides through a scheduler crash without noticing.
    return {
        "name": name,
        "namespace": namespace,
        "lifetime": "detached",
        "num_cpus": 0,
        "max_restarts": -1,
        "max_task_retries": -1,
        "get_if_exists": True,
    }


def _init_ray(address: str | None) -> None:
    if not ray.is_initialized():
        ray.init(address=address or "auto", log_to_driver=False)


def connect(
    settings: Settings | None = None,
    *,
    namespace: str | None = None,
    create_if_missing: bool = True,
    config: ServiceConfig | None = None,
    topology: Topology | None = None,
    address: str | None = None,
    ready_timeout_s: float = 60.0,
) -> ControlPlane:
    """Handles of the coordinator in ``namespace`` (default: settings.namespace).

    Creates the detached actors when absent and ``create_if_missing``; otherwise raises
    :class:`CoordinatorUnavailableError`. ``config`` / ``topology`` only matter on creation.
    """
    s = settings or load_settings()
    ns = namespace or (config.namespace if config else s.namespace)
    _init_ray(address)
    cfg = config or ServiceConfig.from_settings(s)
    cfg = dataclasses.replace(cfg, namespace=ns, topology=topology or cfg.topology)
    handles = {name: _get(name, ns) for name in CONTROL_ACTORS}
    missing = [n for n, h in handles.items() if h is None]
    if missing and not create_if_missing:
        raise CoordinatorUnavailableError(
            f"coordinator actors {missing} are not running in namespace {ns!r}; start them "
            "with `rlix-plugins coordinator start`"
        )
    if missing:
        # The scheduler first: the orchestrator looks it up by name.
        if handles[SCHEDULER_ACTOR] is None:
            handles[SCHEDULER_ACTOR] = _SchedulerActor.options(
                **_options(SCHEDULER_ACTOR, ns)
            ).remote(cfg)
        if handles[ORCHESTRATOR_ACTOR] is None:
            handles[ORCHESTRATOR_ACTOR] = _OrchestratorActor.options(
                **_options(ORCHESTRATOR_ACTOR, ns)
            ).remote(ns)
        if handles[RESOURCE_MANAGER_ACTOR] is None:
            handles[RESOURCE_MANAGER_ACTOR] = _ResourceManagerActor.options(
                **_options(RESOURCE_MANAGER_ACTOR, ns)
            ).remote(cfg.topology)
        if handles[ROLL_RESOURCE_MANAGER_ACTOR] is None:
            handles[ROLL_RESOURCE_MANAGER_ACTOR] = _RollResourceManagerActor.options(
                **_options(ROLL_RESOURCE_MANAGER_ACTOR, ns)
            ).remote(cfg.topology, namespace=ns)
        logger.info("created coordinator actors %s in namespace %r", missing, ns)
    plane = ControlPlane(
        namespace=ns,
        orchestrator=handles[ORCHESTRATOR_ACTOR],
        scheduler=handles[SCHEDULER_ACTOR],
        resource_manager=handles[RESOURCE_MANAGER_ACTOR],
        roll_resource_manager=handles[ROLL_RESOURCE_MANAGER_ACTOR],
    )
    try:
        ray.get(
            [plane.scheduler.ping.remote(), plane.orchestrator.ping.remote()],
            timeout=ready_timeout_s,
        )
    except Exception as exc:
        raise CoordinatorUnavailableError(
            f"coordinator in namespace {ns!r} did not answer within {ready_timeout_s:g}s: {exc}"
        ) from exc
    return plane


def scheduler_handle(namespace: str) -> Any:
    """The scheduler's handle, or :class:`CoordinatorUnavailableError`."""
    handle = _get(SCHEDULER_ACTOR, namespace)
    if handle is None:
        raise CoordinatorUnavailableError(f"no {SCHEDULER_ACTOR} in namespace {namespace!r}")
    return handle


def stop_coordinator(
    namespace: str, *, clear_state: bool = True, timeout_s: float = 30.0
) -> list[str]:
    """Stop the coordinator actors of ``namespace``; returns the names that were running.

    Pipelines keep running (nothing else on Ray is touched); their next call finds no
    coordinator. ``clear_state`` forgets the saved allocation state.
    """
    stopped = []
    sched = _get(SCHEDULER_ACTOR, namespace)
    cleared = False
    if sched is not None:
        try:
            ray.get(sched.stop.remote(clear_state=clear_state), timeout=timeout_s)
            cleared = clear_state
        except Exception:
            logger.warning("scheduler did not stop cleanly; killing it", exc_info=True)
    roll = _get(ROLL_RESOURCE_MANAGER_ACTOR, namespace)
    if roll is not None:
        try:
            ray.get(roll.destroy_placement_group.remote(), timeout=timeout_s)
        except Exception:
            logger.warning("could not remove the shared placement groups", exc_info=True)
    for name in CONTROL_ACTORS:
        handle = _get(name, namespace)
        if handle is None:
            continue
        ray.kill(handle, no_restart=True)
        stopped.append(name)
    # Wait for the names to disappear so a new coordinator can be started right away.
    deadline = time.monotonic() + timeout_s
    for name in stopped:
        while _get(name, namespace) is not None and time.monotonic() < deadline:
            time.sleep(0.05)
    if clear_state and not cleared:
        # No scheduler cleared it (one that cannot start because its saved state is corrupt,
        # or one that did not stop in time): forget the default (Ray KV) state here, only now
        # that it is killed, since a scheduler still running would save it again. A
        # ServiceConfig.state_file is the operator's file to remove.
        from rlix_plugins.coordinator.service.persistence import KvStateStore

        try:
            KvStateStore(namespace).clear()
        except Exception:
            logger.warning("could not clear the saved state of %s", namespace, exc_info=True)
    return stopped
