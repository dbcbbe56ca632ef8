"""A trainer whose training loop is wedged while its process keeps gossiping (seeded simulator).

Gossip alone would keep such a trainer in every view, and every allreduce of the data plane
would wait for it forever. Trainers report their loop's beats to the leader with the time they
may go without one (``lt``); the leader leaves a trainer out once its beats stop for longer,
and takes it back (as a joiner: it was left out) when they resume. A trainer that declares no
``lt`` is never left out for this.
"""
from __future__ import annotations

import pytest

from p2pft.core.node import JOINER, PARTICIPANT, TRAINER_KIND
from p2pft.sim.cluster import Simulator
from p2pft.core.view import Role

LT = 2.0  # seconds a loop may go without a beat


def _roles(sim: Simulator, node_id: str) -> set[Role | None]:
    return {n.view.role_of(node_id) for n in sim.nodes.values() if n.view is not None}


def start_beating(sim: Simulator, trainers: list[str]) -> dict[str, bool]:
    """Every 0.25 s virtual, each trainer whose flag is set beats; returns the flags."""
    beating = {a: True for a in trainers}

    def beat(t: float) -> None:
        for a in trainers:
            if beating[a]:
                sim.call(a, lambda node, now: node.loop_beat(now, LT))
        sim.at(t + 0.25, lambda: beat(t + 0.25))
    sim.at(sim.now, lambda: beat(sim.now))
    return beating


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_wedged_loop_is_left_out_then_comes_back_as_joiner(seed: int) -> None:
    sim = Simulator(seed)
    trainers = ["10.0.0.1:7000", "10.0.0.2:7000", "10.0.0.3:7000"]
    everyone = trainers + ["10.0.1.1:7000", "10.0.1.2:7000"]
    for a in everyone:
        sim.add_node(a, seeds=[x for x in everyone if x != a], kind=TRAINER_KIND if a in trainers else "witness",
                     replica_id=a)
    beating = start_beating(sim, trainers)
    sim.run_until(15.0, stop=lambda: sim.converged() and all(
        _roles(sim, sim.nodes[t].id) == {PARTICIPANT} for t in trainers))
    ids = {a: sim.nodes[a].id for a in trainers}
    assert all(_roles(sim, ids[a]) == {PARTICIPANT} for a in trainers), "cluster did not form"

    wedged = trainers[2]
    beating[wedged] = False
    t0 = sim.now
    sim.run_until(t0 + LT + 5.0, stop=lambda: _roles(sim, ids[wedged]) == {None})
    took = sim.now - t0
    assert _roles(sim, ids[wedged]) == {None}, "a trainer with a wedged loop stayed in the view"
    assert LT <= took <= LT + 3.0, took  # not before its declared time; soon after it
    assert all(_roles(sim, ids[a]) == {PARTICIPANT} for a in trainers[:2]), "a beating trainer was left out"
    # Its process never stopped gossiping: it is alive, only out of the view.
    assert wedged in sim.nodes

    beating[wedged] = True
    t1 = sim.now
    sim.run_until(t1 + 5.0, stop=lambda: _roles(sim, ids[wedged]) == {JOINER})
    assert _roles(sim, ids[wedged]) == {JOINER}, "the trainer did not come back (as a joiner) once its loop ran"


def test_trainer_without_declared_loop_timeout_is_never_left_out() -> None:
    sim = Simulator(7)
    everyone = ["10.0.0.1:7000", "10.0.0.2:7000", "10.0.1.1:7000"]
    for a in everyone:
        sim.add_node(a, seeds=[x for x in everyone if x != a], kind=TRAINER_KIND, replica_id=a)
    sim.run_until(30.0)
    assert sim.converged() and all(len(n.view.members) == 3 for n in sim.nodes.values())


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_wedged_leader_steps_down_and_is_left_out(seed: int) -> None:
    """Three trainers and no witness: the wedged one is the Raft leader, which cannot leave
    itself out; it steps down and stops campaigning, and the next leader leaves it out."""
    sim = Simulator(seed)
    trainers = ["10.0.0.1:7000", "10.0.0.2:7000", "10.0.0.3:7000"]
    for a in trainers:
        sim.add_node(a, seeds=[x for x in trainers if x != a], kind=TRAINER_KIND, replica_id=a)
    beating = start_beating(sim, trainers)
    sim.run_until(15.0, stop=lambda: sim.converged() and sim.leader() is not None and all(
        _roles(sim, sim.nodes[t].id) == {PARTICIPANT} for t in trainers))
    leader = sim.leader()
    assert leader is not None
    wedged = next(a for a, n in sim.nodes.items() if n is leader)
    beating[wedged] = False
    t0 = sim.now
    sim.run_until(t0 + 3 * LT + 5.0, stop=lambda: _roles(sim, leader.id) == {None})
    assert _roles(sim, leader.id) == {None}, "a wedged leader kept itself in the view"
    new = sim.leader()
    assert new is not None and new.id != leader.id
    assert sim.now - t0 <= 2 * LT + 3.0, sim.now - t0
