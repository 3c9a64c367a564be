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


#: cgroup v1 reports "no limit" as a huge page-aligned number (about 2**63)
_V1_UNLIMITED = 1 << 62


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _cgroup_room(directory: Path) -> int | None:
    """Room left under one cgroup directory's memory limit (None: no limit or unreadable):
    v2 (``memory.max`` / ``memory.current``) or v1 (``memory.limit_in_bytes`` /
    ``memory.usage_in_bytes``)."""
    try:
        raw_limit = (directory / "memory.max").read_text().strip()
    except OSError:
        limit = _read_int(directory / "memory.limit_in_bytes")
        usage = _read_int(directory / "memory.usage_in_bytes")
        if limit is None or usage is None or limit >= _V1_UNLIMITED:
            return None
        return max(0, limit - usage)
    current = _read_int(directory / "memory.current")
    if raw_limit == "max" or current is None:
        return None
    try:
        return max(0, int(raw_limit) - current)
    except ValueError:
        return None


def _below(base: Path, path: str) -> list[Path]:
    """``base`` and each directory on ``path`` below it (``/a/b`` -> base, base/a, base/a/b)."""
    dirs = [base]
    for part in (p for p in path.split("/") if p and p not in (".", "..")):
        dirs.append(dirs[-1] / part)
    return dirs


def _own_cgroup(root: Path, proc_cgroup: Path) -> list[Path]:
    """This process's memory cgroup directories, its own and every ancestor's.

    Without a cgroup namespace (a Slurm job step, a systemd scope) the limit sits on a
    sub-cgroup named in ``/proc/self/cgroup``, not on the mount's root, whose limit is then
    the host's "none". v2 names it as ``0::/path`` (under ``root``); v1 as
    ``N:memory:/path`` (under ``root/memory``). With a namespace the path is ``/``.
    """
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return [root]
    dirs: list[Path] = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            dirs += _below(root, path.strip())
        elif "memory" in controllers.split(","):
            dirs += _below(root / "memory", path.strip())
    return dirs or [root]


def _cgroup_available(root: Path, proc_cgroup: Path = Path("/proc/self/cgroup")) -> int | None:
    """Room left under the tightest memory limit on this process's cgroup path (its own and
    every ancestor's count: the kernel enforces each)."""
    rooms = [r for r in (_cgroup_room(d) for d in _own_cgroup(root, proc_cgroup)) if r is not None]
    return min(rooms) if rooms else None


def available_host_memory(
    meminfo: Path = Path("/proc/meminfo"),
    cgroup_root: Path = _CGROUP_ROOT,
    proc_cgroup: Path = Path("/proc/self/cgroup"),
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
    cg = _cgroup_available(cgroup_root, proc_cgroup)
    if cg is not None:
        candidates.append((cg, "cgroup memory limit - usage"))
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
