"""Membership at scale in the simulator: crash detection bounds, no false removals under loss.

The 1,000-peer and 10-minute versions of these runs are in bench/membership.py.
"""
from __future__ import annotations

import random

from p2pft.core.config import DEFAULT
from p2pft.sim.cluster import InvariantChecker, SimEvent, Simulator, ViewCommitted

DETECT_BOUND = 3.0     # virtual s from a crash to "every live node's committed view lacks it" (100 peers)


def form(n: int, seed: int, *, checker: InvariantChecker | None = None) -> tuple[Simulator, list[str]]:
    """n peers joining through up to 3 random earlier peers, 5 ms apart; returns once converged."""
    sim = Simulator(seed, checker=checker)
    rng = random.Random(seed)
    addrs = [f"10.{i // 250}.{i % 250}.1:7000" for i in range(n)]
    sim.add_node(addrs[0])
    for i, a in enumerate(addrs[1:], start=1):
        seeds = rng.sample(addrs[:i], min(3, i))
        sim.at(0.005 * i, lambda a=a, seeds=seeds: sim.add_node(a, seeds=seeds))

    calls = [0]

    def done() -> bool:
        # Views agree and every gossip table is complete (a mass join takes a while to spread).
        # Checked every 200 events: converged() is O(n^2).
        calls[0] += 1
        return (calls[0] % 200 == 0 and len(sim.nodes) == n
                and all(x.gossip.alive_count() == n for x in sim.nodes.values()) and sim.converged())

    sim.run_until(0.005 * n + 30.0, stop=done)
    calls[0] = -1
    assert done(), f"{n} peers did not converge"
    return sim, addrs


def excluded_everywhere(sim: Simulator, node_id: str) -> bool:
    return all(n.view is not None and n.view.member(node_id) is None
               for n in sim.nodes.values())


def detect(sim: Simulator, addr: str) -> float:
    node_id = sim.nodes[addr].id
    t0 = sim.now
    sim.crash(addr)
    sim.run_until(t0 + DETECT_BOUND + 5.0, stop=lambda: excluded_everywhere(sim, node_id))
    assert excluded_everywhere(sim, node_id), f"{addr} still in some view {sim.now - t0:.1f} s after its crash"
    return sim.now - t0


def test_crash_detection_at_100_peers_within_bound() -> None:
    sim, addrs = form(100, seed=1)
    sim.loss = 0.01
    rng = random.Random(2)
    times = []
    for _ in range(3):
        leader = sim.leader()
        assert leader is not None
        victim = rng.choice(sorted(a for a in sim.nodes if a != leader.addr))
        times.append(detect(sim, victim))
        sim.run_until(sim.now + 1.0)
    leader = sim.leader()
    assert leader is not None
    times.append(detect(sim, leader.addr))          # the leader too: election + new view
    print(f"\ndetection at 100 peers (1% loss): {[round(t, 2) for t in times]} s virtual")
    assert max(times) <= DETECT_BOUND
    # Suspicion is at work: nobody is removed on the first missed ack.
    assert min(times) >= DEFAULT.suspicion_min


class RemovalCounter(InvariantChecker):
    """The usual checker, plus every 'dead' and every view that drops a member."""

    def __init__(self) -> None:
        super().__init__()
        self.removals: list[tuple[float, str]] = []
        self.last_members: dict[str, set[str]] = {}

    def on_event(self, ev: SimEvent) -> None:
        super().on_event(ev)
        if isinstance(ev, ViewCommitted):
            members = {m.node for m in ev.view.members}
            before = self.last_members.get(ev.node)
            if before is not None:
                self.removals += [(ev.now, gone) for gone in before - members]
            self.last_members[ev.node] = members


def test_no_false_removal_at_5_percent_loss() -> None:
    """60 peers, 5% message loss, no crash, 3 simulated minutes: nobody is removed from a view
    and gossip declares nobody dead."""
    checker = RemovalCounter()
    sim, _ = form(60, seed=3, checker=checker)
    sim.loss = 0.05
    t0 = sim.now
    epoch0 = max(n.view.epoch for n in sim.nodes.values() if n.view)
    sim.run_until(t0 + 180.0)
    declared = sum(1 for n in sim.nodes.values() for m in n.gossip.members.values() if m.state == "dead")
    refutations = sum(n.gossip.inc for n in sim.nodes.values())
    print(f"\n60 peers, 5% loss, 180 s: {refutations} suspicions refuted, {len(checker.removals)} removals")
    assert checker.removals == [], f"false removals: {checker.removals[:5]}"
    assert declared == 0
    assert sim.converged()
    assert max(n.view.epoch for n in sim.nodes.values()) == epoch0   # no view churn at all
    assert sum(sim.sent.values()) > 60 * 180 * 5                        # it really ran: >5 msgs/node/s
