"""Messages between a weight sender and its receivers.

Everything here is plain data (ints, strings, lists, dicts) so an offer travels through any
host RPC unchanged: vLLM's ``collective_rpc`` (msgpack), Ray, or a pipe. The receiver side
imports only this module, the checksum and the transports; never the cache.

Per bucket the sender sends a JSON header (+ transport frames) on a ZMQ control channel and
waits for the receiver's JSON ack before the next bucket: that lockstep is what bounds a
receiver's extra memory to one bucket.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from rlix_plugins.errors import WeightSyncError
from rlix_plugins.training.checksum import ChecksumKind


class TransportKind(str, enum.Enum):
    """How bucket bytes travel from the cache to one receiver."""

    #: Same host, CPU receiver: it maps the cache's /dev/shm bucket files (no copy on send).
    SHM = "shm"
    #: CPU receiver on any host: bytes in ZMQ frames (ipc on one host, tcp across hosts).
    ZMQ = "zmq"
    #: Receiver on the sender's own GPU: one staging bucket on that GPU shared by CUDA IPC.
    CUDA_IPC = "cuda_ipc"
    #: Receivers on other GPUs: NCCL broadcast on a temporary group (sender + those receivers).
    NCCL = "nccl"
    #: The same broadcast on gloo (CPU tensors): exercises the group logic without a GPU.
    GLOO = "gloo"


@dataclass(frozen=True, slots=True)
class SyncOffer:
    """What a receiver needs to pull one weight version (sent through the host's RPC)."""

    pipeline_id: str
    sync_id: str
    shard_id: str
    version: int
    transport: TransportKind
    control_address: str
    num_buckets: int
    total_bytes: int
    max_bucket_bytes: int
    checksum: ChecksumKind
    timeout_s: float
    details: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["transport"] = self.transport.value
        d["checksum"] = self.checksum.value
        d["details"] = dict(self.details)
        return d

    @staticmethod
    def from_dict(raw: Mapping[str, Any]) -> SyncOffer:
        try:
            return SyncOffer(
                pipeline_id=str(raw["pipeline_id"]),
                sync_id=str(raw["sync_id"]),
                shard_id=str(raw["shard_id"]),
                version=int(raw["version"]),
                transport=TransportKind(raw["transport"]),
                control_address=str(raw["control_address"]),
                num_buckets=int(raw["num_buckets"]),
                total_bytes=int(raw["total_bytes"]),
                max_bucket_bytes=int(raw["max_bucket_bytes"]),
                checksum=ChecksumKind(raw["checksum"]),
                timeout_s=float(raw["timeout_s"]),
                details=dict(raw.get("details") or {}),
            )
        except (KeyError, ValueError, TypeError) as exc:
            raise WeightSyncError(f"malformed sync offer {dict(raw)!r}: {exc}") from None


@dataclass(frozen=True, slots=True)
class ReceiveResult:
    """A receiver's account of a completed sync."""

    shard_id: str
    version: int
    buckets: int
    bytes: int
    seconds: float
    max_bucket_bytes: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_dict(raw: Mapping[str, Any]) -> ReceiveResult:
        return ReceiveResult(
            shard_id=str(raw["shard_id"]),
            version=int(raw["version"]),
            buckets=int(raw["buckets"]),
            bytes=int(raw["bytes"]),
            seconds=float(raw["seconds"]),
            max_bucket_bytes=int(raw["max_bucket_bytes"]),
        )


def encode(msg: Mapping[str, Any]) -> bytes:
    return json.dumps(msg, separators=(",", ":")).encode()


def decode(raw: bytes | memoryview) -> dict[str, Any]:
    value = json.loads(bytes(raw))
    if not isinstance(value, dict):
        raise WeightSyncError(f"control message is not an object: {value!r}")
    return value
