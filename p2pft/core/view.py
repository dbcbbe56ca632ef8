"""Typed views: who takes part in the steps of one epoch, and how to reach them.

A ``View`` is what agreement commits (one per epoch) and what a trainer reads at every step.
It is immutable, so the control thread can replace it while training threads read it. The
wire form (short dict keys, lists) exists only in ``to_wire``/``from_wire``, called at the
edges (the node's messages, the driver, the simulator).
"""
from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


class TargetKind(str, enum.Enum):
    """What a job's target counts: committed steps, or samples trained (every contributor's batch)."""

    STEPS = "steps"
    SAMPLES = "samples"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True)
class JobTarget:
    """Where the job ends. No target at all means "until told" (``finish()`` at any step)."""

    kind: TargetKind
    n: int

    def __post_init__(self) -> None:
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"a job target is a positive int, got {self.n!r}")

    def __str__(self) -> str:
        return f"{self.n} {self.kind.value}"

    def to_wire(self) -> list[Any]:
        return [self.kind.value, self.n]

    @classmethod
    def from_wire(cls, w: Any) -> "JobTarget | None":
        """None for no target; ValueError/TypeError on a malformed one (the frame is dropped)."""
        if w is None:
            return None
        kind, n = w
        return cls(TargetKind(kind), int(n))


class Role(str, enum.Enum):
    """A member's part in a view. ``str`` values so logs and JSON read as before."""

    PARTICIPANT = "participant"   # contributes gradients, holds a data slot
    JOINER = "joiner"             # on the data plane with zeros, catching up in the background
    WITNESS = "witness"           # control plane only (votes, gossips), no data plane
    PAUSED = "paused"             # a trainer stepped out for a while: off the data plane, no slot

    @property
    def on_data_plane(self) -> bool:
        return self is Role.PARTICIPANT or self is Role.JOINER

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True)
class Member:
    """One node (an incarnation of a replica leader) as a view lists it."""

    node: str                       # "<replica_id>.<incarnation>"
    replica_id: str
    addr: str                       # control address
    data_addrs: tuple[str, ...]     # one data-server address per shard of the replica
    role: Role
    slot: int | None                # data slot of a participant (rank in the data cursor)
    shards: int = 1
    since: int = 0                  # epoch this node entered the views
    voter: str = ""                 # its Raft identity when not its node id (a durable voter's, kept on disk)

    @property
    def voter_id(self) -> str:
        """The name this member has in ``View.voters`` (its node id unless it restored a durable
        voter identity from its data directory)."""
        return self.voter or self.node

    @property
    def data_addr(self) -> str:
        """Shard 0's data address (the replica leader's own data server)."""
        return self.data_addrs[0] if self.data_addrs else ""

    def shard_addr(self, shard: int) -> str:
        """Data address for shard `shard` (see ``shard_addr``)."""
        return shard_addr(self.data_addrs, shard, self.node)

    def to_wire(self) -> dict[str, Any]:
        d = {"node": self.node, "replica_id": self.replica_id, "addr": self.addr,
             "data_addr": ",".join(self.data_addrs), "role": self.role.value, "slot": self.slot,
             "shards": self.shards, "since": self.since}
        if self.voter:
            d["vo"] = self.voter
        return d

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> "Member":
        """Raises KeyError/TypeError/ValueError on malformed input (the caller drops the frame)."""
        slot = d.get("slot")
        return cls(node=str(d["node"]), replica_id=str(d.get("replica_id", d["node"])), addr=str(d["addr"]),
                   data_addrs=split_addrs(d.get("data_addr", "")), role=Role(d["role"]),
                   slot=None if slot is None else int(slot), shards=int(d.get("shards", 1)),
                   since=int(d.get("since", 0)), voter=str(d.get("vo", "")))


def shard_addr(addrs: Sequence[str], shard: int, who: str = "a member") -> str:
    """The address of shard `shard` among a replica's data addresses (one per shard): the
    rule every layer uses. A one-shard replica serves every shard index (shards past its last
    address go to its last one), so replicas of different shard counts still pair up."""
    if not addrs:
        raise ValueError(f"{who} has no data address")
    return addrs[min(shard, len(addrs) - 1)]


def split_addrs(joined: str | list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """Data addresses as gossip carries them (comma-joined) to a tuple; the one place that splits."""
    if isinstance(joined, (list, tuple)):
        return tuple(str(a) for a in joined if a)
    return tuple(a for a in str(joined).split(",") if a)


@dataclass(frozen=True, slots=True)
class View:
    """A committed view. Epochs only grow; at most one view exists per epoch.

    ``data_epoch`` is the epoch of the last view that changed the data plane (participants,
    joiners, or a requested fresh communicator): communicators are tagged with it, so a view
    that changes only witnesses or voters does not rebuild them."""

    epoch: int
    members: tuple[Member, ...]
    voters: tuple[str, ...] = ()
    data_epoch: int = 0
    high_water: int = 0             # highest committed step the leader has seen
    left: tuple[str, ...] = ()      # trainers recently left out (they catch up before contributing)
    target: JobTarget | None = None  # the job's declared end (the first trainer's declaration)
    finished: int | None = None     # the step the job finished at (every participant reached its end)
    _by_node: dict[str, Member] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._by_node.update((m.node, m) for m in self.members)
        if self.data_epoch <= 0:
            object.__setattr__(self, "data_epoch", self.epoch)

    def member(self, node: str | None) -> Member | None:
        return self._by_node.get(node) if node is not None else None

    def member_of_voter(self, voter: str | None) -> Member | None:
        """The member that holds Raft identity `voter` (a durable voter's later incarnation)."""
        if voter is None:
            return None
        m = self._by_node.get(voter)
        if m is not None and not m.voter:
            return m
        return next((m for m in self.members if m.voter == voter), None)

    def role_of(self, node: str | None) -> Role | None:
        m = self.member(node)
        return m.role if m is not None else None

    @property
    def participants(self) -> list[Member]:
        return [m for m in self.members if m.role is Role.PARTICIPANT]

    @property
    def joiners(self) -> list[Member]:
        return [m for m in self.members if m.role is Role.JOINER]

    @property
    def paused(self) -> list[Member]:
        return [m for m in self.members if m.role is Role.PAUSED]

    @property
    def data_members(self) -> list[Member]:
        """Members on the data plane (participants and joiners), in communicator rank order."""
        return sorted((m for m in self.members if m.role.on_data_plane), key=lambda m: m.node)

    def data_rank(self, node: str) -> int:
        """`node`'s rank in this view's communicators; ValueError when it is not on the data plane."""
        for i, m in enumerate(self.data_members):
            if m.node == node:
                return i
        raise ValueError(f"{node} is not on the data plane of view e{self.epoch}")

    def shard_addrs(self, shard: int = 0) -> list[str]:
        """The data address of shard `shard` of every data member, in rank order."""
        return [m.shard_addr(shard) for m in self.data_members]

    def member_at_data_addr(self, addr: str | None) -> Member | None:
        """The member serving data address `addr` on any of its shards."""
        if not addr:
            return None
        return next((m for m in self.members if addr in m.data_addrs), None)

    def lead(self) -> Member | None:
        """The participant that does the job's side work (evaluation, logging, checkpoints): the
        lowest slot. Slots stay with their participant from view to view, so the choice moves
        only when that participant leaves, to a survivor, the same at every member."""
        return self.donor()

    def donor(self, exclude: str | None = None) -> Member | None:
        """The participant a catch-up pulls from: the lowest slot (the same choice everywhere)."""
        cands = [m for m in self.participants if m.node != exclude]
        return min(cands, key=lambda m: (m.slot if m.slot is not None else 1 << 30, m.node)) if cands else None

    def to_wire(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "members": [m.to_wire() for m in self.members], "voters": list(self.voters),
                "data_epoch": self.data_epoch, "hw": self.high_water, "left": list(self.left),
                **job_to_wire(self.target, self.finished)}

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> "View":
        """Raises KeyError/TypeError/ValueError on malformed input (the caller drops the frame)."""
        epoch = int(d["epoch"])
        return cls(epoch=epoch, members=tuple(Member.from_wire(m) for m in d["members"]),
                   voters=tuple(str(v) for v in d.get("voters", ())),
                   data_epoch=int(d.get("data_epoch", epoch)), high_water=int(d.get("hw", 0)),
                   left=tuple(str(n) for n in d.get("left", ())), **job_from_wire(d))


def job_to_wire(target: JobTarget | None, finished: int | None) -> dict[str, Any]:
    """The job-state keys of a view header (absent when unset: old frames read as no target)."""
    d: dict[str, Any] = {}
    if target is not None:
        d["tg"] = target.to_wire()
    if finished is not None:
        d["fin"] = finished
    return d


def job_from_wire(d: dict[str, Any]) -> dict[str, Any]:
    """``target`` and ``finished`` from a view header's wire dict."""
    fin = d.get("fin")
    return {"target": JobTarget.from_wire(d.get("tg")), "finished": None if fin is None else int(fin)}


__all__ = ["JobTarget", "Member", "Role", "TargetKind", "View", "job_from_wire", "job_to_wire", "shard_addr",
           "split_addrs"]
