"""The sender never blocks on a control socket whose receiver vanished.

A PAIR socket blocks a plain send when its peer went away between the POLLOUT poll and the
send: a receiver that crashed mid-sync once hung the sender (seen in a CI run: the sync thread
stuck in ``Socket.send``, the test waiting forever). The socket here is a FAKE that reproduces
that window deterministically: POLLOUT is reported, every non-blocking send finds no peer.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest
import zmq

from rlix_plugins.errors import ReceiverGoneError
from rlix_plugins.training import sync


class PeerGoneSocket:
    """FAKE zmq socket: writable by poll, but the peer is gone when the send happens."""

    def __init__(self) -> None:
        self.sends: list[int] = []

    def poll(self, timeout: int, event: int) -> int:
        return event

    def send_multipart(self, parts: list[Any], flags: int = 0, copy: bool = True) -> None:
        self.sends.append(flags)
        if not flags & zmq.NOBLOCK:
            raise AssertionError("a blocking send would hang here forever")
        raise zmq.Again()


def test_send_to_a_vanished_receiver_fails_within_the_timeout() -> None:
    sock = PeerGoneSocket()
    member = sync._Member(
        receiver=SimpleNamespace(shard_id="bad"),  # type: ignore[arg-type]
        transport=sync.TransportKind.SHM,
        address="ipc:///nowhere",
        socket=sock,  # type: ignore[arg-type]
    )
    started = time.monotonic()
    with pytest.raises(ReceiverGoneError, match="shard bad: no connection"):
        sync._send(member, {"kind": "bucket"}, [], timeout_s=0.2)
    assert time.monotonic() - started < 5.0
    assert sock.sends and all(f & zmq.NOBLOCK for f in sock.sends)


def test_send_on_a_real_socket_without_a_peer_fails_within_the_timeout() -> None:
    # The real counterpart (no race to reproduce): a PAIR socket nobody connected to is never
    # writable, so the send gives up at its timeout instead of queueing or blocking.
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.PAIR)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.bind("inproc://rlix-test-sync-send-no-peer")
        member = sync._Member(
            receiver=SimpleNamespace(shard_id="lonely"),  # type: ignore[arg-type]
            transport=sync.TransportKind.SHM,
            address="inproc://rlix-test-sync-send-no-peer",
            socket=sock,
        )
        with pytest.raises(ReceiverGoneError, match="shard lonely: no connection"):
            sync._send(member, {"kind": "bucket"}, [], timeout_s=0.2)
    finally:
        sock.close()
