"""The environment gate: host patches are installed only when ``RLIX_CONTROL_PLANE=rlix``.

``activate()`` registers post-import hooks (wrapt) so each host patch is applied in whichever
process imports that host - driver, Ray workers, vLLM processes - at the moment it is imported,
and never earlier. Unset or ``off``: it does nothing at all (no hook, no import, no contact).

How the call reaches every process: veRL imports the modules named in
``VERL_USE_EXTERNAL_MODULES`` (set it to ``rlix_plugins.autoload``, whose import calls
``activate()``); vLLM loads the ``vllm.general_plugins`` entry point; NeMo RL processes call it
through the plugin worker classes (see docs). Loading is once per process; each process must
have the package importable (same venv or PYTHONPATH).
"""

from __future__ import annotations

import importlib
import logging
import threading
from collections.abc import Callable

import wrapt

from rlix_plugins.patches.base import HostPatch
from rlix_plugins.settings import Settings, load_settings

logger = logging.getLogger(__name__)

#: host module -> "module:factory" returning that host's HostPatch. Imported lazily, only when
#: the host module itself is imported in this process.
PATCHES: dict[str, str] = {
    "nemo_rl": "rlix_plugins.patches.nemo_rl:factory",
    "verl": "rlix_plugins.patches.verl:factory",
}

_lock = threading.Lock()
_active: dict[str, HostPatch] = {}
_hooked = False


def register_patch(module: str, factory: str) -> None:
    """Declare the patch factory for a host module (used by the patches/ modules)."""
    PATCHES[module] = factory


def _load(factory: str) -> HostPatch:
    module_name, _, attr = factory.partition(":")
    patch = getattr(importlib.import_module(module_name), attr)()
    if not isinstance(patch, HostPatch):
        raise TypeError(f"{factory} did not return a HostPatch")
    return patch


def _on_import(module_name: str, factory: str) -> None:
    with _lock:
        if module_name in _active:
            return
        patch = _load(factory)
        patch.apply()
        _active[module_name] = patch


def activate(settings: Settings | None = None) -> bool:
    """Install the post-import hooks if time-sharing is on. Idempotent; True when active."""
    global _hooked
    settings = settings or load_settings()
    if not settings.enabled:
        return False
    with _lock:
        if _hooked:
            return True
        _hooked = True
        items = list(PATCHES.items())
    for module_name, factory in items:
        hook = _make_hook(module_name, factory)
        wrapt.register_post_import_hook(hook, module_name)
    logger.info("rlix-plugins active: hooks for %s", sorted(PATCHES))
    return True


def _make_hook(module_name: str, factory: str) -> Callable[[object], None]:
    def hook(_module: object) -> None:
        _on_import(module_name, factory)

    return hook


def applied_patches() -> dict[str, HostPatch]:
    """Patches applied in this process so far, by host module."""
    with _lock:
        return dict(_active)


def deactivate() -> None:
    """Revert every applied patch (in reverse order). Hooks stay registered but idle."""
    with _lock:
        patches = list(_active.items())
        _active.clear()
    for _, patch in reversed(patches):
        patch.revert()
