"""Sans-IO SWIM membership with the Lifeguard refinements.

No sockets, no clock, no global random: callers feed messages and the current time, and drain
``outbox`` (``(addr, message)`` pairs) and ``events`` (``(kind, node)`` pairs). The same object
runs under the asyncio driver and under the simulator.

What is implemented (memberlist is the reference for the semantics):
- randomised round-robin direct probes; indirect probes through ``k`` members when the direct
  ack is late; nacks from indirect probers (Lifeguard) so a slow *prober* blames itself;
- a local-health multiplier ("awareness") that stretches our probe timeouts when we are the
  unhealthy one;
- suspicion with incarnation refutation; suspicion timeouts that scale with log10(N) and shrink
  from max to min as independent confirmations arrive;
- updates piggybacked on every probe message with a bounded retransmit count;
- push-pull full-state sync on join (through the seeds) and periodically;
- direct evidence from other layers (``report_failure``): a data-plane reset starts suspicion at
  once, and a refused connection on loopback/LAN declares the node dead at once.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

from .config import Profile

ALIVE, SUSPECT, DEAD, LEFT = "alive", "suspect", "dead", "left"
_RANK = {ALIVE: 0, SUSPECT: 1, DEAD: 2, LEFT: 3}


@dataclass
class Member:
    node: str
    addr: str
    inc: int
    state: str
    meta: dict[str, Any]
    since: float                      # time of the last state change
    epoch: int = 0                    # last committed epoch this member told us about
    step: int = 0                     # last committed step this member told us about

    def row(self) -> list[Any]:
        return [self.node, self.addr, self.inc, self.state, self.meta]


@dataclass
class _Suspicion:
    inc: int
    start: float
    min_t: float
    max_t: float
    confirmers: set[str] = field(default_factory=set)

    def deadline(self, k: int) -> float:
        c = len(self.confirmers)
        if k <= 0 or c <= 0:
            return self.start + self.max_t
        frac = math.log(c + 1) / math.log(k + 1)
        return self.start + max(self.min_t, self.max_t - (self.max_t - self.min_t) * frac)


@dataclass
class _Probe:
    target: str
    seq: int
    direct_deadline: float
    end: float
    indirect: bool = False
    acked: bool = False
    nacks_expected: int = 0
    nacks: int = 0


class Gossip:
    """Membership state machine of one node."""

    def __init__(self, node: str, addr: str, meta: dict[str, Any], profile: Profile,
                 rng: random.Random, now: float) -> None:
        self.me = node
        self.addr = addr
        self.p = profile
        self.rng = rng
        self.inc = 0
        self.leaving = False
        self.members: dict[str, Member] = {node: Member(node, addr, 0, ALIVE, dict(meta), now)}
        self.outbox: list[tuple[str, dict[str, Any]]] = []
        self.events: list[tuple[str, str]] = []
        self.local_epoch = 0
        self.local_step = 0
        self.awareness = 0
        self.seeds: list[str] = []
        self._bcast: dict[str, list[Any]] = {}          # node -> [update, transmits]
        self._probe_order: list[str] = []
        self._probe: _Probe | None = None
        self._seq = 0
        self._relay: dict[int, tuple[str, int, float]] = {}  # our seq -> (requester addr, its seq, deadline)
        self._susp: dict[str, _Suspicion] = {}
        self._next_probe = now + rng.uniform(0, profile.probe_interval)
        self._next_pp = now + self._pp_interval()
        self._next_join = float("inf")
        self._queue_update({"k": ALIVE, "n": node, "i": 0, "a": addr, "m": dict(meta)})

    # ------------------------------------------------------------------ public API
    @property
    def meta(self) -> dict[str, Any]:
        return self.members[self.me].meta

    def alive_count(self) -> int:
        return sum(1 for m in self.members.values() if m.state in (ALIVE, SUSPECT))

    def live_members(self) -> list[Member]:
        return [m for m in self.members.values() if m.state in (ALIVE, SUSPECT)]

    def join(self, seeds: list[str], now: float) -> None:
        """Push-pull with every seed; repeated until somebody answers."""
        self.seeds = [s for s in seeds if s != self.addr]
        if self.seeds:
            self._send_join(now)

    def set_meta(self, now: float, **fields: Any) -> None:
        """Change our metadata: a new incarnation so the update wins everywhere."""
        me = self.members[self.me]
        me.meta = {**me.meta, **fields}
        self.inc += 1
        me.inc = self.inc
        self._queue_update({"k": ALIVE, "n": self.me, "i": self.inc, "a": self.addr, "m": me.meta})

    def leave(self, now: float) -> None:
        """Graceful leave: a 'left' update that outranks our alive; peers stop probing us."""
        self.leaving = True
        self.inc += 1
        me = self.members[self.me]
        me.inc, me.state = self.inc, LEFT
        upd = {"k": LEFT, "n": self.me, "i": self.inc}
        self._queue_update(upd)
        # Tell a few members directly so the leave does not wait for our next probe.
        others = [m for m in self.live_members() if m.node != self.me]
        for m in self.rng.sample(others, min(len(others), max(3, self.p.indirect_probes))):
            self._send(m.addr, {"t": "g.upd", "pb": [upd]})

    def report_failure(self, node: str, now: float, certain: bool = False) -> None:
        """Evidence from outside the probe cycle (data-plane error, refused connection).

        ``certain`` (the node's port refuses connections, or another node answers there) declares
        it dead at once; otherwise we suspect it now instead of waiting for our next probe.
        """
        m = self.members.get(node)
        if m is None or node == self.me or m.state in (DEAD, LEFT):
            return
        if certain:
            self._apply_dead({"k": DEAD, "n": node, "i": m.inc, "f": self.me}, now)
        else:
            self._apply_suspect({"k": SUSPECT, "n": node, "i": m.inc, "f": self.me}, now)

    def addr_of(self, node: str) -> str | None:
        m = self.members.get(node)
        return m.addr if m else None

    def node_at(self, addr: str) -> str | None:
        """The newest live member known at an address."""
        best = None
        for m in self.members.values():
            if m.addr == addr and m.state in (ALIVE, SUSPECT):
                best = m.node
        return best

    # ------------------------------------------------------------------ time
    def next_deadline(self) -> float:
        t = min(self._next_probe, self._next_pp, self._next_join)
        if self._probe and not self._probe.acked:
            t = min(t, self._probe.end if self._probe.indirect else self._probe.direct_deadline)
        for _, _, dl in self._relay.values():
            t = min(t, dl)
        for n, s in self._susp.items():
            t = min(t, s.deadline(self.p.suspicion_confirmations))
        return t

    def tick(self, now: float) -> None:
        p = self._probe
        if p and not p.acked and not p.indirect and now >= p.direct_deadline:
            self._go_indirect(p, now)
        if p and now >= p.end:
            self._finish_probe(p, now)
        if now >= self._next_probe:
            self._start_probe(now)
        for seq, (req_addr, req_seq, dl) in list(self._relay.items()):
            if now >= dl:
                del self._relay[seq]
                self._send(req_addr, {"t": "g.nack", "seq": req_seq})
        k = self.p.suspicion_confirmations
        for node, s in list(self._susp.items()):
            if now >= s.deadline(k):
                m = self.members.get(node)
                del self._susp[node]
                if m and m.state == SUSPECT and m.inc == s.inc:
                    self._apply_dead({"k": DEAD, "n": node, "i": s.inc, "f": self.me}, now)
        if now >= self._next_pp:
            self._next_pp = now + self._pp_interval()
            peers = [m for m in self.live_members() if m.node != self.me]
            if peers:
                self._send_pp(self.rng.choice(peers).addr, join=False)
        if now >= self._next_join:
            if len(self.members) > 1 and any(m.node != self.me for m in self.live_members()):
                self._next_join = float("inf")
            else:
                self._send_join(now)
        for node, m in list(self.members.items()):
            if m.state in (DEAD, LEFT) and now - m.since > self.p.dead_keep:
                del self.members[node]

    # ------------------------------------------------------------------ messages
    def handle(self, msg: dict[str, Any], now: float) -> None:
        t = msg.get("t")
        src = msg.get("src")
        for upd in msg.get("pb", ()):
            self._apply(upd, now)
        if isinstance(src, str) and src in self.members:
            m = self.members[src]
            if "e" in msg:
                m.epoch = max(m.epoch, int(msg["e"]))
                if m.epoch > self.local_epoch:
                    self.events.append(("epoch", src))
            if "st" in msg:
                m.step = int(msg["st"])
        if t == "g.ping":
            if msg.get("to") != self.me:
                return  # addressed to an earlier process at this address: stay silent
            self._send(msg["from"], {"t": "g.ack", "seq": msg["seq"]}, info=True)
        elif t == "g.ack":
            seq = msg.get("seq")
            p = self._probe
            if p and p.seq == seq and not p.acked:
                p.acked = True
                self.awareness = max(0, self.awareness - 1)
            relay = self._relay.pop(seq, None)
            if relay:
                self._send(relay[0], {"t": "g.ack", "seq": relay[1]})
        elif t == "g.nack":
            p = self._probe
            if p and p.seq == msg.get("seq"):
                p.nacks += 1
        elif t == "g.preq":
            self._seq += 1
            self._relay[self._seq] = (msg["from"], msg["seq"], now + self.p.probe_timeout * 2)
            self._send(msg["ta"], {"t": "g.ping", "seq": self._seq, "to": msg["tn"]})
        elif t == "g.pp":
            for row in msg.get("state", ()):
                self._merge_row(row, now)
            if msg.get("join") or not msg.get("reply"):
                self._send_pp(msg["from"], join=False, reply=True)
            if msg.get("join"):
                self.events.append(("join_request", src or ""))
        elif t == "g.upd":
            pass  # updates already applied from "pb"

    # ------------------------------------------------------------------ probing
    def _pick_target(self) -> str | None:
        for _ in range(2):
            while self._probe_order:
                node = self._probe_order.pop()
                m = self.members.get(node)
                if m and node != self.me and m.state in (ALIVE, SUSPECT):
                    return node
            self._probe_order = [m.node for m in self.live_members() if m.node != self.me]
            self.rng.shuffle(self._probe_order)
        return None

    def _start_probe(self, now: float) -> None:
        scale = self.awareness + 1
        self._next_probe = now + self.p.probe_interval * scale
        target = self._pick_target()
        if target is None:
            self._probe = None
            return
        self._seq += 1
        self._probe = _Probe(target, self._seq, now + self.p.probe_timeout * scale,
                             now + self.p.probe_interval * scale)
        self._send(self.members[target].addr, {"t": "g.ping", "seq": self._seq, "to": target}, info=True)

    def _go_indirect(self, p: _Probe, now: float) -> None:
        p.indirect = True
        target = self.members.get(p.target)
        if target is None:
            return
        helpers = [m for m in self.live_members() if m.node not in (self.me, p.target) and m.state == ALIVE]
        chosen = self.rng.sample(helpers, min(self.p.indirect_probes, len(helpers)))
        p.nacks_expected = len(chosen)
        for h in chosen:
            self._send(h.addr, {"t": "g.preq", "seq": p.seq, "tn": p.target, "ta": target.addr})

    def _finish_probe(self, p: _Probe, now: float) -> None:
        self._probe = None
        if p.acked:
            return
        # Lifeguard: missing nacks mean *we* may be the slow one; raise our own awareness.
        if p.nacks < p.nacks_expected or p.nacks_expected == 0:
            self.awareness = min(self.p.awareness_max, self.awareness + 1)
        m = self.members.get(p.target)
        if m and m.state in (ALIVE, SUSPECT):
            self._apply_suspect({"k": SUSPECT, "n": p.target, "i": m.inc, "f": self.me}, now)

    # ------------------------------------------------------------------ updates
    def _apply(self, upd: dict[str, Any], now: float) -> None:
        try:
            kind = upd["k"]
            if kind == ALIVE:
                self._apply_alive(upd, now)
            elif kind == SUSPECT:
                self._apply_suspect(upd, now)
            elif kind == DEAD:
                self._apply_dead(upd, now)
            elif kind == LEFT:
                self._apply_left(upd, now)
        except (KeyError, TypeError, ValueError):
            return  # a malformed update from a buggy peer is dropped, never fatal

    def _refute(self, inc: int) -> None:
        if self.leaving:
            return
        self.inc = max(self.inc, int(inc)) + 1
        me = self.members[self.me]
        me.inc = self.inc
        self._queue_update({"k": ALIVE, "n": self.me, "i": self.inc, "a": self.addr, "m": me.meta})

    def _apply_alive(self, u: dict[str, Any], now: float) -> None:
        node, inc = u["n"], int(u["i"])
        if node == self.me:
            if inc > self.inc or (inc == self.inc and u.get("m") != self.meta):
                self._refute(inc)
            return
        m = self.members.get(node)
        if m is None:
            self.members[node] = Member(node, str(u["a"]), inc, ALIVE, dict(u.get("m") or {}), now)
            self._probe_order.insert(self.rng.randrange(len(self._probe_order) + 1), node)
            self.events.append(("join", node))
            self._queue_update(u)
            return
        if inc <= m.inc:
            return
        was = m.state
        m.inc, m.addr = inc, str(u["a"])
        meta = dict(u.get("m") or {})
        changed = meta != m.meta
        m.meta = meta
        self._susp.pop(node, None)
        if was != ALIVE:
            m.state, m.since = ALIVE, now
            self.events.append(("alive", node))
        elif changed:
            self.events.append(("update", node))
        self._queue_update(u)

    def _apply_suspect(self, u: dict[str, Any], now: float) -> None:
        node, inc, frm = u["n"], int(u["i"]), str(u.get("f", ""))
        if node == self.me:
            if inc >= self.inc:
                self._refute(inc)
            return
        m = self.members.get(node)
        if m is None or inc < m.inc or m.state in (DEAD, LEFT):
            return
        if m.state == SUSPECT and inc == m.inc:
            s = self._susp.get(node)
            if s and frm and frm != self.me and frm not in s.confirmers:
                s.confirmers.add(frm)
                self._queue_update(u)
            return
        m.inc, m.state, m.since = inc, SUSPECT, now
        n = max(2, self.alive_count())
        min_t = max(self.p.suspicion_min, self.p.suspicion_mult * math.log10(n) * self.p.probe_interval)
        s = _Suspicion(inc, now, min_t, min_t * self.p.suspicion_max_mult)
        if frm and frm != self.me:
            s.confirmers.add(frm)
        self._susp[node] = s
        self.events.append(("suspect", node))
        self._queue_update({"k": SUSPECT, "n": node, "i": inc, "f": frm or self.me})

    def _apply_dead(self, u: dict[str, Any], now: float) -> None:
        node, inc = u["n"], int(u["i"])
        if node == self.me:
            if not self.leaving:
                self._refute(inc)
            return
        m = self.members.get(node)
        if m is None or inc < m.inc or m.state in (DEAD, LEFT):
            return
        m.inc, m.state, m.since = inc, DEAD, now
        self._susp.pop(node, None)
        self.events.append(("dead", node))
        self._queue_update(u)

    def _apply_left(self, u: dict[str, Any], now: float) -> None:
        node, inc = u["n"], int(u["i"])
        if node == self.me:
            return
        m = self.members.get(node)
        if m is None or inc < m.inc or m.state == LEFT:
            return
        m.inc, m.state, m.since = inc, LEFT, now
        self._susp.pop(node, None)
        self.events.append(("left", node))
        self._queue_update(u)

    def _merge_row(self, row: list[Any], now: float) -> None:
        try:
            node, addr, inc, state, meta = row
        except (TypeError, ValueError):
            return
        if state == ALIVE:
            self._apply({"k": ALIVE, "n": node, "i": inc, "a": addr, "m": meta}, now)
        elif state == LEFT:
            self._apply({"k": LEFT, "n": node, "i": inc}, now)
        elif node in self.members or state == SUSPECT:
            # A remote 'dead' only makes us suspect (memberlist does the same): our own timer decides.
            if node not in self.members and state == SUSPECT:
                self._apply({"k": ALIVE, "n": node, "i": inc, "a": addr, "m": meta}, now)
            self._apply({"k": SUSPECT, "n": node, "i": inc, "f": ""}, now)

    # ------------------------------------------------------------------ sending
    def _retransmit_limit(self) -> int:
        return self.p.retransmit_mult * max(1, math.ceil(math.log10(self.alive_count() + 1)))

    def _queue_update(self, upd: dict[str, Any]) -> None:
        self._bcast[upd["n"]] = [upd, 0]

    def _piggyback(self) -> list[dict[str, Any]]:
        if not self._bcast:
            return []
        limit = self._retransmit_limit()
        items = sorted(self._bcast.items(), key=lambda kv: kv[1][1])[: self.p.max_piggyback]
        out = []
        for node, entry in items:
            entry[1] += 1
            out.append(entry[0])
            if entry[1] >= limit:
                del self._bcast[node]
        return out

    def _send(self, addr: str, msg: dict[str, Any], info: bool = False) -> None:
        msg["from"] = self.addr
        msg["src"] = self.me
        pb = self._piggyback()
        if pb:
            msg["pb"] = pb
        if info:
            msg["e"] = self.local_epoch
            msg["st"] = self.local_step
        self.outbox.append((addr, msg))

    def _state_rows(self) -> list[list[Any]]:
        return [m.row() for m in self.members.values()]

    def _send_pp(self, addr: str, join: bool, reply: bool = False) -> None:
        self._send(addr, {"t": "g.pp", "join": join, "reply": reply, "state": self._state_rows()}, info=True)

    def _send_join(self, now: float) -> None:
        for s in self.seeds:
            self._send_pp(s, join=True)
        self._next_join = now + max(0.5, self.p.probe_interval * 2)

    def _pp_interval(self) -> float:
        n = max(1, len(self.members))
        scale = 1.0 if n <= 32 else 1.0 + math.log2(n / 32)
        return self.p.pushpull_interval * scale * self.rng.uniform(0.8, 1.2)
