"""What every host patch is: declared plug points, supported versions, symmetric apply/revert.

Modelled on OpenTelemetry's instrumentors: a patch declares the host versions it supports and
the plug points it touches; ``apply`` and ``revert`` are symmetric and idempotent; a plug point
that moved or changed signature is reported as drift (a typed error), never silently skipped.
"""

from __future__ import annotations

import abc
import enum
import importlib
import importlib.metadata
import inspect
import logging
from collections.abc import Callable, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

from rlix_plugins.errors import HostDriftError

logger = logging.getLogger(__name__)


class PlugKind(str, enum.Enum):
    """How a plug point is used (official extension points first, patching last)."""

    EXTENSION_POINT = "extension_point"  # a documented seam: registry, factory, entry point
    SUBCLASS = "subclass"  # we subclass the target and hand our class to the host
    ATTRIBUTE = "attribute"  # a module attribute looked up at call time, replaced
    WRAP = "wrap"  # a function/method wrapped in place (last resort)
    READ = "read"  # only called or read


@dataclass(frozen=True, slots=True)
class PlugPoint:
    """A host object the patch relies on: ``module:qualname`` plus expected parameters."""

    name: str
    target: str
    kind: PlugKind
    #: parameter names the callable must accept (empty: only existence is checked)
    params: tuple[str, ...] = ()
    why: str = ""


@dataclass(frozen=True, slots=True)
class PlugPointStatus:
    """Result of checking one plug point against the installed host."""

    point: PlugPoint
    ok: bool
    detail: str


def resolve(target: str) -> Any:
    """Import ``module:qual.name`` and return the object (raises ImportError/AttributeError)."""
    module_name, _, qualname = target.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split(".") if qualname else ():
        obj = getattr(obj, part)
    return obj


def check_plug_point(point: PlugPoint) -> PlugPointStatus:
    """Does ``point.target`` exist and accept ``point.params``?"""
    try:
        obj = resolve(point.target)
    except ImportError as exc:
        return PlugPointStatus(point, False, f"module not importable: {exc}")
    except AttributeError as exc:
        return PlugPointStatus(point, False, f"drift: target moved or was renamed ({exc})")
    if not point.params:
        return PlugPointStatus(point, True, "present")
    func = obj.__init__ if inspect.isclass(obj) and "__init__" in point.params else obj
    try:
        sig = inspect.signature(func)
    except (TypeError, ValueError) as exc:
        return PlugPointStatus(point, False, f"drift: signature unreadable ({exc})")
    names = set(sig.parameters)
    has_var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values())
    missing = [p for p in point.params if p not in names and p != "__init__"]
    if missing and not has_var_kw:
        return PlugPointStatus(point, False, f"drift: signature {sig} lacks parameters {missing}")
    return PlugPointStatus(point, True, f"present, signature {sig}")


def installed_version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


class HostPatch(abc.ABC):
    """One host framework's integration. Subclasses declare and implement; this class guards.

    ``apply`` checks every plug point first and raises :class:`HostDriftError` listing all
    drifted ones before changing anything; a host version that ``version_supported`` rejects is
    logged as a WARNING naming host, version and ``supported``, and the patch is applied anyway
    (its plug points were checked; refusing would stop jobs on a compatible patch release); a
    second ``apply`` is a no-op; ``revert`` undoes exactly what ``apply`` did, in reverse order,
    and is a no-op when nothing is applied.
    """

    #: importable top-level module that triggers the patch (post-import hook)
    module: str = ""
    #: distribution names to read the version from, first found wins
    distributions: tuple[str, ...] = ()
    #: human-readable statement of what is supported (checked by ``version_supported``)
    supported: str = ""
    plug_points: Sequence[PlugPoint] = ()

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []
        self._applied = False

    @property
    def applied(self) -> bool:
        return self._applied

    def version(self) -> str | None:
        for dist in self.distributions:
            v = installed_version(dist)
            if v is not None:
                return v
        return None

    def version_supported(self, version: str | None) -> bool:
        """Override to compare ``version`` with what the patch was tested against."""
        return version is not None

    def check(self) -> list[PlugPointStatus]:
        return [check_plug_point(p) for p in self.plug_points]

    def apply(self) -> None:
        if self._applied:
            return
        drift = [s for s in self.check() if not s.ok]
        if drift:
            lines = "; ".join(f"{s.point.name} ({s.point.target}): {s.detail}" for s in drift)
            raise HostDriftError(
                f"{type(self).__name__} cannot apply to {self.module} {self.version()}: {lines}"
            )
        version = self.version()
        if not self.version_supported(version):
            logger.warning(
                "%s: %s %s is not the supported version (supported: %s); applying anyway, "
                "its plug points checked OK", type(self).__name__, self.module,
                "(version unknown)" if version is None else version, self.supported or "unstated",
            )
        try:
            self._apply()
        except Exception:
            self._run_undo()
            raise
        self._applied = True
        logger.info("applied %s to %s %s", type(self).__name__, self.module, version)

    def revert(self) -> None:
        if not self._applied:
            return
        self._run_undo()
        self._applied = False
        logger.info("reverted %s", type(self).__name__)

    def _run_undo(self) -> None:
        while self._undo:
            self._undo.pop()()

    def set_attribute(self, owner: Any, name: str, value: Any) -> None:
        """Replace ``owner.name`` and remember how to restore it (used by ``_apply``)."""
        missing = object()
        old = owner.__dict__.get(name, missing) if hasattr(owner, "__dict__") else missing
        setattr(owner, name, value)

        def undo() -> None:
            if old is missing:
                delattr(owner, name)
            else:
                setattr(owner, name, old)

        self._undo.append(undo)

    def set_item(self, mapping: MutableMapping[str, Any], key: str, value: Any) -> None:
        """Set ``mapping[key]`` (a host registry) and remember how to restore it."""
        missing = object()
        old = mapping.get(key, missing)
        mapping[key] = value

        def undo() -> None:
            if old is missing:
                mapping.pop(key, None)
            else:
                mapping[key] = old

        self._undo.append(undo)

    @abc.abstractmethod
    def _apply(self) -> None:
        """Install the integration; register undo steps with :meth:`set_attribute`."""
