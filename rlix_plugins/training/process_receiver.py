"""A receiver in a spawned child process holding a preallocated state dict.

Stands in for an inference worker where a real one is not needed (multi-process sync tests,
the bandwidth benchmark): it is a separate process with its own memory, so transports,
failure detection and peak receiver memory are measured for real. The child resets the
kernel's peak-RSS counter before each sync (``/proc/self/clear_refs``) and reports how far
its resident memory rose above the level at the start of the sync, and its shared-mapped
(``RssShmem``: the cache's /dev/shm pages it maps) and private (``RssAnon``) sizes before and
after, so a rise made of mapped sender pages is told apart from new private memory.

The child copies received tensors straight into its preallocated ones (the ``destination``
path of :func:`~rlix_plugins.training.receiver.receive_weights`). Parameter checksums are
computed only on request (:meth:`SpawnedReceiver.param_checksums`), outside a sync.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import multiprocessing
import multiprocessing.connection
import os
import re
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rlix_plugins.errors import ReceiverGoneError, WeightCacheError, WeightSyncError
from rlix_plugins.training.transports.selection import AddressedReceiver, ReceiverLocation
from rlix_plugins.training.wire import ReceiveResult, SyncOffer
from rlix_plugins.values import is_int

#: name -> (dtype name, shape) of the tensors the child preallocates
Layout = Mapping[str, tuple[str, tuple[int, ...]]]

#: How often at most a child applying weights tells its handle it is still busy.
_BEAT_S = 1.0
#: Added to the silence a sync's offer allows a receiver (see _quiet_limit_s).
_QUIET_GRACE_S = 10.0


def _quiet_limit_s(offer: SyncOffer) -> float:
    """How long a child may send nothing during a sync before it counts as hung. Between two
    beats a working child waits at most for: its transport to open, the next bucket header,
    the bucket's bytes and its ack to go out, each bounded by ``offer.timeout_s`` (after that
    it gives up and answers with an error)."""
    return 5 * offer.timeout_s + _QUIET_GRACE_S


@dataclass(frozen=True, slots=True)
class ChildSyncStats:
    """Receiver-side figures of one sync in the child (bytes)."""

    result: ReceiveResult
    rss_before_bytes: int
    peak_rss_bytes: int
    shmem_before_bytes: int = 0
    shmem_after_bytes: int = 0
    anon_before_bytes: int = 0
    anon_after_bytes: int = 0
    files_mapped: int = 0

    @property
    def peak_extra_bytes(self) -> int:
        """Peak RSS rise during the sync, shared-mapped pages included."""
        return max(0, self.peak_rss_bytes - self.rss_before_bytes)

    @property
    def shared_mapped_bytes(self) -> int:
        """Sender pages mapped by the receiver after the sync (not receiver memory)."""
        return self.shmem_after_bytes

    @property
    def private_peak_extra_bytes(self) -> int:
        """Peak rise of the receiver's own memory. Exact when the sync mapped no file and the
        shared-mapped size did not change (kept mappings, zmq, gloo); otherwise the total rise,
        an upper bound (the kernel keeps no peak of private memory alone)."""
        return self.peak_extra_bytes

    @property
    def private_peak_is_exact(self) -> bool:
        return self.files_mapped == 0 and self.shmem_before_bytes == self.shmem_after_bytes


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _child(
    conn: multiprocessing.connection.Connection, layout: dict[str, Any], device: str
) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    from rlix_plugins.training.bucket_cache import torch_dtype
    from rlix_plugins.training.checksum import tensor_fingerprint
    from rlix_plugins.training.receiver import StateDictTarget, receive_weights
    from rlix_plugins.training.transports.shm import mappings_opened

    torch.set_num_threads(1)
    if device.startswith("cuda:"):
        torch.cuda.set_device(device)  # CUDA IPC / NCCL receivers use the current device
    tensors = {
        name: torch.zeros(tuple(shape), dtype=torch_dtype(dtype), device=device)
        for name, (dtype, shape) in layout.items()
    }
    for t in tensors.values():
        t.fill_(0)  # touch every page now: first-touch cost must not count as sync memory
    target = StateDictTarget(tensors)
    conn.send(("ready", os.getpid()))
    while True:
        msg = conn.recv()
        if msg is None:
            return
        if msg == "checksums":
            conn.send({n: tensor_fingerprint(t) for n, t in target.tensors.items()})
            continue
        try:
            offer = SyncOffer.from_dict(msg)
        except Exception as exc:  # a malformed offer must not end the loop (and the child)
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
            continue
        last_beat = time.monotonic()

        def beat() -> None:
            # tells the handle this child is working, not hung (see _quiet_limit_s)
            nonlocal last_beat
            if time.monotonic() - last_beat >= _BEAT_S:
                last_beat = time.monotonic()
                conn.send(("busy",))

        def load(weights: list[tuple[str, torch.Tensor]]) -> None:
            beat()
            target.load_weights(weights)

        def destination(
            name: str, dtype: torch.dtype, shape: tuple[int, ...]
        ) -> torch.Tensor | None:
            beat()
            return target.destination(name, dtype, shape)

        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM so the peak below belongs to this sync
        except OSError:
            pass
        before = [_status_kb(k) * 1024 for k in ("VmRSS", "RssShmem", "RssAnon")]
        maps_before = mappings_opened()
        try:
            result = receive_weights(offer, load, destination=destination)
        except BaseException as exc:
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
            continue
        after = [_status_kb(k) * 1024 for k in ("VmHWM", "RssShmem", "RssAnon")]
        after.append(mappings_opened() - maps_before)
        conn.send(("ok", result.to_dict(), before, after))


def _check_layout(shard_id: str, layout: Layout) -> dict[str, tuple[str, tuple[int, ...]]]:
    """``layout`` as plain data, each entry a known torch dtype name and a shape of ints >= 0."""
    from rlix_plugins.training.bucket_cache import torch_dtype

    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for name, spec in layout.items():
        try:
            dtype, shape = spec
            torch_dtype(str(dtype))
        except (TypeError, ValueError, WeightCacheError):
            raise WeightSyncError(
                f"receiver {shard_id}: layout of {name!r} is {spec!r}; expected (torch dtype "
                "name such as 'bfloat16', shape as a tuple of ints >= 0)"
            ) from None
        if not (
            isinstance(shape, tuple | list)
            and all(is_int(d) and d >= 0 for d in shape)
        ):
            raise WeightSyncError(
                f"receiver {shard_id}: layout of {name!r} has shape {shape!r}; expected a tuple "
                "of ints >= 0"
            )
        out[name] = (str(dtype), tuple(shape))
    return out


class SpawnedReceiver(AddressedReceiver):
    """Sender-side handle of a receiver child process (see module docstring).

    ``device`` is where the child's tensors live: ``"cpu"``, or ``"cuda"`` / ``"cuda:N"`` for a
    GPU engine's weights (the child's current device; RSS figures then cover only its host
    memory).

    A child that stays silent during a sync longer than its offer allows (it reports progress
    while applying; see ``_quiet_limit_s``), or misses ``param_checksums``'s deadline, is
    killed: the handle is then dead and every later call fails with ReceiverGoneError.
    """

    def __init__(
        self,
        shard_id: str,
        layout: Layout,
        location: ReceiverLocation | None = None,
        start_timeout_s: float = 120.0,
        device: str = "cpu",
    ) -> None:
        if not (device == "cpu" or re.fullmatch(r"cuda(:\d+)?", device)):
            raise WeightSyncError(
                f"receiver device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}"
            )
        super().__init__(shard_id, location)
        checked = _check_layout(shard_id, layout)  # a bad one killed the child: EOFError('')
        ctx = multiprocessing.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        self.process = ctx.Process(
            target=_child,
            args=(child_conn, checked, device),
            daemon=True,
            name=f"rlix-receiver-{shard_id}",
        )
        self.process.start()
        child_conn.close()
        try:
            if not self._conn.poll(start_timeout_s):
                raise ReceiverGoneError(
                    f"receiver {shard_id} did not start in {start_timeout_s}s"
                )
            self._conn.recv()
        except BaseException as exc:
            # a failed start leaves neither the child nor its pipe behind
            self.process.kill()
            self.process.join(10)
            self._conn.close()
            if isinstance(exc, (EOFError, OSError)):  # the child died while starting
                raise ReceiverGoneError(
                    f"receiver {shard_id} exited while starting (code "
                    f"{self.process.exitcode}, device {device!r}); see its stderr"
                ) from None
            raise
        self._lock = threading.Lock()
        self.last_stats: ChildSyncStats | None = None
        self.syncs = 0

    def begin_receive(self, offer: SyncOffer) -> concurrent.futures.Future[ReceiveResult]:
        fut: concurrent.futures.Future[ReceiveResult] = concurrent.futures.Future()

        def run() -> None:
            try:
                with self._lock:
                    if not self.process.is_alive():  # killed or crashed earlier
                        raise ReceiverGoneError(
                            f"receiver process {self._shard_id} exited "
                            f"(code {self.process.exitcode})"
                        )
                    self._conn.send(offer.to_dict())
                    quiet_s = _quiet_limit_s(offer)
                    heard = time.monotonic()
                    while True:
                        if self._conn.poll(0.05):
                            reply = self._conn.recv()
                            if reply[0] != "busy":
                                break
                            heard = time.monotonic()
                            continue
                        if not self.process.is_alive():
                            raise ReceiverGoneError(
                                f"receiver process {self._shard_id} exited "
                                f"(code {self.process.exitcode})"
                            )
                        if time.monotonic() - heard > quiet_s:
                            # Alive but hung: waiting on without end kept this future open,
                            # so the version held for the child stayed pinned forever. Killed,
                            # it reads no more pages and answers nothing late on this pipe.
                            self.kill()
                            raise ReceiverGoneError(
                                f"receiver process {self._shard_id} made no progress for "
                                f"{quiet_s:.0f}s receiving weight version {offer.version} "
                                f"(sync {offer.sync_id}); it was killed"
                            )
                if reply[0] != "ok":
                    raise WeightSyncError(f"receiver {self._shard_id}: {reply[1]}")
                _, raw, before, after = reply
                result = ReceiveResult.from_dict(raw)
                self.last_stats = ChildSyncStats(
                    result,
                    rss_before_bytes=before[0],
                    peak_rss_bytes=after[0],
                    shmem_before_bytes=before[1],
                    shmem_after_bytes=after[1],
                    anon_before_bytes=before[2],
                    anon_after_bytes=after[2],
                    files_mapped=after[3],
                )
                self.syncs += 1
                fut.set_result(result)
            except BaseException as exc:  # EOFError/BrokenPipe when the child died
                fut.set_exception(
                    exc
                    if isinstance(exc, WeightSyncError)
                    else ReceiverGoneError(f"receiver {self._shard_id}: {exc!r}")
                )

        threading.Thread(target=run, daemon=True, name=f"rlix-wait-{self._shard_id}").start()
        return fut

    def param_checksums(self, timeout_s: float = 120.0) -> dict[str, str]:
        """:func:`~rlix_plugins.training.checksum.tensor_fingerprint` of each of the child's
        tensors (Fletcher-64, 16 hex digits), computed now (not during a sync)."""
        with self._lock:
            self._conn.send("checksums")
            if not self._conn.poll(timeout_s):
                # The child still owes this answer: it would be read later as the next sync's
                # reply (and that sync's as the one after). Killed, it owes nothing.
                self.kill()
                raise ReceiverGoneError(
                    f"receiver {self._shard_id}: no checksums in {timeout_s}s; the receiver "
                    "process was killed"
                )
            sums = self._conn.recv()
        assert isinstance(sums, dict)
        return sums

    def kill(self) -> None:
        """SIGKILL the child (tests of a receiver dying mid-sync)."""
        self.process.kill()
        self.process.join(10)

    def close(self) -> None:
        if self.process.is_alive():
            with contextlib.suppress(OSError):
                self._conn.send(None)
            self.process.join(10)
            if self.process.is_alive():
                self.process.kill()
                self.process.join(5)
        self._conn.close()
