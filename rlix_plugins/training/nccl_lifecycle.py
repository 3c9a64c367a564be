"""Destroy and re-create Megatron's process groups inside a training worker.

Why: NCCL communicators keep GPU memory (buffers, streams) for as long as their process group
lives. Between train steps the training GPUs are lent to inference, so every NCCL group must
really be gone, and come back identically before the next step. Megatron's own
``destroy_model_parallel()`` only destroys its ``*_GLOO`` groups and sets the others to
``None`` while torch keeps them alive (measured here: 20 cycles grew live groups 18 -> 341,
fds 163 -> 1455, threads 111 -> 1080).

What :meth:`MegatronParallelLifecycle.destroy` does, in order:

1. optional barrier on the default group, so no collective is in flight on any rank;
2. finds every ``torch.distributed.ProcessGroup`` held by ``parallel_state``'s module globals,
   including inside lists, tuples, sets and dicts (names are not hard-coded, so groups added by
   a later release are found too), plus every group that appeared in torch's world map while
   :meth:`initialize` ran; destroys each one still in ``distributed_c10d._world.pg_map``;
3. calls ``destroy_model_parallel()`` and then resets every module global whose pristine value
   (read from the module source) is ``None`` or an empty container, because some survive
   ``destroy_model_parallel()`` (global-rank lists, ``_HYBRID_DP_CP_GROUPS``);
4. verifies the world map no longer holds any destroyed group (a stale handle may keep working
   silently, so "calls fail" is not evidence) and that no global still references a group.

The default (world) group is left alone: it belongs to the host. Every group Megatron created
is destroyed whatever its backend (on CPU they are all gloo); Megatron's extra ``*_GLOO``
groups are re-created by :meth:`initialize` iff the saved configuration's
``create_gloo_process_groups`` is true (Megatron's default).

Held references: megatron-core's ``DistributedDataParallel`` (``self.dp_group`` ...), its
param/grad buffers and bucket groups, the distributed optimizer and ``ProcessGroupCollection``
objects keep the group objects they were built with, so after a destroy/re-init they hold
destroyed groups. :meth:`destroy` remembers which group each ``parallel_state`` global held (by
name and position), :meth:`reinitialize` pairs every old group with the new group at the same
place, and :func:`rebind_process_groups` (or ``reinitialize(roots=...)``) replaces every old
group reachable from the given roots (model chunks, optimizer) and raises
:class:`StaleProcessGroupError` if a destroyed group is still reachable afterwards. A re-init
whose rebind raised leaves the new groups alive and :attr:`~MegatronParallelLifecycle.needs_reinit`
true: the retry (``reinitialize(roots)`` again) rebinds with the same pairing and re-creates
nothing, and :meth:`~MegatronParallelLifecycle.destroy` removes the new groups as usual.

This must run in the training worker process: that is where ``parallel_state`` lives (calling it
in a driver finds nothing). Verified with megatron-core 0.16.1 (the release installable on
Python 3.11); discovery does not depend on global names, but ``initialize_model_parallel``'s
keyword set differs between releases, so the saved configuration must match the installed one.
"""

from __future__ import annotations

import ast
import copy
import functools
import inspect
import logging
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from types import FunctionType, ModuleType
from typing import Any

from rlix_plugins.errors import ParallelStateError

logger = logging.getLogger(__name__)


class StaleProcessGroupError(ParallelStateError):
    """A destroyed process group is still reachable from the objects a train step uses."""

#: megatron-core releases this module was run against.
VERIFIED_MEGATRON_CORE = ("0.16.1",)
_MAX_DEPTH = 4


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    """The keyword arguments of ``parallel_state.initialize_model_parallel`` to restore."""

    init_kwargs: Mapping[str, Any] = field(default_factory=dict)

    @staticmethod
    def of(**kwargs: Any) -> ParallelConfig:
        return ParallelConfig(init_kwargs=dict(kwargs))


@dataclass(frozen=True, slots=True)
class DestroyReport:
    """What one destroy found and removed."""

    destroyed: int
    by_backend: Mapping[str, int]
    found_in_globals: int
    found_by_world_map_diff: int
    globals_reset: int
    live_groups_after: int
    seconds: float


def _import_parallel_state() -> ModuleType:
    try:
        from megatron.core import parallel_state
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ParallelStateError(f"megatron-core is not importable: {exc}") from exc
    module: ModuleType = parallel_state
    return module


def _world() -> Any:
    from torch.distributed import distributed_c10d

    return distributed_c10d._world


def live_process_groups() -> list[Any]:
    """Every process group torch currently tracks (world map), the default group included."""
    return list(_world().pg_map.keys())


def backend_name(group: Any) -> str:
    """Backend of ``group`` ("gloo", "nccl", ...). ``get_backend`` says "undefined" when the
    default group was created without a backend, so the backend config is read as well."""
    import torch.distributed as dist

    try:
        name = str(dist.get_backend(group))
    except Exception:
        name = "undefined"
    if name != "undefined":
        return name
    config = _world().pg_backend_config.get(group)
    if config:
        # "cpu:gloo,cuda:nccl" -> "gloo+nccl"
        parts = sorted({p.split(":")[-1] for p in str(config).split(",") if p})
        return "+".join(parts) or "undefined"
    return "undefined"


def _walk(value: Any, depth: int = 0) -> Iterator[Any]:
    import torch.distributed as dist

    if isinstance(value, dist.ProcessGroup):
        yield value
        return
    if depth >= _MAX_DEPTH:
        return
    if isinstance(value, Mapping):
        for k, v in value.items():
            yield from _walk(k, depth + 1)
            yield from _walk(v, depth + 1)
    elif isinstance(value, (list, tuple, set, frozenset)):
        for v in value:
            yield from _walk(v, depth + 1)


#: where a group sat in ``parallel_state``: (global name, index or key, ...)
SlotPath = tuple[str | int, ...]


def _walk_paths(value: Any, path: SlotPath, depth: int = 0) -> Iterator[tuple[SlotPath, Any]]:
    import torch.distributed as dist

    if isinstance(value, dist.ProcessGroup):
        yield path, value
        return
    if depth >= _MAX_DEPTH:
        return
    if isinstance(value, Mapping):
        for k, v in value.items():
            if isinstance(k, (str, int)):  # only stable keys give a stable position
                yield from _walk_paths(v, (*path, k), depth + 1)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _walk_paths(v, (*path, i), depth + 1)


def group_slots(module: ModuleType) -> dict[SlotPath, Any]:
    """Every ProcessGroup in ``module``'s globals keyed by where it sits (name, index/key...),
    the default group excluded."""
    import torch.distributed as dist

    world = dist.GroupMember.WORLD
    slots: dict[SlotPath, Any] = {}
    for name, value in vars(module).items():
        if name.startswith("__") or isinstance(value, ModuleType) or callable(value):
            continue
        for path, pg in _walk_paths(value, (name,)):
            if pg is not world:
                slots[path] = pg
    return slots


@dataclass(frozen=True, slots=True)
class GroupMapping:
    """Old (destroyed) group -> new group, paired by their place in ``parallel_state``.

    ``pairs`` is keyed by ``id(old)``; the old objects are kept inside so the ids stay valid.
    """

    pairs: Mapping[int, tuple[Any, Any]]
    #: old groups that had no counterpart after re-init (a layout change): never rebindable
    unmatched: tuple[SlotPath, ...] = ()

    @staticmethod
    def between(old: Mapping[SlotPath, Any], new: Mapping[SlotPath, Any]) -> GroupMapping:
        """Pair groups found at the same place; raises if one old group would map to two."""
        pairs: dict[int, tuple[Any, Any]] = {}
        unmatched: list[SlotPath] = []
        for path, old_pg in old.items():
            new_pg = new.get(path)
            if new_pg is None:
                unmatched.append(path)
                continue
            known = pairs.get(id(old_pg))
            if known is not None and known[1] is not new_pg:
                raise ParallelStateError(
                    f"the group at {_fmt(path)} was shared with another slot before re-init but "
                    "not after; the re-initialised layout differs from the destroyed one"
                )
            pairs[id(old_pg)] = (old_pg, new_pg)
        return GroupMapping(pairs=pairs, unmatched=tuple(unmatched))

    def __len__(self) -> int:
        return len(self.pairs)

    def get(self, group: Any) -> Any | None:
        pair = self.pairs.get(id(group))
        return pair[1] if pair is not None and pair[0] is group else None


@dataclass(frozen=True, slots=True)
class RebindReport:
    """What one :func:`rebind_process_groups` walk did."""

    #: references to an old group that now point to its new group
    replaced: int
    #: objects visited (containers and instances)
    objects_visited: int
    #: where an old group sat that could not be replaced (e.g. ``functools.partial`` args)
    unreplaceable: tuple[str, ...]
    #: where a group that is no longer alive is still referenced (after replacing)
    dead_reachable: tuple[str, ...]
    seconds: float


def _fmt(path: Iterable[Any]) -> str:
    out = ""
    for p in path:
        out += f"[{p!r}]" if not isinstance(p, str) or not p.isidentifier() else f".{p}"
    return out.lstrip(".")


class _Rebinder:
    """Walks an object graph replacing old groups by new ones (:func:`rebind_process_groups`)."""

    # leaves: nothing reachable from them can hold a group worth walking
    _ATOMS = (str, bytes, bytearray, int, float, complex, bool, type(None), type, ModuleType,
              range, slice, memoryview)

    def __init__(self, mapping: GroupMapping) -> None:
        import torch
        import torch.distributed as dist

        self.mapping = mapping
        self.pg_type = dist.ProcessGroup
        self.skip_types: tuple[type, ...] = (
            *self._ATOMS, torch.Tensor, torch.dtype, torch.device, torch.Size
        )
        self.module_type = torch.nn.Module
        self.world_map = _world().pg_map
        self.seen: set[int] = set()
        self.pending: list[tuple[Any, list[Any]]] = []
        self.replaced = 0
        self.unreplaceable: list[str] = []
        self.dead: list[str] = []

    def swap(self, value: Any, path: list[Any]) -> tuple[Any, bool]:
        """(value to store, whether it differs) for one reference found at ``path``."""
        if isinstance(value, self.pg_type):
            new = self.mapping.get(value)
            if new is not None:
                self.replaced += 1
                return new, True
            if value not in self.world_map and value is not None:
                self.dead.append(_fmt(path))
            return value, False
        if isinstance(value, (tuple, frozenset)):
            return self.rebuild(value, path)
        # mutable holders are changed in place: queue them (a work stack, not recursion, so a
        # deep object graph cannot hit the interpreter's recursion limit)
        if not isinstance(value, self.skip_types) and id(value) not in self.seen:
            self.pending.append((value, path))
        return value, False

    def rebuild(self, value: tuple[Any, ...] | frozenset[Any],
                path: list[Any]) -> tuple[Any, bool]:
        # immutable: walk the members, rebuild the container only if one of them changed
        if id(value) in self.seen:
            return value, False
        items = list(value)
        changed = False
        for i, item in enumerate(items):
            new, differs = self.swap(item, [*path, i])
            if differs:
                items[i], changed = new, True
        if not changed:
            self.seen.add(id(value))
            return value, False
        if isinstance(value, frozenset):
            return frozenset(items), True
        if hasattr(value, "_make"):  # namedtuple
            return type(value)._make(items), True
        return type(value)(items), True

    def refuse(self, value: Any, path: list[Any]) -> None:
        """Record a reference that changed but has nowhere to be written back."""
        self.unreplaceable.append(_fmt(path))
        # the old groups stay where they are: they were counted as replaced, take them back
        self.replaced -= 1 if isinstance(value, self.pg_type) else len(list(_walk(value)))

    def drain(self) -> None:
        """Visit everything queued, depth first."""
        while self.pending:
            self.visit(*self.pending.pop())

    def visit(self, obj: Any, path: list[Any]) -> None:
        if isinstance(obj, self.skip_types) or id(obj) in self.seen:
            return
        self.seen.add(id(obj))
        if isinstance(obj, list):
            for i, v in enumerate(obj):
                new, differs = self.swap(v, [*path, i])
                if differs:
                    obj[i] = new
        elif isinstance(obj, dict):
            for k in list(obj.keys()):
                new_k, k_differs = self.swap(k, [*path, f"<key {k!r}>"])
                v = obj[k]
                new_v, v_differs = self.swap(v, [*path, k if isinstance(k, (str, int)) else "?"])
                if k_differs:
                    del obj[k]
                    obj[new_k] = new_v
                elif v_differs:
                    obj[k] = new_v
        elif isinstance(obj, set):
            for m in list(obj):
                new, differs = self.swap(m, [*path, "<member>"])
                if differs:
                    obj.discard(m)
                    obj.add(new)
        elif isinstance(obj, functools.partial):
            for i, a in enumerate(obj.args):
                new, differs = self.swap(a, [*path, "args", i])
                if differs:
                    self.refuse(new, [*path, "args", i])
            self.pending.append((obj.keywords, [*path, "keywords"]))
            self.pending.append((obj.func, [*path, "func"]))
        elif isinstance(obj, FunctionType):
            # closures capture groups (megatron builds hooks that way); cells are writable
            for cell, name in zip(obj.__closure__ or (), obj.__code__.co_freevars, strict=True):
                try:
                    content = cell.cell_contents
                except ValueError:  # empty cell
                    continue
                new, differs = self.swap(content, [*path, f"<closure {name}>"])
                if differs:
                    cell.cell_contents = new
        elif inspect.ismethod(obj):
            self.pending.append((obj.__self__, [*path, "__self__"]))
        else:
            self.visit_instance(obj, path)

    def visit_instance(self, obj: Any, path: list[Any]) -> None:
        attrs: dict[str, Any] = {}
        d = getattr(obj, "__dict__", None)
        if isinstance(d, dict):
            attrs.update(d)
        for klass in type(obj).__mro__:
            for name in getattr(klass, "__slots__", ()):
                if name not in ("__dict__", "__weakref__") and hasattr(obj, name):
                    attrs[name] = getattr(obj, name)
        is_module = isinstance(obj, self.module_type)
        for name, value in attrs.items():
            if is_module and name in ("_parameters", "_buffers"):
                continue  # tensors only; the model's size would dominate the walk
            new, differs = self.swap(value, [*path, name])
            if not differs:
                continue
            try:
                # object.__setattr__: frozen dataclasses and __setattr__ overrides included
                object.__setattr__(obj, name, new)
            except (AttributeError, TypeError):
                self.refuse(new, [*path, name])


def rebind_process_groups(
    roots: Mapping[str, Any] | Iterable[Any], mapping: GroupMapping, *, strict: bool = True
) -> RebindReport:
    """Replace every reference to an old group reachable from ``roots`` by its new group.

    ``roots`` are the objects a train step uses (model chunks, optimizer, process-group
    collections), by name or as a sequence. The walk follows instance ``__dict__`` and
    ``__slots__`` (frozen dataclasses too), lists, dicts (keys and values), sets, closures and
    ``functools.partial`` keywords; tuples and frozensets are rebuilt and written back where
    they sit; tensors and modules' parameters/buffers are skipped. Each object is visited once.

    A reference that cannot be written back (``partial`` args, a tuple root, a read-only
    attribute) is listed in ``unreplaceable``; a group that is not alive any more and still
    reachable is listed in ``dead_reachable``. With ``strict`` (the default) either raises
    :class:`StaleProcessGroupError`, so a train step never runs on a destroyed group. Objects
    held only by C++ (or outside the roots) are not seen: pass every root the step uses.
    """
    started = time.perf_counter()
    named = dict(roots) if isinstance(roots, Mapping) else {
        f"root{i}": r for i, r in enumerate(roots)
    }
    walker = _Rebinder(mapping)
    for name, root in named.items():
        new, differs = walker.swap(root, [name])
        if differs:
            walker.refuse(new, [name])
        walker.drain()
    report = RebindReport(
        replaced=walker.replaced,
        objects_visited=len(walker.seen),
        unreplaceable=tuple(walker.unreplaceable),
        dead_reachable=tuple(walker.dead),
        seconds=time.perf_counter() - started,
    )
    logger.info(
        "rebound %d process-group references over %d objects in %.3f s",
        report.replaced, report.objects_visited, report.seconds,
    )
    if strict and (report.unreplaceable or report.dead_reachable):
        raise StaleProcessGroupError(
            f"destroyed process groups are still reachable: {len(report.unreplaceable)} "
            f"reference(s) could not be replaced {list(report.unreplaceable)[:10]} and "
            f"{len(report.dead_reachable)} reference(s) point to dead groups "
            f"{list(report.dead_reachable)[:10]}; pass mutable holders as roots (or rebuild "
            "the holder after re-init)"
        )
    return report


def groups_in_module(module: ModuleType) -> list[Any]:
    """Every ProcessGroup reachable from ``module``'s globals, the default group excluded."""
    import torch.distributed as dist

    world = dist.GroupMember.WORLD
    seen: dict[int, Any] = {}
    for name, value in vars(module).items():
        if name.startswith("__") or isinstance(value, ModuleType) or callable(value):
            continue
        for pg in _walk(value):
            if pg is not world:
                seen.setdefault(id(pg), pg)
    return list(seen.values())


def init_keywords(module: ModuleType) -> frozenset[str]:
    """Parameters ``module.initialize_model_parallel`` takes (empty when unreadable)."""
    try:
        return frozenset(inspect.signature(module.initialize_model_parallel).parameters)
    except (TypeError, ValueError):  # pragma: no cover - a C or patched callable
        return frozenset()


def _destroy_live(groups: Iterable[Any]) -> dict[str, int]:
    """Destroy each of ``groups`` still in torch's world map (the default group never);
    returns how many per backend."""
    import torch.distributed as dist

    world = dist.GroupMember.WORLD
    wanted = {id(pg) for pg in groups}
    # Oldest first: torch's world map keeps creation order. On an H100 (NCCL 2.28) a group
    # destroyed after a younger one took about 0.48 s, in creation order 0.015 s: Megatron's 17
    # NCCL groups came down in 3.0 s in parallel_state's globals order, 8.1 s newest first and
    # 0.49 s oldest first (benchmarks/gpu/megatron_teardown.py). Groups no longer in the map
    # are already gone (megatron destroyed its gloo groups, or a stale handle).
    live = [pg for pg in _world().pg_map if id(pg) in wanted and pg is not world]
    by_backend: dict[str, int] = {}
    for pg in live:
        name = backend_name(pg)
        dist.destroy_process_group(pg)
        by_backend[name] = by_backend.get(name, 0) + 1
    return by_backend


def pristine_state(module: ModuleType) -> dict[str, Any]:
    """Module globals whose source default is ``None`` or an empty container: its state slots."""
    try:
        tree = ast.parse(inspect.getsource(module))
    except (OSError, TypeError, SyntaxError) as exc:
        raise ParallelStateError(f"cannot read the source of {module.__name__}: {exc}") from exc
    defaults: dict[str, Any] = {}
    for node in tree.body:
        targets: list[ast.expr]
        if isinstance(node, ast.Assign):
            targets, value = list(node.targets), node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        try:
            literal = ast.literal_eval(value)
        except ValueError:
            continue
        if literal is not None and literal not in ({}, [], ()) and literal != set():
            continue
        for t in targets:
            if isinstance(t, ast.Name) and t.id.startswith("_") and not t.id.startswith("__"):
                defaults[t.id] = literal
    return defaults


class MegatronParallelLifecycle:
    """Owns Megatron's parallel state in one training worker: initialize, destroy, re-init.

    Use :meth:`initialize` instead of calling ``initialize_model_parallel`` yourself, or
    :meth:`adopt` when the host already did (then only module globals are scanned).
    """

    def __init__(
        self,
        config: ParallelConfig,
        parallel_state: ModuleType | None = None,
        *,
        barrier: bool = True,
    ) -> None:
        self.config = config
        self.ps = parallel_state or _import_parallel_state()
        self.barrier = barrier
        self._defaults = pristine_state(self.ps)
        self._created: list[Any] = []
        # where each group sat before the last destroy, and old -> new after re-init
        self._destroyed_slots: dict[SlotPath, Any] = {}
        self._mapping: GroupMapping | None = None
        # the groups were re-created but rebinding the held references has not succeeded since
        self._rebind_pending = False
        self._check_release()

    @classmethod
    def adopt(
        cls, config: ParallelConfig, parallel_state: ModuleType | None = None, **kw: Any
    ) -> MegatronParallelLifecycle:
        """Wrap parallel state the host initialised already."""
        return cls(config, parallel_state, **kw)

    def _check_release(self) -> None:
        try:
            import megatron.core as mc

            version = str(getattr(mc, "__version__", "unknown"))
        except ImportError:
            version = "unknown"
        if version not in VERIFIED_MEGATRON_CORE and self.ps.__name__.startswith("megatron."):
            logger.warning(
                "megatron-core %s is not among the verified releases %s; group discovery is "
                "generic, but check initialize_model_parallel's arguments",
                version,
                VERIFIED_MEGATRON_CORE,
            )

    @property
    def initialized(self) -> bool:
        """Whether the parallel state's groups exist (see :attr:`needs_reinit` before a step)."""
        return bool(self.ps.model_parallel_is_initialized())

    @property
    def rebind_pending(self) -> bool:
        """The groups were re-created, but rebinding the held references raised and has not
        succeeded since: the holders may still reference destroyed groups."""
        return self._rebind_pending

    @property
    def needs_reinit(self) -> bool:
        """Whether :meth:`reinitialize` must run before the next step: the groups are
        destroyed, or re-created with a rebind still pending (:attr:`rebind_pending`)."""
        return not self.initialized or self._rebind_pending

    def initialize(self) -> None:
        """``initialize_model_parallel(**config)``, remembering which groups it created.

        If megatron rejects the configuration, the groups it had created are destroyed, the
        module state is restored and :class:`ParallelStateError` names the configuration."""
        if self.initialized:
            raise ParallelStateError(
                "Megatron parallel state is already initialised; destroy() it first"
            )
        before = {id(pg) for pg in live_process_groups()}
        saved = self._snapshot()
        try:
            self.ps.initialize_model_parallel(**dict(self.config.init_kwargs))
        except Exception as exc:
            # megatron raises (often a bare AssertionError) after creating some groups and
            # setting some globals: undo both, or the groups leak and the next initialize()
            # fails on megatron's "already initialized" instead of on the configuration
            self._undo_initialize(
                [pg for pg in live_process_groups() if id(pg) not in before], saved
            )
            raise ParallelStateError(
                f"initialize_model_parallel rejected the saved configuration "
                f"{dict(self.config.init_kwargs)}: {type(exc).__name__}: {exc}; valid "
                f"keywords: {sorted(init_keywords(self.ps))}"
            ) from exc
        self._created = [pg for pg in live_process_groups() if id(pg) not in before]

    def _snapshot(self) -> dict[str, Any]:
        """The module's state slots (shallow copies: megatron appends to its lists)."""
        return {name: copy.copy(getattr(self.ps, name))
                for name in self._defaults if hasattr(self.ps, name)}

    def _undo_initialize(self, created: list[Any], saved: Mapping[str, Any]) -> None:
        """Destroy the groups an unfinished initialize created and restore the module state."""
        _destroy_live(created)
        for name, value in saved.items():
            setattr(self.ps, name, value)

    def destroy(self) -> DestroyReport:
        """Destroy every process group of the parallel state and reset the module."""
        import torch.distributed as dist

        started = time.perf_counter()
        if self.barrier and dist.is_initialized():
            dist.barrier()
        from_globals = groups_in_module(self.ps)
        slots = group_slots(self.ps)
        if slots or not self._destroyed_slots:
            self._destroyed_slots = slots
        # else: a repeated destroy (a retry, nothing re-initialised since) finds the globals
        # already reset; keep the earlier slots or reinitialize() could not pair old groups.
        self._mapping = None
        # the groups a pending rebind targeted are going: the next re-init pairs anew
        self._rebind_pending = False
        world_default = dist.GroupMember.WORLD
        targets: dict[int, Any] = {id(pg): pg for pg in from_globals}
        diff_only = 0
        for pg in self._created:
            if id(pg) not in targets and pg is not world_default:
                targets[id(pg)] = pg
                diff_only += 1
        by_backend = _destroy_live(targets.values())
        destroyed = sum(by_backend.values())
        self.ps.destroy_model_parallel()
        reset = 0
        for name, default in self._defaults.items():
            if hasattr(self.ps, name):
                setattr(self.ps, name, copy.deepcopy(default))
                reset += 1
        self._created = []
        leaked = [pg for pg in targets.values() if pg in _world().pg_map]
        still_referenced = groups_in_module(self.ps)
        report = DestroyReport(
            destroyed=destroyed,
            by_backend=by_backend,
            found_in_globals=len(from_globals),
            found_by_world_map_diff=diff_only,
            globals_reset=reset,
            live_groups_after=len(_world().pg_map),
            seconds=time.perf_counter() - started,
        )
        targets.clear()
        from_globals.clear()
        if leaked or still_referenced:
            raise ParallelStateError(
                f"after destroy, {len(leaked)} destroyed group(s) are still in torch's world map "
                f"and {len(still_referenced)} still referenced by {self.ps.__name__}"
            )
        logger.info("destroyed %d Megatron process groups %s", destroyed, by_backend)
        return report

    def reinitialize(
        self, roots: Mapping[str, Any] | Iterable[Any] | None = None
    ) -> RebindReport | None:
        """Re-create the parallel state from the saved configuration (after :meth:`destroy`),
        pair every destroyed group with its successor and, given ``roots``, rebind the
        references held under them (:meth:`rebind`).

        After a re-init whose rebind raised (:attr:`rebind_pending`), a retry re-creates
        nothing: it rebinds ``roots`` with the same old -> new pairing (the groups are alive;
        re-creating them would be a collective that ranks whose rebind succeeded skip)."""
        if self._rebind_pending and self.initialized:
            if roots is None:
                raise ParallelStateError(
                    "the last re-init's rebind failed and is still pending; retry "
                    "reinitialize() with the roots (or call rebind(roots))"
                )
            logger.info("retrying the rebind of the last re-init (the groups are alive)")
            return self.rebind(roots)
        saved = self._snapshot()
        self.initialize()
        try:
            self._mapping = GroupMapping.between(self._destroyed_slots, group_slots(self.ps))
        except ParallelStateError:
            # back to the destroyed state: left initialised, a retry would see "nothing to
            # re-init" while the holders keep the destroyed groups
            self._undo_initialize(self._created, saved)
            self._created = []
            raise
        self._destroyed_slots = {}
        if self._mapping.unmatched:
            logger.warning(
                "%d destroyed group slot(s) have no successor after re-init: %s",
                len(self._mapping.unmatched), [_fmt(p) for p in self._mapping.unmatched][:10],
            )
        return self.rebind(roots) if roots is not None else None

    @property
    def group_mapping(self) -> GroupMapping:
        """Old -> new groups of the last destroy/re-init (empty before the first one)."""
        return self._mapping or GroupMapping(pairs={})

    def rebind(self, roots: Mapping[str, Any] | Iterable[Any], *,
               strict: bool = True) -> RebindReport:
        """:func:`rebind_process_groups` over ``roots`` with the last destroy/re-init's
        mapping; raises :class:`StaleProcessGroupError` (``strict``) if a destroyed group is
        still reachable from them."""
        if not self.initialized:
            raise ParallelStateError("rebind() needs the re-initialised parallel state; "
                                     "call reinitialize() first")
        # pending until a walk succeeds: a failure (strict, or mid-walk) leaves holders with
        # destroyed groups, and the next reinitialize() must retry rather than skip
        self._rebind_pending = True
        report = rebind_process_groups(roots, self.group_mapping, strict=strict)
        self._rebind_pending = False
        return report

    def cycle(self, roots: Mapping[str, Any] | Iterable[Any] | None = None) -> DestroyReport:
        """destroy() then reinitialize(roots); returns the destroy report."""
        report = self.destroy()
        self.reinitialize(roots)
        return report
