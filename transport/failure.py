"""Failure bookkeeping of a ring communicator: the sticky first error and whom to blame.

`FailState` is shared by the calling thread, the lane threads and the connection set-up of one
communicator. The functions here decide which peer an error is about: a verdict relayed by a
neighbour keeps naming the peer that really failed, and a frame that does not fit the current
operation is diagnosed field by field.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

from .errors import CommAborted, CommError, ProtocolMismatch
from .wire import FRAME_MAGIC, FRAME_PREFIX, OP_ALLREDUCE, RemoteError

__all__ = ["FailHooks", "FailState", "error_from_remote", "frame_mismatch"]


class FailState:
    """The first error of one communicator (sticky) and the events to set when it happens.

    `lock` also guards the communicator's own bookkeeping (op in progress, sockets), so that an
    error and the start of an operation are ordered; `cond` is signalled on every change.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self.failed: CommError | None = None
        #: the OP_ERROR frame announcing `failed` to the neighbours
        self.error_frame: bytes | None = None
        #: set once the failing thread is done writing to and shutting the incoming sockets
        self.io_done = threading.Event()
        self._waiters: set[threading.Event] = set()

    @contextmanager
    def waiter(self) -> Iterator[threading.Event]:
        """An event that `wake_waiters` sets (on a failure or a lane finishing) while in use."""
        ev = threading.Event()
        with self.lock:
            self._waiters.add(ev)
        try:
            yield ev
        finally:
            with self.lock:
                self._waiters.discard(ev)

    def wake_waiters(self) -> None:
        with self.lock:
            ws = list(self._waiters)
        for ev in ws:
            ev.set()


@dataclass(frozen=True)
class FailHooks:
    """How lane and connection code reports failures to, and learns them from, its communicator."""

    state: FailState
    #: record `err` unless an error is already recorded, tell the neighbours; returns the sticky error
    fail: Callable[[CommError], CommError]
    #: rebuild the verdict of a neighbour's error frame (frame, rank it came from)
    from_remote: Callable[[RemoteError, int], CommError]


def error_from_remote(r: RemoteError, via: int, *, rank: int, my_tag: int, peers: list[str]) -> CommError:
    """Rebuild the error a neighbour reported so this rank blames the same peer.

    A tag mismatch names a rank whose tag differs from this rank's own (`my_tag`), so every rank
    blames a mismatching peer even when its neighbours agree with it.
    """
    def addr(rk: int | None) -> str | None:
        return peers[rk] if rk is not None and 0 <= rk < len(peers) else None

    if r.cls is ProtocolMismatch and r.tags:
        for rk, tg in sorted(r.tags.items()):
            if rk != rank and tg != my_tag:
                return ProtocolMismatch(
                    f"tag mismatch: rank {rk} has tag {tg}, this rank {my_tag} (reported by rank {r.origin})",
                    peer_rank=rk, peer_addr=addr(rk), origin=r.origin, tags={**r.tags, rank: my_tag})
    peer = r.peer_rank
    if r.cls is CommAborted and peer is None:
        peer = r.origin
    peer_addr = r.peer_addr if r.peer_addr is not None else addr(peer)
    if r.cls is CommAborted and r.peer_rank is None:
        reason = f"rank {r.origin} {r.reason}"
    elif r.origin == peer:
        reason = r.reason
    else:
        reason = f"{r.reason} (reported by rank {r.origin})"
    if via != r.origin:
        reason += f" (relayed by rank {via})"
    return r.cls(reason, peer_rank=peer, peer_addr=peer_addr, origin=r.origin, tags=r.tags)


_PREFIX_NAMES = ("magic", "op", "dtype", "epoch", "shard", "src rank", "op seq", "tag", "total bytes")


def frame_mismatch(got_prefix: bytes | memoryview, expected: bytes, *, left: int, rank: int,
                   left_addr: str) -> ProtocolMismatch:
    """Say how a frame header from the left neighbour differs from the one this op expects
    (neither a keepalive nor an error frame: those are handled by the receiver)."""
    got = FRAME_PREFIX.unpack_from(got_prefix)
    exp = FRAME_PREFIX.unpack(expected)
    if got[0] != FRAME_MAGIC:
        return ProtocolMismatch("stream out of sync (bad frame magic)", peer_rank=left, peer_addr=left_addr)
    if got[1:7] == exp[1:7] and got[7] != exp[7]:
        what = "tag" if exp[1] == OP_ALLREDUCE else "broadcast root"
        return ProtocolMismatch(f"{what} mismatch: rank {left} has {got[7]}, this rank {exp[7]}",
                                peer_rank=left, peer_addr=left_addr, tags={left: got[7], rank: exp[7]})
    diffs = [f"{n} {g} != {x}" for n, g, x in zip(_PREFIX_NAMES, got, exp) if g != x]
    return ProtocolMismatch(f"frame from rank {left} does not match this op: " + ", ".join(diffs),
                            peer_rank=left, peer_addr=left_addr)
