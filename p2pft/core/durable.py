"""``HardState``: what a durable Raft voter must find again after its process restarts.

Raft is safe only if a voter never votes twice in a term nor forgets an entry it acknowledged;
that is what its stable storage is for. A node started with a data directory keeps its voter
identity there (the name the views list it under), its current term, its vote in that term and
its log, so that a replica killed with a majority of the voters and restarted with the same data
directory returns as the same voter and the cluster heals (docs/control-plane.md, "Durable
voters"). The core only says *what* to keep (``Ready.hard_state``); the driver writes it (atomic
replace, fsync) before it sends anything, and the simulator keeps it on a virtual disk.

The log is kept compacted at the commit index: everything up to it is committed, so the
committed view stands for it as a snapshot, and only the entries after it (at most a few: the
leader proposes one view at a time) are kept as entries.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .view import View

FORMAT = 1   # the on-disk format's version: a newer one is refused rather than misread


@dataclass(frozen=True, slots=True)
class HardState:
    """A voter's durable Raft state. ``voter`` is its identity in ``View.voters``; ``replica_id``
    is checked on load (a data directory is one replica's). ``snap_*`` is the last committed
    entry, ``entries`` the ``(term, view)`` entries after it, in index order."""

    voter: str
    replica_id: str
    term: int = 0
    vote: str | None = None
    snap_index: int = 0
    snap_term: int = 0
    snap_view: View | None = None
    entries: tuple[tuple[int, View], ...] = ()

    @property
    def has_log(self) -> bool:
        """It was part of a cluster (a node with no entry ever has nothing to come back to)."""
        return self.snap_view is not None or bool(self.entries)

    def to_wire(self) -> dict[str, Any]:
        return {"format": FORMAT, "voter": self.voter, "replica_id": self.replica_id, "term": self.term,
                "vote": self.vote, "snap_index": self.snap_index, "snap_term": self.snap_term,
                "snap_view": self.snap_view.to_wire() if self.snap_view is not None else None,
                "entries": [[t, v.to_wire()] for t, v in self.entries]}

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> "HardState":
        """Raises ValueError (with the reason) on anything that is not a state this code wrote."""
        try:
            if not isinstance(d, dict):
                raise TypeError("not a map")
            if d.get("format") != FORMAT:
                raise ValueError(f"format {d.get('format')!r}, expected {FORMAT}")
            sv = d.get("snap_view")
            vote = d.get("vote")
            hs = cls(voter=str(d["voter"]), replica_id=str(d["replica_id"]), term=int(d["term"]),
                     vote=None if vote is None else str(vote), snap_index=int(d["snap_index"]),
                     snap_term=int(d["snap_term"]), snap_view=None if sv is None else View.from_wire(sv),
                     entries=tuple((int(t), View.from_wire(v)) for t, v in d["entries"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a voter state: {exc}") from None
        if not hs.voter or hs.term < 0 or hs.snap_index < 0:
            raise ValueError("not a voter state: empty voter id or a negative term/index")
        for i, (_, v) in enumerate(hs.entries):
            if v.epoch != hs.snap_index + 1 + i:
                raise ValueError(f"not a voter state: entry {i} has epoch {v.epoch}, expected {hs.snap_index + 1 + i}")
        return hs


__all__ = ["FORMAT", "HardState"]
