"""Typed environment settings.

``RLIX_CONTROL_PLANE`` decides everything: unset, empty or ``off`` means standalone (nothing is
patched, nothing is contacted); ``rlix`` means time-sharing under the coordinator. Any other
value is an error naming the valid ones: an explicit value is a request, and silently running
standalone on a typo would hide it.

The gates (``activation.activate``, the vLLM plugin) read only :func:`control_plane_from_env`
first and the other settings only when it is ``rlix``: a standalone job must behave exactly as
without this package, whatever else its environment holds (``PIPELINE_ID=`` included). The
other settings are validated like the control plane, and a bad value never silently falls back
to a default.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from rlix_plugins.errors import SettingsError

ENV_CONTROL_PLANE = "RLIX_CONTROL_PLANE"
ENV_NAMESPACE = "RLIX_NAMESPACE"
ENV_REQUEST_TIMEOUT_S = "RLIX_REQUEST_TIMEOUT_S"
ENV_RESIZE_TIMEOUT_S = "RLIX_RESIZE_TIMEOUT_S"
ENV_LEASE_S = "RLIX_LEASE_S"
ENV_TRACE_DIR = "RLIX_TRACE_DIR"
ENV_VLLM_SLEEP_LEVEL = "RLIX_VLLM_SLEEP_LEVEL"
ENV_BACKGROUND_EXPANDS = "RLIX_BACKGROUND_EXPANDS"
ENV_PIPELINE_ID = "PIPELINE_ID"
ENV_ROLL_RAY_NAMESPACE = "ROLL_RAY_NAMESPACE"


class ControlPlane(str, enum.Enum):
    """Which control plane a job runs under."""

    OFF = "off"
    RLIX = "rlix"


@dataclass(frozen=True, slots=True)
class Settings:
    """Validated settings of one process. Build with :func:`load_settings`."""

    control_plane: ControlPlane = ControlPlane.OFF
    namespace: str = "rlix"
    request_timeout_s: float = 1800.0
    resize_timeout_s: float = 120.0
    lease_s: float = 10.0
    trace_dir: Path | None = None
    #: vLLM sleep level of a preempted shard (2 frees weights and KV cache; 0/1 keep weights)
    vllm_sleep_level: int = 2
    #: the scheduler commits a cycle once its shrinks are done and lets expands (wake + sync)
    #: finish in the background, so one slow wake does not hold every other grant
    background_expands: bool = False
    pipeline_id: str | None = None
    ray_namespace: str | None = None

    def __post_init__(self) -> None:
        # Settings built in code are checked as load_settings checks the environment: the
        # plane is compared by identity, so Settings(control_plane="rlix") ran standalone
        # without a word (make_hooks returned no-op hooks), and a lease of 0 turned the
        # heartbeat into a busy loop.
        plane = _plane(self.control_plane, "Settings.control_plane")
        object.__setattr__(self, "control_plane", plane)
        for name in ("request_timeout_s", "resize_timeout_s", "lease_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not (
                MIN_SECONDS <= value < float("inf")
            ):
                raise SettingsError(
                    f"Settings.{name}={value!r} is out of range; expected finite seconds >= "
                    f"{MIN_SECONDS:g}"
                )
            object.__setattr__(self, name, float(value))
        if isinstance(self.vllm_sleep_level, bool) or self.vllm_sleep_level not in (0, 1, 2):
            raise SettingsError(
                f"Settings.vllm_sleep_level={self.vllm_sleep_level!r} is not valid; "
                "expected 0, 1 or 2"
            )

    @property
    def enabled(self) -> bool:
        """True when the job time-shares GPUs under the coordinator."""
        return self.control_plane is ControlPlane.RLIX


#: the shortest timeout or lease a setting may name: shorter ones turn the heartbeat and the
#: retry loops into busy loops (a lease of 1e-9 s beats every 3e-10 s) and no RPC answers
#: that fast anyway
MIN_SECONDS = 0.1


def _positive_float(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise SettingsError(
            f"{name}={raw!r} is not a number; expected finite seconds >= {MIN_SECONDS:g}"
        ) from None
    if not value >= MIN_SECONDS or value == float("inf"):
        raise SettingsError(
            f"{name}={raw!r} is out of range; expected finite seconds >= {MIN_SECONDS:g}"
        )
    return value


def _nonempty(env: Mapping[str, str], name: str, default: str | None) -> str | None:
    raw = env.get(name)
    if raw is None:
        return default
    value = raw.strip()
    if not value:
        raise SettingsError(f"{name} is set but empty; unset it or give a non-empty value")
    return value


def control_plane_from_env(env: Mapping[str, str] | None = None) -> ControlPlane:
    """Only ``RLIX_CONTROL_PLANE`` from ``env`` (default: ``os.environ``); nothing else is read.

    Unset or empty is ``off``; a value other than ``off``/``rlix`` raises :class:`SettingsError`.
    """
    env = os.environ if env is None else env
    raw_plane = env.get(ENV_CONTROL_PLANE)
    if raw_plane is None or raw_plane.strip() == "":
        return ControlPlane.OFF
    return _plane(raw_plane, ENV_CONTROL_PLANE)


def _plane(raw: object, name: str) -> ControlPlane:
    """``raw`` (a member, or its value in any case) as a :class:`ControlPlane`, else
    :class:`SettingsError` naming ``name`` and the valid values."""
    if isinstance(raw, ControlPlane):
        return raw
    try:
        if not isinstance(raw, str):
            raise ValueError(raw)
        return ControlPlane(raw.strip().lower())
    except ValueError:
        valid = ", ".join(repr(p.value) for p in ControlPlane)
        unset = "unset or " if name == ENV_CONTROL_PLANE else ""
        raise SettingsError(
            f"{name}={raw!r} is not valid; expected {unset}one of {valid}"
        ) from None


def settings_if_enabled(env: Mapping[str, str] | None = None) -> Settings | None:
    """Every setting when ``RLIX_CONTROL_PLANE=rlix``, else None without reading any other
    variable (a standalone job never fails on them)."""
    if control_plane_from_env(env) is not ControlPlane.RLIX:
        return None
    return load_settings(env)


def load_settings(env: Mapping[str, str] | None = None) -> Settings:
    """Read and validate every setting from ``env`` (default: ``os.environ``)."""
    env = os.environ if env is None else env
    plane = control_plane_from_env(env)
    namespace = _nonempty(env, ENV_NAMESPACE, "rlix")
    assert namespace is not None
    trace = _nonempty(env, ENV_TRACE_DIR, None)
    raw_level = (env.get(ENV_VLLM_SLEEP_LEVEL) or "").strip() or "2"
    if raw_level not in ("0", "1", "2"):
        raise SettingsError(
            f"{ENV_VLLM_SLEEP_LEVEL}={env.get(ENV_VLLM_SLEEP_LEVEL)!r} is not valid; "
            "expected 0, 1 or 2"
        )
    raw_bg = (env.get(ENV_BACKGROUND_EXPANDS) or "").strip() or "0"
    if raw_bg not in ("0", "1"):
        raise SettingsError(
            f"{ENV_BACKGROUND_EXPANDS}={env.get(ENV_BACKGROUND_EXPANDS)!r} is not valid; "
            "expected 0 (a cycle waits for its expands) or 1 (expands finish in the background)"
        )
    lease = _positive_float(env, ENV_LEASE_S, 10.0)
    return Settings(
        control_plane=plane,
        namespace=namespace,
        request_timeout_s=_positive_float(env, ENV_REQUEST_TIMEOUT_S, 1800.0),
        resize_timeout_s=_positive_float(env, ENV_RESIZE_TIMEOUT_S, 120.0),
        lease_s=lease,
        trace_dir=Path(trace) if trace else None,
        vllm_sleep_level=int(raw_level),
        background_expands=raw_bg == "1",
        pipeline_id=_nonempty(env, ENV_PIPELINE_ID, None),
        ray_namespace=_nonempty(env, ENV_ROLL_RAY_NAMESPACE, None),
    )
