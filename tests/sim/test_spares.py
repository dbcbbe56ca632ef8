"""Hot spares (seeded simulator runs): with more trainers than the planned participants, the
extra ones stay joiners (spares, kept current by the data plane), and the view that removes a
dead participant promotes a spare in the same view: a failure costs one view change."""
from __future__ import annotations

import pytest

from p2pft.sim.cluster import Simulator, ViewCommitted
from p2pft.core.view import Role, View

TRAINERS = [f"10.0.0.{i}:7000" for i in range(1, 5)]
WITNESSES = ["10.0.1.1:7000", "10.0.1.2:7000"]


def _roles(sim: Simulator) -> dict[str, Role] | None:
    """Roles by address in the view every live node agrees on (None while they disagree)."""
    views = {n.view.epoch: n.view for n in sim.nodes.values() if n.view is not None}
    if len(views) != 1 or not sim.converged():
        return None
    (view,) = views.values()
    by_node = {n.id: a for a, n in sim.nodes.items()}
    return {by_node[m.node]: m.role for m in view.members if m.node in by_node}


def _count(roles: dict[str, Role] | None, role: Role) -> int:
    return sum(1 for r in (roles or {}).values() if r is role)


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_a_spare_takes_the_dead_participants_place_in_one_view(seed: int) -> None:
    seen: dict[int, View] = {}
    sim = Simulator(seed, on_event=lambda ev: seen.setdefault(ev.view.epoch, ev.view)
                    if isinstance(ev, ViewCommitted) else None)
    everyone = TRAINERS + WITNESSES
    for a in everyone:
        kind = "trainer" if a in TRAINERS else "witness"
        sim.add_node(a, seeds=[x for x in everyone if x != a], kind=kind, replica_id=a,
                     max_participants=3 if kind == "trainer" else None)
    sim.run_until(20.0, stop=lambda: _count(_roles(sim), Role.PARTICIPANT) == 3
                  and _count(_roles(sim), Role.JOINER) == 1)
    roles = _roles(sim)
    assert roles is not None and _count(roles, Role.PARTICIPANT) == 3, roles
    spare = next(a for a, r in roles.items() if r is Role.JOINER)
    victim = next(a for a, r in roles.items() if r is Role.PARTICIPANT)
    # Stays so: the spare is not promoted while three participants live.
    sim.run_until(sim.now + 5.0)
    assert _roles(sim) == roles

    dead_id = sim.nodes[victim].id
    epochs_before = {n.view.epoch for n in sim.nodes.values() if n.view is not None}
    sim.crash(victim)
    sim.run_until(sim.now + 15.0, stop=lambda: (_roles(sim) or {}).get(spare) is Role.PARTICIPANT)
    roles = _roles(sim)
    assert roles is not None and roles[spare] is Role.PARTICIPANT and _count(roles, Role.PARTICIPANT) == 3
    # The first view without the dead participant already has the spare as a participant.
    first = min((v for v in seen.values() if v.member(dead_id) is None and v.epoch > max(epochs_before)),
                key=lambda v: v.epoch)
    assert first.role_of(sim.nodes[spare].id) is Role.PARTICIPANT, first

    # The restarted process becomes the new spare.
    fresh = sim.restart(victim, seeds=[a for a in everyone if a != victim])
    sim.run_until(sim.now + 15.0, stop=lambda: (_roles(sim) or {}).get(victim) is not None)
    sim.run_until(sim.now + 3.0)
    roles = _roles(sim)
    assert roles is not None and roles[victim] is Role.JOINER and _count(roles, Role.PARTICIPANT) == 3, roles
    assert fresh.view is not None

