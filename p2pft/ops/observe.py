"""What one node observes about the cluster, for operators: events, message counts, seeds.

An ``Observer`` rides along with a ``NodeServer`` (driver hooks: one call per frame sent or
received, one per failed connection, and the view callback). It keeps

- a bounded log of cluster events derived from successive committed views (members joining or
  removed, role changes such as a joiner's promotion, leader changes), which ``p2pft top``
  shows through the ``admin.top`` request;
- control-plane message counts by type, read by the metrics collector at scrape time;
- a watch on the seeds: a seed that does not resolve, or that has not answered while this node
  still has no cluster, is a WARNING naming it (a node given only bad seeds would otherwise wait
  silently).

It imports nothing outside the standard library, so a witness peer stays light.
"""
from __future__ import annotations

import logging
import socket
import time
from collections import Counter, deque
from dataclasses import asdict, dataclass
from typing import Any, Callable, Protocol

from ..core.view import Role, View


class NodeServer(Protocol):
    """What the observer reads of the driver's ``NodeServer`` (a protocol: no import back)."""

    seeds: list[str]
    node: Any
    counters: Any
    on_view: list[Callable[[View], None]]

    def members_report(self) -> dict[str, Any]: ...

log = logging.getLogger("p2pft.seeds")

EVENTS_KEEP = 256            # cluster events kept for `p2pft top` (oldest dropped)
TOP_EVENTS = 40              # events sent in one admin.top answer
SEED_GRACE = 5.0             # s without a cluster before a silent seed is worth a warning
SEED_WARN_EVERY = 30.0       # s between two warnings about the same seed

# Control-plane message types (gossip, Raft, views). Received frames of any other type are
# counted as "other", so a hostile sender cannot grow the counters without bound.
MESSAGE_TYPES = frozenset({"g.ping", "g.ack", "g.nack", "g.preq", "g.upd", "g.who", "g.pp",
                           "r.pv", "r.pvr", "r.rv", "r.rvr", "r.ae", "r.aer", "r.snap",
                           "v.get", "v.view", "v.delta"})
FAMILIES = {"g": "gossip", "r": "raft", "v": "view"}


def family(mtype: str) -> str:
    """'gossip', 'raft', 'view' or 'other' for a message type."""
    return FAMILIES.get(mtype[:1], "other") if mtype in MESSAGE_TYPES else "other"


@dataclass(frozen=True)
class ClusterEvent:
    """One thing an operator wants to see scroll by."""

    t: float                 # wall time on the observing node
    kind: str                # joined, removed, role, leader, view
    text: str

    def to_wire(self) -> dict[str, Any]:
        return asdict(self)


class SeedWatch:
    """Warns about seeds that do not resolve or do not answer while there is no cluster."""

    def __init__(self, seeds: list[str]) -> None:
        self.seeds = frozenset(seeds)
        self.started = time.monotonic()
        self._last_error: dict[str, str] = {}
        self._next_warn: dict[str, float] = {}

    def connect_failed(self, addr: str, exc: BaseException) -> None:
        """A connection to `addr` failed; a seed whose name does not resolve is reported at once."""
        if addr not in self.seeds:
            return
        why = _describe_error(exc)
        self._last_error[addr] = why
        if isinstance(exc, socket.gaierror):
            self._warn(addr, "seed %s does not resolve (%s)", addr, why)

    def sending(self, addr: str, known: bool) -> None:
        """About to send to seed `addr` while in no cluster: one still unknown (no member at that
        address) after SEED_GRACE is named."""
        if known or addr not in self.seeds:
            return
        waited = time.monotonic() - self.started
        if waited >= SEED_GRACE:
            self._warn(addr, "seed %s has not answered in %.0f s and this node is in no cluster yet (%s)",
                       addr, waited, self._last_error.get(addr, "no answer"))

    def _warn(self, addr: str, fmt: str, *args: Any) -> None:
        now = time.monotonic()
        if now < self._next_warn.get(addr, 0.0):
            return
        self._next_warn[addr] = now + SEED_WARN_EVERY
        log.warning(fmt, *args)


def _describe_error(exc: BaseException) -> str:
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, TimeoutError) or type(exc).__name__ == "TimeoutError":
        return "connection timed out"
    return str(getattr(exc, "strerror", None) or exc) or type(exc).__name__


class Observer:
    """Per-node record of cluster events and message counts (driver loop thread only, except
    the counters, which a metrics scrape copies)."""

    def __init__(self, server: NodeServer) -> None:
        self.server = server
        self.sent: Counter[str] = Counter()
        self.received: Counter[str] = Counter()
        self.events: deque[ClusterEvent] = deque(maxlen=EVENTS_KEEP)
        self.leader_changes = 0
        self.views_seen = 0
        self.seed_watch = SeedWatch(server.seeds)
        self.joiner_since: dict[str, float] = {}     # node -> wall time it became a joiner
        self._leader: str | None = None
        self._prev: View | None = None
        server.on_view.append(self.on_view)

    # ------------------------------------------------------------------ driver hooks
    def note_sent(self, addr: str, mtype: str) -> None:
        self.sent[mtype] += 1
        if addr in self.seed_watch.seeds:
            node = self.server.node
            if node is not None and node.view is None:   # in a cluster: seeds no longer matter
                self.seed_watch.sending(addr, node.gossip.node_at(addr) is not None)

    def note_received(self, mtype: str) -> None:
        self.received[mtype if mtype in MESSAGE_TYPES else "other"] += 1

    def connect_failed(self, addr: str, exc: BaseException) -> None:
        self.seed_watch.connect_failed(addr, exc)

    # ------------------------------------------------------------------ views
    def on_view(self, view: View) -> None:
        now = time.time()
        self.views_seen += 1
        prev = self._prev
        self._prev = view
        e = view.epoch
        if prev is None:
            self._add(now, "view", f"e{e}: first view here, {len(view.members)} member(s)")
        else:
            for m in view.members:
                was = prev.member(m.node)
                if was is None:
                    self._add(now, "joined", f"e{e}: {m.replica_id} joined as {m.role}")
                elif was.role is not m.role:
                    what = " (caught up)" if was.role is Role.JOINER and m.role is Role.PARTICIPANT else ""
                    self._add(now, "role", f"e{e}: {m.replica_id} {was.role} -> {m.role}{what}")
            for m in prev.members:
                if view.member(m.node) is None:
                    self._add(now, "removed", f"e{e}: {m.replica_id} removed")
        for m in view.joiners:
            self.joiner_since.setdefault(m.node, now)
        for n in [n for n in self.joiner_since if view.role_of(n) is not Role.JOINER]:
            del self.joiner_since[n]
        self.check_leader()

    def check_leader(self) -> None:
        node = self.server.node
        leader = node.leader if node is not None else None
        if leader and leader != self._leader:
            if self._leader is not None:
                self.leader_changes += 1
                self._add(time.time(), "leader", f"leader {_short(self._leader)} -> {_short(leader)}")
            self._leader = leader

    def _add(self, t: float, kind: str, text: str) -> None:
        self.events.append(ClusterEvent(t, kind, text))

    # ------------------------------------------------------------------ admin.top
    def top_report(self) -> dict[str, Any]:
        """The `admin.top` answer: the members report plus what `p2pft top` shows beside it."""
        self.check_leader()
        server, node = self.server, self.server.node
        out = server.members_report()
        out["now"] = time.time()
        out["leader_changes"] = self.leader_changes
        out["term"] = node.raft.term if node is not None else 0
        out["joiner_since"] = dict(self.joiner_since)
        out["events"] = [e.to_wire() for e in list(self.events)[-TOP_EVENTS:]]
        out["rejected"] = rejected_counts(server.counters)
        out["unreachable"] = data_unreachable_report(node) if node is not None else []
        return out


def data_unreachable_report(node: Any) -> list[dict[str, Any]]:
    """Members that trainers alive on gossip name as unreachable on the data plane (they are
    left out of the view meanwhile: see p2pft/core/reach.py), each with who names it."""
    named: dict[str, list[str]] = {}
    for g in node.gossip.members.values():
        if g.state == "alive":
            for n in g.meta.data_unreachable:
                named.setdefault(n, []).append(g.meta.replica_id or g.node)
    out = []
    for n, by in sorted(named.items()):
        g = node.gossip.members.get(n)
        out.append({"node": n, "replica_id": (g.meta.replica_id if g else "") or _short(n),
                    "data_addr": ",".join(g.meta.data_addrs) if g else "", "named_by": sorted(by)})
    return out


REJECT_KEYS = ("bad_message", "inbound_evicted", "idle_closed", "slow_reader_closed")


def rejected_counts(counters: Counter[str] | dict[str, int]) -> dict[str, int]:
    """Frames and connections this node refused, by reason (bad_frame_<kind> -> <kind>)."""
    out: dict[str, int] = {}
    for key, value in dict(counters).items():
        if key.startswith("bad_frame_"):
            out[key[len("bad_frame_"):]] = int(value)
        elif key in REJECT_KEYS:
            out[key] = int(value)
    return out


def _short(node: str) -> str:
    """'r0.1a2b3c4d' -> 'r0' (the replica id; incarnations are noise on a screen)."""
    return node.rsplit(".", 1)[0] if "." in node else node


__all__ = ["ClusterEvent", "FAMILIES", "MESSAGE_TYPES", "Observer", "SeedWatch", "family", "rejected_counts"]
