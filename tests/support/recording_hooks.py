"""FAKE RLix hooks for adapter tests that need no coordinator: they record the protocol calls
in order (``CoordinatorHooks`` against the real coordinator is tested on real Ray)."""

from __future__ import annotations


class FakeHooks:
    """FAKE hooks: records calls; ``close`` is what stops the real heartbeat thread."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def before_training(self, step: int) -> None:
        self.calls.append(f"before_training:{step}")

    def after_training(self, step: int) -> None:
        self.calls.append(f"after_training:{step}")

    def close(self) -> None:
        self.calls.append("close")
