"""The control messages, one dataclass each (gossip ``g.*``, Raft ``r.*``, views ``v.*``).

The cores build and read these; ``p2pft.core.codec`` alone turns them into the wire's short-key
dicts and back, at the edge (the driver around each frame, the simulator around its msgpack
round trip). Every message carries its sender's address (``frm``) and node id (``src``),
stamped by the layer that sends it.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, ClassVar, Union

from .meta import MemberMeta
from .view import JobTarget, Member, View

class MemberState(str, enum.Enum):
    """A member's state as gossip knows it (a piggybacked update names the state it announces).
    ``str`` values: the wire and the logs carry the plain word."""

    ALIVE = "alive"
    SUSPECT = "suspect"
    DEAD = "dead"
    LEFT = "left"

    def __str__(self) -> str:
        return self.value


ALIVE, SUSPECT, DEAD, LEFT = MemberState.ALIVE, MemberState.SUSPECT, MemberState.DEAD, MemberState.LEFT
STATES = tuple(MemberState)


@dataclass(slots=True)
class Update:
    """A piggybacked membership update: ``node`` is in ``state`` at incarnation ``inc``.

    ``addr``/``meta`` come with ``alive``; ``accuser`` (who suspects or declared it) with
    ``suspect``/``dead``. Never changed once made (not frozen only because thousands are
    decoded per simulated second, and a frozen dataclass is several times slower to build)."""

    state: MemberState
    node: str
    inc: int
    addr: str = ""
    meta: MemberMeta | None = None
    accuser: str = ""
    wire: dict[str, Any] | None = field(default=None, init=False, repr=False, compare=False)  # codec's cache


@dataclass(slots=True)
class Row:
    """One member in a push-pull full-state sync (never changed once made, like ``Update``)."""

    node: str
    addr: str
    inc: int
    state: MemberState
    meta: MemberMeta


@dataclass(slots=True, kw_only=True)
class Envelope:
    """Sender's address and node id, on every message."""

    TYPE: ClassVar[str] = ""
    frm: str = ""
    src: str = ""


# ---------------------------------------------------------------------- gossip
@dataclass(slots=True, kw_only=True)
class GossipMessage(Envelope):
    """Gossip header: piggybacked updates, and what the sender tells about itself (its
    committed epoch and step on probes and syncs; its training-loop beat to the leader)."""

    updates: list[Update] = field(default_factory=list)
    epoch: int | None = None
    step: int | None = None
    beat: int | None = None


@dataclass(slots=True, kw_only=True)
class Ping(GossipMessage):
    TYPE: ClassVar[str] = "g.ping"
    seq: int
    to: str                 # target node id: an earlier process at that address stays silent


@dataclass(slots=True, kw_only=True)
class Ack(GossipMessage):
    TYPE: ClassVar[str] = "g.ack"
    seq: int


@dataclass(slots=True, kw_only=True)
class Nack(GossipMessage):
    TYPE: ClassVar[str] = "g.nack"
    seq: int


@dataclass(slots=True, kw_only=True)
class ProbeRequest(GossipMessage):
    """Ask a member to probe ``target`` at ``target_addr`` for us (indirect probe)."""

    TYPE: ClassVar[str] = "g.preq"
    seq: int
    target: str
    target_addr: str


@dataclass(slots=True, kw_only=True)
class PushPull(GossipMessage):
    TYPE: ClassVar[str] = "g.pp"
    join: bool = False
    reply: bool = False
    rows: list[Row] = field(default_factory=list)


@dataclass(slots=True, kw_only=True)
class Updates(GossipMessage):
    """Updates only (direct notices, loop beats)."""

    TYPE: ClassVar[str] = "g.upd"


@dataclass(slots=True, kw_only=True)
class Who(GossipMessage):
    """"I don't know you": answered with the sender's own alive update."""

    TYPE: ClassVar[str] = "g.who"


# ---------------------------------------------------------------------- raft
@dataclass(slots=True, kw_only=True)
class RaftMessage(Envelope):
    to: str = ""            # recipient node id: a message for an earlier process is dropped
    term: int


@dataclass(slots=True, kw_only=True)
class PreVote(RaftMessage):
    TYPE: ClassVar[str] = "r.pv"
    last_index: int
    last_term: int


@dataclass(slots=True, kw_only=True)
class PreVoteResp(RaftMessage):
    TYPE: ClassVar[str] = "r.pvr"
    ok: bool


@dataclass(slots=True, kw_only=True)
class Vote(RaftMessage):
    TYPE: ClassVar[str] = "r.rv"
    last_index: int
    last_term: int


@dataclass(slots=True, kw_only=True)
class VoteResp(RaftMessage):
    TYPE: ClassVar[str] = "r.rvr"
    ok: bool


@dataclass(slots=True, kw_only=True)
class Append(RaftMessage):
    """Append entries (views, each with its term) after ``prev``; a heartbeat when empty."""

    TYPE: ClassVar[str] = "r.ae"
    prev: int
    prev_term: int
    entries: list[tuple[int, View]]
    commit: int


@dataclass(slots=True, kw_only=True)
class AppendResp(RaftMessage):
    TYPE: ClassVar[str] = "r.aer"
    ok: bool
    match: int = 0          # with ok: the last index we hold that matches the leader's log
    hint: int = 0           # without ok: where the leader should try next


@dataclass(slots=True, kw_only=True)
class Snapshot(RaftMessage):
    """The committed view at ``index`` for a follower behind the compacted log."""

    TYPE: ClassVar[str] = "r.snap"
    index: int
    snap_term: int
    view: View


# ---------------------------------------------------------------------- views
@dataclass(slots=True, kw_only=True)
class ViewRequest(Envelope):
    """Ask for the committed view if it is newer than ``epoch``."""

    TYPE: ClassVar[str] = "v.get"
    epoch: int = 0


@dataclass(slots=True, kw_only=True)
class ViewFull(Envelope):
    """A whole committed view (``term``: its Raft term), with the sender's idea of the leader."""

    TYPE: ClassVar[str] = "v.view"
    view: View
    term: int = 0
    leader: str | None = None
    leader_addr: str | None = None


@dataclass(slots=True, kw_only=True)
class ViewDelta(Envelope):
    """A committed view as a change to the view of epoch ``base``: O(change) bytes."""

    TYPE: ClassVar[str] = "v.delta"
    base: int
    epoch: int
    term: int = 0
    voters: tuple[str, ...] = ()
    data_epoch: int = 0
    high_water: int = 0
    left: tuple[str, ...] = ()
    target: JobTarget | None = None
    finished: int | None = None
    changed: list[Member] = field(default_factory=list)   # new or changed members
    removed: list[str] = field(default_factory=list)      # node ids no longer in the view
    leader: str | None = None
    leader_addr: str | None = None


@dataclass(slots=True, kw_only=True)
class Unknown(Envelope):
    """A message type this version does not know (counted, otherwise ignored)."""

    type: str = ""


GossipMsg = Union[Ping, Ack, Nack, ProbeRequest, PushPull, Updates, Who]
RaftMsg = Union[PreVote, PreVoteResp, Vote, VoteResp, Append, AppendResp, Snapshot]
ViewMsg = Union[ViewRequest, ViewFull, ViewDelta]
Message = Union[GossipMsg, RaftMsg, ViewMsg, Unknown]


__all__ = ["ALIVE", "SUSPECT", "DEAD", "LEFT", "STATES", "MemberState", "Update", "Row", "Envelope", "GossipMessage",
           "Ping", "Ack", "Nack", "ProbeRequest", "PushPull", "Updates", "Who", "RaftMessage", "PreVote", "PreVoteResp",
           "Vote", "VoteResp", "Append", "AppendResp", "Snapshot", "ViewRequest", "ViewFull", "ViewDelta",
           "Unknown", "Message", "GossipMsg", "RaftMsg", "ViewMsg"]
