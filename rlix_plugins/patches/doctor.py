"""``rlix-plugins doctor``: is every plug point of every registered host patch where we expect?

For each host patch in :data:`rlix_plugins.activation.PATCHES` (NeMo RL, veRL, ... iterated
generically) and each of its plug points: import the target and check its signature; if the
module cannot be imported in this environment (wrong Python, a missing optional dependency),
find its source file without executing it and check the definition statically (AST). A target
that moved, was renamed or lost a parameter is DRIFT, whichever way it was checked; the exit code
is non-zero on any drift. A module whose source cannot be found at all is reported as
unavailable (``--strict`` turns that into a failure too).

The NeMo RL version is read from ``NEMO_RL_SRC``'s git metadata (commit) or the installed
package, and compared with the pinned commit.
"""

from __future__ import annotations

import ast
import enum
import importlib
import importlib.util
import logging
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlix_plugins.errors import UnknownHostError
from rlix_plugins.patches.base import HostPatch, PlugPoint, check_plug_point

logger = logging.getLogger(__name__)

ENV_NEMO_RL_SRC = "NEMO_RL_SRC"


class Outcome(str, enum.Enum):
    """Result of one plug-point check."""

    OK = "ok"
    DRIFT = "drift"
    UNAVAILABLE = "unavailable"


@dataclass(frozen=True, slots=True)
class PointResult:
    """One plug point's check (``how``: "import" or "static")."""

    host: str
    name: str
    target: str
    kind: str
    outcome: Outcome
    how: str
    detail: str


@dataclass(frozen=True, slots=True)
class HostVersion:
    """What was found of a host: version, git commit, where, and whether it is the pinned one."""

    host: str
    version: str | None
    commit: str | None
    source: str | None
    supported: str
    matches: bool | None


# --------------------------------------------------------------------------- static checks


def find_source(module: str) -> Path | None:
    """Source file of ``module`` on ``sys.path``, found without importing anything."""
    parts = module.split(".")
    for entry in sys.path:
        base = Path(entry or ".").joinpath(*parts)
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate
    return None


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[set[str], bool]:
    a = fn.args
    names = {x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)}
    if a.vararg:
        names.add(a.vararg.arg)
    return names, a.kwarg is not None


def _find_in(body: list[ast.stmt], name: str) -> ast.AST | None:
    found: ast.AST | None = None
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if node.name == name:
                found = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                found = node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                if (alias.asname or alias.name.split(".")[0]) == name:
                    found = node
        elif isinstance(node, (ast.If, ast.Try)):
            inner = _find_in([*node.body, *getattr(node, "orelse", [])], name)
            found = inner or found
    return found


def check_static(point: PlugPoint) -> tuple[Outcome, str]:
    """Check ``point`` from its module's source text (never executes it)."""
    module, _, qualname = point.target.partition(":")
    path = find_source(module)
    if path is None:
        return Outcome.UNAVAILABLE, f"module {module} not found on sys.path"
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except (SyntaxError, ValueError) as exc:  # ValueError: not UTF-8, or a NUL byte
        # e.g. syntax newer than this Python: the point cannot be checked here, which is not
        # drift; --strict fails on it.
        return Outcome.UNAVAILABLE, (
            f"{path} cannot be parsed by Python {sys.version_info.major}."
            f"{sys.version_info.minor} ({type(exc).__name__}: {exc}); check with the host's "
            "Python"
        )
    node: ast.AST | None = tree
    for part in qualname.split(".") if qualname else ():
        body = getattr(node, "body", None)
        if not isinstance(body, list):
            return Outcome.DRIFT, f"drift: {qualname} not found in {path} (parent is not a class)"
        node = _find_in(body, part)
        if node is None:
            return Outcome.DRIFT, f"drift: {part!r} of {qualname} not defined in {path}"
    if point.params:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return Outcome.OK, f"present in {path} (not a function; parameters not checked)"
        names, has_kw = _params(node)
        missing = [p for p in point.params if p not in names]
        if missing and not has_kw:
            return Outcome.DRIFT, f"drift: {qualname} in {path} lacks parameters {missing}"
    return Outcome.OK, f"present in {path}"


def check_point(host: str, point: PlugPoint) -> PointResult:
    """Import-based check, falling back to the static check when the import fails."""
    how = "import"
    try:
        status = check_plug_point(point)
        ok, detail = status.ok, status.detail
        imported = not detail.startswith("module not importable")
    except Exception as exc:  # a host module may fail at import for any reason (asserts)
        ok, detail, imported = False, f"module not importable: {type(exc).__name__}: {exc}", False
    if imported:
        outcome = Outcome.OK if ok else Outcome.DRIFT
    else:
        how = "static"
        outcome, static_detail = check_static(point)
        detail = f"{static_detail} [import failed here: {detail.split(': ', 1)[-1][:160]}]"
    return PointResult(host, point.name, point.target, point.kind.value, outcome, how, detail)


# --------------------------------------------------------------------------- versions


def git_commit(path: Path) -> str | None:
    """HEAD commit of the git work tree at ``path`` (None without git metadata)."""
    try:
        out = subprocess.run(
            ["git", "-C", str(path), "rev-parse", "HEAD"],
            capture_output=True, text=True, timeout=10, check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    commit = out.stdout.strip()
    return commit if out.returncode == 0 and len(commit) == 40 else None


def nemo_rl_version(src: str | None) -> HostVersion:
    """NeMo RL found via ``src`` (NEMO_RL_SRC) or the installed package."""
    from rlix_plugins.patches.nemo_rl import SUPPORTED_COMMIT, SUPPORTED_VERSION, NemoRlPatch

    commit: str | None = None
    version: str | None = None
    where: str | None = None
    if src:
        root = Path(src)
        where = str(root)
        commit = git_commit(root)
        info = root / "nemo_rl" / "package_info.py"
        if info.is_file():
            version = _package_info_version(info)
    if version is None:
        version = NemoRlPatch().version()
        if version is not None and where is None:
            spec = importlib.util.find_spec("nemo_rl")
            where = str(Path(spec.origin).parent) if spec and spec.origin else None
    if commit is not None:
        matches: bool | None = commit == SUPPORTED_COMMIT
    elif version is not None:
        matches = version == SUPPORTED_VERSION
    else:
        matches = None
    return HostVersion("nemo_rl", version, commit, where, NemoRlPatch.supported, matches)


def _package_info_version(path: Path) -> str | None:
    values: dict[str, Any] = {}
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            t = node.targets[0]
            if isinstance(t, ast.Name) and t.id in ("MAJOR", "MINOR", "PATCH", "PRE_RELEASE"):
                try:
                    values[t.id] = ast.literal_eval(node.value)
                except ValueError:
                    return None
    if {"MAJOR", "MINOR", "PATCH"} <= values.keys():
        pre = values.get("PRE_RELEASE", "")
        return f"{values['MAJOR']}.{values['MINOR']}.{values['PATCH']}{pre}"
    return None


# --------------------------------------------------------------------------- command


def load_patches() -> dict[str, HostPatch | Exception]:
    """Every registered host patch (or the error that stopped its module from loading)."""
    from rlix_plugins import activation

    out: dict[str, HostPatch | Exception] = {}
    for host, factory in sorted(activation.PATCHES.items()):
        module_name, _, attr = factory.partition(":")
        try:
            patch = getattr(importlib.import_module(module_name), attr)()
            if not isinstance(patch, HostPatch):
                raise TypeError(f"{factory} did not return a HostPatch")
            out[host] = patch
        except Exception as exc:
            out[host] = exc
    return out


def collect(
    hosts: list[str] | None = None,
) -> tuple[list[HostVersion], list[PointResult], list[str]]:
    """Run every check; returns (versions, point results, patch-load errors).

    Raises:
        UnknownHostError: ``hosts`` names a host without a registered patch (valid ones
            listed).
    """
    from rlix_plugins import activation

    unknown = sorted(set(hosts or ()) - set(activation.PATCHES))
    if unknown:
        raise UnknownHostError(
            f"unknown host(s) {unknown}; valid hosts are {sorted(activation.PATCHES)}"
        )
    versions: list[HostVersion] = []
    results: list[PointResult] = []
    errors: list[str] = []
    for host, patch in load_patches().items():
        if hosts and host not in hosts:
            continue
        if isinstance(patch, Exception):
            errors.append(f"{host}: patch module failed to load: {type(patch).__name__}: {patch}")
            continue
        if host == "nemo_rl":
            versions.append(nemo_rl_version(os.environ.get(ENV_NEMO_RL_SRC)))
        else:
            try:
                v = patch.version()
            except Exception:
                v = None
            versions.append(HostVersion(host, v, None, None, patch.supported,
                                        None if v is None else patch.version_supported(v)))
        results.extend(check_point(host, p) for p in patch.plug_points)
    return versions, results, errors
