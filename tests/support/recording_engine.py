"""FAKE shard engines for tests of the router, the shard lifecycle and the controller (a vLLM
engine per shard is what the integration suites start)."""

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


class IdleLifecycleEngine:
    """The lifecycle half of a FAKE ShardEngine that has nothing to abort, drain, sleep or wake:
    subclasses supply ``generate`` (and override what they need to observe)."""

    async def abort_all(self) -> int:
        return 0

    async def num_running(self) -> int:
        return 0

    async def sleep(self, level: int | None = None) -> None:
        return None

    async def wake_up(self) -> None:
        return None

    async def resume(self) -> None:
        return None
