"""Hook protocol between a host training loop and the coordinator."""

from __future__ import annotations

from typing import Any

from rlix_plugins.errors import SettingsError
from rlix_plugins.hooks.protocol import NoOpRLixHooks, RLixHooks
from rlix_plugins.settings import ENV_PIPELINE_ID, Settings, settings_if_enabled


def make_hooks(
    settings: Settings | None = None,
    *,
    pipeline_id: str | None = None,
    scheduler: Any = None,
    heartbeat: bool = True,
) -> RLixHooks:
    """The hooks a host should call: no-ops when the control plane is off, else
    :class:`~rlix_plugins.hooks.coordinator_hooks.CoordinatorHooks` for ``pipeline_id``
    (default: ``PIPELINE_ID`` from the environment). Off, no other variable is read."""
    s = settings if settings is not None else settings_if_enabled()
    if s is None or not s.enabled:
        return NoOpRLixHooks()
    pid = pipeline_id or s.pipeline_id
    if not pid:
        raise SettingsError(
            f"the control plane is on but no pipeline id is known; set {ENV_PIPELINE_ID} or "
            "pass pipeline_id"
        )
    from rlix_plugins.hooks.coordinator_hooks import CoordinatorHooks

    return CoordinatorHooks(pid, s, scheduler=scheduler, heartbeat=heartbeat)


__all__ = ["NoOpRLixHooks", "RLixHooks", "make_hooks"]
