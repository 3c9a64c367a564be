"""What the GPU benchmarks share: each measurement runs in a fresh spawned process (a clean
CUDA context and NCCL state), reports through a queue, and is recorded even when it fails
(device time is scarce: the other measurements still report)."""

from __future__ import annotations

import logging
import multiprocessing
import socket
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("bench.gpu")


def free_port() -> int:
    """A TCP port free on localhost now (for a world's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def machine() -> dict[str, str]:
    """The GPU, torch and NCCL versions the figures were measured on."""
    import torch

    return {
        "gpu": torch.cuda.get_device_properties(0).name,
        "torch": torch.__version__,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())),  # type: ignore[no-untyped-call]
    }


def run_in_process(target: Callable[..., None], args: tuple[Any, ...],
                   timeout_s: float) -> dict[str, Any]:
    """Run ``target(*args, queue)`` in a spawned process; what it put on the queue, with its
    exit code, or ``{"status": "failed: ..."}`` when it put nothing within ``timeout_s``."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=target, args=(*args, queue))
    proc.start()
    out: dict[str, Any]
    try:
        out = queue.get(timeout=timeout_s)
    except Exception as exc:  # recorded, so the caller's other measurements still report
        out = {"status": f"failed: {type(exc).__name__}: {exc}"}
    proc.join(30)
    if proc.is_alive():
        proc.kill()
    out["exitcode"] = proc.exitcode
    return out
