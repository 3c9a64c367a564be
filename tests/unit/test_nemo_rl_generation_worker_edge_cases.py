"""Edge cases in the NeMo RL worker adapter and the vLLM plugin (pure unit tests).

NeMo RL is not installed here: its worker base class is a FAKE module placed in
``sys.modules`` for the duration of each test; the vLLM engine is a FAKE ``AsyncLLM``.
"""

from __future__ import annotations

import asyncio
import importlib
import sys
import types
from collections.abc import AsyncIterator, Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from rlix_plugins.errors import HostDriftError, SettingsError, ShardPreemptedError
from rlix_plugins.patches import vllm as vllm_patch

_WORKERS = "rlix_plugins.adapters.nemo_rl_workers"
_FAKE_BASE = "nemo_rl.models.generation.vllm.vllm_worker_async"


class FakeWorkerImpl:
    """FAKE NeMo RL ``VllmAsyncGenerationWorkerImpl`` (only what the subclass touches)."""

    llm: Any
    cfg: Any


@pytest.fixture
def workers(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The workers module imported over FAKE NeMo RL modules; removed again afterwards."""
    parts = _FAKE_BASE.split(".")
    for i in range(1, len(parts) + 1):
        name = ".".join(parts[:i])
        mod = types.ModuleType(name)
        if name == _FAKE_BASE:
            mod.VllmAsyncGenerationWorkerImpl = FakeWorkerImpl  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.delitem(sys.modules, _WORKERS, raising=False)
    module = importlib.import_module(_WORKERS)
    yield module
    sys.modules.pop(_WORKERS, None)


def _out(finish_reason: str | None) -> Any:
    return SimpleNamespace(
        finished=finish_reason is not None,
        outputs=[SimpleNamespace(token_ids=[], logprobs=None, finish_reason=finish_reason)],
    )


class FakeAsyncLLM:
    """FAKE vLLM 0.32 ``AsyncLLM``: ``generate`` awaits input processing (``release``) before
    the request is registered in ``output_processor.external_req_ids``, as the real one does
    (``process_inputs_async`` / ``get_supported_tasks`` precede ``_add_request``)."""

    def __init__(self, version: int | None = 5) -> None:
        self.output_processor = SimpleNamespace(external_req_ids={}, request_states={})
        self.release = asyncio.Event()
        self._aborted: dict[str, asyncio.Event] = {}
        self.version = version
        self.sleep_error: Exception | None = None

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.external_req_ids)

    async def generate(self, prompt: Any, params: Any, request_id: str) -> AsyncIterator[Any]:
        await self.release.wait()
        self.output_processor.external_req_ids[request_id] = [request_id]
        event = self._aborted.setdefault(request_id, asyncio.Event())
        await event.wait()
        # vLLM drops a finished request from its map before delivering the last output.
        self.output_processor.external_req_ids.pop(request_id, None)
        yield _out("abort")

    async def abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._aborted.setdefault(rid, asyncio.Event()).set()

    async def sleep(self, level: int = 1, mode: str = "abort") -> None:
        if self.sleep_error is not None:
            raise self.sleep_error

    async def reset_prefix_cache(self) -> None:
        return None

    async def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        assert method == "rlix_weight_version"
        return [self.version]


def _worker(workers: Any, engine: FakeAsyncLLM, cfg: Any = None) -> Any:
    w = object.__new__(workers.RLixVllmAsyncGenerationWorkerImpl)
    w.llm = engine
    w.cfg = cfg if cfg is not None else {}
    w.rlix_install()
    return w


def test_request_still_submitting_counts_as_running(workers: Any) -> None:
    """A request that passed the gate but is not registered in vLLM yet must keep the shard
    from looking idle; otherwise the drain ends and the request lands in a sleeping engine."""

    async def scenario() -> None:
        engine = FakeAsyncLLM()
        w = _worker(workers, engine)

        async def consume() -> None:
            async for _ in w.llm.generate("p", SimpleNamespace(output_kind=None), "r1"):
                pass

        task = asyncio.create_task(consume())
        await asyncio.sleep(0)  # passed the gate, now in vLLM's input processing
        await w.rlix_abort_all()
        assert await w.rlix_num_running() == 1
        engine.release.set()
        for _ in range(5):
            await asyncio.sleep(0)
        await w.rlix_abort_all()  # the drain loop again: the request is registered now
        with pytest.raises(ShardPreemptedError):
            await task
        assert await w.rlix_num_running() == 0

    asyncio.run(scenario())


@pytest.mark.parametrize("path", ["rlix_sleep", "sleep_async"])
def test_failed_level2_sleep_reports_no_weight_version(workers: Any, path: str) -> None:
    """A level-2 sleep that fails part-way may have discarded the weights: the version the
    engine held must not be reported as applied any more."""

    async def scenario() -> None:
        engine = FakeAsyncLLM(version=5)
        w = _worker(workers, engine, {"rlix": {"sleep_level": 2}})
        assert await w.rlix_weight_version() == 5
        engine.sleep_error = RuntimeError("engine core RPC failed during sleep")
        with pytest.raises(RuntimeError, match="during sleep"):
            await (w.rlix_sleep(2) if path == "rlix_sleep" else w.sleep_async())
        assert await w.rlix_weight_version() is None

    asyncio.run(scenario())


def test_bad_sleep_level_config_is_a_typed_error(workers: Any) -> None:
    with pytest.raises(SettingsError, match=r"sleep_level=3 is not valid; expected 0, 1 or 2"):
        workers.configured_sleep_level({"rlix": {"sleep_level": 3}})
    with pytest.raises(SettingsError, match=r"policy\.generation\.rlix.*mapping"):
        workers.configured_sleep_level({"rlix": "deep"})
    assert workers.configured_sleep_level({"rlix": None}) == 2
    assert workers.configured_sleep_level({}) == 2


def test_unknown_extension_is_a_typed_error(workers: Any) -> None:
    with pytest.raises(SettingsError, match="no RLix counterpart; supported"):
        workers.rlix_extension_fqn("some.other.Extension")


def test_register_failure_leaves_module_state_unchanged(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    vllm_patch.revert()
    monkeypatch.setenv("RLIX_CONTROL_PLANE", "rlix")
    monkeypatch.setenv("RLIX_VLLM_SLEEP_LEVEL", "1")
    before = vllm_patch._sleep_level
    monkeypatch.setattr(vllm_patch, "_sleep_level", before)  # restored whatever happens

    def drift(self: Any) -> None:
        raise HostDriftError("FAKE drift: AsyncLLM moved")

    monkeypatch.setattr(vllm_patch.VllmPatch, "apply", drift)
    with pytest.raises(HostDriftError, match="FAKE drift: AsyncLLM moved"):
        vllm_patch.register()
    assert not vllm_patch.registered()
    assert vllm_patch._sleep_level == before


class FakeSleepyAsyncLLM(FakeAsyncLLM):
    """FAKE ``AsyncLLM`` that tracks sleep and runs the receiver extension as a slow call."""

    def __init__(self) -> None:
        super().__init__(version=None)
        self.asleep = False
        self.receiving = asyncio.Event()
        self.finish_receive = asyncio.Event()
        self.received_while_asleep = False

    async def sleep(self, level: int = 1, mode: str = "abort") -> None:
        self.asleep = True

    async def wake_up(self) -> None:
        self.asleep = False

    async def is_sleeping(self) -> bool:
        return self.asleep

    async def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        if method != "rlix_receive_weights":
            return await super().collective_rpc(method, args)
        self.received_while_asleep |= self.asleep
        self.receiving.set()
        await self.finish_receive.wait()
        self.received_while_asleep |= self.asleep
        self.version = 7
        return [{"shard_id": "s", "version": 7}]


def test_a_receive_never_runs_into_a_sleeping_engine(workers: Any) -> None:
    """The driver's refresh can race the coordinator's shrink: a receive into an engine asleep
    at level 2 would write into released weight memory. Refused while asleep; a sleep that
    arrives during a receive waits for it (and the version it applied is then cleared)."""

    async def scenario() -> None:
        engine = FakeSleepyAsyncLLM()
        w = _worker(workers, engine, {"rlix": {"sleep_level": 2}})
        await w.rlix_sleep(2)
        refused = await asyncio.wait_for(w.rlix_receive_weights({"shard_id": "s"}), 5)
        assert refused["failed"] and refused["error_type"] == "ShardStateError"
        assert await w.rlix_receive_weights([{"a": 1}, {"b": 2}]) == [refused, refused]
        assert not engine.receiving.is_set()
        await w.rlix_wake_up()
        receive = asyncio.create_task(w.rlix_receive_weights({"shard_id": "s"}))
        await engine.receiving.wait()
        sleep = asyncio.create_task(w.rlix_sleep(2))
        await asyncio.sleep(0.01)
        assert not engine.asleep  # the sleep waits for the receive under way
        engine.finish_receive.set()
        assert (await receive)["version"] == 7
        await sleep
        assert engine.asleep and not engine.received_while_asleep
        assert await w.rlix_weight_version() is None  # discarded by the level-2 sleep

    asyncio.run(asyncio.wait_for(scenario(), 30))
