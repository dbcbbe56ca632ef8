"""Deterministic simulator: the real sans-IO ``Node`` code on a virtual network and clock.

Everything random comes from one seeded ``random.Random``; time only moves when the event
queue says so. A failing seed therefore replays exactly (``Simulator(seed=...)``), which is
what makes thousands of fault schedules useful. Messages go through a msgpack round trip, as on
the wire, so nothing that could not be sent is ever delivered.

Faults: loss, duplication, reordering (random delay), partitions (also one-way), crash and
restart (a restart is a new node at the same address, as a restarted process is). A node added
with ``durable=True`` has a data directory: a virtual disk that keeps what its ``Ready`` said to
write (``hard_state``, written before its messages leave) across a crash, unless the crash loses
it (``crash(addr, lose_disk=True)``); its restart restores its voter identity from there.
"""
from __future__ import annotations

import heapq
import itertools
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import msgpack

from ..core import codec
from ..core.config import DEFAULT, Profile
from ..core.durable import HardState
from ..core.meta import NodeSpec, Status
from ..core.node import WITNESS_KIND, Node
from ..core.view import View


class InvariantViolation(AssertionError):
    pass


@dataclass(frozen=True, slots=True)
class SimEvent:
    """What a node's ``Ready`` said that checkers and tests watch: who (address, node id), when."""

    addr: str
    node: str
    now: float


@dataclass(frozen=True, slots=True)
class LeaderElected(SimEvent):
    term: int


@dataclass(frozen=True, slots=True)
class ViewCommitted(SimEvent):
    view: View


def view_key(view: View) -> tuple[Any, ...]:
    members = tuple(sorted((m.node, m.role, m.slot) for m in view.members))
    return view.epoch, members, tuple(view.voters)


@dataclass
class InvariantChecker:
    """Safety: one leader per term; one view per epoch, the same everywhere; epochs grow. For
    durable voters, on every write to their (virtual) disk: a voter's term never goes back and
    its vote in a term never changes, and what it knew to be committed never shrinks."""

    leaders: dict[int, str] = field(default_factory=dict)
    views: dict[int, tuple[Any, ...]] = field(default_factory=dict)
    last_epoch: dict[str, int] = field(default_factory=dict)
    max_epoch: int = 0
    votes: dict[tuple[str, int], str] = field(default_factory=dict)    # (voter, term) -> the vote cast
    hard: dict[str, tuple[int, int]] = field(default_factory=dict)     # voter -> (term, committed index) on disk

    def on_hard_state(self, hs: HardState, now: float) -> None:
        term, commit = self.hard.get(hs.voter, (0, 0))
        if hs.term < term:
            raise InvariantViolation(f"t={now:.3f}: voter {hs.voter} wrote term {hs.term} after term {term}")
        if hs.snap_index < commit:
            raise InvariantViolation(f"t={now:.3f}: voter {hs.voter} forgot committed entries "
                                     f"({hs.snap_index} < {commit})")
        self.hard[hs.voter] = (hs.term, hs.snap_index)
        if hs.vote is not None:
            cast = self.votes.setdefault((hs.voter, hs.term), hs.vote)
            if cast != hs.vote:
                raise InvariantViolation(f"t={now:.3f}: voter {hs.voter} voted for {cast} and {hs.vote} "
                                         f"in term {hs.term}")
        if hs.snap_view is not None:
            seen = self.views.get(hs.snap_index)
            if seen is not None and seen != view_key(hs.snap_view):
                raise InvariantViolation(f"t={now:.3f}: voter {hs.voter} holds another view as committed epoch "
                                         f"{hs.snap_index}:\n {seen}\n {view_key(hs.snap_view)}")

    def on_event(self, ev: SimEvent) -> None:
        node, now = ev.node, ev.now
        if isinstance(ev, LeaderElected):
            other = self.leaders.setdefault(ev.term, node)
            if other != node:
                raise InvariantViolation(f"t={now:.3f}: two leaders in term {ev.term}: {other} and {node}")
        elif isinstance(ev, ViewCommitted):
            key = view_key(ev.view)
            epoch = key[0]
            prev = self.last_epoch.get(node, 0)
            if epoch <= prev:
                raise InvariantViolation(f"t={now:.3f}: {node} epoch went from {prev} to {epoch}")
            self.last_epoch[node] = epoch
            seen = self.views.setdefault(epoch, key)
            if seen != key:
                raise InvariantViolation(f"t={now:.3f}: two views for epoch {epoch}:\n {seen}\n {key}")
            self.max_epoch = max(self.max_epoch, epoch)


class Simulator:
    def __init__(self, seed: int, profile: Profile = DEFAULT, *, loss: float = 0.0, dup: float = 0.0,
                 delay: tuple[float, float] = (0.0002, 0.002), checker: InvariantChecker | None = None,
                 on_event: Callable[[SimEvent], None] | None = None) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        self.profile = profile
        self.loss, self.dup, self.delay = loss, dup, delay
        self.now = 0.0
        self.nodes: dict[str, Node] = {}          # addr -> live node
        self.crashed: dict[str, dict[str, Any]] = {}  # addr -> how to restart it
        self.blocked: set[tuple[str, str]] = set()   # (from, to) pairs that drop everything
        self.checker = checker or InvariantChecker()
        self.on_event = on_event
        self.sent: Counter[str] = Counter()       # messages sent per addr
        self.delivered = 0
        self._q: list[tuple[float, int, str, Any]] = []
        self._seq = itertools.count()
        self._timer: dict[str, float] = {}
        self._spec: dict[str, dict[str, Any]] = {}
        self.disk: dict[str, HardState] = {}      # addr -> a durable node's data directory (survives crashes)
        self.disk_writes: Counter[str] = Counter()

    # ------------------------------------------------------------------ cluster
    def add_node(self, addr: str, *, seeds: list[str] | None = None, kind: str = WITNESS_KIND,
                 replica_id: str | None = None, shards: int = 1, max_participants: int | None = None,
                 durable: bool = False) -> Node:
        spec = {"seeds": list(seeds or []), "kind": kind, "replica_id": replica_id or addr, "shards": shards,
                "max_participants": max_participants, "durable": durable}
        self._spec[addr] = spec
        return self._start(addr, spec)

    def _start(self, addr: str, spec: dict[str, Any]) -> Node:
        node = Node(NodeSpec(replica_id=spec["replica_id"], kind=spec["kind"], data_addrs=(addr,),
                             shards=spec["shards"], status=Status.FRESH if spec["kind"] != WITNESS_KIND else None,
                             max_participants=spec.get("max_participants")),
                    addr=addr, seeds=spec["seeds"], profile=self.profile,
                    rng=random.Random(self.rng.getrandbits(64)), now=self.now,
                    durable=bool(spec.get("durable")), restore=self.disk.get(addr) if spec.get("durable") else None)
        self.nodes[addr] = node
        self.crashed.pop(addr, None)
        self._after(addr, node)
        return node

    def crash(self, addr: str, lose_disk: bool = False) -> None:
        """Kill the node at `addr` (no goodbye). `lose_disk`: its data directory is gone too, so
        it restarts as a new voter identity."""
        if lose_disk:
            self.disk.pop(addr, None)
        node = self.nodes.pop(addr, None)
        if node is not None:
            self.crashed[addr] = self._spec[addr]
            self._timer.pop(addr, None)

    def restart(self, addr: str, seeds: list[str] | None = None) -> Node:
        spec = dict(self._spec[addr])
        if seeds is not None:
            spec["seeds"] = seeds
        elif not spec["seeds"]:
            spec["seeds"] = [a for a in self.nodes if a != addr][:3]
        self._spec[addr] = spec
        return self._start(addr, spec)

    def partition(self, *groups: list[str]) -> None:
        """Block traffic between different groups (both ways)."""
        for i, a in enumerate(groups):
            for b in groups[i + 1:]:
                for x in a:
                    for y in b:
                        self.blocked.add((x, y))
                        self.blocked.add((y, x))

    def block(self, src: str, dst: str) -> None:
        self.blocked.add((src, dst))

    def heal(self) -> None:
        self.blocked.clear()

    # ------------------------------------------------------------------ running
    def at(self, t: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._q, (t, next(self._seq), "call", fn))

    def call(self, addr: str, fn: Callable[[Node, float], None]) -> None:
        """Run `fn(node, now)` on a live node (an API call from its trainer) and deliver what it sends."""
        node = self.nodes.get(addr)
        if node is not None:
            fn(node, self.now)
            self._after(addr, node)

    def run_until(self, t_end: float, stop: Callable[[], bool] | None = None) -> None:
        while self._q and self._q[0][0] <= t_end:
            t, _, kind, payload = heapq.heappop(self._q)
            self.now = max(self.now, t)
            if kind == "msg":
                addr, data = payload
                node = self.nodes.get(addr)
                if node is None:
                    continue
                self.delivered += 1
                try:
                    node.handle(codec.from_wire(msgpack.unpackb(data, raw=False)), self.now)
                except (KeyError, TypeError, ValueError):
                    node.stats["bad_message"] += 1
                self._after(addr, node)
            elif kind == "timer":
                addr, when = payload
                node = self.nodes.get(addr)
                if node is None or self._timer.get(addr) != when:
                    continue
                node.tick(self.now)
                self._after(addr, node)
            else:
                payload()
            if stop is not None and stop():
                return
        self.now = max(self.now, t_end)

    def _after(self, addr: str, node: Node) -> None:
        """Take the node's Ready: messages onto the virtual network (as msgpack bytes, through
        the codec as on the wire), leader terms and views to the checker."""
        ready = node.ready()
        if ready.hard_state is not None:   # on "disk" before any message leaves (etcd's rule)
            self.disk[addr] = ready.hard_state
            self.disk_writes[addr] += 1
            self.checker.on_hard_state(ready.hard_state, self.now)
        last: Any = None
        data = b""
        for dst, msg in ready.messages:
            self.sent[addr] += 1
            if (addr, dst) in self.blocked or self.rng.random() < self.loss:
                continue
            if msg is not last:   # one message value sent to many (a view to every member): encode once
                last, data = msg, msgpack.packb(codec.to_wire(msg), use_bin_type=True)
            copies = 2 if self.rng.random() < self.dup else 1
            for _ in range(copies):
                t = self.now + self.rng.uniform(*self.delay)
                heapq.heappush(self._q, (t, next(self._seq), "msg", (dst, data)))
        events: list[SimEvent] = ([LeaderElected(addr, node.id, self.now, term) for term in ready.leader_terms]
                                  + [ViewCommitted(addr, node.id, self.now, v) for v in ready.views]
                                  if ready.leader_terms or ready.views else [])
        for ev in events:
            self.checker.on_event(ev)
            if self.on_event is not None:
                self.on_event(ev)
        when = max(node.next_deadline(), self.now + 1e-4)
        if self._timer.get(addr) != when:
            self._timer[addr] = when
            heapq.heappush(self._q, (when, next(self._seq), "timer", (addr, when)))

    # ------------------------------------------------------------------ observations
    def live_ids(self) -> set[str]:
        return {n.id for n in self.nodes.values()}

    def converged(self) -> bool:
        """Every live node holds the same committed view, whose members are exactly the live nodes."""
        live = self.live_ids()
        epochs = set()
        for n in self.nodes.values():
            if n.view is None or {m.node for m in n.view.members} != live:
                return False
            epochs.add(n.view.epoch)
        return len(epochs) == 1

    def leader(self) -> Node | None:
        best = None
        for n in self.nodes.values():
            if n.is_leader() and (best is None or n.raft.term > best.raft.term):
                best = n
        return best

    def replay_hint(self) -> str:
        return f"replay with: Simulator(seed={self.seed}) (see tests/sim/test_safety.py::run_schedule)"
