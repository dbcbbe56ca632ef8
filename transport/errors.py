"""Errors raised by the data plane.

Every error names the peer it is about when one is known, because the control plane uses a
data-plane error against a peer as direct evidence for suspecting that peer. What a ring learns
about a failure travels with the error as real fields (`origin`, `tags`), so a rank that relays
a neighbour's verdict blames the same peer as the rank that saw the failure first.
"""

from __future__ import annotations

from typing import Mapping

__all__ = ["CommError", "PeerFailed", "CommTimeout", "CommAborted", "ProtocolMismatch", "SharedDevice"]


class CommError(Exception):
    """Base class: an operation on a communicator or a state stream did not complete.

    reason:    what went wrong, in words.
    peer_rank: rank of the peer the error is about (None: not known, or this rank itself).
    peer_addr: data address ("host:port") of that peer; callers map it back to a member.
    origin:    rank that detected the failure when this rank learned it from a neighbour's error
               frame (None: detected here).
    tags:      allreduce tag (or broadcast root) used by each rank, as far as known: lets a tag
               mismatch name a mismatching peer on every rank (empty when not about tags).
    """

    def __init__(self, reason: str, *, peer_rank: int | None = None, peer_addr: str | None = None,
                 origin: int | None = None, tags: Mapping[int, int] | None = None) -> None:
        self.reason = reason
        self.peer_rank = peer_rank
        self.peer_addr = peer_addr
        self.origin = origin
        self.tags: dict[int, int] = dict(tags) if tags else {}
        super().__init__(self._describe())

    def _describe(self) -> str:
        if self.peer_rank is None and self.peer_addr is None:
            return self.reason
        who = []
        if self.peer_rank is not None:
            who.append(f"rank {self.peer_rank}")
        if self.peer_addr is not None:
            who.append(self.peer_addr)
        return f"{self.reason} [peer {' @ '.join(who)}]"

    def copy(self) -> "CommError":
        """A fresh instance with the same class and fields (each raise gets its own traceback)."""
        return type(self)(self.reason, peer_rank=self.peer_rank, peer_addr=self.peer_addr,
                          origin=self.origin, tags=self.tags)

    def __reduce__(self):  # keep the fields when pickled across processes
        return (_rebuild, (type(self), self.reason, self.peer_rank, self.peer_addr, self.origin, self.tags))


def _rebuild(cls: type, reason: str, peer_rank: int | None, peer_addr: str | None,
             origin: int | None = None, tags: dict[int, int] | None = None) -> CommError:
    return cls(reason, peer_rank=peer_rank, peer_addr=peer_addr, origin=origin, tags=tags)


class PeerFailed(CommError):
    """A known peer closed, reset or refused its connection (EOF, ECONNRESET, ECONNREFUSED)."""


class CommTimeout(CommError):
    """No progress within the timeout; the peer is the one this rank was waiting on, if known."""


class CommAborted(CommError):
    """abort() was called on this communicator (peer unset) or on a peer's (peer set)."""


class ProtocolMismatch(CommError):
    """A frame of another epoch/shard/op/tag, a bad handshake or a wrong cluster secret."""


class SharedDevice(ProtocolMismatch):
    """Two ranks of one NCCL communicator are on the same device (same PCI bus id / UUID), with
    the data plane explicitly 'nccl': NCCL refuses that at init, so no retry can succeed. Carried
    by name in error frames, so every rank learns it is this and not a peer failure."""


ERROR_CLASSES: dict[str, type[CommError]] = {
    c.__name__: c for c in (CommError, PeerFailed, CommTimeout, CommAborted, ProtocolMismatch, SharedDevice)
}
