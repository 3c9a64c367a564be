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


class CorruptStateError(ProtocolError):
    """The coordinator's saved state cannot be read back (truncated, malformed, or from
    another cluster); the message names where it is and how to start afresh."""


class RegistrationError(RlixPluginsError, ValueError):
    """A pipeline registration is invalid (device mapping, TP layout, overlap, duplicate)."""


class UnsupportedJobError(RegistrationError):
    """A host job is configured in a way the coordinator cannot time-share (NeMo RL: a
    DTensor policy, a synchronous trainer or vLLM engine, colocated inference, ...; veRL: the
    legacy trainer, another rollout engine or checkpoint backend). Raised before anything is
    started; ``problems`` holds one record per unsupported setting."""

    def __init__(self, message: str, problems: tuple[object, ...] = ()) -> None:
        super().__init__(message)
        self.problems = problems

    def __reduce__(self) -> tuple[type[UnsupportedJobError], tuple[str, tuple[object, ...]]]:
        # Raised inside Ray actors (veRL's TaskRunner): pickled with its problems.
        return (type(self), (str(self), self.problems))


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


class RunOverError(RequestStateError):
    """A pipeline asked for generation GPUs after it ended its training run (``end_run``).

    Its demand is gone and its pending GENERATION request was cancelled with this error; it
    stays registered (training requests still work) until it unregisters. Register again to
    start another run.
    """


class CoordinatorUnavailableError(RlixPluginsError, RuntimeError):
    """The coordinator could not be reached or did not answer in time."""


class HostDriftError(RlixPluginsError, RuntimeError):
    """A host framework's plug point moved or changed signature (patch target drift)."""


class UnknownHostError(RlixPluginsError, ValueError):
    """A host framework name that has no registered patch (the message lists the valid ones)."""


# --- training/ (weight cache, selective sync, NCCL lifecycle) ---------------------------------


class WeightCacheError(RlixPluginsError, RuntimeError):
    """The CPU weight cache cannot do what was asked (base of the cache errors)."""


class UnknownWeightVersionError(WeightCacheError, KeyError):
    """A sync or lookup named a weight version the cache does not hold (never built or freed)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class OversizeTensorError(WeightCacheError, ValueError):
    """A tensor is larger than one bucket; raise the bucket size (tensors are never split)."""


class InsufficientHostMemoryError(WeightCacheError, MemoryError):
    """Host RAM available is below what building a cache version needs (plus the reserve)."""


class WeightSyncError(RlixPluginsError, RuntimeError):
    """A selective weight sync failed for at least one receiver (base of the sync errors)."""


class ReceiverGoneError(WeightSyncError):
    """A receiver died, disconnected or stopped answering during a sync."""


class ChecksumMismatchError(WeightSyncError):
    """A bucket arrived with different bytes than were sent (verified per bucket)."""


class TransportUnavailableError(WeightSyncError):
    """No transport can reach a receiver from this sender (capability mismatch)."""


class ParallelStateError(RlixPluginsError, RuntimeError):
    """Megatron parallel-state destroy/re-init failed or left process groups alive."""


class ShardStateError(RlixPluginsError, ValueError):
    """A generation-shard transition does not fit the shard's state, or names an unknown rank."""


class LastActiveShardError(ShardStateError):
    """Preempting would leave no active shard and the pipeline is configured to refuse that."""


class RefreshHoldError(ShardStateError):
    """A ``preempt`` was refused: an in-place weight refresh claims one of the replicas (it
    read them ACTIVE and its abort has not reached them yet). Nothing changed; retry once the
    refresh released them (veRL's load balancer, :mod:`rlix_plugins.patches.verl_routing`)."""


class ShardPreemptedError(RlixPluginsError, RuntimeError):
    """A request's shard was preempted (internal re-dispatch signal; raised to the caller only
    when the request ran out of re-dispatch attempts)."""


class NoActiveShardError(RlixPluginsError, TimeoutError):
    """No generation shard became active within the configured wait."""


class PreemptionError(RlixPluginsError, RuntimeError):
    """Abort, drain or sleep failed on at least one shard being preempted."""


# --- coordinator service (Ray actors, failures) ------------------------------------------------


class PipelineFailedError(RlixPluginsError, RuntimeError):
    """The coordinator declared a pipeline dead (actor death, lease expiry, failed resize).

    Its GPUs were returned to the pool; every call it had waiting, and any call it makes
    afterwards, gets this error. Re-register under a new pipeline id to continue.
    """


class RequestTimeoutError(RlixPluginsError, TimeoutError):
    """A blocking coordinator call (``request_gpus``, ``await_release_gpus``) timed out.

    The request was withdrawn: nothing was granted and the state is as if it was never made.
    """
