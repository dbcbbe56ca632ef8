"""Errors raised by the data plane.

Every error names the peer it is about when one is known, because the control plane uses a
data-plane error against a peer as direct evidence for suspecting that peer.
"""

from __future__ import annotations

__all__ = ["CommError", "PeerFailed", "CommTimeout", "CommAborted", "ProtocolMismatch"]


class CommError(Exception):
    """Base class: an operation on a communicator or a state stream did not complete."""

    def __init__(self, reason: str, *, peer_rank: int | None = None, peer_addr: str | None = None) -> None:
        self.reason = reason
        self.peer_rank = peer_rank
        self.peer_addr = peer_addr
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

    def __reduce__(self):  # keep attributes when pickled across processes
        return (_rebuild, (type(self), self.reason, self.peer_rank, self.peer_addr))


def _rebuild(cls: type, reason: str, peer_rank: int | None, peer_addr: str | None) -> CommError:
    return cls(reason, peer_rank=peer_rank, peer_addr=peer_addr)


class PeerFailed(CommError):
    """A known peer closed, reset or refused its connection (EOF, ECONNRESET, ECONNREFUSED)."""


class CommTimeout(CommError):
    """No progress within the timeout; the peer is the one this rank was waiting on, if known."""


class CommAborted(CommError):
    """abort() was called on this communicator (peer unset) or on a peer's (peer set)."""


class ProtocolMismatch(CommError):
    """A frame of another epoch/shard/op/tag, a bad handshake or a wrong cluster secret."""


ERROR_CLASSES: dict[str, type[CommError]] = {
    c.__name__: c for c in (CommError, PeerFailed, CommTimeout, CommAborted, ProtocolMismatch)
}
