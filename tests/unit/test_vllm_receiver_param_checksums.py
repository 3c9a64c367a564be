"""rlix_param_checksums refuses a bare name instead of answering for its characters.

The extension is real; its model is a small torch module in place of the FAKE vLLM runner's
model (vLLM cannot run in a unit test).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from rlix_plugins.errors import WeightSyncError
from rlix_plugins.training.vllm_receiver import RlixWeightReceiverExtension


class FakeWorker(RlixWeightReceiverExtension):
    """FAKE vLLM worker: its ``model_runner.model`` is a one-layer torch model."""

    def __init__(self) -> None:
        self.model_runner: Any = SimpleNamespace(model=torch.nn.Linear(4, 2))


def test_a_bare_name_is_refused_with_what_is_valid() -> None:
    # names="weight" was read as the set {"w", "e", "i", "g", "h", "t"}: {} came back, as if
    # the worker held no such parameter
    worker = FakeWorker()
    assert set(worker.rlix_param_checksums(["weight"])) == {"weight"}
    with pytest.raises(WeightSyncError, match=r"names='weight'.*list of parameter names"):
        worker.rlix_param_checksums("weight")
    with pytest.raises(WeightSyncError, match="list of parameter names"):
        worker.rlix_param_checksums([1])  # type: ignore[list-item]
    assert set(worker.rlix_param_checksums()) == {"weight", "bias"}
