"""The files a gate run leaves in ``--out``: cleared when a run starts, written whole.

A report left by an earlier run must never stand for a run that crashed before writing its
own (``gate{N}_report.json`` saying ``"passed": true`` next to a traceback), and a report is
either absent or complete (written to a temporary file, then renamed over the old one).
"""

from __future__ import annotations

import logging
from pathlib import Path

from rlix_plugins.files import write_text_atomic

logger = logging.getLogger(__name__)


def output_names(gate: int) -> tuple[str, ...]:
    """The files a run of ``gate`` writes into ``--out`` (report, timeline, plot)."""
    return (f"gate{gate}_report.json", f"gate{gate}_timeline.json",
            f"gate{gate}_gpu_ownership.png")


def clear_outputs(out: Path, gate: int) -> list[Path]:
    """Remove an earlier run's outputs of ``gate`` from ``out``; returns what was removed."""
    removed = []
    for name in output_names(gate):
        path = out / name
        if path.is_file() or path.is_symlink():
            path.unlink()
            removed.append(path)
    if removed:
        logger.info("removed an earlier run's outputs: %s", ", ".join(p.name for p in removed))
    return removed


__all__ = ["clear_outputs", "output_names", "write_text_atomic"]
