"""The job's state in the views (seeded simulator runs): it outlives every trainer, a restart
below the high-water step is refused unless a trainer allows it, and the end barrier's
``finished`` flag reaches every member, witnesses included."""
from __future__ import annotations

import pytest

from p2pft.core.node import JOINER, PARTICIPANT, TRAINER_KIND
from p2pft.sim.cluster import Simulator
from p2pft.core.view import JobTarget, TargetKind

TRAINERS = ["10.0.0.1:7000", "10.0.0.2:7000"]
WITNESSES = ["10.0.1.1:7000", "10.0.1.2:7000"]
EVERYONE = TRAINERS + WITNESSES


def _cluster(seed: int) -> Simulator:
    sim = Simulator(seed)
    for a in EVERYONE:
        sim.add_node(a, seeds=[x for x in EVERYONE if x != a], kind=TRAINER_KIND if a in TRAINERS else "witness",
                     replica_id=a)
    sim.run_until(15.0, stop=lambda: sim.converged() and all(
        _role(sim, sim.nodes[t].id) == PARTICIPANT for t in TRAINERS))
    assert all(_role(sim, sim.nodes[t].id) == PARTICIPANT for t in TRAINERS), "cluster did not form"
    return sim


def _role(sim: Simulator, node_id: str) -> str | None:
    roles = {n.view.role_of(node_id) for n in sim.nodes.values() if n.view is not None}
    return roles.pop() if len(roles) == 1 else "disagree"


def _witness_views(sim: Simulator) -> list:
    return [sim.nodes[w].view for w in WITNESSES]


def _kill_trainers(sim: Simulator) -> None:
    for t in TRAINERS:
        sim.crash(t)
    sim.run_until(sim.now + 20.0, stop=lambda: all(v is not None and not v.participants and
                                                   not any(m.role is not None and m.role.value != "witness"
                                                           for m in v.members) for v in _witness_views(sim)))


@pytest.mark.parametrize("seed", [1, 2])
def test_restart_below_high_water_is_refused_until_allowed(seed: int) -> None:
    sim = _cluster(seed)
    for t in TRAINERS:
        sim.call(t, lambda node, now: node.set_step(20))
    sim.run_until(sim.now + 3.0)
    _kill_trainers(sim)
    assert all(v.high_water == 20 and not v.participants for v in _witness_views(sim)), \
        "the witnesses lost the high-water step with the trainers"

    back = sim.restart(TRAINERS[0], seeds=WITNESSES)        # a fresh process: no state, step 0
    sim.run_until(sim.now + 20.0)                            # well past the leader's resume grace
    assert _role(sim, back.id) == JOINER, "a trainer at step 0 resumed a job that had reached step 20"
    assert all(v.high_water == 20 for v in _witness_views(sim))
    leader = sim.leader()
    assert leader is not None and leader.stats["resume_refused"] >= 1

    sim.call(TRAINERS[0], lambda node, now: node.declare_job(None, True, now))
    sim.run_until(sim.now + 20.0, stop=lambda: _role(sim, back.id) == PARTICIPANT)
    assert _role(sim, back.id) == PARTICIPANT, "allow_restart_from_scratch did not let it train"
    assert all(v.high_water == 0 for v in _witness_views(sim)), "the high water did not restart with the job"


@pytest.mark.parametrize("seed", [1, 2])
def test_finished_flag_survives_every_trainer_and_keeps_a_restart_out(seed: int) -> None:
    sim = _cluster(seed)
    target = JobTarget(TargetKind.STEPS, 8)
    for t in TRAINERS:
        sim.call(t, lambda node, now: node.declare_job(target, False, now))
    sim.run_until(sim.now + 3.0, stop=lambda: all(v.target == target for v in _witness_views(sim)))
    assert all(v.target == target for v in _witness_views(sim)), "the declared target is not in the views"
    sim.call(TRAINERS[0], lambda node, now: node.set_status("done", now, 8))
    sim.run_until(sim.now + 3.0)
    assert all(v.finished is None for v in _witness_views(sim)), "finished before every participant was done"
    sim.call(TRAINERS[1], lambda node, now: node.set_status("done", now, 8))
    sim.run_until(sim.now + 5.0, stop=lambda: all(v.finished == 8 for v in _witness_views(sim)))
    assert all(v.finished == 8 for v in _witness_views(sim))

    _kill_trainers(sim)
    back = sim.restart(TRAINERS[0], seeds=WITNESSES)
    sim.run_until(sim.now + 15.0, stop=lambda: _role(sim, back.id) is not None)
    view = sim.nodes[TRAINERS[0]].view
    assert view is not None and view.finished == 8 and view.target == target
    sim.run_until(sim.now + 10.0)
    assert _role(sim, back.id) == JOINER, "a restart after the job finished was made a participant"

    # A further target of the same kind extends the finished job (a trainer that holds step 8 may then
    # train on).
    further = JobTarget(TargetKind.STEPS, 12)
    sim.call(TRAINERS[0], lambda node, now: node.declare_job(further, False, now))
    sim.run_until(sim.now + 5.0, stop=lambda: all(v.finished is None for v in _witness_views(sim)))
    assert all(v.finished is None and v.target == further for v in _witness_views(sim))
