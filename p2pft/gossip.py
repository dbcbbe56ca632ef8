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
from collections import OrderedDict
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
    heard: bool = False               # it spoke to us directly (its epoch/step are first-hand)
    beat: int = -1                    # last training-loop beat it sent us directly (trainers)
    beat_at: float | None = None      # our clock when that beat last changed

    def row(self) -> list[Any]:
        return [self.node, self.addr, self.inc, self.state, self.meta]


@dataclass
class _Suspicion:
    inc: int
    start: float
    min_t: float
    max_t: float
    confirmers: set[str] = field(default_factory=set)   # independent suspecters, not the first one
    origin: str = ""                                      # who suspected first

    def deadline(self, k: int) -> float:
        """From max_t down to min_t as confirmations arrive (log-scaled, Lifeguard/memberlist).
        The first suspicion is not its own confirmation: a lone accuser leaves the full max_t
        for the suspect to refute."""
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
        self._n_live = 1                                   # members ALIVE or SUSPECT (us included)
        self._live_ids: list[str] = [node]                 # the same members, indexable for sampling
        self._live_pos: dict[str, int] = {node: 0}
        self._gone: set[str] = set()                       # members DEAD or LEFT (tombstones)
        self.outbox: list[tuple[str, dict[str, Any]]] = []
        self.events: list[tuple[str, str]] = []
        self.declared: list[dict[str, Any]] = []       # 'dead' updates we originated (for the node layer)
        self.local_epoch = 0
        self.local_step = 0
        self.awareness = 0
        self.seeds: list[str] = []
        self._bcast: dict[str, list[Any]] = {}          # node -> [update, transmits, priority]
        # [priority][transmits] -> nodes, oldest first (priority 0: urgent, 1: joins). OrderedDict,
        # not dict: a dict used as a FIFO keeps dead slots at its front, and iterating it costs
        # O(everything ever removed).
        self._bq: tuple[list[OrderedDict[str, None]], list[OrderedDict[str, None]]] = ([], [])
        self._probe_order: list[str] = []
        self._carry: list[str] = []                     # members cut from the last probe round
        self._round_base = 1                            # live members when this round began
        self._probe: _Probe | None = None
        self._seq = 0
        self._relay: dict[int, tuple[str, int, float]] = {}  # our seq -> (requester addr, its seq, deadline)
        self._susp: dict[str, _Suspicion] = {}
        self._next_probe = now + rng.uniform(0, profile.probe_interval)
        self._next_pp = now + self._pp_interval()
        self._last_pp = now
        self._next_join = float("inf")
        self._quiet = False               # merging our own join answer: do not re-broadcast
        self._limit_for, self._limit = -1, 0
        self._awaiting_join = False
        self._next_reconnect = now + profile.reconnect_interval * rng.uniform(0.5, 1.5)
        self._queue_update({"k": ALIVE, "n": node, "i": 0, "a": addr, "m": dict(meta)}, urgent=False)

    # ------------------------------------------------------------------ public API
    @property
    def meta(self) -> dict[str, Any]:
        return self.members[self.me].meta

    def alive_count(self) -> int:
        return self._n_live

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
        me.inc = self.inc
        self._set_state(me, LEFT, now)
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
        t = min(self._next_probe, self._next_pp, self._next_join, self._next_reconnect)
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
        if now >= self._next_pp and now < self._last_pp + self._pp_interval(jitter=False) * 0.8:
            # The interval was set when we knew fewer members; it grows with the cluster, so a
            # thousand peers that joined together do not all sync their full state at once.
            self._next_pp = self._last_pp + self._pp_interval()
        if now >= self._next_pp:
            self._last_pp = now
            self._next_pp = now + self._pp_interval()
            peers = [m for m in self.live_members() if m.node != self.me]
            if peers:
                self._send_pp(self.rng.choice(peers).addr, join=False)
        if now >= self._next_join:
            if self._n_live > 1:
                self._next_join = float("inf")
            else:
                self._send_join(now)
        if now >= self._next_reconnect:
            self._next_reconnect = now + self.p.reconnect_interval * self.rng.uniform(0.8, 1.2)
            self._reconnect()
        for node in [n for n in self._gone if n != self.me and now - self.members[n].since > self.p.dead_keep]:
            self._gone.discard(node)
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
                m.heard = True
                m.epoch = max(m.epoch, int(msg["e"]))
                if m.epoch > self.local_epoch:
                    self.events.append(("epoch", src))
            if "st" in msg:
                m.step = int(msg["st"])
            if "lb" in msg and int(msg["lb"]) != m.beat:
                m.beat = int(msg["lb"])
                m.beat_at = now
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
            # The answer to our own join holds what everyone else already knows: merge it without
            # re-broadcasting each row (at 1,000 members that would be 1,000 updates per joiner).
            self._quiet = bool(msg.get("reply")) and self._awaiting_join
            try:
                for row in msg.get("state", ()):
                    self._merge_row(row, now)
            finally:
                self._quiet = False
            if msg.get("reply"):
                self._awaiting_join = False
            if msg.get("join") or not msg.get("reply"):
                self._send_pp(msg["from"], join=False, reply=True)
            if msg.get("join"):
                self.events.append(("join_request", src or ""))
        elif t == "g.who":
            me = self.members[self.me]
            if not self.leaving and isinstance(msg.get("from"), str):
                out: dict[str, Any] = {"t": "g.upd"}
                self._send(msg["from"], out)
                self._prepend(out, {"k": ALIVE, "n": self.me, "i": self.inc, "a": self.addr, "m": me.meta})
        elif t == "g.upd":
            pass  # updates already applied from "pb"
        if isinstance(src, str) and t in ("g.ping", "g.pp") and src != self.me:
            self._answer_stranger(src, msg)

    # ------------------------------------------------------------------ probing
    def _pick_target(self) -> str | None:
        for _ in range(2):
            while self._probe_order:
                node = self._probe_order.pop()
                m = self.members.get(node)
                if m and node != self.me and m.state in (ALIVE, SUSPECT):
                    return node
            self._new_round()
        return None

    def _new_round(self) -> None:
        """A fresh random probe order, of random length between half and all of the members.

        Plain randomized round-robin makes every round exactly N probes long, so peers that
        start together run phase-locked rounds: near the end of a round a member that everyone
        probed early has no prober left, and a crash there waits for all rounds to end (2.4 s
        seen at 100 peers, far worse at 1,000). Cutting each round at a random length keeps the
        phases apart. Members cut from a round open the next one, so each member is still
        probed at least once every two rounds.
        """
        carry = [n for n in self._carry if n in self._live_pos and n != self.me]
        held = set(carry)
        pool = [n for n in self._live_ids if n != self.me and n not in held]
        self.rng.shuffle(pool)
        order = pool + carry                       # popped from the end: the carried go first
        keep = self.rng.randint((len(order) + 1) // 2, len(order)) if order else 0
        self._carry = order[: len(order) - keep]
        self._probe_order = order[len(order) - keep:]
        self._round_base = max(1, self._n_live)

    def _start_probe(self, now: float) -> None:
        scale = self.awareness + 1
        self._next_probe = now + self.p.probe_interval * scale
        target = self._pick_target()
        if target is None:
            self._probe = None
            # Alone (everyone else dead or never met): keep knocking on the seeds and on the
            # addresses of the dead, or a healed partition would leave us isolated for good.
            if self._next_join == float("inf") and (self.seeds or self._gone):
                self._next_join = now
            return
        self._seq += 1
        self._probe = _Probe(target, self._seq, now + self.p.probe_timeout * scale,
                             now + self.p.probe_interval * scale)
        m = self.members[target]
        msg: dict[str, Any] = {"t": "g.ping", "seq": self._seq, "to": target}
        self._send(m.addr, msg, info=True)
        if m.state == SUSPECT:
            # Lifeguard's buddy system: tell a suspect so on every probe, so it can refute.
            self._prepend(msg, {"k": SUSPECT, "n": target, "i": m.inc, "f": self.me})

    def _prepend(self, msg: dict[str, Any], upd: dict[str, Any]) -> None:
        """Put one update first in a message's piggyback (within the max_piggyback bound)."""
        msg["pb"] = [upd] + [u for u in msg.get("pb", ()) if u.get("n") != upd["n"]][: self.p.max_piggyback - 1]

    def _go_indirect(self, p: _Probe, now: float) -> None:
        p.indirect = True
        target = self.members.get(p.target)
        if target is None:
            return
        chosen = self._sample_alive(self.p.indirect_probes, (self.me, p.target))
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
            upd = {"k": SUSPECT, "n": p.target, "i": m.inc, "f": self.me}
            self._apply_suspect(upd, now)
            # Also tell the suspect directly: if it is alive it refutes at once, before the
            # suspicion has spread (and timed out) anywhere.
            out: dict[str, Any] = {"t": "g.upd"}
            self._send(m.addr, out)
            self._prepend(out, dict(upd))

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
        upd = {"k": ALIVE, "n": self.me, "i": self.inc, "a": self.addr, "m": me.meta}
        self._queue_update(upd)
        # Seed the refutation's epidemic with a few direct messages: the suspicion has a head
        # start, and a suspect is often slow to send (its own awareness stretched its probes).
        for m in self._sample_alive(self.p.indirect_probes, (self.me,)):
            out: dict[str, Any] = {"t": "g.upd"}
            self._send(m.addr, out)
            self._prepend(out, dict(upd))

    def _apply_alive(self, u: dict[str, Any], now: float) -> None:
        node, inc = u["n"], int(u["i"])
        if node == self.me:
            if inc > self.inc or (inc == self.inc and u.get("m") != self.meta):
                self._refute(inc)
            return
        m = self.members.get(node)
        if m is None:
            self.members[node] = Member(node, str(u["a"]), inc, ALIVE, dict(u.get("m") or {}), now)
            self._n_live += 1
            self._live_add(node)
            if self._n_live >= 2 * self._round_base:
                self._new_round()          # membership doubled (a join wave): re-randomize now
            else:
                self._probe_order.insert(self.rng.randrange(len(self._probe_order) + 1), node)
            self.events.append(("join", node))
            if not self._quiet:
                self._queue_update(u, urgent=False)
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
            self._set_state(m, ALIVE, now)
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
            # Only a named accuser confirms (our own failed probe names us); a suspicion merged
            # from a push-pull row names nobody and must not count as anyone's confirmation.
            if s and frm and frm != s.origin and frm not in s.confirmers:
                s.confirmers.add(frm)
                self._queue_update(u)
            return
        m.inc = inc
        self._set_state(m, SUSPECT, now)
        n = max(2, self._n_live)
        min_t = max(self.p.suspicion_min, self.p.suspicion_mult * math.log10(n) * self.p.probe_interval)
        s = _Suspicion(inc, now, min_t, min_t * self.p.suspicion_max_mult, origin=frm or self.me)
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
        m.inc = inc
        self._set_state(m, DEAD, now)
        self._susp.pop(node, None)
        self.events.append(("dead", node))
        self._queue_update(u)
        if u.get("f") == self.me:
            self.declared.append(dict(u))

    def _apply_left(self, u: dict[str, Any], now: float) -> None:
        node, inc = u["n"], int(u["i"])
        if node == self.me:
            return
        m = self.members.get(node)
        if m is None or inc < m.inc or m.state == LEFT:
            return
        m.inc = inc
        self._set_state(m, LEFT, now)
        self._susp.pop(node, None)
        self.events.append(("left", node))
        self._queue_update(u)

    def _set_state(self, m: Member, state: str, now: float) -> None:
        """Every state change goes through here so the live count and tombstone set stay exact."""
        was_live = m.state in (ALIVE, SUSPECT)
        is_live = state in (ALIVE, SUSPECT)
        if was_live and not is_live:
            self._n_live -= 1
            self._gone.add(m.node)
            self._live_remove(m.node)
        elif is_live and not was_live:
            self._n_live += 1
            self._gone.discard(m.node)
            self._live_add(m.node)
        m.state, m.since = state, now

    def _live_add(self, node: str) -> None:
        if node not in self._live_pos:
            self._live_pos[node] = len(self._live_ids)
            self._live_ids.append(node)

    def _live_remove(self, node: str) -> None:
        i = self._live_pos.pop(node, None)
        if i is None:
            return
        last = self._live_ids.pop()
        if last != node:
            self._live_ids[i] = last
            self._live_pos[last] = i

    def _sample_alive(self, k: int, exclude: tuple[str, ...]) -> list[Member]:
        """Up to k distinct ALIVE members not in exclude, uniformly at random, without an O(N) scan."""
        ids = self._live_ids
        if len(ids) <= 4 * (k + len(exclude)):
            pool = [self.members[n] for n in ids if n not in exclude and self.members[n].state == ALIVE]
            return self.rng.sample(pool, min(k, len(pool)))
        out: list[Member] = []
        seen = set(exclude)
        for _ in range(8 * k):
            n = ids[self.rng.randrange(len(ids))]
            if n in seen:
                continue
            seen.add(n)
            m = self.members[n]
            if m.state == ALIVE:
                out.append(m)
                if len(out) == k:
                    break
        return out

    def _answer_stranger(self, src: str, msg: dict[str, Any]) -> None:
        """A probe or sync from a node we think dead, or have forgotten, is healed at once.

        Without this, both sides of a healed partition can hold each other dead forever: nobody
        probes the dead, and the updates that said so have stopped being piggybacked. Telling a
        'dead' sender so makes it refute with a higher incarnation; a sender we do not know at
        all gets a push-pull, which adds it here and tells it everything we know.
        """
        frm = msg.get("from")
        if not isinstance(frm, str):
            return
        m = self.members.get(src)
        if m is None:
            if msg.get("t") == "g.ping":
                self._send(frm, {"t": "g.who"})  # O(1): the answer is its own alive update
        elif m.state == DEAD:
            out: dict[str, Any] = {"t": "g.upd"}
            self._send(frm, out)
            self._prepend(out, {"k": DEAD, "n": src, "i": m.inc, "f": self.me})

    def _reconnect(self) -> None:
        """Push-pull with one random dead member (Serf's reconnect): heals a partition whose
        sides have declared each other dead. Addresses now held by a live member are skipped."""
        dead = [n for n in self._gone if self.members[n].state == DEAD]
        if not dead:
            return
        node = self.members[self.rng.choice(sorted(dead))]
        if node.addr != self.addr and self.node_at(node.addr) is None:
            self._send_pp(node.addr, join=False)

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
        n = self._n_live
        if n != self._limit_for:
            self._limit_for = n
            self._limit = self.p.retransmit_mult * max(1, math.ceil(math.log10(n + 1)))
        return self._limit

    def _queue_update(self, upd: dict[str, Any], urgent: bool = True) -> None:
        """Queue an update for piggybacking. News of failures, refutations and metadata changes
        is urgent; the 'alive' of a member we just learned of (a join) is not, so the backlog of
        a mass join never delays a suspicion or its refutation."""
        node = upd["n"]
        old = self._bcast.get(node)
        if old is not None:
            self._bq[old[2]][old[1]].pop(node, None)
        prio = 0 if urgent else 1
        self._bcast[node] = [upd, 0, prio]
        buckets = self._bq[prio]
        if not buckets:
            buckets.append(OrderedDict())
        buckets[0][node] = None

    def _piggyback(self) -> list[dict[str, Any]]:
        """Urgent updates before joins; within each, the least-transmitted first and, among
        those, the newest first (as memberlist does). Bucketed by count, so O(max_piggyback)
        per message even with 1,000 updates queued after a mass join."""
        if not self._bcast:
            return []
        limit = self._retransmit_limit()
        want = self.p.max_piggyback
        taken: list[str] = []
        for buckets in self._bq:
            for bucket in buckets:
                for node in reversed(bucket):
                    taken.append(node)
                    if len(taken) >= want:
                        break
                if len(taken) >= want:
                    break
            if len(taken) >= want:
                break
        out = []
        for node in taken:
            entry = self._bcast[node]
            upd, count, prio = entry
            buckets = self._bq[prio]
            del buckets[count][node]
            out.append(upd)
            count += 1
            if count >= limit:
                del self._bcast[node]
                continue
            entry[1] = count
            while len(buckets) <= count:
                buckets.append(OrderedDict())
            buckets[count][node] = None
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
        self._awaiting_join = True
        targets = list(self.seeds)
        if self._n_live <= 1:
            # Alone: also try where the dead used to live (a healed partition, a restarted cluster).
            targets += sorted({self.members[n].addr for n in self._gone} - set(targets) - {self.addr})
        for s in targets:
            self._send_pp(s, join=True)
        self._next_join = now + max(0.5, self.p.probe_interval * 2)

    def _pp_interval(self, jitter: bool = True) -> float:
        n = max(1, len(self.members))
        scale = 1.0 if n <= 32 else 1.0 + math.log2(n / 32)
        return self.p.pushpull_interval * scale * (self.rng.uniform(0.8, 1.2) if jitter else 1.0)
