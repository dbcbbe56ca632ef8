"""SWIM + Lifeguard core, driven directly (no Node, no Raft) on a tiny virtual network."""
from __future__ import annotations

import heapq
import itertools
import math
import random
from typing import Any

import msgpack
import pytest

from p2pft.core import codec
from p2pft.core.config import DEFAULT, Profile
from p2pft.core.gossip.events import GossipEventKind
from p2pft.core.gossip.swim import ALIVE, DEAD, LEFT, SUSPECT, Gossip, Suspicion
from p2pft.core.messages import Updates
from p2pft.core.meta import MemberMeta


def wire_msg(body: dict[str, Any]) -> Any:
    """A message as a peer would send it: a wire dict through the codec (sender 'x')."""
    return codec.from_wire({"from": "x:0", "src": "x", **body})


class Net:
    """Gossip instances on a virtual clock; messages take 1 ms and pass through msgpack."""

    def __init__(self, n: int, *, profile: Profile = DEFAULT, seed: int = 0, join: bool = True) -> None:
        self.p = profile
        self.now = 0.0
        self.rng = random.Random(seed)
        self.addrs = [f"10.0.0.{i}:7000" for i in range(n)]
        self.g: dict[str, Gossip] = {}
        self.down: set[str] = set()
        self.blocked: set[tuple[str, str]] = set()
        self.events: list[tuple[float, str, GossipEventKind, str]] = []   # (time, observer addr, kind, node)
        self.sent: list[tuple[str, dict[str, Any]]] = []   # (sender addr, wire dict)
        self._q: list[tuple[float, int, str, bytes]] = []
        self._seq = itertools.count()
        for i, a in enumerate(self.addrs):
            self.start(a, seeds=[self.addrs[0]] if join and i else [])

    def start(self, addr: str, seeds: list[str], inc_name: str = "") -> Gossip:
        node_id = f"{addr}.{inc_name or 'n'}"
        g = Gossip(node_id, addr, MemberMeta(replica_id=addr), self.p, random.Random(self.rng.getrandbits(32)),
                   self.now)
        self.g[addr] = g
        self.down.discard(addr)
        if seeds:
            g.join(seeds, self.now)
        self._drain(addr)
        return g

    def id(self, addr: str) -> str:
        return self.g[addr].me

    def _drain(self, addr: str) -> None:
        g = self.g[addr]
        for dst, msg in g.outbox:
            wire = codec.to_wire(msg)
            self.sent.append((addr, wire))
            if (addr, dst) not in self.blocked:
                heapq.heappush(self._q, (self.now + 0.001, next(self._seq), dst, msgpack.packb(wire)))
        g.outbox.clear()
        for ev in g.events:
            self.events.append((self.now, addr, ev.kind, ev.node))
        g.events.clear()

    def run(self, until: float) -> None:
        while True:
            live = [a for a in self.g if a not in self.down]
            t_timer = min((self.g[a].next_deadline() for a in live), default=math.inf)
            t_msg = self._q[0][0] if self._q else math.inf
            t = min(t_timer, t_msg)
            if t > until:
                self.now = until
                return
            self.now = max(self.now, t)
            if t_msg <= t_timer:
                _, _, dst, data = heapq.heappop(self._q)
                if dst in self.g and dst not in self.down:
                    self.g[dst].handle(codec.from_wire(msgpack.unpackb(data)), self.now)
                    self._drain(dst)
            else:
                for a in live:
                    if self.g[a].next_deadline() <= self.now:
                        self.g[a].tick(self.now)
                        self._drain(a)

    def state(self, observer: str, addr: str) -> str | None:
        m = self.g[observer].members.get(self.id(addr))
        return m.state if m else None

    def first(self, kind: GossipEventKind, addr: str, since: float = 0.0) -> float | None:
        node = self.id(addr)
        times = [t for t, _, k, n in self.events if k is kind and n == node and t >= since]
        return min(times) if times else None


def everyone_alive(net: Net) -> bool:
    live = [a for a in net.addrs if a not in net.down]
    return all(net.state(o, a) == ALIVE for o in live for a in live)


def test_join_through_one_seed_learns_everyone() -> None:
    net = Net(6)
    net.run(2.0)
    assert everyone_alive(net)
    for g in net.g.values():
        assert g.alive_count() == 6


def test_crashed_member_is_suspected_then_declared_dead() -> None:
    net = Net(5, seed=1)
    net.run(2.0)
    victim = net.addrs[3]
    net.down.add(victim)
    t_crash = net.now
    net.run(t_crash + 5.0)
    survivors = [a for a in net.addrs if a != victim]
    assert all(net.state(o, victim) == DEAD for o in survivors)
    t_suspect = net.first(GossipEventKind.SUSPECT, victim, t_crash)
    t_dead = net.first(GossipEventKind.DEAD, victim, t_crash)
    assert t_suspect is not None and t_dead is not None
    # Suspicion is used (never instant death from one missed ack) and its timeout is bounded.
    assert t_dead - t_suspect >= DEFAULT.suspicion_min - 1e-9
    assert t_dead - t_crash < 3.0
    # No survivor was ever suspected.
    assert not [e for e in net.events
                if e[2] in (GossipEventKind.SUSPECT, GossipEventKind.DEAD) and e[3] != net.id(victim)]


def test_suspected_member_refutes_with_a_higher_incarnation() -> None:
    net = Net(4, seed=2)
    net.run(2.0)
    target, accuser = net.addrs[2], net.addrs[1]
    inc0 = net.g[target].inc
    net.g[accuser].handle(wire_msg({"t": "g.upd", "pb": [{"k": SUSPECT, "n": net.id(target), "i": inc0, "f": "x"}]}),
                          net.now)
    net._drain(accuser)
    assert net.state(accuser, target) == SUSPECT
    net.run(net.now + 3.0)
    assert net.g[target].inc > inc0
    assert everyone_alive(net)
    assert net.first(GossipEventKind.DEAD, target) is None


def test_confirmations_shrink_the_suspicion_timeout() -> None:
    s = Suspicion(inc=0, start=10.0, min_t=0.5, max_t=2.0)
    k = 3
    deadlines = []
    for c in range(k + 1):
        deadlines.append(s.deadline(k))
        s.confirmers.add(f"n{c}")
    assert deadlines[0] == pytest.approx(12.0)                      # no confirmation: the max
    assert all(a > b for a, b in zip(deadlines, deadlines[1:]))     # each one shortens it
    assert s.deadline(k) == pytest.approx(10.5)                     # K of them: the min
    s.confirmers.update({"a", "b", "c"})
    assert s.deadline(k) == pytest.approx(10.5)                     # never below the min


def test_suspicion_timeout_scales_with_log_n() -> None:
    def timeout_for(n_members: int) -> float:
        g = Gossip("me", "m:1", MemberMeta(), DEFAULT, random.Random(0), 0.0)
        for i in range(n_members - 1):
            g.handle(wire_msg({"t": "g.upd", "pb": [{"k": ALIVE, "n": f"x{i}", "i": 0, "a": f"x:{i}", "m": {}}]}), 0.0)
        g.handle(wire_msg({"t": "g.upd", "pb": [{"k": SUSPECT, "n": "x0", "i": 0, "f": "other"}]}), 0.0)
        return g._susp["x0"].min_t

    small, large = timeout_for(10), timeout_for(1000)
    assert large > small
    assert large == pytest.approx(DEFAULT.suspicion_mult * 3 * DEFAULT.probe_interval, rel=0.01)


def test_report_failure_certain_is_dead_at_once_and_uncertain_is_suspect() -> None:
    net = Net(3, seed=3)
    net.run(1.5)
    g = net.g[net.addrs[0]]
    g.report_failure(net.id(net.addrs[1]), net.now, certain=False)
    assert net.state(net.addrs[0], net.addrs[1]) == SUSPECT
    g.report_failure(net.id(net.addrs[2]), net.now, certain=True)
    assert net.state(net.addrs[0], net.addrs[2]) == DEAD
    net._drain(net.addrs[0])
    # The wrongly suspected/declared members refute once they hear of it.
    net.run(net.now + 3.0)
    assert everyone_alive(net)


def test_graceful_leave_is_seen_everywhere_quickly() -> None:
    net = Net(5, seed=4)
    net.run(2.0)
    leaver = net.addrs[4]
    t0 = net.now
    net.g[leaver].leave(net.now)
    net._drain(leaver)
    net.run(t0 + 0.2)
    net.down.add(leaver)
    others = net.addrs[:4]
    assert all(net.state(o, leaver) == LEFT for o in others)
    net.run(t0 + 5.0)
    assert all(net.state(o, leaver) == LEFT for o in others)   # not resurrected, not "dead"
    assert net.first(GossipEventKind.DEAD, leaver) is None


def test_piggyback_is_bounded_and_each_update_sent_a_limited_number_of_times() -> None:
    p = DEFAULT
    g = Gossip("me", "m:1", MemberMeta(), p, random.Random(0), 0.0)
    n = 30
    for i in range(n):
        g.handle(wire_msg({"t": "g.upd", "pb": [{"k": ALIVE, "n": f"x{i}", "i": 0, "a": f"x:{i}", "m": {}}]}), 0.0)
    limit = g._retransmit_limit()
    counts: dict[str, int] = {}
    for _ in range(200):
        g._send("x:0", Updates())
    for _, msg in g.outbox:
        pb = codec.to_wire(msg).get("pb", [])
        assert len(pb) <= p.max_piggyback
        for u in pb:
            counts[u["n"]] = counts.get(u["n"], 0) + 1
    assert counts["me"] == limit
    assert all(counts[f"x{i}"] == limit for i in range(n))
    # The least-sent updates go first: a new one rides the very next message.
    g.outbox.clear()
    g.handle(wire_msg({"t": "g.upd", "pb": [{"k": DEAD, "n": "x5", "i": 0, "f": "z"}]}), 1.0)
    g._send("x:0", Updates())
    assert any(u.node == "x5" and u.state == DEAD for u in g.outbox[-1][1].updates)


def test_lifeguard_awareness_rises_when_we_are_the_slow_one() -> None:
    net = Net(5, seed=5)
    net.run(2.0)
    lonely = net.addrs[0]
    for a in net.addrs[1:]:
        net.blocked.add((a, lonely))          # nobody's acks or nacks reach us
    net.run(net.now + 3.0)
    g = net.g[lonely]
    assert g.awareness >= 3
    # ... which stretches our probe interval, so we send fewer probes while unhealthy.
    n_before = len([m for src, m in net.sent if src == lonely and m["t"] == "g.ping"])
    t = net.now
    net.run(t + 2.0)
    pings = len([m for src, m in net.sent if src == lonely and m["t"] == "g.ping"]) - n_before
    assert pings < 2.0 / DEFAULT.probe_interval
    net.blocked.clear()
    net.run(net.now + 10.0)
    assert g.awareness == 0
    assert everyone_alive(net)


def test_indirect_probes_avoid_a_false_suspicion_over_a_broken_link() -> None:
    net = Net(5, seed=6)
    net.run(2.0)
    a, b = net.addrs[1], net.addrs[2]
    net.blocked.add((a, b))               # a cannot reach b directly; everyone else can
    t0 = net.now
    net.run(t0 + 10.0)
    assert net.first(GossipEventKind.DEAD, b, t0) is None
    assert net.state(a, b) in (ALIVE, SUSPECT)
    assert everyone_alive(net) or net.state(a, b) == SUSPECT
    assert any(m["t"] == "g.preq" for src, m in net.sent if src == a)


def test_healed_partition_rejoins_both_sides() -> None:
    """Both sides declare each other dead; after the heal, reconnect + refutation restore everyone."""
    net = Net(6, seed=7)
    net.run(2.0)
    left, right = net.addrs[:3], net.addrs[3:]
    for x in left:
        for y in right:
            net.blocked.update({(x, y), (y, x)})
    net.run(net.now + 8.0)
    assert all(net.state(o, a) == DEAD for o in left for a in right)
    assert all(net.state(o, a) == DEAD for o in right for a in left)
    net.blocked.clear()
    t_heal = net.now
    net.run(t_heal + 6.0)
    assert everyone_alive(net)


def test_a_forgotten_member_is_relearned_from_its_probe() -> None:
    """A node that ages out of someone's table (tombstone expired) is learned back via g.who."""
    net = Net(3, seed=8)
    net.run(1.5)
    a, b = net.addrs[0], net.addrs[1]
    g = net.g[a]
    gone = net.id(b)            # forget b the way an expired tombstone would
    g.table.forget(gone)
    g.probes.order = [n for n in g.probes.order if n != gone]
    net.run(net.now + 4.0)
    assert net.state(a, b) == ALIVE
    assert any(m["t"] == "g.who" for src, m in net.sent if src == a)


def test_same_seed_same_messages() -> None:
    def trace(seed: int) -> list[tuple[str, str]]:
        net = Net(5, seed=seed)
        net.run(3.0)
        net.down.add(net.addrs[2])
        net.run(6.0)
        return [(src, msgpack.packb(m).hex()) for src, m in net.sent]

    assert trace(11) == trace(11)
    assert trace(11) != trace(12)


@pytest.mark.parametrize("junk", [[{"k": "alive"}], [{"k": "dead", "n": "x", "i": "nan"}], [{"n": "x"}],
                                  [{"k": "alive", "n": "y", "i": "1", "a": "h:1", "m": 5}], [None], ["str"]])
def test_malformed_updates_are_dropped_not_fatal(junk: list[Any]) -> None:
    g = Gossip("me", "m:1", MemberMeta(), DEFAULT, random.Random(0), 0.0)
    before = {k: (m.state, m.inc) for k, m in g.members.items()}
    try:
        g.handle(wire_msg({"t": "g.upd", "pb": junk}), 0.0)
    except (KeyError, TypeError, ValueError, AttributeError):
        pass  # the driver drops such a message; what matters is that our own entry is intact
    assert g.members["me"].state == ALIVE
    assert {k: (m.state, m.inc) for k, m in g.members.items() if k == "me"} == {"me": before["me"]}


def test_probe_rounds_cover_everyone_within_two_rounds_and_vary_in_length() -> None:
    """Rounds are cut at random lengths (so peers that start together do not probe in lockstep),
    yet every member is probed at least once in any two consecutive rounds."""
    g = Gossip("me", "m:1", MemberMeta(), DEFAULT, random.Random(3), 0.0)
    n = 40
    for i in range(n):
        g.handle(wire_msg({"t": "g.upd", "pb": [{"k": ALIVE, "n": f"x{i}", "i": 0, "a": f"x:{i}", "m": {}}]}), 0.0)
    rounds: list[list[str]] = []
    picks: list[str] = []
    for _ in range(20 * n):
        if not g.probes.order:
            rounds.append([])
        target = g._pick_target()
        assert target is not None
        picks.append(target)
        if rounds:
            rounds[-1].append(target)
    lengths = [len(r) for r in rounds[1:-1]]
    assert len(set(lengths)) > 3 and min(lengths) >= n // 2 and max(lengths) <= n
    for a, b in zip(rounds[1:-1], rounds[2:-1]):
        assert set(a) | set(b) == {f"x{i}" for i in range(n)}
    assert all(len(r) == len(set(r)) for r in rounds)          # nobody twice in one round


def test_a_suspicion_heard_from_another_member_is_probed_next() -> None:
    """Our next probe goes to a member someone else just suspected: a dead one gets our
    confirmation a probe later (shortening its suspicion), a live one hears of the suspicion
    from us and refutes sooner."""
    net = Net(6, seed=4)
    net.run(2.0)
    observer, target = net.addrs[1], net.addrs[4]
    g = net.g[observer]
    for _ in range(3):   # wherever the target sits in the observer's round
        g.probes.order = [n for n in g.probes.order if n != net.id(target)]
        inc = g.members[net.id(target)].inc
        pb = [{"k": SUSPECT, "n": net.id(target), "i": inc, "f": net.id(net.addrs[2])}]
        g.handle(wire_msg({"t": "g.upd", "pb": pb}), net.now)
        net._drain(observer)
        assert g.members[net.id(target)].state == SUSPECT
        nxt = g.next_deadline()
        net.run(nxt + 1e-6)
        pings = [w for a, w in net.sent if a == observer and w.get("t") == "g.ping"]
        assert pings and pings[-1]["to"] == net.id(target)
        net.run(net.now + 2.0)   # the target refutes; everyone alive again
        assert everyone_alive(net)
