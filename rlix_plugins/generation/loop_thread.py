"""An asyncio event loop on a daemon thread, for sync callers of the async generation pieces.

The coordinator actor calls ``resize_infer`` from its own (sync) threads while a pipeline's
engines, router and lifecycle are asyncio objects bound to one loop (``AsyncLLM`` binds to the
loop that first uses it); every call is handed to that loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from rlix_plugins.errors import RequestStateError

T = TypeVar("T")

logger = logging.getLogger(__name__)

#: How long :meth:`LoopThread.close` waits for cancelled tasks to finish, and for the thread.
_CLOSE_WAIT_S = 10.0


class LoopThread:
    """One event loop running forever on a daemon thread, until :meth:`close`."""

    def __init__(self, name: str = "rlix-shards", *, default_timeout: float | None = None) -> None:
        self.default_timeout = default_timeout
        self.loop = asyncio.new_event_loop()
        self._close_lock = threading.Lock()
        self._closed = False
        #: futures of coroutines handed to the loop and not done yet (close() cancels any the
        #: stopped loop left behind, so nobody waits on them forever)
        self._inflight: set[concurrent.futures.Future[Any]] = set()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True, name=name)
        self._thread.start()

    @property
    def closed(self) -> bool:
        return self._closed

    def _submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Hand ``coro`` to the loop, or refuse with :class:`RequestStateError` once closed.

        Checked and submitted under the close lock, which :meth:`close` takes to mark the
        loop closed: a coroutine either reaches the loop before close() cancels its tasks (and
        is cancelled with them) or is refused here. It is never queued on a loop that already
        stopped, where its future would never complete (and a run() waiting on it hang).
        """
        with self._close_lock:
            if self._closed or not self._thread.is_alive():
                coro.close()  # never scheduled: close it so Python does not warn "never awaited"
                state = "is closed" if self._closed else "has stopped (its thread ended)"
                raise RequestStateError(
                    f"LoopThread {self._thread.name} {state}; create a new one"
                )
            future = asyncio.run_coroutine_threadsafe(coro, self.loop)
            self._inflight.add(future)
        future.add_done_callback(self._forget)
        return future

    def _forget(self, future: concurrent.futures.Future[Any]) -> None:
        with self._close_lock:
            self._inflight.discard(future)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and wait for its result (at most ``timeout`` seconds, or
        the default timeout).

        If the wait ends without a result (timeout, interrupt) the coroutine is cancelled
        (at its next await): a caller told the call failed must not see it go ahead later.

        Raises:
            RequestStateError: the loop is closed, or was closed while the call waited (the
                coroutine was cancelled).
            RuntimeError: called on the loop's own thread (a sync callback running on the
                loop): blocking there would stop the loop that has to run ``coro``, so the
                call could only time out or hang; ``await`` the coroutine instead.
        """
        if threading.current_thread() is self._thread:
            coro.close()  # never scheduled: close it so Python does not warn "never awaited"
            raise RuntimeError(
                f"LoopThread.run() called on its own loop thread {self._thread.name} would "
                "deadlock (the loop cannot run the coroutine while run() blocks it); await "
                "the coroutine instead"
            )
        future = self._submit(coro)
        try:
            return future.result(timeout if timeout is not None else self.default_timeout)
        except concurrent.futures.CancelledError:
            if self._closed:
                raise RequestStateError(
                    f"LoopThread {self._thread.name} was closed while the call waited; the "
                    "coroutine was cancelled"
                ) from None
            raise
        except BaseException:
            future.cancel()  # no-op when the coroutine itself raised (already done)
            raise

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the loop without waiting (:class:`RequestStateError` once
        closed; close() cancels the future if the coroutine has not finished by then)."""
        return self._submit(coro)

    def close(self) -> None:
        """Cancel every task still on the loop, stop it, join its thread and close the loop
        (releasing its selector and self-pipe fds). Idempotent; not from the loop's thread."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("LoopThread.close() called on its own loop thread would "
                               "deadlock; call it from another thread")
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        if self._thread.is_alive():
            try:
                asyncio.run_coroutine_threadsafe(_cancel_tasks(), self.loop).result(
                    _CLOSE_WAIT_S + 1.0)
            except Exception:
                logger.warning("loop thread %s: cancelling its tasks failed", self._thread.name,
                               exc_info=True)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=_CLOSE_WAIT_S)
        # A task that ignored its cancellation (or a loop that stopped under it) leaves its
        # future pending: cancel it so its run() raises instead of waiting forever. Before
        # loop.close(): cancelling schedules a callback on the loop, which must not be closed.
        with self._close_lock:
            stranded = [f for f in self._inflight if not f.done()]
        for future in stranded:
            future.cancel()
        if self._thread.is_alive():
            # Closing a running loop raises; leave it to the daemon thread's end.
            logger.warning("loop thread %s did not stop within %.0fs; its loop stays open",
                           self._thread.name, _CLOSE_WAIT_S)
            return
        self.loop.close()


async def _cancel_tasks() -> None:
    current = asyncio.current_task()
    tasks = [t for t in asyncio.all_tasks() if t is not current]
    for t in tasks:
        t.cancel()
    if tasks:
        # Bounded: a task that swallows its cancellation must not block close() forever.
        _, pending = await asyncio.wait(tasks, timeout=_CLOSE_WAIT_S)
        if pending:
            logger.warning("%d task(s) ignored cancellation at loop close", len(pending))
