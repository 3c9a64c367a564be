"""The environment gate: host patches are installed only when ``RLIX_CONTROL_PLANE=rlix``.

``activate()`` registers post-import hooks (wrapt) so each host patch is applied in whichever
process imports that host - driver, Ray workers, vLLM processes - at the moment it is imported,
and never earlier. Unset or ``off``: it does nothing at all (no hook, no import, no contact).

How the call reaches every process: veRL imports the modules named in
``VERL_USE_EXTERNAL_MODULES`` (set it to ``rlix_plugins.autoload``, whose import calls
``activate()``); vLLM loads the ``vllm.general_plugins`` entry point; NeMo RL processes call it
through the plugin worker classes (see docs). Loading is once per process; each process must
have the package importable (same venv or PYTHONPATH).

``deactivate()`` reverts every applied patch and disables the hooks (wrapt cannot unregister
them, so each hook checks an enabled flag); ``activate()`` after it re-enables them and patches
at once every host already imported. Both are idempotent.
"""

from __future__ import annotations

import importlib
import logging
import sys
import threading
from collections.abc import Callable

import wrapt

from rlix_plugins.patches.base import HostPatch
from rlix_plugins.settings import ControlPlane, Settings, control_plane_from_env, load_settings

logger = logging.getLogger(__name__)

#: host module -> "module:factory" returning that host's HostPatch. Imported lazily, only when
#: the host module itself is imported in this process.
PATCHES: dict[str, str] = {
    "nemo_rl": "rlix_plugins.patches.nemo_rl:factory",
    "verl": "rlix_plugins.patches.verl:factory",
}

_lock = threading.Lock()
_active: dict[str, HostPatch] = {}
#: the post-import hooks are registered (once per process: wrapt has no unregister)
_hooked = False
#: hooks apply patches only while True (False before activate() and after deactivate())
_enabled = False


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
        if not _enabled or module_name in _active:
            return
        patch = _load(factory)
        patch.apply()
        _active[module_name] = patch


def activate(settings: Settings | None = None) -> bool:
    """Install the post-import hooks if time-sharing is on. Idempotent; True when active.

    Without ``settings`` only ``RLIX_CONTROL_PLANE`` is read first; the other variables are
    validated only when it is ``rlix`` (a standalone job never fails on them). An invalid
    ``RLIX_CONTROL_PLANE`` raises :class:`~rlix_plugins.errors.SettingsError`.
    """
    global _hooked, _enabled
    if settings is None:
        if control_plane_from_env() is not ControlPlane.RLIX:
            return False
        settings = load_settings()
    if not settings.enabled:
        return False
    with _lock:
        reenabled = _hooked and not _enabled
        first = not _hooked
        _hooked = True
        _enabled = True
        items = list(PATCHES.items())
    # A host that fails to patch (drift) raises, but only after every other host is hooked
    # or patched: hooks register once per process, so one left out here would never be.
    errors: list[Exception] = []
    if first:
        # Fires at once for a host imported already, else when it is imported.
        for module_name, factory in items:
            try:
                wrapt.register_post_import_hook(_make_hook(module_name, factory), module_name)
            except Exception as exc:
                errors.append(exc)
        logger.info("rlix-plugins active: hooks for %s", sorted(PATCHES))
    elif reenabled:
        # After deactivate(): the hooks of hosts imported meanwhile have fired (while disabled)
        # and never fire again, so those hosts are patched here.
        for module_name, factory in items:
            if module_name in sys.modules:
                try:
                    _on_import(module_name, factory)
                except Exception as exc:
                    errors.append(exc)
        logger.info("rlix-plugins re-activated: hooks for %s", sorted(PATCHES))
    if errors:
        raise errors[0]
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
    """Disable the hooks and revert every applied patch (in reverse order). Idempotent.

    The hooks stay registered but do nothing until :func:`activate` runs again. A patch whose
    revert raises does not stop the others from being reverted; it stays in
    :func:`applied_patches` (so it is never applied twice, and a later call retries it) and
    the first such error is raised once every patch was tried.
    """
    global _enabled
    with _lock:
        _enabled = False
        patches = list(_active.items())
        _active.clear()
    errors: list[Exception] = []
    failed: list[tuple[str, HostPatch]] = []
    for module_name, patch in reversed(patches):
        try:
            patch.revert()
        except Exception as exc:
            logger.error("reverting the %s patch failed: %s", module_name, exc)
            errors.append(exc)
            failed.append((module_name, patch))
    if failed:
        with _lock:
            for module_name, patch in reversed(failed):
                _active.setdefault(module_name, patch)
        raise errors[0]
