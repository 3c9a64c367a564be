"""Host RAM accounting for the CPU weight cache.

A cache version is as large as the model (bf16: 2 bytes per parameter), and the owner node
also runs inference engines and Ray. Running out of RAM there kills processes that are not
ours (the kernel OOM killer picks), so the cache checks before it allocates and fails with a
typed error instead.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from rlix_plugins.errors import InsufficientHostMemoryError

logger = logging.getLogger(__name__)

_CGROUP_ROOT = Path("/sys/fs/cgroup")


@dataclass(frozen=True, slots=True)
class HostMemory:
    """Available host RAM in bytes and where the figure came from."""

    available_bytes: int
    source: str


def _meminfo_available(meminfo: Path) -> int | None:
    try:
        text = meminfo.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("MemAvailable:"):
            parts = line.split()
            return int(parts[1]) * 1024  # the kernel reports kB
    return None


def _cgroup_available(root: Path) -> int | None:
    """Room left under a cgroup v2 memory limit, if this process runs under one."""
    limit_file = root / "memory.max"
    current_file = root / "memory.current"
    try:
        raw_limit = limit_file.read_text().strip()
        current = int(current_file.read_text().strip())
    except (OSError, ValueError):
        return None
    if raw_limit == "max":
        return None
    try:
        return max(0, int(raw_limit) - current)
    except ValueError:
        return None


def available_host_memory(
    meminfo: Path = Path("/proc/meminfo"), cgroup_root: Path = _CGROUP_ROOT
) -> HostMemory:
    """RAM this process can still allocate: the smaller of MemAvailable and the cgroup room.

    A container's cgroup limit is usually far below the machine's MemAvailable, and exceeding it
    gets the container OOM-killed, so both are read. Off Linux (no /proc) this falls back to
    ``os.sysconf``'s free pages.
    """
    candidates: list[tuple[int, str]] = []
    avail = _meminfo_available(meminfo)
    if avail is not None:
        candidates.append((avail, "MemAvailable"))
    cg = _cgroup_available(cgroup_root)
    if cg is not None:
        candidates.append((cg, "cgroup memory.max - memory.current"))
    if not candidates:
        try:
            pages = os.sysconf("SC_AVPHYS_PAGES")
            size = os.sysconf("SC_PAGE_SIZE")
            candidates.append((int(pages) * int(size), "sysconf free pages"))
        except (ValueError, OSError, AttributeError):
            return HostMemory(available_bytes=1 << 62, source="unknown (no limit applied)")
    value, source = min(candidates)
    return HostMemory(available_bytes=value, source=source)


def check_host_memory(
    needed_bytes: int,
    *,
    reserve_bytes: int,
    what: str,
    probe: HostMemory | None = None,
) -> HostMemory:
    """Raise :class:`InsufficientHostMemoryError` unless ``needed + reserve`` bytes are free."""
    mem = probe if probe is not None else available_host_memory()
    if needed_bytes + reserve_bytes > mem.available_bytes:
        raise InsufficientHostMemoryError(
            f"{what} needs {needed_bytes / 2**20:.1f} MiB plus a reserve of "
            f"{reserve_bytes / 2**20:.1f} MiB, but only {mem.available_bytes / 2**20:.1f} MiB "
            f"of host RAM is available ({mem.source}); free host memory, lower the reserve, "
            "or keep fewer cached versions"
        )
    logger.debug(
        "%s: %d bytes needed, %d available (%s)",
        what,
        needed_bytes,
        mem.available_bytes,
        mem.source,
    )
    return mem


def accelerator_available() -> bool:
    """True when a CUDA device is usable: the cache then pins its buffers for fast H2D."""
    import torch

    return bool(torch.cuda.is_available())
