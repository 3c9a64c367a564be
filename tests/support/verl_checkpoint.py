"""Refresh-test helpers for ``RLixCheckpointEngineManager`` without veRL's worker groups.

:func:`fake_read_claim` (FAKE): a :class:`RefreshClaim` that reads a test's own record of the
ACTIVE replicas and claims nothing, for tests that drive the shard state by hand (no RLix load
balancer to claim on); :func:`bare_refresh_manager`: the manager bound to ``replicas``."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any


def fake_read_claim(active: Callable[[], Iterable[int]]) -> Any:
    """FAKE ``RefreshClaim``: ``begin(ranks)`` is ``active()`` read (restricted to ``ranks``),
    ``end`` does nothing. It does NOT claim: only for tests where no shrink can interleave
    (production binds the RLix load balancer's ``rlix_refresh_begin`` / ``_end``)."""
    from rlix_plugins.patches.verl_checkpoint import RefreshClaim

    return RefreshClaim(begin=lambda ranks: set(active()) & set(ranks), end=lambda ranks: None)


def bare_refresh_manager(replicas: list[Any]) -> Any:
    """The manager as ``bind`` leaves it, built without veRL's ``__init__`` (it needs worker
    groups on GPUs): all ``replicas`` ACTIVE (dp ranks 0..n-1, :func:`fake_read_claim`), its
    cache sync a no-op that reports 0 s; ``_refresh`` then drives their abort/resume calls."""
    from rlix_plugins.patches.verl_checkpoint import RLixCheckpointEngineManager

    mgr = RLixCheckpointEngineManager.__new__(RLixCheckpointEngineManager)
    mgr.replicas = replicas
    mgr._active = fake_read_claim(lambda: range(len(replicas)))
    mgr._ranks = list(range(len(replicas)))
    mgr._observe = None
    mgr.refreshed = []
    mgr.rlix_sync = lambda indices, version: {"seconds": 0.0}
    return mgr
