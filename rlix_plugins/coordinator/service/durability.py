"""Nobody acts on a decision a restart would not restore.

The scheduler saves its record after every commit and registry change. When a save fails, the
decision stays applied in memory, but its answers are held back: a commit's answers (grants,
release acknowledgements, background expands) wait in commit order until a save succeeds
(:meth:`Durability.hold` / :meth:`Durability.retry`, retried each cycle), and an answer to a
release or (un)registration waits for one with backoff (:meth:`Durability.until_saved`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from rlix_plugins.coordinator.service.persistence import StateStore
from rlix_plugins.errors import CoordinatorUnavailableError

logger = logging.getLogger(__name__)


class Durability:
    """Saves the record ``build_record`` returns to ``store``; holds answers until saved."""

    def __init__(
        self,
        store: StateStore,
        build_record: Callable[[], dict[str, Any]],
        *,
        namespace: str,
        timeout_s: float,
    ) -> None:
        self.store = store
        self._build_record = build_record
        self._namespace = namespace
        self._timeout_s = timeout_s
        #: whether the last save succeeded
        self.saved = True
        #: answers of commits whose save failed, in commit order
        self.held: list[Callable[[], None]] = []

    def save(self) -> bool:
        """Save the record now; False when the save failed (logged, never raised: a store
        outage must not take the scheduler down). ``build_record`` may raise (a stopped
        scheduler refuses to save), and that does propagate."""
        record = self._build_record()
        try:
            self.store.save(record)
        except Exception:
            logger.exception("scheduler %s: persisting state failed", self._namespace)
            self.saved = False
            return False
        self.saved = True
        return True

    async def until_saved(self, what: str) -> None:
        """Return once the state as it is now has been saved. A release or (un)registration
        answered before its save would be undone by a restart while its caller acts on it
        (a released cluster still holding its GPUs, a registered pipeline unknown). Retried
        with backoff up to ``timeout_s``, then :class:`CoordinatorUnavailableError` (the event
        stays applied in memory and is saved with the next successful save)."""
        if self.saved:
            return
        deadline = time.monotonic() + self._timeout_s
        delay = 0.05
        while not self.save():
            if time.monotonic() >= deadline:
                raise CoordinatorUnavailableError(
                    f"{what}: the coordinator could not save its state for "
                    f"{self._timeout_s:g}s (see its log); retry the call"
                )
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)

    def hold(self, answer: Callable[[], None], *, durable: bool) -> None:
        """Run a commit's ``answer`` now if its save succeeded (``durable``) and no earlier
        answer is held; else hold it until :meth:`retry` saves (answers keep commit order)."""
        if durable and not self.held:
            answer()
        else:
            self.held.append(answer)

    def retry(self) -> bool:
        """Save again and run the held answers; False while saving fails."""
        if not self.save():
            return False
        waiting, self.held = self.held, []
        for answer in waiting:
            answer()
        return True
