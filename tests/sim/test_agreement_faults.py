"""Agreement under attack, as named scenarios (the random schedules of test_safety.py cover
them only by chance): the Raft leader crashes; two of five voters crash at once (with and
without the leader); a voter, or the leader, crashes while a view change is in flight.

Seven witness peers, five of them voters. Every event goes through the simulator's invariant
checker (one leader per term, one view per epoch everywhere, epochs only grow). After each
scenario a view of exactly the live nodes must be committed at every live node within
``BOUND`` virtual seconds, with a new leader where the old one died and five voters again.
"""
from __future__ import annotations

from typing import Callable

import pytest

from p2pft.core.node import Node
from p2pft.sim.cluster import Simulator

N = 7
BOUND = 10.0   # virtual seconds from the crash to a converged view of the live nodes
SEEDS = [1, 2, 3, 4]


def formed(seed: int) -> Simulator:
    sim = Simulator(seed)
    addrs = [f"10.0.0.{i + 1}:7000" for i in range(N)]
    for a in addrs:
        sim.add_node(a, seeds=[x for x in addrs if x != a])
    sim.run_until(20.0, stop=lambda: sim.converged() and sim.leader() is not None
                  and all(len(n.view.voters) == 5 for n in sim.nodes.values()))
    assert sim.converged() and sim.leader() is not None, "cluster did not form"
    assert all(len(n.view.voters) == 5 for n in sim.nodes.values())
    return sim


def addr_of(sim: Simulator, node: Node) -> str:
    return next(a for a, n in sim.nodes.items() if n is node)


def voters(sim: Simulator) -> list[str]:
    """Addresses of the current voters, the leader first."""
    leader = sim.leader()
    assert leader is not None and leader.view is not None
    ids = set(leader.view.voters)
    out = [addr_of(sim, leader)]
    out += sorted(a for a, n in sim.nodes.items() if n.id in ids and n is not leader)
    return out


def converge(sim: Simulator, t0: float, what: str) -> float:
    sim.run_until(t0 + BOUND, stop=lambda: sim.converged() and sim.leader() is not None)
    assert sim.converged(), f"{what}: no view of exactly the live nodes within {BOUND} s virtual ({sim.replay_hint()})"
    took = sim.now - t0
    # Voter replacement follows the member change one server at a time: let it finish.
    def voters_settled() -> bool:
        return all(n.view is not None and set(n.view.voters) <= sim.live_ids()
                   and len(n.view.voters) == min(5, len(sim.nodes)) for n in sim.nodes.values())
    sim.run_until(sim.now + BOUND, stop=voters_settled)
    for n in sim.nodes.values():
        assert n.view is not None and set(n.view.voters) <= sim.live_ids()
        assert len(n.view.voters) == min(5, len(sim.nodes)), f"{what}: voters {n.view.voters}"
    return took


def crash_all(sim: Simulator, addrs: list[str]) -> None:
    for a in addrs:
        sim.crash(a)


@pytest.mark.parametrize("seed", SEEDS)
def test_leader_crash(seed: int) -> None:
    sim = formed(seed)
    old = sim.leader()
    assert old is not None
    t0 = sim.now
    sim.crash(addr_of(sim, old))
    took = converge(sim, t0, "leader crash")
    new = sim.leader()
    assert new is not None and new.id != old.id
    assert took < BOUND


@pytest.mark.parametrize("with_leader", [False, True], ids=["two-followers", "leader-and-one"])
@pytest.mark.parametrize("seed", SEEDS)
def test_two_of_five_voters_at_once(seed: int, with_leader: bool) -> None:
    sim = formed(seed)
    vs = voters(sim)
    victims = [vs[0], vs[1]] if with_leader else [vs[1], vs[2]]
    gone = {sim.nodes[a].id for a in victims}
    t0 = sim.now
    crash_all(sim, victims)
    converge(sim, t0, f"two voters crashed ({'with' if with_leader else 'without'} the leader)")
    leader = sim.leader()
    assert leader is not None and leader.id not in gone
    assert all(m.node not in gone for n in sim.nodes.values() for m in n.view.members)


def _in_flight(sim: Simulator) -> Callable[[], bool]:
    def pending() -> bool:
        leader = sim.leader()
        return leader is not None and leader.raft.pending()
    return pending


@pytest.mark.parametrize("victim", ["voter", "leader"])
@pytest.mark.parametrize("seed", SEEDS)
def test_crash_during_a_view_change(seed: int, victim: str) -> None:
    sim = formed(seed)
    vs = voters(sim)
    non_voter = next(a for a in sorted(sim.nodes) if a not in vs)
    t0 = sim.now
    sim.crash(non_voter)  # starts a view change once it is detected
    sim.run_until(t0 + BOUND, stop=_in_flight(sim))
    assert _in_flight(sim)(), "the leader never proposed a view without the crashed node"
    second = vs[0] if victim == "leader" else vs[1]
    sim.crash(second)  # while that view is proposed but not committed
    converge(sim, t0, f"{victim} crashed during a view change")
    assert len(sim.nodes) == N - 2
