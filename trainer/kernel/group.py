"""The ranks of one replica, as the step engine needs them: all-gather and broadcast.

A replica of one rank (``FaultTolerant``) and an FSDP replica of many (``HSDP``) run the same
step engine; only this object differs. ``LocalGroup`` answers at once; ``DistGroup`` runs the
collectives on the replica's own ``torch.distributed`` process group.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, TypeVar, cast

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

T = TypeVar("T")


class ReplicaGroup(Protocol):
    rank: int
    world: int

    def agree(self, obj: T) -> list[T]:
        """All-gather one small picklable object per rank (in rank order)."""

    def broadcast(self, obj: T | None) -> T:
        """Rank 0's object on every rank (the others pass None)."""

    def side_group(self) -> ProcessGroup | None:
        """Collective: a new gloo process group of the same ranks, for collectives run on
        another thread (checkpoint writes); None for a replica of one rank."""


class LocalGroup:
    """A replica of one rank: every collective is the identity."""

    rank = 0
    world = 1

    def agree(self, obj: T) -> list[T]:
        return [obj]

    def broadcast(self, obj: T | None) -> T:
        return cast(T, obj)   # rank 0's object, whatever it is (None included)

    def side_group(self) -> ProcessGroup | None:
        return None


class DistGroup:
    """The ranks of an FSDP replica, over its torch.distributed process group."""

    def __init__(self, group: ProcessGroup | None = None) -> None:
        import torch.distributed as dist
        self._dist = dist
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)

    def agree(self, obj: T) -> list[T]:
        out: list[object] = [None] * self.world
        self._dist.all_gather_object(out, obj, group=self.group)
        return cast("list[T]", out)   # every rank's `obj`, filled in

    def broadcast(self, obj: T | None) -> T:
        box: list[object] = [obj]
        self._dist.broadcast_object_list(box, src=0, group=self.group)
        return cast(T, box[0])   # rank 0's object, filled in

    def side_group(self) -> ProcessGroup | None:
        ranks = self._dist.get_process_group_ranks(self.group) if self.group is not None else None
        return self._dist.new_group(ranks=ranks, backend="gloo")


__all__ = ["DistGroup", "LocalGroup", "ReplicaGroup"]
