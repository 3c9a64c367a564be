"""Let the coordinator unpickle RLix's own wire classes without RLix installed.

ROLL pipelines send ``rlix.protocol.types.ProgressReport`` / ``Priority`` instances pickled by
reference. Our coordinator process has no ``rlix`` package (it is not installable from an
index), so unpickling would fail before any duck typing could help. When — and only when —
``rlix`` is not importable, :func:`install` registers a tiny stand-in module under that name whose
classes accept any pickled state; the scheduler then reads them by their fields
(:func:`~rlix_plugins.protocol.types.coerce_progress_report`), never by ``isinstance``.
"""

from __future__ import annotations

import enum
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Sequence
from typing import Any

SHIM_MODULES = ("rlix", "rlix.protocol", "rlix.protocol.types")
_FIELDS = {
    "ProgressReport": ("pipeline_id", "step_target_trajectories", "fifo_timestamp", "metrics"),
    "ActionResponse": ("success", "error"),
}


class _Record:
    """Accepts the state of a (slotted or not) dataclass pickled by RLix."""

    _fields: tuple[str, ...] = ()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        for name, value in zip(self._fields, args, strict=False):
            setattr(self, name, value)
        for name, value in kwargs.items():
            setattr(self, name, value)

    def __setstate__(self, state: Any) -> None:
        # dict state (plain dataclass), (None, slots-dict), or a field-ordered list (slots).
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):
            state = {**(state[0] or {}), **state[1]}
        if isinstance(state, dict):
            for name, value in state.items():
                setattr(self, name, value)
        elif isinstance(state, Sequence):
            for name, value in zip(self._fields, state, strict=False):
                setattr(self, name, value)

    def __repr__(self) -> str:
        body = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"rlix-shim.{type(self).__name__}({body})"


def _build_types_module() -> types.ModuleType:
    from rlix_plugins.protocol.types import Priority as OurPriority

    mod = types.ModuleType("rlix.protocol.types")
    mod.__doc__ = "rlix-plugins stand-in for RLix's wire types (installed by rlix_compat)"
    for name, fields in _FIELDS.items():
        cls = type(name, (_Record,), {"_fields": fields, "__module__": mod.__name__})
        setattr(mod, name, cls)
    # Same names and values as RLix's IntEnum: an enum unpickles as Priority(value).
    members = [(p.name, p.value) for p in OurPriority]
    priority: Any = enum.IntEnum("Priority", members, module=mod.__name__)  # type: ignore[misc]
    setattr(mod, "Priority", priority)  # noqa: B010
    return mod


class _ShimFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(
        self, fullname: str, path: Any = None, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in SHIM_MODULES:
            return None
        return importlib.machinery.ModuleSpec(
            fullname, self, is_package=fullname != "rlix.protocol.types"
        )

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        if spec.name == "rlix.protocol.types":
            return _build_types_module()
        mod = types.ModuleType(spec.name)
        mod.__path__ = []
        return mod

    def exec_module(self, module: types.ModuleType) -> None:
        return None


_installed = False


def install() -> bool:
    """Register the stand-in if ``rlix`` is not importable; True if it is (now) in place."""
    global _installed
    if _installed:
        return True
    if "rlix" in sys.modules or importlib.util.find_spec("rlix") is not None:
        return False  # the real RLix is here: its classes unpickle as themselves
    sys.meta_path.append(_ShimFinder())
    _installed = True
    return True
