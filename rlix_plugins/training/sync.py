"""Selective, chunked weight sync: send one cached version to a chosen set of receivers.

:func:`sync_version` pins the version in the cache, picks a transport per receiver
(:func:`~rlix_plugins.training.transports.select_transport`), and streams the version bucket by
bucket; each receiver acks a bucket only after verifying and applying it, and the next bucket
is sent only after that ack, so a receiver's extra memory peaks at one bucket. The shm
transport is the exception to the lockstep: its receivers map the cache's own pages, so all
bucket headers are sent at once and the receiver works through them one bucket at a time.

A receiver on another host reaches its control socket at a random tcp port, which a later sync
may bind again while a late receiver of the earlier sync still connects to it: that socket is a
ROUTER that admits only a receiver whose ``hello`` names this sync and refuses any other at once
(control protocol 2, :data:`~rlix_plugins.training.wire.CONTROL_PROTOCOLS`), so the stale one
never takes the place of the receiver the port is meant for. Same-host receivers use an ipc
path that names its sync (protocol 1, a PAIR socket).

Receivers that share nothing are independent: point-to-point receivers (shm, zmq, cuda_ipc)
each get their own thread, broadcast receivers (nccl, gloo) share one temporary group. State
is per call (sockets, threads, groups, sync id) and there is no module-level lock: a sync for
one pipeline never waits for another's. Receivers not named are never contacted.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import tempfile
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from rlix_plugins.errors import (
    ChecksumMismatchError,
    ReceiverGoneError,
    RlixPluginsError,
    TransportUnavailableError,
    WeightSyncError,
)
from rlix_plugins.training.bucket_cache import BucketCache, CachedVersion, StorageKind
from rlix_plugins.training.transports.base import SenderTransport, open_sender_transport
from rlix_plugins.training.transports.selection import (
    ReceiverLocation,
    SenderLocation,
    select_transport,
)
from rlix_plugins.training.wire import (
    HANDSHAKE_PROTOCOL,
    ReceiveResult,
    SyncOffer,
    TransportKind,
    decode,
    encode,
)
from rlix_plugins.values import is_finite

if TYPE_CHECKING:
    import zmq

logger = logging.getLogger(__name__)

_POLL_MS = 20
_GRACE_S = 10.0
_BROADCAST = (TransportKind.NCCL, TransportKind.GLOO)
_ON_GPU = (TransportKind.CUDA_IPC, TransportKind.NCCL)


@runtime_checkable
class ReceiverHandle(Protocol):
    """An inference shard as the sender sees it.

    ``begin_receive`` must return promptly with a future that completes when the receiver has
    run :func:`~rlix_plugins.training.receiver.receive_weights` for the offer (a Ray call, a
    vLLM ``collective_rpc``, a thread). A future that fails early tells the sync the receiver
    is gone.
    """

    @property
    def shard_id(self) -> str: ...

    @property
    def location(self) -> ReceiverLocation: ...

    def begin_receive(self, offer: SyncOffer) -> concurrent.futures.Future[Any]: ...


@dataclass(frozen=True, slots=True)
class SyncOptions:
    """Timeouts and addressing of a sync.

    ``ack_timeout_s`` bounds the wait for any single ack (one bucket applied); a receiver that
    is silent that long is declared gone. ``transports`` forces a transport per shard id, as a
    :class:`TransportKind` or its value (``"zmq"``); values are converted here, and an unknown
    one raises :class:`TransportUnavailableError` naming the valid kinds.
    ``advertise_host`` is the address remote receivers use to reach this sender (its tcp
    control sockets and the rendezvous of a broadcast group).
    """

    ack_timeout_s: float = 120.0
    transports: Mapping[str, TransportKind | str] = field(default_factory=dict)
    advertise_host: str | None = None
    socket_dir: str | None = None
    raise_on_error: bool = True

    def __post_init__(self) -> None:
        if not (is_finite(self.ack_timeout_s) and self.ack_timeout_s > 0):
            # A negative or NaN bound failed every sync as "no connection within the timeout";
            # True (a bool is an int) read as one second.
            raise WeightSyncError(
                f"SyncOptions.ack_timeout_s must be finite seconds > 0, got {self.ack_timeout_s!r}"
            )
        # The sync compares kinds by identity, so a plain string must become the enum member.
        kinds: dict[str, TransportKind] = {}
        for shard_id, raw in self.transports.items():
            try:
                kinds[shard_id] = TransportKind(raw)
            except ValueError:
                valid = ", ".join(repr(k.value) for k in TransportKind)
                raise TransportUnavailableError(
                    f"SyncOptions.transports[{shard_id!r}] = {raw!r} is not a transport; "
                    f"valid: {valid}"
                ) from None
        object.__setattr__(self, "transports", kinds)

    def forced_transport(self, shard_id: str) -> TransportKind | None:
        """The transport forced for ``shard_id``, if any (always a :class:`TransportKind`)."""
        kind = self.transports.get(shard_id)
        return None if kind is None else TransportKind(kind)


@dataclass(frozen=True, slots=True)
class ShardOutcome:
    """What happened to one receiver."""

    shard_id: str
    transport: TransportKind
    ok: bool
    result: ReceiveResult | None = None
    error: str | None = None
    error_type: str | None = None


@dataclass(frozen=True, slots=True)
class SyncReport:
    """A finished sync: per-shard outcomes and timing."""

    pipeline_id: str
    sync_id: str
    version: int
    total_bytes: int
    num_buckets: int
    seconds: float
    outcomes: tuple[ShardOutcome, ...]

    @property
    def succeeded(self) -> tuple[str, ...]:
        return tuple(o.shard_id for o in self.outcomes if o.ok)

    @property
    def failed(self) -> tuple[str, ...]:
        return tuple(o.shard_id for o in self.outcomes if not o.ok)


class _Failure(Exception):
    def __init__(self, shard_id: str, exc: BaseException) -> None:
        super().__init__(str(exc))
        self.shard_id = shard_id
        self.exc = exc


@dataclass(slots=True)
class _Member:
    receiver: ReceiverHandle
    transport: TransportKind
    address: str
    socket: zmq.Socket[bytes]
    future: concurrent.futures.Future[Any] | None = None
    done: bool = False
    #: the sync this member belongs to (named in the refusal a stale receiver gets)
    sync_id: str = ""
    #: control protocol 2: ``socket`` is a ROUTER that admits the receiver by its hello
    handshake: bool = False
    #: the admitted receiver's routing id on a ROUTER socket; every message goes to it only
    peer: bytes | None = None


def _raise_for_ack(member: _Member, ack: Mapping[str, Any]) -> None:
    if ack.get("ok"):
        return
    msg = f"shard {member.receiver.shard_id}: {ack.get('error', 'receiver reported failure')}"
    if ack.get("error_type") == "checksum":
        raise ChecksumMismatchError(msg)
    raise WeightSyncError(msg)


def _gone(member: _Member, why: str) -> WeightSyncError:
    """The receiver stopped answering. When it ended on a checksum mismatch (it found the
    corruption first and quit before its ack reached us), that verdict is the error: callers
    must not see a corrupted transfer as a mere disconnect."""
    fut = member.future
    detail = ""
    exc: BaseException | None = None
    if fut is not None and fut.done():
        exc = None if fut.cancelled() else fut.exception()
        detail = f" (receiver ended: {type(exc).__name__}: {exc})" if exc else " (receiver ended)"
    msg = f"shard {member.receiver.shard_id}: {why}{detail}"
    if isinstance(exc, ChecksumMismatchError):
        return ChecksumMismatchError(msg)
    return ReceiverGoneError(msg)


def _wait(member: _Member, event: int, deadline: float, what: str) -> None:
    """Poll the control socket for ``event``; fail fast if the receiver's future ended."""
    while True:
        if member.socket.poll(_POLL_MS, event):
            return
        fut = member.future
        if fut is not None and fut.done():
            # A receiver that ended well sent its last messages before its future completed,
            # but they travel on another channel (ZMQ's I/O threads) than the future's result
            # (a pipe, an RPC) and can arrive later under load: give them a grace period.
            failed = fut.cancelled() or fut.exception() is not None
            left = max(0.0, deadline - time.monotonic())
            grace_ms = 0 if failed else int(1000 * min(_GRACE_S, left))
            if member.socket.poll(grace_ms, event):
                return
            raise _gone(member, f"ended before {what}")
        if time.monotonic() > deadline:
            raise _gone(member, f"no {what} within the ack timeout")


def _send(member: _Member, header: Mapping[str, Any], frames: list[Any], timeout_s: float) -> None:
    import zmq

    deadline = time.monotonic() + timeout_s
    parts = [encode(header), *frames]
    if member.handshake:
        if member.peer is None:
            raise WeightSyncError(
                f"shard {member.receiver.shard_id}: no receiver was admitted on its control "
                "socket (the hello handshake must come first)"
            )
        parts.insert(0, member.peer)  # a ROUTER routes by the first frame
    while True:
        _wait(member, zmq.POLLOUT, deadline, "connection")
        try:
            # Never a blocking send: a PAIR socket whose peer went away between the poll and
            # the send blocks forever (a receiver that crashed mid-sync hung the sender).
            member.socket.send_multipart(parts, flags=zmq.NOBLOCK, copy=False)
            return
        except zmq.Again:
            if time.monotonic() > deadline:
                raise _gone(member, "no connection within the ack timeout") from None
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            # ROUTER_MANDATORY: the admitted receiver disconnected
            raise _gone(member, "disconnected") from None


def _refuse(member: _Member, peer: bytes, why: str) -> None:
    """Turn away a peer that is not this member's receiver: it is told at once (naming this
    sync) and never gets a bucket. Best effort: a peer that already left is not waited for."""
    import zmq

    logger.warning(
        "shard %s: refused a peer on control address %s (sync %s): %s",
        member.receiver.shard_id, member.address, member.sync_id, why,
    )
    msg = {"kind": "refused", "sync_id": member.sync_id, "reason": why}
    with contextlib.suppress(zmq.ZMQError):
        member.socket.send_multipart([peer, encode(msg)], flags=zmq.NOBLOCK)


def _next_from_peer(member: _Member, deadline: float, what: str) -> list[zmq.Frame]:
    """The next message of the admitted receiver (without its routing frame); messages of any
    other peer (a late receiver of an earlier sync that reached this port) are refused, within
    the same deadline: a stale peer never extends the wait for the real one."""
    import zmq

    while True:
        _wait(member, zmq.POLLIN, deadline, what)
        frames = member.socket.recv_multipart(copy=False)
        peer = bytes(frames[0].bytes)
        if peer == member.peer:
            return frames[1:]
        _refuse(member, peer, f"this control address belongs to sync {member.sync_id}")


def _accept(member: _Member, deadline: float) -> None:
    """Admit the member's own receiver (control protocol 2): the first peer whose hello names
    this sync and this shard. Any other peer is refused at once, and the wait for the hello
    stays bounded by ``deadline``."""
    import zmq

    what = "hello"
    while True:
        _wait(member, zmq.POLLIN, deadline, what)
        frames = member.socket.recv_multipart()
        peer, payload = frames[0], frames[-1]
        try:
            hello = decode(payload)
        except (ValueError, WeightSyncError):
            hello = {}
        if hello.get("kind") != "hello":
            _refuse(member, peer, f"expected a hello naming sync {member.sync_id}, got {hello!r}")
            continue
        if hello.get("sync_id") != member.sync_id or hello.get("shard_id") != (
            member.receiver.shard_id
        ):
            _refuse(
                member,
                peer,
                f"a receiver of sync {hello.get('sync_id')} (shard {hello.get('shard_id')}) "
                f"reached the control address of sync {member.sync_id} (shard "
                f"{member.receiver.shard_id}); its own sync gave up and the port was reused",
            )
            continue
        member.peer = peer
        _send(member, {"kind": "welcome", "sync_id": member.sync_id}, [],
              max(0.0, deadline - time.monotonic()))
        return


def _recv(
    member: _Member, timeout_s: float, what: str, kind: str, index: int | None = None
) -> dict[str, Any]:
    """The next ack, which must be ``kind`` (for ``index``): acks were taken in order without
    a look, so one for the wrong bucket (or an early "done") passed as the awaited one."""
    import zmq

    deadline = time.monotonic() + timeout_s
    if member.handshake:
        ack = decode(_next_from_peer(member, deadline, what)[0].buffer)
    else:
        _wait(member, zmq.POLLIN, deadline, what)
        ack = decode(member.socket.recv())
    _raise_for_ack(member, ack)
    if ack.get("kind") != kind or (index is not None and ack.get("index") != index):
        expected = f"{kind!r} with index {index}" if index is not None else repr(kind)
        raise WeightSyncError(
            f"shard {member.receiver.shard_id}: expected the {what} (kind {expected}), got "
            f"{ack!r}"
        )
    return ack


class _Group:
    """Receivers that share one sender transport (one receiver, or one broadcast group)."""

    def __init__(
        self,
        kind: TransportKind,
        members: list[_Member],
        cv: CachedVersion,
        pipeline_id: str,
        sync_id: str,
        options: SyncOptions,
        cuda_device: int | None,
    ) -> None:
        self.kind = kind
        #: the CUDA device the sync's caller was on: a GPU transport stages there
        self.cuda_device = cuda_device
        self.members = members
        self.cv = cv
        self.pipeline_id = pipeline_id
        self.sync_id = sync_id
        self.options = options
        #: members that finished; kept on the group so a later member's failure (which
        #: returns through _fail) does not drop their outcomes from the report
        self._ok: list[ShardOutcome] = []

    def run(self) -> list[ShardOutcome]:
        # This runs on a pool thread, whose current CUDA device is 0 whatever the caller's
        # was: without this a trainer on GPU 3 would stage (and run NCCL) on GPU 0.
        with _on_cuda_device(self.cuda_device if self.kind in _ON_GPU else None):
            return self._run()

    def _run(self) -> list[ShardOutcome]:
        opts = self.options
        cv = self.cv
        transport: SenderTransport | None = None
        try:
            transport = open_sender_transport(
                self.kind, cv, len(self.members), opts.ack_timeout_s, opts.advertise_host
            )
            total = sum(b.layout.nbytes for b in cv.buckets)
            max_bucket = max((b.layout.nbytes for b in cv.buckets), default=0)
            for rank, m in enumerate(self.members, start=1):
                offer = SyncOffer(
                    pipeline_id=self.pipeline_id,
                    sync_id=self.sync_id,
                    shard_id=m.receiver.shard_id,
                    version=cv.version,
                    transport=self.kind,
                    control_address=m.address,
                    num_buckets=len(cv.buckets),
                    total_bytes=total,
                    max_bucket_bytes=max_bucket,
                    checksum=cv.checksum,
                    timeout_s=opts.ack_timeout_s,
                    details=transport.details(rank),
                    control_protocol=HANDSHAKE_PROTOCOL if m.handshake else 1,
                )
                try:
                    m.future = m.receiver.begin_receive(offer)
                except Exception as exc:
                    raise _Failure(
                        m.receiver.shard_id,
                        ReceiverGoneError(
                            f"shard {m.receiver.shard_id}: could not start receiving: {exc}"
                        ),
                    ) from exc
            # Admit each receiver before the transport's rendezvous (a receiver hellos before
            # it opens its transport); one bound for the group, which a stale peer (refused
            # here) does not extend.
            deadline = time.monotonic() + opts.ack_timeout_s
            for m in self.members:
                if m.handshake:
                    self._guard(m, _accept, m, deadline)
            self._guard(None, transport.prepare)
            # Acks awaited from the receivers, oldest first. A transport whose receivers hold
            # no copy of a bucket (shm: they map the cache's own pages) may announce buckets
            # ahead of the acks, so a receiver goes from one bucket to the next without a
            # round trip through the sender; the others keep strict lockstep (one in flight).
            window = max(1, transport.headers_ahead)
            in_flight = 0
            acked = 0  # buckets acked by every member; the next ack is for cv.buckets[acked]

            def collect_ack() -> None:
                nonlocal acked, in_flight
                index = cv.buckets[acked].layout.index
                what = f"ack of bucket {index}"
                for m in self.members:
                    self._guard(m, _recv, m, opts.ack_timeout_s, what, "ack", index)
                acked += 1
                in_flight -= 1

            for bucket in cv.buckets:
                while in_flight >= window:
                    collect_ack()
                extras, frames = transport.frames(bucket)
                header = {
                    "kind": "bucket",
                    # names this sync: a late receiver of an earlier sync that connected to
                    # this socket (a tcp port reused) must refuse the bucket, not apply it
                    "sync_id": self.sync_id,
                    "index": bucket.layout.index,
                    "nbytes": bucket.layout.nbytes,
                    "checksum": bucket.layout.checksum,
                    "entries": [e.to_wire() for e in bucket.layout.entries],
                    "segment_bytes": bucket.layout.segment_bytes,
                    "segment_checksums": list(bucket.layout.segment_checksums),
                    **extras,
                }
                for m in self.members:
                    self._guard(m, _send, m, header, frames, opts.ack_timeout_s)
                self._guard(None, transport.after_headers, bucket)
                in_flight += 1
            # with every header ahead, "end" goes right behind them: the receiver finishes
            # without waiting for the sender to collect its acks
            end_early = window > len(cv.buckets)
            if end_early:
                for m in self.members:
                    self._guard(m, _send, m, {"kind": "end"}, [], opts.ack_timeout_s)
            while in_flight:
                collect_ack()
            if not end_early:
                for m in self.members:
                    self._guard(m, _send, m, {"kind": "end"}, [], opts.ack_timeout_s)
            for m in self.members:
                ack = self._guard(m, _recv, m, opts.ack_timeout_s, "final ack", "done")
                assert m.future is not None
                # the receiver returns right after its final ack; its future carries the result
                raw = self._guard(m, m.future.result, opts.ack_timeout_s)
                if isinstance(raw, ReceiveResult):
                    result = raw
                else:  # from_dict: a typed error naming a missing or malformed field
                    result = ReceiveResult.from_dict(
                        raw if isinstance(raw, Mapping) else ack.get("result")
                    )
                m.done = True
                self._ok.append(ShardOutcome(m.receiver.shard_id, self.kind, True, result))
            return list(self._ok)
        except _Failure as f:
            return self._fail(f.shard_id, f.exc)
        except Exception as exc:  # transport setup or prepare failed: every member fails
            return self._fail(None, exc)
        finally:
            if transport is not None:
                transport.close()

    def _guard(self, member: _Member | None, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except _Failure:
            raise
        except Exception as exc:
            shard = member.receiver.shard_id if member is not None else None
            raise _Failure(shard or "", exc) from exc

    def _fail(self, shard_id: str | None, exc: BaseException) -> list[ShardOutcome]:
        reason = f"{type(exc).__name__}: {exc}"
        outcomes: list[ShardOutcome] = list(self._ok)
        for m in self.members:
            if m.done:
                continue
            if m.future is not None and not m.future.done():
                # tell a still-listening receiver to stop (it would otherwise wait for a bucket)
                with contextlib.suppress(Exception):
                    import zmq

                    abort = encode({"kind": "abort", "reason": reason})
                    if not m.handshake:
                        m.socket.send(abort, zmq.NOBLOCK)
                    elif m.peer is not None:  # nobody admitted yet: nobody to tell
                        m.socket.send_multipart([m.peer, abort], zmq.NOBLOCK)
            culprit = shard_id in (None, "", m.receiver.shard_id)
            outcomes.append(
                ShardOutcome(
                    m.receiver.shard_id,
                    self.kind,
                    False,
                    error=reason if culprit else f"aborted with its group: {reason}",
                    error_type=type(exc).__name__,
                )
            )
        return outcomes


def _caller_cuda_device(shard_id: str, kind: TransportKind) -> int:
    """The calling thread's CUDA device, where a GPU transport to ``shard_id`` stages."""
    import torch

    if not torch.cuda.is_available():
        valid = sorted(k.value for k in TransportKind if k not in _ON_GPU)
        raise TransportUnavailableError(
            f"shard {shard_id}: transport {kind.value!r} needs a CUDA device in the sender's "
            f"process, which has none (valid without one: {', '.join(valid)})"
        )
    return int(torch.cuda.current_device())


@contextlib.contextmanager
def _on_cuda_device(device: int | None) -> Iterator[None]:
    if device is None:
        yield
        return
    import torch

    with torch.cuda.device(device):
        yield


def _control_address(
    sock: zmq.Socket[bytes], same_host: bool, sync_id: str, index: int, options: SyncOptions
) -> str:
    import zmq

    if same_host:
        base = options.socket_dir or tempfile.gettempdir()
        path = os.path.join(base, f"rlix-{sync_id[:16]}-{index}.sock")
        try:
            sock.bind(f"ipc://{path}")
        except zmq.ZMQError as exc:  # a missing dir or a path over the socket-path limit
            raise TransportUnavailableError(
                f"cannot bind the control socket ipc://{path}: {exc}; SyncOptions.socket_dir "
                f"must be an existing directory with a short path (was {options.socket_dir!r})"
            ) from None
        return f"ipc://{path}"
    port = sock.bind_to_random_port("tcp://0.0.0.0")
    from rlix_plugins.training.transports.collective import _node_address

    return f"tcp://{options.advertise_host or _node_address()}:{port}"


def sync_version(
    cache: BucketCache,
    version: int,
    receivers: Sequence[ReceiverHandle],
    *,
    sender: SenderLocation | None = None,
    options: SyncOptions | None = None,
) -> SyncReport:
    """Send cached ``version`` to exactly ``receivers``; returns when every one has finished.

    Raises :class:`UnknownWeightVersionError` before contacting anyone if the version is not
    cached, :class:`TransportUnavailableError` if some receiver cannot be reached (again before
    contacting anyone), and -- with ``raise_on_error`` -- a :class:`WeightSyncError` subclass
    (:class:`ReceiverGoneError`, :class:`ChecksumMismatchError`) naming the failed and the
    succeeded shards. Receivers that failed hold partially applied weights: resync them.

    A GPU transport (``cuda_ipc``, ``nccl``) stages on the calling thread's current CUDA
    device (``torch.cuda.set_device`` in the trainer), whichever thread the sync runs on.
    """
    import zmq

    opts = options or SyncOptions()
    sender = sender or SenderLocation()
    ids = [r.shard_id for r in receivers]
    if len(set(ids)) != len(ids):
        raise WeightSyncError(f"duplicate shard ids in one sync: {ids}")
    sync_id = uuid.uuid4().hex
    started = time.perf_counter()
    with cache.pinned(version) as cv:
        in_shm = cv.storage is StorageKind.SHARED
        plan: list[tuple[ReceiverHandle, TransportKind]] = []
        cuda_device: int | None = None
        for r in receivers:
            forced = opts.forced_transport(r.shard_id)
            kind = forced or select_transport(sender, r.location, cache_in_shm=in_shm)
            if kind is TransportKind.SHM and not in_shm:
                raise TransportUnavailableError(
                    f"shard {r.shard_id}: transport 'shm' needs a cache in shared memory"
                )
            if kind in _ON_GPU and cuda_device is None:
                cuda_device = _caller_cuda_device(r.shard_id, kind)
            plan.append((r, kind))
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        members: list[_Member] = []
        try:
            for i, (r, kind) in enumerate(plan):
                same_host = r.location.host == sender.host
                # tcp (another host): a ROUTER, which admits only this sync's receiver
                sock = ctx.socket(zmq.PAIR if same_host else zmq.ROUTER)
                sock.setsockopt(zmq.LINGER, 0)
                if not same_host:
                    # a send to a receiver that left fails instead of vanishing silently
                    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
                members.append(
                    _Member(r, kind, "", sock, sync_id=sync_id, handshake=not same_host)
                )
                members[-1].address = _control_address(sock, same_host, sync_id, i, opts)
            groups: list[_Group] = []
            broadcast: dict[TransportKind, list[_Member]] = {}
            for m in members:
                if m.transport in _BROADCAST:
                    broadcast.setdefault(m.transport, []).append(m)
                else:
                    groups.append(
                        _Group(m.transport, [m], cv, cache.pipeline_id, sync_id, opts, cuda_device)
                    )
            for kind, ms in broadcast.items():
                groups.append(_Group(kind, ms, cv, cache.pipeline_id, sync_id, opts, cuda_device))
            outcomes: list[ShardOutcome] = []
            if groups:
                with concurrent.futures.ThreadPoolExecutor(
                    max_workers=len(groups), thread_name_prefix=f"rlix-sync-{cache.pipeline_id}"
                ) as pool:
                    for res in pool.map(lambda g: g.run(), groups):
                        outcomes.extend(res)
            for m in members:
                if m.future is not None and not m.future.done():
                    # The sync gave up on a receiver that is still applying (its "end" may
                    # already be queued, so it can still finish and record this version): its
                    # pages must not be recycled under it by the next builds until it stops.
                    m.future.add_done_callback(cache.hold(version))
                    logger.warning(
                        "pipeline %s: shard %s still receiving weight version %d after its "
                        "sync ended; the version stays cached until it stops",
                        cache.pipeline_id,
                        m.receiver.shard_id,
                        version,
                    )
        finally:
            for m in members:
                m.socket.close(linger=0)
                if m.address.startswith("ipc://"):
                    with contextlib.suppress(OSError):
                        os.unlink(m.address[len("ipc://") :])
        report = SyncReport(
            pipeline_id=cache.pipeline_id,
            sync_id=sync_id,
            version=version,
            total_bytes=sum(b.layout.nbytes for b in cv.buckets),
            num_buckets=len(cv.buckets),
            seconds=time.perf_counter() - started,
            outcomes=tuple(sorted(outcomes, key=lambda o: ids.index(o.shard_id))),
        )
    logger.info(
        "pipeline %s: synced version %d to %s in %.3fs (failed: %s)",
        cache.pipeline_id,
        version,
        report.succeeded,
        report.seconds,
        report.failed,
    )
    if report.failed and opts.raise_on_error:
        raise _error_for(report)
    return report


def _error_for(report: SyncReport) -> RlixPluginsError:
    failed = [o for o in report.outcomes if not o.ok]
    first = failed[0]
    msg = (
        f"pipeline {report.pipeline_id}: sync of weight version {report.version} failed for "
        f"{[o.shard_id for o in failed]} (succeeded: {list(report.succeeded)}); first error: "
        f"{first.shard_id}: {first.error}"
    )
    types = {o.error_type for o in failed}
    if "ChecksumMismatchError" in types:
        return ChecksumMismatchError(msg)
    if types & {"ReceiverGoneError", "TimeoutError", "BrokenProcessPool", "_Failure"}:
        return ReceiverGoneError(msg)
    return WeightSyncError(msg)
