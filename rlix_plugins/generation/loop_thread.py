"""An asyncio event loop on a daemon thread, for sync callers of the async generation pieces.

The coordinator actor calls ``resize_infer`` from its own (sync) threads while a pipeline's
engines, router and lifecycle are asyncio objects bound to one loop (``AsyncLLM`` binds to the
loop that first uses it); every call is handed to that loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class LoopThread:
    """One event loop running forever on a daemon thread."""

    def __init__(self, name: str = "rlix-shards", *, default_timeout: float | None = None) -> None:
        self.default_timeout = default_timeout
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True, name=name)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and wait for its result (at most ``timeout`` seconds, or
        the default timeout)."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return future.result(timeout if timeout is not None else self.default_timeout)

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the loop without waiting."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
