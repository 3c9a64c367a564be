"""RlixWorkerExtension.rlix_device_memory_bytes reports its own worker's device.

No GPU here: ``torch.cuda`` is replaced by a FAKE driver with two devices of different usage,
device 0 being the calling thread's current one (as on a thread that never set a device).
"""

from __future__ import annotations

import pytest
import torch

from rlix_plugins.patches.vllm import RlixWorkerExtension

GIB = 1 << 30
#: FAKE driver state: (free, total) per device
_MEM_INFO = {0: (70 * GIB, 80 * GIB), 1: (20 * GIB, 80 * GIB)}


class WorkerOnCuda1(RlixWorkerExtension):
    """The extension as vLLM mixes it into a worker whose device is cuda:1."""

    device = torch.device("cuda", 1)


def _fake_mem_get_info(device: torch.device | int | None = None) -> tuple[int, int]:
    if device is None:
        return _MEM_INFO[0]  # the current device of a thread that never set one
    return _MEM_INFO[torch.device(device).index if isinstance(device, torch.device) else device]


def test_device_memory_is_read_on_the_workers_own_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # mem_get_info() without a device answered for the thread's current device (0), so a
    # worker on cuda:1 reported device 0's 10 GiB instead of its own 60 GiB.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", _fake_mem_get_info)
    assert WorkerOnCuda1().rlix_device_memory_bytes() == 60 * GIB
