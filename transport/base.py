"""The communicator interface the runtime programs against (backend-neutral, no torch import)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from .errors import CommError

__all__ = ["Communicator"]


class Communicator(ABC):
    """The data-plane group of one (epoch, shard index): `world` ranks, this process is `rank`.

    A communicator never recovers from an error: once `failed` is set every later operation
    raises that error again, and the runtime builds a communicator for the next epoch.
    """

    epoch: int
    shard: int
    rank: int
    world: int

    @abstractmethod
    def allreduce(self, tensor: Any, *, contribute: bool = True, tag: int = 0,
                  timeout: float | None = None) -> int:
        """In-place SUM over ranks of a contiguous 1-D-viewable tensor; returns the number of contributors.

        contribute=False: this rank's buffer counts as zeros and the rank is not counted (joiners).
        `tag` (e.g. the step) must be equal on all ranks, else ProtocolMismatch naming a mismatching peer.
        """

    @abstractmethod
    def broadcast(self, tensor: Any, root: int, *, timeout: float | None = None) -> None:
        """Copy `root`'s tensor into every rank's tensor (same shape and dtype on all ranks)."""

    @abstractmethod
    def abort(self, reason: str) -> None:
        """Fail the communicator now (thread-safe, idempotent); a waiting op raises CommAborted."""

    @abstractmethod
    def close(self) -> None:
        """Release sockets and threads (idempotent)."""

    @property
    @abstractmethod
    def failed(self) -> CommError | None:
        """The error that ended this communicator, or None while it is usable."""

    def peer_started(self) -> bool:
        """A neighbour has begun an operation this rank has not (its bytes wait to be read);
        False where the backend cannot tell (NCCL)."""
        return False

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
