"""GPU memory in use, read from the driver (NVML), for the gates' memory-release criterion.

Gate 1's pass criterion "GPU 0 after sleep(2) + NCCL destroy: < 2 GiB used by the vLLM and
Megatron processes together" is about device memory as the driver sees it (every process's
CUDA context, NCCL buffers, allocator caches), not ``torch.cuda.memory_allocated`` of one
process. :class:`NvmlMemoryReader` reads ``nvmlDeviceGetMemoryInfo(handle).used`` through
``nvidia-ml-py`` (a NeMo RL dependency) and falls back to ``nvidia-smi --query-gpu``.

Off unless ``RLIX_OBSERVE_GPU_MEMORY=1`` (GPU-mode gates set it for their jobs): the hooks
then read the training GPUs right before releasing them
(:mod:`rlix_plugins.hooks.coordinator_hooks`).

GPU ids are the coordinator's global ids, read as NVML indices of the node the reading
process runs on: right on a single node (the gates' 2-GPU box) when CUDA's ordinals follow
the PCI bus order (``CUDA_DEVICE_ORDER=PCI_BUS_ID``, or one GPU model on the node). A GPU the
node does not have is a :class:`MemoryReadError`, recorded as such, never a wrong figure.
Not run on a GPU yet: this machine has none (docs/gates.md).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from rlix_plugins.errors import RlixPluginsError

#: ``1`` turns the readings on (the GPU-mode gates set it for the jobs they launch)
ENV_OBSERVE_GPU_MEMORY = "RLIX_OBSERVE_GPU_MEMORY"

_MIB = 1 << 20


class MemoryReadError(RlixPluginsError, RuntimeError):
    """GPU memory could not be read (no NVML, no ``nvidia-smi``, or no such GPU)."""


class GpuMemoryReader(Protocol):
    """Device memory in use on one GPU, in bytes (every process together)."""

    def used_bytes(self, gpu: int) -> int: ...


def parse_smi_used_mib(text: str, gpu: int) -> int:
    """Bytes from ``nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -i N``
    (one integer, MiB)."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    if len(lines) != 1 or not lines[0].isdigit():
        raise MemoryReadError(
            f"GPU {gpu}: nvidia-smi printed {text.strip()[:200]!r}; expected one integer "
            "(memory.used in MiB)"
        )
    return int(lines[0]) * _MIB


class NvmlMemoryReader:
    """:class:`GpuMemoryReader` through NVML, else ``nvidia-smi``; decides once per process
    which of the two works and remembers why neither does.

    ``nvml`` and ``run`` are injectable for tests (the NVML module and ``subprocess.run``).
    """

    def __init__(self, *, nvml: Any = None,
                 run: Callable[..., subprocess.CompletedProcess[str]] | None = None) -> None:
        self._nvml = nvml
        self._run = run or subprocess.run
        self._backend: str | None = None  # "nvml" | "smi" once chosen
        self._why_not = ""
        #: why neither works (raised again on every later read: nothing changes mid-run)
        self._unavailable: str | None = None

    def _choose(self) -> str:
        if self._backend is not None:
            return self._backend
        if self._unavailable is not None:
            raise MemoryReadError(self._unavailable)
        nvml_error = ""
        try:
            if self._nvml is None:
                import pynvml  # type: ignore[import-not-found,unused-ignore]

                self._nvml = pynvml
            self._nvml.nvmlInit()
            self._backend = "nvml"
            return self._backend
        except Exception as exc:  # any NVML failure: try nvidia-smi
            nvml_error = f"NVML unavailable ({type(exc).__name__}: {exc})"
        if self._run is subprocess.run and shutil.which("nvidia-smi") is None:
            self._unavailable = f"{nvml_error}; nvidia-smi not found on PATH"
            raise MemoryReadError(self._unavailable)
        self._why_not = nvml_error
        self._backend = "smi"
        return self._backend

    def used_bytes(self, gpu: int) -> int:
        """Bytes in use on NVML index ``gpu``.

        Raises:
            MemoryReadError: neither NVML nor ``nvidia-smi`` answers, or no such GPU.
        """
        if isinstance(gpu, bool) or not isinstance(gpu, int) or gpu < 0:
            raise MemoryReadError(f"GPU {gpu!r} is not valid; expected an index >= 0")
        if self._choose() == "nvml":
            try:
                handle = self._nvml.nvmlDeviceGetHandleByIndex(gpu)
                v2 = getattr(self._nvml, "nvmlMemory_v2", None)
                # v1's ``used`` counts memory the driver reserves (hundreds of MiB on an
                # A100); v2 reports it apart, so ``used`` is what processes hold (as nvidia-smi)
                info = (self._nvml.nvmlDeviceGetMemoryInfo(handle) if v2 is None
                        else self._nvml.nvmlDeviceGetMemoryInfo(handle, version=v2))
                return int(info.used)
            except Exception as exc:  # NVML raises its own error types
                raise MemoryReadError(
                    f"GPU {gpu}: NVML read failed ({type(exc).__name__}: {exc})"
                ) from None
        try:
            done = self._run(
                ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                 "-i", str(gpu)],
                capture_output=True, text=True, timeout=10, check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            # Hung or gone: not asked again (each read runs before a GPU release).
            self._backend = None
            self._unavailable = f"GPU {gpu}: nvidia-smi failed ({exc}); {self._why_not}"
            raise MemoryReadError(self._unavailable) from None
        if done.returncode != 0:
            raise MemoryReadError(
                f"GPU {gpu}: nvidia-smi exited {done.returncode}: "
                f"{(done.stderr or done.stdout).strip()[:200]}"
            )
        return parse_smi_used_mib(done.stdout, gpu)


def memory_reader_from_env(env: Mapping[str, str] | None = None) -> GpuMemoryReader | None:
    """An :class:`NvmlMemoryReader` when ``RLIX_OBSERVE_GPU_MEMORY=1``, else None (off)."""
    env = os.environ if env is None else env
    return NvmlMemoryReader() if env.get(ENV_OBSERVE_GPU_MEMORY, "").strip() == "1" else None


__all__ = [
    "ENV_OBSERVE_GPU_MEMORY",
    "GpuMemoryReader",
    "MemoryReadError",
    "NvmlMemoryReader",
    "memory_reader_from_env",
    "parse_smi_used_mib",
]
