"""A FAKE shard engine for tests of the shard lifecycle and controller (a vLLM engine per shard
is what the integration suites start): it records the lifecycle calls the real ShardLifecycle
makes on it."""

from __future__ import annotations

from dataclasses import dataclass

from rlix_plugins.generation import EngineOutput, GenerationRequest


@dataclass
class FakeRecordingEngine:
    """FAKE shard engine: records lifecycle calls instead of driving vLLM."""

    rank: int
    calls: list[tuple[str, int]]

    async def generate(self, request: GenerationRequest) -> EngineOutput:
        raise NotImplementedError

    async def abort_all(self) -> int:
        self.calls.append(("abort_all", self.rank))
        return 0

    async def num_running(self) -> int:
        return 0

    async def sleep(self, level: int | None = None) -> None:
        self.calls.append(("sleep", self.rank))

    async def wake_up(self) -> None:
        self.calls.append(("wake_up", self.rank))

    async def resume(self) -> None:
        self.calls.append(("resume", self.rank))
