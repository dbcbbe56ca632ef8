"""The HSDP side channel (rank 0 -> the replica's other ranks: data epochs, prepares, pings)
proves the cluster secret on every connection: a connection without it is refused and changes
nothing; rank 0's own connection, with it, aborts stale communicators and is answered."""
from __future__ import annotations

import socket
import struct
import time
from collections.abc import Callable

from p2pft.trainer.kernel.comms import SIDE_AUTH_S, SIDE_NONCE, ShardComms, _side_mac

SECRET = b"the cluster secret"


class NoServer:
    """A data server no communicator is ever built on (the side channel needs none)."""

    addr, host = "127.0.0.1:1", "127.0.0.1"

    def communicator(self, *a: object, **kw: object) -> object:
        raise AssertionError("no communicator is built here")


def _comms(secret: bytes | None) -> tuple[ShardComms, tuple[str, int], list[int]]:
    c = ShardComms(NoServer(), 1, 1.0, secret=secret)  # type: ignore[arg-type]
    aborted: list[int] = []
    c.abort_below = aborted.append  # type: ignore[method-assign]
    return c, c.listen("127.0.0.1"), aborted


def _closed_by_peer(s: socket.socket) -> bool:
    """The other end closed the connection (cleanly, or with a reset for data it never read)."""
    s.settimeout(SIDE_AUTH_S + 1.0)
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True


def _until(cond: Callable[[], bool], timeout: float = 3.0) -> bool:
    end = time.monotonic() + timeout
    while not cond() and time.monotonic() < end:
        time.sleep(0.01)
    return cond()


def test_rank_zero_proves_the_secret_and_is_served() -> None:
    side, addr, aborted = _comms(SECRET)
    rank0, _, _ = _comms(SECRET)
    s = rank0._side_connect(addr)
    s.sendall(struct.pack(">q", 7))
    assert _until(lambda: aborted == [7])
    s.sendall(struct.pack(">q", -1))     # a ping is answered
    assert s.recv(1) == b"\x01"
    s.close()
    side.close()


def test_a_connection_without_the_secret_is_refused_and_changes_nothing() -> None:
    side, addr, aborted = _comms(SECRET)
    for mac in (b"", b"x" * 32):         # no proof, a wrong one
        s = socket.create_connection(addr, timeout=2.0)
        nonce = s.recv(SIDE_NONCE)
        assert len(nonce) == SIDE_NONCE
        if mac:
            s.sendall(mac)
        s.sendall(struct.pack(">q", 9))   # a forged epoch: never acted on
        assert _closed_by_peer(s), "the connection was not closed"
        s.close()
    wrong, _, _ = _comms(b"another secret")
    try:
        t = wrong._side_connect(addr)
        t.sendall(struct.pack(">q", 9))
        assert _closed_by_peer(t)
    except OSError:
        pass
    assert aborted == [] and side._refusals >= 2
    side.close()


def test_each_connection_gets_a_fresh_nonce() -> None:
    side, addr, _ = _comms(SECRET)
    seen = set()
    for _ in range(3):
        s = socket.create_connection(addr, timeout=2.0)
        n = s.recv(SIDE_NONCE)
        seen.add(n)
        s.sendall(_side_mac(SECRET, n))   # a replayed proof would be for another nonce
        s.close()
    assert len(seen) == 3
    side.close()


def test_without_a_secret_the_channel_is_open_as_before() -> None:
    side, addr, aborted = _comms(None)
    s = socket.create_connection(addr, timeout=2.0)
    s.sendall(struct.pack(">q", 3))
    assert _until(lambda: aborted == [3])
    s.close()
    side.close()
