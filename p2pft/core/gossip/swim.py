"""Sans-IO SWIM membership with the Lifeguard refinements.

No sockets, no clock, no global random: callers feed messages and the current time, and drain
``outbox`` (``(addr, message)`` pairs) and ``events`` (``GossipEvent`` values). The same object
runs under the asyncio driver and under the simulator. The member table and suspicions live in
``p2pft.core.gossip.members``, the piggyback queue in ``p2pft.core.gossip.broadcast``, the probe order in
``p2pft.core.gossip.probe``.

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
from dataclasses import replace
from typing import Any

from ..config import Profile
from ..messages import (ALIVE, DEAD, LEFT, SUSPECT, Ack, GossipMessage, GossipMsg, Nack, Ping, ProbeRequest, PushPull,
                        Row, Update, Updates, Who)
from ..meta import MemberMeta
from .broadcast import BroadcastQueue
from .events import GossipEvent, GossipEventKind
from .members import GossipMember, MemberTable, Suspicion
from .probe import Probe, ProbeOrder


class Gossip:
    """Membership state machine of one node."""

    def __init__(self, node: str, addr: str, meta: MemberMeta, profile: Profile,
                 rng: random.Random, now: float, *, step: int = 0) -> None:
        self.me = node
        self.addr = addr
        self.p = profile
        self.rng = rng
        self.inc = 0
        self.leaving = False
        self.table = MemberTable(GossipMember(node, addr, 0, ALIVE, meta, now))
        self.members: dict[str, GossipMember] = self.table.by_id     # read-only for callers
        self.outbox: list[tuple[str, GossipMsg]] = []
        self.events: list[GossipEvent] = []
        self._declared: list[Update] = []              # 'dead' updates we originated (for the node layer)
        self._epoch = 0                                # our committed epoch, told on probes
        self._step = int(step)                         # our committed step, told on probes
        self.awareness = 0
        self.seeds: list[str] = []
        self._bcast = BroadcastQueue()
        self.probes = ProbeOrder(node, self.table, rng)
        self._probe: Probe | None = None
        self._seq = 0
        self._relay: dict[int, tuple[str, int, float]] = {}  # our seq -> (requester addr, its seq, deadline)
        self._susp: dict[str, Suspicion] = {}
        self._next_probe = now + rng.uniform(0, profile.probe_interval)
        self._next_pp = now + self._pp_interval()
        self._last_pp = now
        self._next_join = float("inf")
        self._quiet = False               # merging our own join answer: do not re-broadcast
        self._awaiting_join = False
        self._next_reconnect = now + profile.reconnect_interval * rng.uniform(0.5, 1.5)
        self._bcast.push(self.alive_update(), urgent=False)

    # ------------------------------------------------------------------ public API
    @property
    def meta(self) -> MemberMeta:
        return self.members[self.me].meta

    def alive_count(self) -> int:
        return self.table.n_live

    def live_members(self) -> list[GossipMember]:
        return self.table.live()

    def alive_update(self) -> Update:
        """Our own 'alive' at our current incarnation and metadata."""
        return Update(ALIVE, self.me, self.inc, self.addr, self.meta)

    def join(self, seeds: list[str], now: float) -> None:
        """Push-pull with every seed; repeated until somebody answers."""
        self.seeds = [s for s in seeds if s != self.addr]
        if self.seeds:
            self._send_join(now)

    def update_meta(self, now: float, **changes: Any) -> None:
        """Change our metadata (``MemberMeta`` field names): a new incarnation so the update wins
        everywhere."""
        me = self.members[self.me]
        me.meta = replace(me.meta, **changes)
        self.inc += 1
        me.inc = self.inc
        self._bcast.push(self.alive_update())

    def set_epoch(self, epoch: int) -> None:
        """Our committed epoch (told on probes; a peer behind asks us for the view)."""
        self._epoch = int(epoch)

    def set_step(self, step: int) -> None:
        """Our committed step (told on probes)."""
        self._step = int(step)

    def record_beat(self, beat: int, now: float) -> None:
        """Our own training loop beat (the node checks its own loop against it)."""
        me = self.members[self.me]
        me.beat, me.beat_at = int(beat), now

    def take_declared(self) -> list[Update]:
        """The 'dead' updates we originated since the last call."""
        out, self._declared = self._declared, []
        return out

    def leave(self, now: float) -> None:
        """Graceful leave: a 'left' update that outranks our alive; peers stop probing us."""
        self.leaving = True
        self.inc += 1
        me = self.members[self.me]
        me.inc = self.inc
        self.table.set_state(me, LEFT, now)
        upd = Update(LEFT, self.me, self.inc)
        self._bcast.push(upd)
        # Tell a few members directly so the leave does not wait for our next probe.
        others = [m for m in self.live_members() if m.node != self.me]
        for m in self.rng.sample(others, min(len(others), max(3, self.p.indirect_probes))):
            self._send(m.addr, Updates(updates=[upd]))

    def report_failure(self, node: str, now: float, certain: bool = False) -> None:
        """Evidence from outside the probe cycle (data-plane error, refused connection).

        ``certain`` (the node's port refuses connections, or another node answers there) declares
        it dead at once; otherwise we suspect it now instead of waiting for our next probe.
        """
        m = self.members.get(node)
        if m is None or node == self.me or m.state in (DEAD, LEFT):
            return
        if certain:
            self._apply_gone(Update(DEAD, node, m.inc, accuser=self.me), now)
        else:
            self._apply_suspect(Update(SUSPECT, node, m.inc, accuser=self.me), now)

    def addr_of(self, node: str) -> str | None:
        m = self.members.get(node)
        return m.addr if m else None

    def node_at(self, addr: str) -> str | None:
        """The newest live member known at an address."""
        return self.table.node_at(addr)

    # ------------------------------------------------------------------ time
    def next_deadline(self) -> float:
        t = min(self._next_probe, self._next_pp, self._next_join, self._next_reconnect)
        if self._probe and not self._probe.acked:
            t = min(t, self._probe.end if self._probe.indirect else self._probe.direct_deadline)
        for _, _, dl in self._relay.values():
            t = min(t, dl)
        for s in self._susp.values():
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
                self._send(req_addr, Nack(seq=req_seq))
        k = self.p.suspicion_confirmations
        for node, s in list(self._susp.items()):
            if now >= s.deadline(k):
                m = self.members.get(node)
                del self._susp[node]
                if m and m.state == SUSPECT and m.inc == s.inc:
                    self._apply_gone(Update(DEAD, node, s.inc, accuser=self.me), now)
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
            if self.table.n_live > 1:
                self._next_join = float("inf")
            else:
                self._send_join(now)
        if now >= self._next_reconnect:
            self._next_reconnect = now + self.p.reconnect_interval * self.rng.uniform(0.8, 1.2)
            self._reconnect()
        self.table.expire(now, self.p.dead_keep)

    # ------------------------------------------------------------------ messages
    def handle(self, msg: GossipMsg, now: float) -> None:
        src = msg.src
        for upd in msg.updates:
            self._apply(upd, now)
        m = self.members.get(src)
        if m is not None:
            if msg.epoch is not None:
                m.heard = True
                m.epoch = max(m.epoch, msg.epoch)
                if m.epoch > self._epoch:
                    self.events.append(GossipEvent(GossipEventKind.NEWER_VIEW, src))
            if msg.step is not None:
                m.step = msg.step
            if msg.beat is not None and msg.beat != m.beat:
                m.beat = msg.beat
                m.beat_at = now
        if isinstance(msg, Ping):
            if msg.to != self.me:
                return  # addressed to an earlier process at this address: stay silent
            self._send(msg.frm, Ack(seq=msg.seq), info=True)
        elif isinstance(msg, Ack):
            p = self._probe
            if p and p.seq == msg.seq and not p.acked:
                p.acked = True
                self.awareness = max(0, self.awareness - 1)
            relay = self._relay.pop(msg.seq, None)
            if relay:
                self._send(relay[0], Ack(seq=relay[1]))
        elif isinstance(msg, Nack):
            p = self._probe
            if p and p.seq == msg.seq:
                p.nacks += 1
        elif isinstance(msg, ProbeRequest):
            self._seq += 1
            self._relay[self._seq] = (msg.frm, msg.seq, now + self.p.probe_timeout * 2)
            self._send(msg.target_addr, Ping(seq=self._seq, to=msg.target))
        elif isinstance(msg, PushPull):
            # The answer to our own join holds what everyone else already knows: merge it without
            # re-broadcasting each row (at 1,000 members that would be 1,000 updates per joiner).
            self._quiet = msg.reply and self._awaiting_join
            try:
                for row in msg.rows:
                    self._merge_row(row, now)
            finally:
                self._quiet = False
            if msg.reply:
                self._awaiting_join = False
            if msg.join or not msg.reply:
                self._send_pp(msg.frm, join=False, reply=True)
            if msg.join:
                self.events.append(GossipEvent(GossipEventKind.JOIN_REQUEST, src))
        elif isinstance(msg, Who):
            if not self.leaving:
                out = Updates()
                self._send(msg.frm, out)
                self._prepend(out, self.alive_update())
        # Updates: already applied above
        if isinstance(msg, (Ping, PushPull)) and src != self.me:
            self._answer_stranger(src, msg)

    # ------------------------------------------------------------------ probing
    def _pick_target(self) -> str | None:
        return self.probes.next_target()

    def _start_probe(self, now: float) -> None:
        scale = self.awareness + 1
        self._next_probe = now + self.p.probe_interval * scale
        target = self._pick_target()
        if target is None:
            self._probe = None
            # Alone (everyone else dead or never met): keep knocking on the seeds and on the
            # addresses of the dead, or a healed partition would leave us isolated for good.
            if self._next_join == float("inf") and (self.seeds or self.table.gone):
                self._next_join = now
            return
        self._seq += 1
        self._probe = Probe(target, self._seq, now + self.p.probe_timeout * scale,
                            now + self.p.probe_interval * scale)
        m = self.members[target]
        msg = Ping(seq=self._seq, to=target)
        self._send(m.addr, msg, info=True)
        if m.state == SUSPECT:
            # Lifeguard's buddy system: tell a suspect so on every probe, so it can refute.
            self._prepend(msg, Update(SUSPECT, target, m.inc, accuser=self.me))

    def _prepend(self, msg: GossipMessage, upd: Update) -> None:
        """Put one update first in a message's piggyback (within the max_piggyback bound)."""
        msg.updates = [upd] + [u for u in msg.updates if u.node != upd.node][: self.p.max_piggyback - 1]

    def _go_indirect(self, p: Probe, now: float) -> None:
        p.indirect = True
        target = self.members.get(p.target)
        if target is None:
            return
        chosen = self.table.sample_alive(self.rng, self.p.indirect_probes, (self.me, p.target))
        p.nacks_expected = len(chosen)
        for h in chosen:
            self._send(h.addr, ProbeRequest(seq=p.seq, target=p.target, target_addr=target.addr))

    def _finish_probe(self, p: Probe, now: float) -> None:
        self._probe = None
        if p.acked:
            return
        # Lifeguard: missing nacks mean *we* may be the slow one; raise our own awareness.
        if p.nacks < p.nacks_expected or p.nacks_expected == 0:
            self.awareness = min(self.p.awareness_max, self.awareness + 1)
        m = self.members.get(p.target)
        if m and m.state in (ALIVE, SUSPECT):
            upd = Update(SUSPECT, p.target, m.inc, accuser=self.me)
            self._apply_suspect(upd, now)
            # Also tell the suspect directly: if it is alive it refutes at once, before the
            # suspicion has spread (and timed out) anywhere.
            out = Updates()
            self._send(m.addr, out)
            self._prepend(out, upd)
            # And a few others now, not at our next probe: each probes the suspect next
            # (``ProbeOrder.next_up``), so a dead member's confirmations come a probe later.
            for h in self.table.sample_alive(self.rng, self.p.indirect_probes, (self.me, p.target)):
                tell = Updates()
                self._send(h.addr, tell)
                self._prepend(tell, upd)

    # ------------------------------------------------------------------ updates
    def _apply(self, upd: Update, now: float) -> None:
        kind = upd.state
        if kind == ALIVE:
            self._apply_alive(upd, now)
        elif kind == SUSPECT:
            self._apply_suspect(upd, now)
        elif kind in (DEAD, LEFT):
            self._apply_gone(upd, now)

    def _refute(self, inc: int) -> None:
        if self.leaving:
            return
        self.inc = max(self.inc, int(inc)) + 1
        me = self.members[self.me]
        me.inc = self.inc
        upd = self.alive_update()
        self._bcast.push(upd)
        # Seed the refutation's epidemic with a few direct messages: the suspicion has a head
        # start, and a suspect is often slow to send (its own awareness stretched its probes).
        for m in self.table.sample_alive(self.rng, self.p.indirect_probes, (self.me,)):
            out = Updates()
            self._send(m.addr, out)
            self._prepend(out, upd)

    def _apply_alive(self, u: Update, now: float) -> None:
        node, inc = u.node, u.inc
        meta = u.meta if u.meta is not None else MemberMeta()
        if node == self.me:
            if inc > self.inc or (inc == self.inc and meta != self.meta):
                self._refute(inc)
            return
        m = self.members.get(node)
        if m is None:
            self.table.add(GossipMember(node, u.addr, inc, ALIVE, meta, now))
            self.probes.learned(node)
            self.events.append(GossipEvent(GossipEventKind.JOIN, node))
            if not self._quiet:
                self._bcast.push(u, urgent=False)
            return
        if inc <= m.inc:
            return
        was = m.state
        m.inc, m.addr = inc, u.addr
        changed = meta != m.meta
        m.meta = meta
        self._susp.pop(node, None)
        if was != ALIVE:
            self.table.set_state(m, ALIVE, now)
            self.events.append(GossipEvent(GossipEventKind.ALIVE, node))
        elif changed:
            self.events.append(GossipEvent(GossipEventKind.UPDATE, node))
        self._bcast.push(u)

    def _apply_suspect(self, u: Update, now: float) -> None:
        node, inc, frm = u.node, u.inc, u.accuser
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
                self._bcast.push(u)
            return
        m.inc = inc
        self.table.set_state(m, SUSPECT, now)
        n = max(2, self.table.n_live)
        min_t = max(self.p.suspicion_min, self.p.suspicion_mult * math.log10(n) * self.p.probe_interval)
        s = Suspicion(inc, now, min_t, min_t * self.p.suspicion_max_mult, origin=frm or self.me)
        self._susp[node] = s
        self.events.append(GossipEvent(GossipEventKind.SUSPECT, node))
        if frm and frm != self.me and not (self._probe and self._probe.target == node):
            self.probes.next_up(node)  # a confirmation (or the suspect's news) one probe away
        self._bcast.push(u if frm else Update(SUSPECT, node, inc, accuser=self.me))

    def _apply_gone(self, u: Update, now: float) -> None:
        """'dead' or 'left'. A dead member may still leave; a left one is never declared dead."""
        node, inc, state = u.node, u.inc, u.state
        if node == self.me:
            if state == DEAD and not self.leaving:
                self._refute(inc)
            return
        m = self.members.get(node)
        if m is None or inc < m.inc or m.state == LEFT or (state == DEAD and m.state == DEAD):
            return
        m.inc = inc
        self.table.set_state(m, state, now)
        self._susp.pop(node, None)
        self.events.append(GossipEvent(GossipEventKind.gone(state), node))
        self._bcast.push(u)
        if state == DEAD and u.accuser == self.me:
            self._declared.append(u)

    def _answer_stranger(self, src: str, msg: GossipMsg) -> None:
        """A probe or sync from a node we think dead, or have forgotten, is healed at once.

        Without this, both sides of a healed partition can hold each other dead forever: nobody
        probes the dead, and the updates that said so have stopped being piggybacked. Telling a
        'dead' sender so makes it refute with a higher incarnation; a sender we do not know at
        all gets a push-pull, which adds it here and tells it everything we know.
        """
        m = self.members.get(src)
        if m is None:
            if isinstance(msg, Ping):
                self._send(msg.frm, Who())  # O(1): the answer is its own alive update
        elif m.state == DEAD:
            out = Updates()
            self._send(msg.frm, out)
            self._prepend(out, Update(DEAD, src, m.inc, accuser=self.me))

    def _reconnect(self) -> None:
        """Push-pull with one random dead member (Serf's reconnect): heals a partition whose
        sides have declared each other dead. Addresses now held by a live member are skipped."""
        dead = self.table.dead_ids()
        if not dead:
            return
        node = self.members[self.rng.choice(sorted(dead))]
        if node.addr != self.addr and self.node_at(node.addr) is None:
            self._send_pp(node.addr, join=False)

    def _merge_row(self, row: Row, now: float) -> None:
        node, state = row.node, row.state
        if state == ALIVE:
            self._apply(Update(ALIVE, node, row.inc, row.addr, row.meta), now)
        elif state == LEFT:
            self._apply(Update(LEFT, node, row.inc), now)
        elif node in self.members or state == SUSPECT:
            # A remote 'dead' only makes us suspect (memberlist does the same): our own timer decides.
            if node not in self.members and state == SUSPECT:
                self._apply(Update(ALIVE, node, row.inc, row.addr, row.meta), now)
            self._apply(Update(SUSPECT, node, row.inc), now)

    # ------------------------------------------------------------------ sending
    def _retransmit_limit(self) -> int:
        return self._bcast.limit(self.table.n_live, self.p.retransmit_mult)

    def _send(self, addr: str, msg: GossipMsg, info: bool = False) -> None:
        msg.frm = self.addr
        msg.src = self.me
        pb = self._bcast.take(self.p.max_piggyback, self._retransmit_limit())
        if pb:
            msg.updates = pb
        if info:
            msg.epoch = self._epoch
            msg.step = self._step
        self.outbox.append((addr, msg))

    def _send_pp(self, addr: str, join: bool, reply: bool = False) -> None:
        self._send(addr, PushPull(join=join, reply=reply, rows=[m.row() for m in self.members.values()]), info=True)

    def _send_join(self, now: float) -> None:
        self._awaiting_join = True
        targets = list(self.seeds)
        if self.table.n_live <= 1:
            # Alone: also try where the dead used to live (a healed partition, a restarted cluster).
            targets += sorted({self.members[n].addr for n in self.table.gone} - set(targets) - {self.addr})
        for s in targets:
            self._send_pp(s, join=True)
        self._next_join = now + max(0.5, self.p.probe_interval * 2)

    def _pp_interval(self, jitter: bool = True) -> float:
        n = max(1, len(self.members))
        scale = 1.0 if n <= 32 else 1.0 + math.log2(n / 32)
        return self.p.pushpull_interval * scale * (self.rng.uniform(0.8, 1.2) if jitter else 1.0)


__all__ = ["ALIVE", "SUSPECT", "DEAD", "LEFT", "Gossip", "GossipMember", "Suspicion"]
