"""Typed errors raised by rlix-plugins.

Every error names what was wrong and what would be valid. They carry only a message so they
pickle cleanly across Ray (a Ray task re-raises them on the caller side as the same type).
"""

from __future__ import annotations


class RlixPluginsError(Exception):
    """Base class of every error raised by this package."""


class SettingsError(RlixPluginsError, ValueError):
    """An environment setting has a value outside its valid set."""


class ProtocolError(RlixPluginsError, ValueError):
    """A wire value (cluster id, pipeline id, report) is malformed."""


class RegistrationError(RlixPluginsError, ValueError):
    """A pipeline registration is invalid (device mapping, TP layout, overlap, duplicate)."""


class UnknownPipelineError(RlixPluginsError, KeyError):
    """A call named a pipeline id the coordinator does not know."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else ""


class UnknownClusterError(RlixPluginsError, KeyError):
    """A call named a cluster id the coordinator does not know."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class OwnershipError(RlixPluginsError, PermissionError):
    """A pipeline tried to release or resize a cluster that is not its own."""


class RequestStateError(RlixPluginsError, RuntimeError):
    """A call does not fit the cluster's current state (e.g. a second pending request)."""


class CoordinatorUnavailableError(RlixPluginsError, RuntimeError):
    """The coordinator could not be reached or did not answer in time."""


class HostDriftError(RlixPluginsError, RuntimeError):
    """A host framework's plug point moved or changed signature (patch target drift)."""
