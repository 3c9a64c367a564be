"""A FAKE NeMo RL ``Policy`` that records the calls the driver adapter makes on it (NeMo RL's
``Policy`` needs its workers on GPUs): shared by the adapter tests that extend it."""

from __future__ import annotations

from typing import Any


class RecordingPolicy:
    """FAKE ``Policy``: ``calls`` lists the worker methods and offloads, in order."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.calls: list[str] = []

    def run_all_workers_single_data(self, method: str, *args: Any) -> list[Any]:
        self.calls.append(method)
        return []

    def offload_before_refit(self) -> None:
        self.calls.append("offload_before_refit")

    def offload_after_refit(self) -> None:
        self.calls.append("offload_after_refit")
