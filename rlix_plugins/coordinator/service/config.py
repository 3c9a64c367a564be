"""Configuration of the coordinator actors (passed to their constructors, so it pickles)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from rlix_plugins.coordinator.core.model import PolicyConfig, Topology
from rlix_plugins.errors import SettingsError
from rlix_plugins.settings import Settings, load_settings
from rlix_plugins.values import is_finite

#: the shortest period or timeout accepted (tests tick at 0.05 s)
_MIN_SECONDS = 0.01


@dataclass(frozen=True, slots=True)
class ServiceConfig:
    """Everything the scheduler actor needs; Ray re-runs the constructor with it on restart."""

    namespace: str = "rlix"
    #: None: read GPUs per node from Ray's cluster resources
    topology: Topology | None = None
    request_timeout_s: float = 1800.0
    resize_timeout_s: float = 120.0
    lease_s: float = 10.0
    trace_dir: str | None = None
    #: periodic cycle (aging, background rebalancing) when no event triggers one
    tick_s: float = 1.0
    #: liveness probes and lease checks
    liveness_interval_s: float = 1.0
    probe_timeout_s: float = 5.0
    policy: PolicyConfig = dataclasses.field(default_factory=PolicyConfig)
    #: None: Ray's internal KV; a path: a JSON file
    state_file: str | None = None
    metrics: bool = True
    #: commit a cycle once its shrinks are done; expands (wake + sync) finish in the
    #: background, one at a time per cluster, and a later shrink of a rank still waking waits
    #: for its wake (RLIX_BACKGROUND_EXPANDS). False: a cycle waits for its expands, as RLix's
    #: scheduler does.
    background_expands: bool = False

    def __post_init__(self) -> None:
        # Checked here, in the caller's process: a zero tick or interval makes the actor's
        # loops spin, a bad timeout fails every request later and far from its cause.
        for name in ("request_timeout_s", "resize_timeout_s", "lease_s", "tick_s",
                     "liveness_interval_s", "probe_timeout_s"):
            value = getattr(self, name)
            if not is_finite(value) or value < _MIN_SECONDS:
                raise SettingsError(
                    f"ServiceConfig.{name} must be finite seconds >= {_MIN_SECONDS}, "
                    f"got {value!r}"
                )
        if not isinstance(self.namespace, str) or not self.namespace:
            raise SettingsError(
                f"ServiceConfig.namespace must be a non-empty string, got {self.namespace!r}"
            )

    @classmethod
    def from_settings(cls, settings: Settings | None = None, **overrides: object) -> ServiceConfig:
        """Build from validated environment settings, then apply keyword overrides."""
        s = settings or load_settings()
        base = cls(
            namespace=s.namespace,
            request_timeout_s=s.request_timeout_s,
            resize_timeout_s=s.resize_timeout_s,
            lease_s=s.lease_s,
            trace_dir=str(s.trace_dir) if s.trace_dir else None,
            background_expands=s.background_expands,
        )
        return dataclasses.replace(base, **overrides)  # type: ignore[arg-type]
