"""Random fault schedules against the real Node code in the simulator.

Safety is checked on every event (one leader per term, one view per epoch everywhere, epochs
only grow). Liveness: once every fault is healed, a view holding exactly the live nodes is
committed at every live node within ``LIVENESS_BOUND`` virtual seconds.

A failing schedule prints its seed, its actions and the command that replays it:

    python tests/sim/test_safety.py SEED [--trace]
"""
from __future__ import annotations

import random
import sys
from dataclasses import dataclass, field, replace
from typing import Any

import pytest

from p2pft.core.node import PARTICIPANT, TRAINER_KIND, WITNESS, WITNESS_KIND
from p2pft.sim.cluster import InvariantViolation, LeaderElected, SimEvent, Simulator, ViewCommitted, view_key

N_SCHEDULES = 500          # run in CHUNKS parametrized tests
CHUNKS = 10
N_DURABLE = 200            # the same kind of schedules with data directories
DURABLE_CHUNKS = 4
LIVENESS_BOUND = 10.0      # virtual seconds from the last heal to a converged view everywhere
FORM_BOUND = 10.0          # virtual seconds for the initial cluster to converge
VOTER_SETTLE = 3.0         # virtual seconds for voter changes to follow a converged membership


@dataclass
class Result:
    seed: int
    plan: list[tuple[float, str, float]]
    applied: list[str] = field(default_factory=list)
    liveness: float | None = None
    sequences: dict[str, list[tuple[Any, ...]]] = field(default_factory=dict)   # node -> committed view keys
    sim: Simulator | None = None


def make_plan(seed: int) -> tuple[int, str, list[str], list[tuple[float, str, float]]]:
    """Everything a schedule does, decided by the seed alone: size, start, node kinds, faults."""
    rng = random.Random(seed)
    n = rng.randint(3, 7)
    start = rng.choice(["chain", "same_seeds"])
    kinds = [rng.choice([WITNESS_KIND, TRAINER_KIND]) for _ in range(n)]
    plan = []
    t = 0.0
    for _ in range(rng.randint(3, 10)):
        t += rng.uniform(0.05, 1.5)
        kind = rng.choice(["crash", "crash", "restart", "partition", "oneway", "heal", "net"])
        plan.append((round(t, 3), kind, rng.random()))
    return n, start, kinds, plan


def cut_off(sim: Simulator) -> set[str]:
    """Live voter ids (node ids, unless restored from a data directory) that a partition or
    one-way block separates from some other node."""
    ids = set()
    for a, b in sim.blocked:
        for x in (a, b):
            if x in sim.nodes:
                ids.add(sim.nodes[x].voter_id)
    return ids


def voter_sets(sim: Simulator) -> list[frozenset[str]]:
    """Every voter set in any live node's log, committed or not, and the one a leader has
    decided to propose next (its two-step voter change is under way)."""
    out: list[frozenset[str]] = []
    for node in sim.nodes.values():
        pending = node.planner.voter_change[0] if node.is_leader() and node.planner.voter_change else None
        for voters in (v.voters for v in (node.raft.last_view(), node.view) if v):
            if frozenset(voters) not in out:
                out.append(frozenset(voters))
        if pending is not None and frozenset(pending) not in out:
            out.append(frozenset(pending))
    return out


def dropped_voters(sim: Simulator) -> set[str]:
    """Voters that some node's newest view no longer lists as members: gossip holds them dead
    (rightly or not), so the leader is about to drop them from the voters."""
    out: set[str] = set()
    for node in sim.nodes.values():
        view = node.raft.last_view()
        if view:
            out |= set(view.voters) - {m.voter_id for m in view.members}
    return out


def may_crash(sim: Simulator, addr: str) -> bool:
    """The fault budget: after this crash, every voter set still has a majority that is alive,
    not cut off by a partition and not about to be dropped. Such voters count as failed: the
    leader may remove one from the voters, and a crash in that window would leave a voter set
    with no live majority, which no protocol with single-server changes can recover from."""
    victim = sim.nodes[addr].voter_id
    usable = {n.voter_id for n in sim.nodes.values()} - {victim} - cut_off(sim) - dropped_voters(sim)
    return all(len(s & usable) * 2 > len(s) for s in voter_sets(sim))


def run_schedule(seed: int, *, trace: bool = False, keep_sim: bool = False, durable: bool = False) -> Result:
    """``durable``: every node has a data directory (a restart keeps its voter identity), and a
    crash loses it with probability 0.3 (the node then comes back as a new voter)."""
    n, start, kinds, plan = make_plan(seed)
    res = Result(seed, plan)
    rng = random.Random(seed * 7919 + 1)

    def on_event(ev: SimEvent) -> None:
        if isinstance(ev, ViewCommitted):
            res.sequences.setdefault(ev.node, []).append(view_key(ev.view))
        if trace:
            what = (f"view e{ev.view.epoch} {sorted(m.node for m in ev.view.members)}" if isinstance(ev, ViewCommitted)
                    else f"leader {ev.term}" if isinstance(ev, LeaderElected) else ev)
            print(f"  t={ev.now:8.3f} {ev.node:24} {what}")

    def note(action: str) -> None:
        res.applied.append(action)
        if trace:
            print(f"  ** {action}")

    sim = Simulator(seed, on_event=on_event)
    addrs = [f"10.0.0.{i}:7000" for i in range(n)]
    for i, a in enumerate(addrs):
        seeds = ([] if i == 0 else [addrs[0]]) if start == "chain" else addrs
        sim.add_node(a, seeds=seeds, kind=kinds[i], durable=durable)
    sim.run_until(FORM_BOUND, stop=sim.converged)
    if not sim.converged():
        raise AssertionError(f"initial cluster of {n} did not converge within {FORM_BOUND} s")
    t0 = sim.now
    for t, kind, x in plan:
        sim.run_until(t0 + t)
        r = random.Random(x)
        if kind == "crash":
            allowed = sorted(a for a in sim.nodes if may_crash(sim, a))
            if allowed:
                a = r.choice(allowed)
                lose = durable and r.random() < 0.3
                note(f"t={sim.now:.3f} crash {a} ({sim.nodes[a].id}){' losing its data directory' if lose else ''}")
                sim.crash(a, lose_disk=lose)
        elif kind == "restart" and sim.crashed:
            a = r.choice(sorted(sim.crashed))
            sim.restart(a, seeds=[s for s in addrs if s != a])
            note(f"t={sim.now:.3f} restart {a} as {sim.nodes[a].id}")
        elif kind == "partition":
            shuffled = list(addrs)
            r.shuffle(shuffled)
            k = r.randint(1, len(shuffled) - 1)
            sim.partition(shuffled[:k], shuffled[k:])
            note(f"t={sim.now:.3f} partition {sorted(shuffled[:k])} | {sorted(shuffled[k:])}")
        elif kind == "oneway":
            a, b = r.sample(addrs, 2)
            sim.block(a, b)
            note(f"t={sim.now:.3f} block {a} -> {b}")
        elif kind == "heal":
            sim.heal()
            note(f"t={sim.now:.3f} heal")
        elif kind == "net":
            sim.loss = r.choice([0.0, 0.05, 0.2])
            sim.dup = r.choice([0.0, 0.05])
            sim.delay = r.choice([(0.0002, 0.002), (0.001, 0.05)])
            note(f"t={sim.now:.3f} net loss={sim.loss} dup={sim.dup} delay={sim.delay}")
    # Heal everything: no partitions, no loss; each crashed address is restarted or stays dead.
    sim.heal()
    sim.loss, sim.dup, sim.delay = 0.0, 0.0, (0.0002, 0.002)
    for a in sorted(sim.crashed):
        if rng.random() < 0.5:
            sim.restart(a, seeds=[s for s in addrs if s != a])
            note(f"t={sim.now:.3f} heal: restart {a} as {sim.nodes[a].id}")
    t_heal = sim.now
    sim.run_until(t_heal + LIVENESS_BOUND, stop=sim.converged)
    if sim.converged():
        res.liveness = sim.now - t_heal
    if keep_sim:
        res.sim = sim
    return res


def replay_text(res: Result) -> str:
    n, start, kinds, _ = make_plan(res.seed)
    lines = [f"seed {res.seed}: {n} nodes, start={start}, kinds={kinds}", "applied:"]
    lines += [f"  {a}" for a in res.applied] or ["  (none)"]
    lines.append(f"replay: python tests/sim/test_safety.py {res.seed} --trace")
    return "\n".join(lines)


def check_one(seed: int, durable: bool = False) -> Result:
    try:
        res = run_schedule(seed, keep_sim=True, durable=durable)
    except InvariantViolation as exc:
        partial = Result(seed, make_plan(seed)[3])
        pytest.fail(f"safety violated: {exc}\nseed {seed}, plan {partial.plan}\n"
                    f"replay: python tests/sim/test_safety.py {seed} --trace")
    assert res.sim is not None
    if res.liveness is None:
        pytest.fail(f"no converged view within {LIVENESS_BOUND} s after healing\n{replay_text(res)}")
    bad = {n.id: n.stats["bad_message"] for n in res.sim.nodes.values() if n.stats["bad_message"]}
    assert not bad, f"correct nodes sent messages their peers could not handle: {bad}\n{replay_text(res)}"
    return res


@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_random_fault_schedules(chunk: int) -> None:
    per = N_SCHEDULES // CHUNKS
    worst = 0.0
    faults = 0
    for seed in range(chunk * per, (chunk + 1) * per):
        res = check_one(seed)
        assert res.liveness is not None
        worst = max(worst, res.liveness)
        faults += len(res.applied)
    assert faults > per  # the schedules really injected faults
    print(f"\nchunk {chunk}: {per} schedules, {faults} faults, worst heal->converged {worst:.3f} s virtual")


def check_chain(res: Result) -> None:
    """Every node's committed views are one chain: strictly growing epochs, each equal to the one
    global view of its epoch; consecutive views change the voter set by at most one server."""
    global_map: dict[int, tuple[Any, ...]] = {}
    for node, seq in res.sequences.items():
        epochs = [k[0] for k in seq]
        assert epochs == sorted(epochs) and len(set(epochs)) == len(epochs), f"{node}: {epochs}"
        for key in seq:
            assert global_map.setdefault(key[0], key) == key, f"epoch {key[0]} has two views"
    epochs = sorted(global_map)
    for e1, e2 in zip(epochs, epochs[1:]):
        if e2 == e1 + 1:
            v1, v2 = set(global_map[e1][2]), set(global_map[e2][2])
            assert len(v1 ^ v2) <= 1, f"epochs {e1}->{e2} changed voters {sorted(v1)} -> {sorted(v2)}"
    sim = res.sim
    assert sim is not None
    # Voter changes follow member changes by a view or two: let them settle, then check the set.
    sim.run_until(sim.now + VOTER_SETTLE)
    global_map.update({k[0]: k for seq in res.sequences.values() for k in seq})
    epochs = sorted(global_map)
    final = {view_key(n.view) for n in sim.nodes.values() if n.view}
    assert len(final) == 1 and final.pop() == global_map[epochs[-1]]
    for n in sim.nodes.values():
        assert n.view is not None
        members = n.view.members
        slots = [m.slot for m in members if m.role is PARTICIPANT]
        assert len(slots) == len(set(slots)) and None not in slots
        assert all(m.slot is None for m in members if m.role is WITNESS)
        assert n.view.data_epoch <= n.view.epoch
        voters = set(n.view.voters)
        assert voters <= {m.voter_id for m in members}, "a voter outside the view"
        live = len(members)
        assert len(voters) == min(n.p.max_voters, live if live % 2 else live - 1), f"{len(voters)} voters of {live}"


@pytest.mark.parametrize("seed", range(10_000, 10_060))
def test_committed_views_form_one_chain(seed: int) -> None:
    check_chain(check_one(seed))


@pytest.mark.parametrize("chunk", range(DURABLE_CHUNKS))
def test_random_fault_schedules_with_data_directories(chunk: int) -> None:
    """The same fault schedules with every node durable: restarts keep their voter identity (or
    lose it with their directory), on top of partitions, one-way blocks, loss, duplication and
    reordering; the disk writes are checked too (one vote per term, terms and commits never
    go back), and the views still form one chain."""
    per = N_DURABLE // DURABLE_CHUNKS
    for seed in range(20_000 + chunk * per, 20_000 + (chunk + 1) * per):
        res = check_one(seed, durable=True)
        if seed % 5 == 0:
            check_chain(res)


def test_the_checker_catches_a_forged_second_view() -> None:
    """The invariant checker used above is not vacuous: a conflicting view for an epoch trips it."""
    res = check_one(3)
    sim = res.sim
    assert sim is not None
    node = next(iter(sim.nodes.values()))
    forged = replace(node.view, members=node.view.members[:-1])
    with pytest.raises(InvariantViolation):
        sim.checker.on_event(ViewCommitted("10.9.9.9:7000", "someone-else", sim.now, forged))


def main(argv: list[str]) -> int:
    """Replay one seed: ``python tests/sim/test_safety.py SEED [--trace] [--durable]``."""
    if not argv or not argv[0].isdigit():
        print(__doc__)
        return 2
    seed = int(argv[0])
    n, start, kinds, plan = make_plan(seed)
    print(f"seed {seed}: {n} nodes, start={start}, kinds={kinds}\nplan: {plan}")
    try:
        res = run_schedule(seed, trace="--trace" in argv, keep_sim=True, durable="--durable" in argv)
    except InvariantViolation as exc:
        print(f"SAFETY VIOLATION: {exc}")
        return 1
    print(replay_text(res))
    print(f"heal -> converged: {res.liveness if res.liveness is not None else 'NOT WITHIN BOUND'}")
    return 0 if res.liveness is not None else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
