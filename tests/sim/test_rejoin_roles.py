"""Who may come back as a participant at once (seeded simulator runs).

A replica cut off from the others can finish an allreduce that theirs fail (it still receives
the last frames while its own are lost): it then holds a step the others redo without it. So a
trainer that was left out of a view must come back through catch-up (as a joiner), even when it
reports 'ready' at the participants' own step; a fresh process at that step (a new node id) may
start as a participant.
"""
from __future__ import annotations

from typing import Any

import pytest

from p2pft.core.node import JOINER, PARTICIPANT, TRAINER_KIND
from p2pft.sim.cluster import Simulator, ViewCommitted


def _role(sim: Simulator, node_id: str) -> str | None:
    views = [n.view for n in sim.nodes.values() if n.view is not None]
    roles = {v.role_of(node_id) for v in views}
    return roles.pop() if len(roles) == 1 else "disagree"


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_cut_off_trainer_returns_as_joiner_fresh_process_as_participant(seed: int) -> None:
    sim = Simulator(seed)
    trainers = ["10.0.0.1:7000", "10.0.0.2:7000", "10.0.0.3:7000"]
    witnesses = ["10.0.1.1:7000", "10.0.1.2:7000"]
    everyone = trainers + witnesses
    for a in everyone:
        kind = TRAINER_KIND if a in trainers else "witness"
        sim.add_node(a, seeds=[x for x in everyone if x != a], kind=kind, replica_id=a)
    cut = trainers[2]
    sim.run_until(15.0, stop=lambda: sim.converged() and all(
        _role(sim, sim.nodes[t].id) == PARTICIPANT for t in trainers))
    assert all(_role(sim, sim.nodes[t].id) == PARTICIPANT for t in trainers), "cluster did not form"
    node_id = sim.nodes[cut].id

    sim.partition([cut], [a for a in everyone if a != cut])
    t0 = sim.now
    sim.run_until(t0 + 10.0, stop=lambda: all(
        n.view is not None and n.view.member(node_id) is None
        for a, n in sim.nodes.items() if a != cut))
    majority_view = sim.nodes[trainers[0]].view
    assert majority_view is not None and majority_view.member(node_id) is None
    assert node_id in majority_view.left

    # It still says 'ready' at step 0, the participants' step: before, that meant "participant".
    sim.heal()
    t1 = sim.now
    sim.run_until(t1 + 10.0, stop=lambda: sim.converged() and _role(sim, node_id) is not None)
    assert _role(sim, node_id) == JOINER, "a trainer left out of a view came back as a participant"

    # A fresh process in its place (new node id, 'ready' at the head) starts as a participant.
    sim.crash(cut)
    fresh = sim.restart(cut, seeds=[a for a in everyone if a != cut])
    t2 = sim.now
    sim.run_until(t2 + 15.0, stop=lambda: sim.converged() and _role(sim, fresh.id) == PARTICIPANT)
    assert _role(sim, fresh.id) == PARTICIPANT


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_fresh_process_behind_the_head_stays_a_joiner_until_it_caught_up(seed: int) -> None:
    """A process that just started at step 0 while the others are at step 5 holds none of the
    steps in between: it stays a joiner in every later view, however close its step is (the
    slack for a caught-up joiner must not let it in), until it says 'ready' after a catch-up."""
    seen: dict[int, Any] = {}
    sim = Simulator(seed, on_event=lambda ev: seen.setdefault(ev.view.epoch, ev.view)
                    if isinstance(ev, ViewCommitted) else None)
    trainers = ["10.0.0.1:7000", "10.0.0.2:7000"]
    witnesses = ["10.0.1.1:7000", "10.0.1.2:7000"]
    everyone = trainers + witnesses
    for a in everyone:
        sim.add_node(a, seeds=[x for x in everyone if x != a], kind=TRAINER_KIND if a in trainers else "witness",
                     replica_id=a)
    sim.run_until(15.0, stop=lambda: sim.converged() and all(
        _role(sim, sim.nodes[t].id) == PARTICIPANT for t in trainers))
    assert all(_role(sim, sim.nodes[t].id) == PARTICIPANT for t in trainers), "cluster did not form"
    for t in trainers:
        sim.call(t, lambda node, now: node.set_step(5))
    sim.run_until(sim.now + 2.0)

    late = "10.0.0.3:7000"
    node = sim.add_node(late, seeds=everyone, kind=TRAINER_KIND, replica_id=late)
    sim.run_until(sim.now + 10.0, stop=lambda: sim.converged() and _role(sim, node.id) == JOINER)
    assert _role(sim, node.id) == JOINER
    # More views while it is a joiner (a new witness joins): it must not be promoted in any.
    extra = "10.0.1.3:7000"
    sim.add_node(extra, seeds=everyone, kind="witness", replica_id=extra)
    sim.run_until(sim.now + 10.0, stop=lambda: sim.converged() and _role(sim, sim.nodes[extra].id) is not None)
    assert _role(sim, sim.nodes[extra].id) is not None, "the new witness never got in"
    sim.run_until(sim.now + 5.0)
    promoted = [v.epoch for v in seen.values() if v.role_of(node.id) == PARTICIPANT]
    assert not promoted, f"a fresh process at step 0 was a participant in views {promoted} (head at step 5)"

    # Caught up (a joiner applies every step, so 'ready' a step behind the head is current).
    sim.call(late, lambda n, now: n.set_status("ready", now, 4))
    sim.run_until(sim.now + 10.0, stop=lambda: sim.converged() and _role(sim, node.id) == PARTICIPANT)
    assert _role(sim, node.id) == PARTICIPANT
