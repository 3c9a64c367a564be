"""Driving asyncio interleavings step by step in tests (no timed sleeps)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

#: bound on one test's event loop: a regression fails here instead of hanging the session
TEST_BOUND_S = 30.0


def run_bounded(coro: Coroutine[Any, Any, Any]) -> Any:
    """``asyncio.run(coro)``, failing after :data:`TEST_BOUND_S`."""
    return asyncio.run(asyncio.wait_for(coro, TEST_BOUND_S))


async def quiesce() -> None:
    """Let every runnable task run until all wait on something (no I/O: deterministic)."""
    for _ in range(50):
        await asyncio.sleep(0)
