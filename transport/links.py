"""The connections of one ring communicator and their set-up.

Rank r connects one socket per lane to rank r+1 and only sends on it (`rights`); rank r-1's
connections arrive through the DataServer, which hands them over with `attach` (`lefts`). The
reverse direction of every connection carries at most one error frame. Connecting retries with
backoff while the right neighbour's server is not up, within `connect_timeout`.
"""

from __future__ import annotations

import select
import socket
import time

from .errors import CommAborted, CommError, CommTimeout, PeerFailed, ProtocolMismatch
from .failure import FailHooks
from .options import RingOptions
from .sockutil import close_quietly, shutdown_quietly
from .wire import (
    ACK_LEN, KIND_RING, ST_BUSY, ST_CLOSED, ST_OK, ST_PENDING, STATUS_TEXT, pack_hello, parse_ack,
    connect_abortable, read_reverse_error, recv_exact, source_address, split_addr, tune_socket,
)

__all__ = ["RingLinks"]


class RingLinks:
    """Lane sockets to the right and from the left neighbour; each socket is closed once."""

    def __init__(self, *, epoch: int, shard: int, rank: int, peers: list[str], options: RingOptions,
                 connect_timeout: float, hooks: FailHooks) -> None:
        self.epoch = epoch
        self.shard = shard
        self.rank = rank
        self.world = len(peers)
        self.peers = peers
        self.left = (rank - 1) % self.world
        self.right = (rank + 1) % self.world
        self.options = options
        self.connect_timeout = connect_timeout
        self.hooks = hooks
        self.state = hooks.state
        self.lefts: list[socket.socket | None] = [None] * options.lanes
        self.rights: list[socket.socket | None] = [None] * options.lanes
        self._closed: set[int] = set()

    # ------------------------------------------------------------------ ownership
    def close_sock(self, s: socket.socket | None) -> None:
        """Shut and close `s` unless that was done already (several threads may try)."""
        if s is None:
            return
        with self.state.lock:
            if id(s) in self._closed:
                return
            self._closed.add(id(s))
        shutdown_quietly(s)
        close_quietly(s)

    def left_taken(self, lane: int) -> bool:
        with self.state.lock:
            return self.lefts[lane] is not None

    def attach(self, lane: int, sock: socket.socket) -> None:
        """Take ownership of an accepted, acknowledged connection from the left neighbour."""
        tune_socket(sock, self.options.sock_bufsize)
        with self.state.cond:
            if self.state.failed is None and self.lefts[lane] is None:
                self.lefts[lane] = sock
                self.state.cond.notify_all()
                return
        close_quietly(sock)

    # ------------------------------------------------------------------ set-up
    def connect(self, deadline: float) -> None:
        """Connect every lane to the right and wait for every lane from the left, until `deadline`."""
        state = self.state
        for lane in range(self.options.lanes):
            if self.rights[lane] is None:
                s = self._connect_lane(lane, deadline)
                with state.lock:
                    self.rights[lane] = s
                    failed = state.failed
                if failed is not None:
                    raise failed
        while True:
            with state.cond:
                if state.failed is not None or all(s is not None for s in self.lefts):
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                state.cond.wait(min(left, 0.05))
            self._watch_rights()
        if state.failed is not None:
            raise state.failed
        if any(s is None for s in self.lefts):
            raise self.hooks.fail(CommTimeout(
                f"rank {self.left} did not connect within connect_timeout={self.connect_timeout:g} s",
                peer_rank=self.left, peer_addr=self.peers[self.left]))

    def _watch_rights(self) -> None:
        """While waiting for the left neighbour, notice a right neighbour that already dropped
        our connection (its server expired or refused it and left an error frame behind)."""
        socks = [s for s in self.rights if s is not None]
        if not socks:
            return
        poller = select.poll()
        byfd = {}
        for s in socks:
            try:
                poller.register(s, select.POLLIN)
                byfd[s.fileno()] = s
            except (OSError, ValueError):
                return
        for fd, _ev in poller.poll(0):
            s = byfd[fd]
            remote = read_reverse_error(s)
            if remote is not None:
                self.hooks.fail(self.hooks.from_remote(remote, self.right))
            else:
                self.hooks.fail(PeerFailed(f"rank {self.right} closed the connection before the first operation",
                                           peer_rank=self.right, peer_addr=self.peers[self.right]))
            return

    def _connect_lane(self, lane: int, deadline: float) -> socket.socket:
        """Connect to the right neighbour, retrying with backoff while its server is not up."""
        opts = self.options
        state = self.state
        fail = self.hooks.fail
        right, right_addr = self.right, self.peers[self.right]
        host, port = split_addr(right_addr)
        source = source_address(opts.source_host, host)
        backoff = 0.002
        last = "no attempt"
        while True:
            if state.failed is not None:
                raise state.failed
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if "refused" in last:
                    raise fail(PeerFailed(f"cannot connect to rank {right}: {last}",
                                          peer_rank=right, peer_addr=right_addr))
                raise fail(CommTimeout(f"cannot connect to rank {right} within "
                                       f"connect_timeout={self.connect_timeout:g} s: {last}",
                                       peer_rank=right, peer_addr=right_addr))
            sock = None
            # A fresh hello (time + nonce) per attempt: servers accept each hello only once.
            hello = pack_hello(opts.secret, KIND_RING, self.epoch, self.shard, self.rank, self.right,
                               self.world, lane, opts.lanes, opts.chunk_bytes)
            try:
                # Abortable: a newer view must not wait for a connect to a vanished host.
                sock = connect_abortable(host, port, min(remaining, 2.0), source, lambda: state.failed is not None)
                if sock is None:
                    raise state.failed or CommAborted("connect given up")
                tune_socket(sock, opts.sock_bufsize)
                sock.sendall(hello)
                ack = bytearray(ACK_LEN)
                recv_exact(sock, memoryview(ack))
                status = parse_ack(opts.secret, hello, bytes(ack))
                if status in (ST_OK, ST_PENDING):
                    sock.settimeout(None)
                    return sock
                close_quietly(sock)
                sock = None
                if status == ST_BUSY:
                    last = "peer busy"
                elif status == ST_CLOSED:
                    raise fail(CommAborted(
                        f"rank {right} already closed its communicator of epoch {self.epoch}",
                        peer_rank=right, peer_addr=right_addr))
                else:
                    raise fail(ProtocolMismatch(
                        f"rank {right} rejected the connection: {STATUS_TEXT.get(status, status)}",
                        peer_rank=right, peer_addr=right_addr))
            except ProtocolMismatch as e:
                if sock is not None:
                    close_quietly(sock)
                if e.peer_rank is None:
                    e = ProtocolMismatch(e.reason, peer_rank=right, peer_addr=right_addr)
                raise fail(e) from None
            except CommError:
                if sock is not None:
                    close_quietly(sock)
                raise
            except (ConnectionRefusedError, socket.timeout, TimeoutError, EOFError, OSError) as e:
                if sock is not None:
                    close_quietly(sock)
                last = "connection refused" if isinstance(e, ConnectionRefusedError) else repr(e)
            with state.cond:
                if state.failed is None:
                    state.cond.wait(min(backoff, max(0.0, deadline - time.monotonic())))
            backoff = min(backoff * 2, 0.2)
