"""Where the scheduler keeps its state between restarts.

The scheduler saves a JSON record after every commit and registry change; a restarted scheduler
loads it before answering anything. Two stores: Ray's internal KV (the default: it lives in the
GCS, so it survives the actor and any node but the head) and a file (for a coordinator whose
GCS is not fault tolerant, or for inspection).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from pathlib import Path
from typing import Any, Protocol

from rlix_plugins.errors import CorruptStateError

logger = logging.getLogger(__name__)

_KV_NAMESPACE = "rlix_plugins"


class StateStore(Protocol):
    """Load/save/clear one JSON-able record."""

    def load(self) -> dict[str, Any] | None: ...

    def save(self, record: dict[str, Any]) -> None: ...

    def clear(self) -> None: ...


def _parse(raw: str | bytes, where: str) -> dict[str, Any]:
    """A saved record, or :class:`CorruptStateError` naming where it is."""
    try:
        record = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise CorruptStateError(
            f"the coordinator's saved state in {where} is not valid JSON ({exc}); "
            "start afresh with `rlix-plugins coordinator stop` (clears it) or remove it"
        ) from None
    if not isinstance(record, dict):
        raise CorruptStateError(
            f"the coordinator's saved state in {where} is a JSON {type(record).__name__}, "
            "not an object; start afresh with `rlix-plugins coordinator stop` or remove it"
        )
    return record


def kv_key(namespace: str) -> bytes:
    """The KV key of the scheduler of control-plane ``namespace``."""
    return f"scheduler_state:{namespace}".encode()


class KvStateStore:
    """Ray internal KV (GCS). Needs a connected Ray worker or driver."""

    def __init__(self, namespace: str) -> None:
        self._key = kv_key(namespace)

    def load(self) -> dict[str, Any] | None:
        from ray.experimental import internal_kv

        raw = internal_kv._internal_kv_get(self._key, namespace=_KV_NAMESPACE)
        if raw is None:
            return None
        return _parse(raw, f"Ray KV key {self._key.decode()!r} (namespace {_KV_NAMESPACE!r})")

    def save(self, record: dict[str, Any]) -> None:
        from ray.experimental import internal_kv

        internal_kv._internal_kv_put(
            self._key, json.dumps(record).encode(), overwrite=True, namespace=_KV_NAMESPACE
        )

    def clear(self) -> None:
        from ray.experimental import internal_kv

        internal_kv._internal_kv_del(self._key, namespace=_KV_NAMESPACE)


def _fsync_dir(path: Path) -> None:
    """Make the entries of directory ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class FileStateStore:
    """A JSON file, replaced atomically (write to a temp file, fsync, rename)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def load(self) -> dict[str, Any] | None:
        try:
            # Bytes: a file that is not valid UTF-8 is corrupt state (CorruptStateError from
            # _parse), not a UnicodeDecodeError from reading it.
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return None
        return _parse(raw, f"file {self.path}")

    def save(self, record: dict[str, Any]) -> None:
        parent = self.path.parent
        created = [d for d in (parent, *parent.parents) if not d.exists()]
        parent.mkdir(parents=True, exist_ok=True)
        # A directory made here must survive a host crash too: its entry lives in its parent.
        for d in reversed(created):
            _fsync_dir(d.parent)
        tmp = self.path.with_suffix(self.path.suffix + ".tmp")
        with tmp.open("w") as f:
            json.dump(record, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        # The rename itself must survive a host crash, or an older state comes back.
        _fsync_dir(parent)

    def clear(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
