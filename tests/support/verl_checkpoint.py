"""An ``RLixCheckpointEngineManager`` for refresh tests without veRL's worker groups: bound to
``replicas`` (all ACTIVE, dp ranks 0..n-1), its cache sync a no-op that reports 0 s."""

from __future__ import annotations

from typing import Any


def bare_refresh_manager(replicas: list[Any]) -> Any:
    """The manager as ``bind`` leaves it, built without veRL's ``__init__`` (it needs worker
    groups on GPUs); ``_refresh`` then drives ``replicas``' abort/resume calls."""
    from rlix_plugins.patches.verl_checkpoint import RLixCheckpointEngineManager

    mgr = RLixCheckpointEngineManager.__new__(RLixCheckpointEngineManager)
    mgr.replicas = replicas
    mgr._active = lambda: set(range(len(replicas)))
    mgr._ranks = list(range(len(replicas)))
    mgr._observe = None
    mgr.refreshed = []
    mgr.rlix_sync = lambda indices, version: {"seconds": 0.0}
    return mgr
