"""The ranks of one replica, as the step engine needs them: all-gather and broadcast.

A replica of one rank (``FaultTolerant``) and an FSDP replica of many (``HSDP``) run the same
step engine; only this object differs. ``LocalGroup`` answers at once; ``DistGroup`` runs the
collectives on the replica's own ``torch.distributed`` process group.
"""
from __future__ import annotations

from typing import Any, Protocol, TypeVar

T = TypeVar("T")


class ReplicaGroup(Protocol):
    rank: int
    world: int

    def agree(self, obj: T) -> list[T]:
        """All-gather one small picklable object per rank (in rank order)."""

    def broadcast(self, obj: T | None) -> T:
        """Rank 0's object on every rank (the others pass None)."""


class LocalGroup:
    """A replica of one rank: every collective is the identity."""

    rank = 0
    world = 1

    def agree(self, obj: T) -> list[T]:
        return [obj]

    def broadcast(self, obj: T | None) -> T:
        assert obj is not None
        return obj


class DistGroup:
    """The ranks of an FSDP replica, over its torch.distributed process group."""

    def __init__(self, group: Any = None) -> None:
        import torch.distributed as dist
        self._dist = dist
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)

    def agree(self, obj: T) -> list[T]:
        out: list[Any] = [None] * self.world
        self._dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast(self, obj: T | None) -> T:
        box: list[Any] = [obj]
        self._dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]


__all__ = ["DistGroup", "LocalGroup", "ReplicaGroup"]
