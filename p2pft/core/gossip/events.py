"""What gossip tells the node layer happened: one typed event per membership change.

``Gossip.events`` holds these until the node drains them (``Node._pump``): a change of the
member table makes the leader reconcile its view, a member that died or left may have been the
Raft leader, and a member that holds a newer view than ours is asked for it.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

from ..messages import MemberState


class GossipEventKind(str, enum.Enum):
    """Why an event was raised; the first six change the member table."""

    JOIN = "join"                  # a member we did not know
    ALIVE = "alive"                # a suspect or dead member is alive again (a newer incarnation)
    UPDATE = "update"              # an alive member's metadata changed
    SUSPECT = "suspect"
    DEAD = "dead"
    LEFT = "left"
    NEWER_VIEW = "epoch"           # a member's probes carry a newer view epoch than ours
    JOIN_REQUEST = "join_request"  # a node joined through us (push-pull with the join flag)

    def __str__(self) -> str:
        return self.value

    @classmethod
    def gone(cls, state: MemberState) -> "GossipEventKind":
        """The event of a member found dead or gone (``MemberState.DEAD``/``LEFT``)."""
        return cls.DEAD if state is MemberState.DEAD else cls.LEFT


@dataclass(frozen=True, slots=True)
class GossipEvent:
    """`node` (a node id) is the subject of `kind`."""

    kind: GossipEventKind
    node: str

    @property
    def lost(self) -> bool:
        """The member is no longer there (dead or left): if it led Raft, a new leader is due."""
        return self.kind is GossipEventKind.DEAD or self.kind is GossipEventKind.LEFT


__all__ = ["GossipEvent", "GossipEventKind"]
