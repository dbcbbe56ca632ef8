"""What a member tells the cluster about itself through gossip (``MemberMeta``).

Gossip carries this metadata in every ``alive`` update and push-pull row; the leader reads it
to derive views (kind, status, step, start stamp, loop timeout, data-epoch requests). The short
wire keys exist only in ``to_wire``/``from_wire``: they keep frames small at 1,000 members:

``r`` replica id, ``d`` data addresses (comma-joined), ``k`` kind, ``sh`` shard count, ``s`` status,
``t0`` process start stamp, ``st`` committed step when the status was set, ``lt`` loop timeout,
``rb`` a failed data epoch for which a fresh one is requested, ``mp`` the most participants the
job plans for (more trainers than that are hot spares), ``du`` the members whose data address
this trainer has not reached for longer than the bound (see p2pft/core/reach.py), ``tg`` the job
target it declares (``[kind, n]``), ``ar`` 1 when it may restart the job from scratch, ``vo``
its Raft voter identity when that is not its node id (a durable voter restored from its data
directory: docs/control-plane.md, "Durable voters").
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from .view import JobTarget, split_addrs


class Kind(str, enum.Enum):
    """What runs behind a node: a trainer (replica leader) or a witness (``p2pft peer``)."""

    TRAINER = "trainer"
    WITNESS = "witness"

    def __str__(self) -> str:
        return self.value


class Status(str, enum.Enum):
    """A trainer's own account of its state (witnesses are always ``ready``)."""

    JOINING = "joining"     # needs catch-up before it contributes
    READY = "ready"         # holds the cluster's current state (at ``step``)
    FRESH = "fresh"         # just started, with its own state at ``step`` (a checkpoint or a new
                            # model): current only if that is exactly the cluster's step
    LEAVING = "leaving"     # on its way out: left out of the next view
    PAUSED = "paused"       # stepped out for a while (evaluation, a checkpoint): off the data plane,
                            # holding the committed state of ``step``
    DONE = "done"           # reached the job's end at ``step``: waits at the end barrier

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True)
class MemberMeta:
    """One node's metadata. Immutable: a change is a new value under a new incarnation."""

    replica_id: str = ""                      # empty: the node id stands for it
    data_addrs: tuple[str, ...] = ()          # one data-server address per shard
    kind: Kind | None = None
    shards: int = 1
    status: Status | None = None
    start: float = 0.0                        # process start stamp (the newest incarnation wins)
    step: int = -1                            # committed step when the status was set
    loop_timeout: float | None = None         # longest the training loop may go without a beat
    data_epoch_request: int | None = None     # a failed data epoch: asks the leader for a fresh one
    max_participants: int | None = None       # planned participants; trainers beyond it are spares
    data_unreachable: tuple[str, ...] = ()    # members alive on gossip whose data port we cannot reach
    target: JobTarget | None = None           # the job's end as this trainer declares it
    allow_scratch: bool = False               # may restart below the high-water step (state lost)
    voter: str = ""                           # its Raft identity when not its node id (restored from disk)
    _wire: dict[str, Any] | None = field(default=None, init=False, repr=False, compare=False)

    def to_wire(self) -> dict[str, Any]:
        """The short-key dict (built once per value: every probe piggybacks it)."""
        w = self._wire
        if w is None:
            w = {"r": self.replica_id, "d": ",".join(self.data_addrs), "sh": self.shards, "t0": self.start,
                 "st": self.step}
            if self.kind is not None:
                w["k"] = self.kind.value
            if self.status is not None:
                w["s"] = self.status.value
            if self.loop_timeout is not None:
                w["lt"] = self.loop_timeout
            if self.data_epoch_request is not None:
                w["rb"] = self.data_epoch_request
            if self.max_participants is not None:
                w["mp"] = self.max_participants
            if self.data_unreachable:
                w["du"] = list(self.data_unreachable)
            if self.target is not None:
                w["tg"] = self.target.to_wire()
            if self.allow_scratch:
                w["ar"] = 1
            if self.voter:
                w["vo"] = self.voter
            object.__setattr__(self, "_wire", w)
        return w

    @classmethod
    def from_wire(cls, d: dict[str, Any] | None) -> "MemberMeta":
        """Raises TypeError/ValueError on malformed input (the update carrying it is dropped).
        Unknown keys are ignored (a newer peer may send more).

        Memoized: every probe piggybacks a few members' metadata, which changes rarely, and the
        values are immutable, so equal wire dicts share one value."""
        if d is None:
            return _EMPTY
        if not isinstance(d, dict):
            raise TypeError(f"member metadata is a {type(d).__name__}, not a map")
        try:
            key: tuple[Any, ...] | None = tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in d.items())
            hit = _decoded.get(key)  # type: ignore[arg-type]
        except TypeError:  # an unhashable value: decode (and fail) without the memo
            key, hit = None, None
        if hit is not None:
            return hit
        k, s, lt, rb, mp, du = d.get("k"), d.get("s"), d.get("lt"), d.get("rb"), d.get("mp"), d.get("du")
        if du is not None and not (isinstance(du, (list, tuple)) and all(isinstance(x, str) for x in du)):
            raise TypeError("data_unreachable is not a list of node ids")
        meta = cls(replica_id=str(d.get("r", "")), data_addrs=split_addrs(d.get("d", "")),
                   kind=None if k is None else _enum(Kind, k), shards=int(d.get("sh", 1)),
                   status=None if s is None else _enum(Status, s), start=float(d.get("t0", 0.0)),
                   step=int(d.get("st", -1)), loop_timeout=None if lt is None else float(lt),
                   data_epoch_request=None if rb is None else int(rb),
                   max_participants=None if mp is None else int(mp),
                   data_unreachable=tuple(du or ())[:64], target=JobTarget.from_wire(d.get("tg")),
                   allow_scratch=bool(d.get("ar", 0)), voter=str(d.get("vo", "")))
        if key is not None:
            if len(_decoded) >= _DECODED_MAX:
                _decoded.clear()
            _decoded[key] = meta
        return meta


@dataclass(frozen=True, slots=True)
class MemberStatus:
    """What other threads may read of one member (``NodeServer.members``): the committed step it
    last told us about and its gossip metadata, copied out of the node's live table."""

    step: int
    meta: MemberMeta


@dataclass(frozen=True)
class NodeSpec:
    """What a node says about itself when it starts: the fields of its first ``MemberMeta``.

    Built once (by ``Runtime``, ``p2pft peer`` or the simulator) and passed down through the
    driver to the ``Node``; defaults here are a witness's. Values are checked and normalized
    once, with an error naming the option."""

    replica_id: str = ""                      # empty: the node's address stands for it
    kind: Kind = Kind.WITNESS
    data_addrs: tuple[str, ...] = ()          # one data-server address per shard (comma-joined accepted)
    shards: int = 1
    status: Status | None = None              # None: ready for a witness, joining for a trainer
    step: int = 0                             # the committed step it starts from
    max_participants: int | None = None       # planned participants; trainers beyond it are spares

    def __post_init__(self) -> None:
        mp = self.max_participants
        if mp is not None and (isinstance(mp, bool) or not isinstance(mp, int) or mp < 1):
            raise ValueError(f"max_participants must be a positive int or None, got {mp!r}")
        object.__setattr__(self, "replica_id", str(self.replica_id))
        object.__setattr__(self, "kind", Kind(self.kind))
        if isinstance(self.data_addrs, str):
            object.__setattr__(self, "data_addrs", split_addrs(self.data_addrs))
        else:
            object.__setattr__(self, "data_addrs", tuple(self.data_addrs))
        object.__setattr__(self, "shards", int(self.shards))
        object.__setattr__(self, "step", int(self.step))
        if self.status is not None:
            object.__setattr__(self, "status", Status(self.status))

    def meta(self, start: float) -> MemberMeta:
        """The first metadata of the incarnation started at wall time `start`."""
        status = self.status
        if status is None:
            status = Status.READY if self.kind is Kind.WITNESS else Status.JOINING
        return MemberMeta(replica_id=self.replica_id, data_addrs=self.data_addrs, kind=self.kind, shards=self.shards,
                          status=status, start=float(start), step=self.step, max_participants=self.max_participants)


_EMPTY = MemberMeta()
_DECODED_MAX = 8192
_decoded: dict[tuple[Any, ...], MemberMeta] = {}
_BY_VALUE: dict[type, dict[Any, Any]] = {Kind: {k.value: k for k in Kind}, Status: {s.value: s for s in Status}}


def _enum(cls: type, value: Any) -> Any:
    """``cls(value)`` without Enum's slow call path; ValueError for an unknown value."""
    try:
        return _BY_VALUE[cls][value]
    except (KeyError, TypeError):
        raise ValueError(f"{value!r} is not a valid {cls.__name__}") from None


__all__ = ["MemberStatus", "Kind", "MemberMeta", "NodeSpec", "Status"]
