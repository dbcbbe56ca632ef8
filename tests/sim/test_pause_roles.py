"""Pauses are not failures (seeded simulator): the leader's side of ``ft.pause()``.

A trainer that says 'paused' is taken off the data plane (role ``paused``, no slot) so the
others commit without it; it is not left out as a stalled loop however long it pauses (its
loop's beats may stop altogether); back with 'ready' at the head it is a participant again,
behind it a joiner. A paused trainer still holds the committed state: with every trainer
paused, a fresh one joins as a joiner instead of the cluster resuming from its step 0.
"""
from __future__ import annotations

import pytest

from p2pft.core.node import JOINER, PARTICIPANT, TRAINER_KIND
from p2pft.sim.cluster import Simulator
from p2pft.core.view import Role

LT = 2.0  # seconds a loop may go without a beat
TRAINERS = ["10.0.0.1:7000", "10.0.0.2:7000", "10.0.0.3:7000"]
WITNESSES = ["10.0.1.1:7000", "10.0.1.2:7000"]


def _roles(sim: Simulator, node_id: str) -> set[Role | None]:
    return {n.view.role_of(node_id) for n in sim.nodes.values() if n.view is not None}


def _cluster(seed: int, trainers: list[str] = TRAINERS) -> tuple[Simulator, dict[str, bool], dict[str, str]]:
    sim = Simulator(seed)
    everyone = trainers + WITNESSES
    for a in everyone:
        sim.add_node(a, seeds=[x for x in everyone if x != a], kind=TRAINER_KIND if a in trainers else "witness",
                     replica_id=a)
    beating = {a: True for a in trainers}

    def beat(t: float) -> None:
        for a in trainers:
            if beating[a] and a in sim.nodes:
                sim.call(a, lambda node, now: node.loop_beat(now, LT))
        sim.at(t + 0.25, lambda: beat(t + 0.25))
    sim.at(sim.now, lambda: beat(sim.now))
    sim.run_until(15.0, stop=lambda: sim.converged() and all(
        _roles(sim, sim.nodes[t].id) == {PARTICIPANT} for t in trainers))
    ids = {a: sim.nodes[a].id for a in trainers}
    assert all(_roles(sim, ids[a]) == {PARTICIPANT} for a in trainers), "cluster did not form"
    return sim, beating, ids


def _status(sim: Simulator, addr: str, status: str, step: int) -> None:
    def fn(node: object, now: float) -> None:
        node.set_step(step)  # type: ignore[attr-defined]
        node.set_status(status, now, step)  # type: ignore[attr-defined]
    sim.call(addr, fn)


@pytest.mark.parametrize("seed", [1, 2])
def test_paused_trainer_is_off_the_data_plane_not_left_out_and_comes_back(seed: int) -> None:
    sim, beating, ids = _cluster(seed)
    p = TRAINERS[1]
    _status(sim, p, "paused", 0)
    beating[p] = False  # the worst case: no beat at all during the pause
    t0 = sim.now
    sim.run_until(t0 + 5.0, stop=lambda: _roles(sim, ids[p]) == {Role.PAUSED})
    assert _roles(sim, ids[p]) == {Role.PAUSED}, "a paused trainer stayed on the data plane"
    for n in sim.nodes.values():
        assert ids[p] not in {m.node for m in n.view.data_members}
        assert n.view.member(ids[p]).slot is None
    sim.run_until(sim.now + 4 * LT)  # far longer than its loop timeout
    assert _roles(sim, ids[p]) == {Role.PAUSED}, "a paused trainer was left out as a stalled loop"
    assert all(_roles(sim, ids[a]) == {PARTICIPANT} for a in TRAINERS if a != p)

    beating[p] = True
    _status(sim, p, "ready", 0)  # back at the head (the others did not move in this simulation)
    sim.run_until(sim.now + 5.0, stop=lambda: _roles(sim, ids[p]) == {PARTICIPANT})
    assert _roles(sim, ids[p]) == {PARTICIPANT}, "back at the head, the trainer did not take part again"


def test_back_from_a_pause_behind_the_head_is_a_joiner() -> None:
    sim, beating, ids = _cluster(3)
    p = TRAINERS[2]
    _status(sim, p, "paused", 0)
    sim.run_until(sim.now + 5.0, stop=lambda: _roles(sim, ids[p]) == {Role.PAUSED})
    for a in TRAINERS:
        if a != p:
            sim.call(a, lambda node, now: node.set_step(30))
    sim.run_until(sim.now + 2.0)
    _status(sim, p, "ready", 0)
    sim.run_until(sim.now + 5.0, stop=lambda: _roles(sim, ids[p]) == {JOINER})
    assert _roles(sim, ids[p]) == {JOINER}, "a trainer that missed steps came back as a participant"


def test_with_every_trainer_paused_a_fresh_one_joins_as_joiner() -> None:
    """The paused ones hold the committed state of step 40: a new trainer at step 0 must catch
    up from them, not become the cluster's state (no resume below the high-water step)."""
    sim, beating, ids = _cluster(4, TRAINERS[:2])
    for a in TRAINERS[:2]:
        sim.call(a, lambda node, now: node.set_step(40))
        _status(sim, a, "paused", 40)
    sim.run_until(sim.now + 5.0, stop=lambda: all(_roles(sim, ids[a]) == {Role.PAUSED} for a in TRAINERS[:2]))
    assert all(_roles(sim, ids[a]) == {Role.PAUSED} for a in TRAINERS[:2])
    new = TRAINERS[2]
    everyone = TRAINERS + WITNESSES
    sim.add_node(new, seeds=[x for x in everyone if x != new], kind=TRAINER_KIND, replica_id=new)
    sim.call(new, lambda node, now: node.set_status("fresh", now, 0))
    sim.run_until(sim.now + 15.0)  # well past the headless grace period
    new_id = sim.nodes[new].id
    assert _roles(sim, new_id) == {JOINER}, _roles(sim, new_id)
    assert not any(n.stats.get("resumed_below_high_water") for n in sim.nodes.values())
