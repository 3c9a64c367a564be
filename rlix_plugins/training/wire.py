"""Messages between a weight sender and its receivers.

Everything here is plain data (ints, strings, lists, dicts) so an offer travels through any
host RPC unchanged: vLLM's ``collective_rpc`` (msgpack), Ray, or a pipe. The receiver side
imports only this module, the checksum and the transports; never the cache.

Per bucket the sender sends a JSON header (+ transport frames) on a ZMQ control channel and
waits for the receiver's JSON ack before the next bucket: that lockstep is what bounds a
receiver's extra memory to one bucket.

A shared-memory bucket file also starts with a small binary header (:class:`ShmFileHeader`)
written by the cache when the bucket is sealed: the receiver reads it through its own mapping
and compares it with the control message, so a mapping kept from an earlier sync is only used
when it shows exactly the bucket the sender announced.
"""

from __future__ import annotations

import enum
import json
import math
import numbers
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from rlix_plugins.errors import WeightSyncError
from rlix_plugins.training.checksum import ChecksumKind
from rlix_plugins.values import is_finite, is_int, is_number


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


#: Control-channel protocols this package speaks. 1: the receiver connects a PAIR socket and
#: the sender starts with the first bucket. 2: the sender's socket is a ROUTER, the receiver
#: connects a DEALER and first sends a ``hello`` naming its sync; the sender answers
#: ``welcome`` to its own receiver and ``refused`` (naming its own sync) to any other, so a
#: late receiver of an earlier sync that reached a reused tcp port never takes the place of
#: the receiver the port is meant for. The sender offers 2 on tcp control addresses (the only
#: ones that can be reused: an ipc path names its sync) and 1 on ipc.
CONTROL_PROTOCOLS = (1, 2)
#: The handshake protocol (see :data:`CONTROL_PROTOCOLS`).
HANDSHAKE_PROTOCOL = 2


class StaleSyncError(WeightSyncError):
    """A receiver reached a sender of another sync (its tcp control port was reused after its
    own sync gave up) and was refused before anything was applied."""


@dataclass(frozen=True, slots=True)
class SyncOffer:
    """What a receiver needs to pull one weight version (sent through the host's RPC).

    ``control_protocol`` is the control-channel protocol (:data:`CONTROL_PROTOCOLS`); an offer
    without one (from a sender before the handshake) is protocol 1.
    """

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
    control_protocol: int = 1

    def __post_init__(self) -> None:
        # A receiver polls with int(timeout_s * 1000): a negative value is an endless wait in
        # ZMQ, NaN or inf a crash mid-sync; negative counts would never match what arrives.
        for name in ("version", "num_buckets", "total_bytes", "max_bucket_bytes",
                     "control_protocol"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise WeightSyncError(f"sync offer field {name}={value!r} must be an int")
            if name != "version" and value < 0:
                raise WeightSyncError(f"sync offer field {name}={value!r} must be >= 0")
            object.__setattr__(self, name, int(value))  # numpy ints travel as plain ints
        if self.control_protocol not in CONTROL_PROTOCOLS:
            # a newer sender's protocol: speaking 1 or 2 to it would hang both ends until the
            # timeout, so the receiver refuses the offer by name instead
            raise WeightSyncError(
                f"sync offer field control_protocol={self.control_protocol} is not spoken by "
                f"this receiver (valid: {', '.join(map(str, CONTROL_PROTOCOLS))}); install the "
                "same rlix-plugins version on the trainer and the inference workers"
            )
        t = self.timeout_s
        if not is_number(t) or not 0 < t < math.inf:
            raise WeightSyncError(
                f"sync offer field timeout_s={t!r} must be finite seconds > 0"
            )

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["transport"] = self.transport.value
        d["checksum"] = self.checksum.value
        d["details"] = dict(self.details)
        return d

    @staticmethod
    def from_dict(raw: Mapping[str, Any]) -> SyncOffer:
        if not isinstance(raw, Mapping):
            raise WeightSyncError(
                f"malformed sync offer {raw!r}: expected a mapping of the SyncOffer fields"
            )
        try:
            return SyncOffer(
                pipeline_id=str(raw["pipeline_id"]),
                sync_id=str(raw["sync_id"]),
                shard_id=str(raw["shard_id"]),
                version=raw["version"],  # checked (not truncated by int()) in __post_init__
                transport=TransportKind(raw["transport"]),
                control_address=str(raw["control_address"]),
                num_buckets=raw["num_buckets"],
                total_bytes=raw["total_bytes"],
                max_bucket_bytes=raw["max_bucket_bytes"],
                checksum=ChecksumKind(raw["checksum"]),
                timeout_s=float(raw["timeout_s"]),
                details=dict(raw.get("details") or {}),
                # absent from a sender before the handshake, which speaks protocol 1
                control_protocol=raw.get("control_protocol", 1),
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
        # It arrives from another process: a missing field was a bare KeyError, True read as
        # version 1 and 1.5 bytes as 1.
        if not isinstance(raw, Mapping):
            raise WeightSyncError(
                f"malformed receive result {raw!r}: expected a mapping of the ReceiveResult "
                "fields"
            )
        for name in ("shard_id", "version", "buckets", "bytes", "seconds", "max_bucket_bytes"):
            value = raw.get(name)
            if name == "shard_id":
                ok = isinstance(value, str)
                valid = "a str"
            elif name == "seconds":
                ok = is_finite(value) and value >= 0
                valid = "finite seconds >= 0"
            else:
                ok = is_int(value) and (name == "version" or value >= 0)
                valid = "an int" if name == "version" else "an int >= 0"
            if not ok:
                raise WeightSyncError(
                    f"malformed receive result {dict(raw)!r}: field {name}={value!r} must be "
                    f"{valid}"
                )
        return ReceiveResult(
            shard_id=raw["shard_id"],
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


#: Bytes before a shared-memory bucket's data (one page, so the data stays page-aligned).
SHM_FILE_HEADER_BYTES = 4096
_SHM_MAGIC = 0x31305742584C4952  # b"RLIXWB01" little-endian
_U64 = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class ShmFileHeader:
    """What a /dev/shm bucket file holds right now, as written by the cache at seal time.

    ``token`` is random per cache instance and ``generation`` increases every time the cache
    (re)writes a bucket, so the pair names one bucket content uniquely; ``generation == 0``
    marks a file being (re)written. The sender puts the same fields in the bucket's control
    header; a receiver whose mapping shows anything else has a stale or foreign mapping.
    """

    token: int
    generation: int
    version: int
    index: int
    nbytes: int
    checksum: int

    WORDS = 8

    def to_words(self) -> np.ndarray:
        """The header as little-endian uint64 words (the first 64 bytes of the file)."""
        return np.array(
            [_SHM_MAGIC, self.token, self.generation, self.version & _U64, self.index,
             self.nbytes, self.checksum & _U64, 0],
            dtype="<u8",
        )

    @staticmethod
    def from_words(words: np.ndarray) -> ShmFileHeader | None:
        """Parse the first 8 words of a file; None when it holds no sealed bucket."""
        w = [int(x) for x in words[: ShmFileHeader.WORDS]]
        if len(w) < ShmFileHeader.WORDS or w[0] != _SHM_MAGIC or w[2] == 0:
            return None
        version = w[3] - (1 << 64) if w[3] >> 63 else w[3]
        return ShmFileHeader(w[1], w[2], version, w[4], w[5], w[6])

    def to_wire(self) -> dict[str, int]:
        return {
            "token": self.token,
            "generation": self.generation,
            "version": self.version,
            "index": self.index,
            "nbytes": self.nbytes,
            "checksum": self.checksum,
        }
