"""A majority of the voters killed at once, and their return with their data directories.

Seeded schedules in the simulator (3-7 members: 0-2 witnesses that live on, trainers with data
directories; message loss and duplication): after the job has declared its target and reached a
step that a committed view carries, a majority of the voters (all trainers) is crashed at once,
some of them losing their data directory, and held down for a while; then every one is
restarted at its address. Checked:

- safety on every event: one leader per term, one view per epoch everywhere, epochs grow; on
  every write to a voter's disk: its term never goes back, its vote in a term never changes, what
  it knew to be committed never shrinks (``InvariantChecker``);
- while the majority is down, every live member reports the missing voters (``Node.quorum_lost``:
  the ERROR line, logged once) within ``ERROR_BOUND``;
- when enough voters come back with their disks to make a majority of the voter set, a view of
  exactly the live members is committed everywhere within ``HEAL_BOUND`` of the last restart, the
  job's state is kept (the target and high water committed before the loss; with a witness alive,
  the high water of the steps made after that view, which only the witnesses' gossip saw), and the
  voters settle on live members; when too many disks were lost, nothing is committed (the
  cluster stays stuck, safely, and says so).

The same schedules without data directories (the code before durable voters: a restarted process
is a new identity) stay stuck: ``test_without_data_dirs_the_same_schedules_stay_stuck``.

Replay one: ``python tests/sim/test_majority_loss.py SEED [--old]``; many, with the report and
heal times: ``python tests/sim/test_majority_loss.py --sweep 0 5000``.
"""
from __future__ import annotations

import random
import sys
from dataclasses import dataclass, field

import pytest

from p2pft.core.meta import Status
from p2pft.core.node import TRAINER_KIND, WITNESS_KIND
from p2pft.core.view import JobTarget, TargetKind, View
from p2pft.sim.cluster import InvariantViolation, Simulator

N_SCHEDULES = 200
CHUNKS = 4
N_OLD = 30             # schedules also run without data directories (they must stay stuck)
FORM_BOUND = 15.0
ERROR_BOUND = 7.0      # virtual s from the crash to every live member reporting the missing voters
HEAL_BOUND = 10.0      # virtual s from the last restart to one view of exactly the live members
STUCK_WATCH = 12.0     # virtual s an unrecoverable (or old-code) schedule is watched for a commit
STEP = 40
TARGET = JobTarget(TargetKind.STEPS, 100)


@dataclass
class Plan:
    seed: int
    witnesses: int
    trainers: int
    loss: float
    dup: float
    kill: list[int]                 # trainer indexes crashed together (a majority of the voters)
    lose_disk: list[int]            # ... of which these lose their data directory
    hold: float                     # virtual s the majority stays down
    restart_gaps: list[float]       # virtual s between consecutive restarts


@dataclass
class Outcome:
    plan: Plan
    recoverable: bool = False
    healed_after: float | None = None
    error_after: float | None = None
    notes: list[str] = field(default_factory=list)


def make_plan(seed: int) -> Plan:
    rng = random.Random(seed)
    n = rng.randint(3, 7)
    voters = min(5, n) - (1 - min(5, n) % 2)          # the odd target the planner settles on
    witnesses = rng.randint(0, (voters - 1) // 2)     # the trainers among the voters are a majority
    trainers = n - witnesses
    loss = rng.choice([0.0, 0.0, 0.01, 0.03, 0.05])
    dup = rng.choice([0.0, 0.01])
    kill = list(range(trainers))                      # every trainer: a rack, a spot reclaim
    if rng.random() < 0.3 and trainers > voters - witnesses:
        kill = kill[:-1]                              # one non-voter trainer lives on
    lose = [i for i in kill if rng.random() < 0.2]
    if witnesses == 0 and len(lose) == len(kill) == trainers:
        lose = lose[1:]   # every member without memory is total loss (a new cluster), not this test's case
    hold = rng.choice([0.3, 1.0, ERROR_BOUND + 0.5, ERROR_BOUND + 2.0])
    gaps = [rng.uniform(0.0, 0.5) for _ in kill]
    return Plan(seed, witnesses, trainers, loss, dup, kill, lose, hold, gaps)


def _addr(kind: str, i: int) -> str:
    return f"10.0.{1 if kind == 'w' else 2}.{i + 1}:7000"


def _views(sim: Simulator) -> list[View]:
    return [n.view for n in sim.nodes.values() if n.view is not None]


def run(plan: Plan, durable: bool = True, trace: bool = False) -> Outcome:
    out = Outcome(plan)
    sim = Simulator(plan.seed)
    ws = [_addr("w", i) for i in range(plan.witnesses)]
    ts = [_addr("t", i) for i in range(plan.trainers)]
    everyone = ws + ts
    for a in everyone:
        sim.add_node(a, seeds=[x for x in everyone if x != a], kind=WITNESS_KIND if a in ws else TRAINER_KIND,
                     replica_id=a, durable=durable and a in ts)
    n_voters = min(5, len(everyone)) - (1 - min(5, len(everyone)) % 2)
    sim.run_until(FORM_BOUND, stop=lambda: sim.converged() and all(
        len(v.voters) == n_voters and len(v.participants) == len(ts) for v in _views(sim)))
    assert sim.converged(), f"seed {plan.seed}: did not form"
    voters = set(_views(sim)[0].voters)
    # The job: a declared target and a step, which a committed view carries (a pause and its
    # end are two views).
    for t in ts:
        sim.call(t, lambda node, now: node.declare_job(TARGET, False, now))
        sim.call(t, lambda node, now: node.set_status(Status.READY, now, STEP))
    sim.run_until(sim.now + 1.0)   # the steps reach the leader (probes carry them)
    sim.call(ts[0], lambda node, now: node.set_status(Status.PAUSED, now, STEP))
    sim.run_until(sim.now + 5.0, stop=lambda: all(len(v.paused) == 1 for v in _views(sim)))
    sim.call(ts[0], lambda node, now: node.set_status(Status.READY, now, STEP))
    sim.run_until(sim.now + 5.0, stop=lambda: all(not v.paused and v.high_water == STEP and v.target == TARGET
                                                  for v in _views(sim)) and sim.converged())
    before = _views(sim)[0]
    assert before.high_water == STEP and before.target == TARGET, \
        (f"seed {plan.seed}: job state not in the view: "
         f"{[(v.epoch, v.high_water, v.target, len(v.paused)) for v in _views(sim)]}")
    # Steps go on after that view (steps make no view): only gossip carries them, to the witnesses.
    for t in ts:
        sim.call(t, lambda node, now: node.set_step(STEP + 5))
    sim.run_until(sim.now + 1.5)
    sim.loss, sim.dup = plan.loss, plan.dup

    killed = [ts[i] for i in plan.kill]
    killed_voters = {sim.nodes[a].voter_id for a in killed} & voters
    assert len(killed_voters) * 2 > len(voters), f"seed {plan.seed}: the schedule kills no majority"
    lost_voters = {sim.nodes[ts[i]].voter_id for i in plan.lose_disk} & voters
    out.recoverable = durable and (len(voters) - len(lost_voters)) * 2 > len(voters)
    epoch_at_crash = sim.checker.max_epoch
    t_crash = sim.now
    for i in plan.kill:
        sim.crash(ts[i], lose_disk=i in plan.lose_disk)

    def everyone_reports() -> bool:
        return bool(sim.nodes) and all(n.quorum_lost for n in sim.nodes.values())
    sim.run_until(t_crash + plan.hold, stop=everyone_reports)
    if everyone_reports():
        out.error_after = sim.now - t_crash
        assert out.error_after <= ERROR_BOUND, f"seed {plan.seed}: reported after {out.error_after:.2f} s"
        # Named: voters of the set, a majority of it (under loss a live voter may be suspect too).
        assert all(set(n.quorum_lost) <= voters and len(n.quorum_lost) * 2 > len(voters) for n in sim.nodes.values())
    elif plan.hold >= ERROR_BOUND and sim.nodes:
        raise AssertionError(f"seed {plan.seed}: a majority down {plan.hold} s and "
                             f"{[a for a, n in sim.nodes.items() if not n.quorum_lost]} did not report it")
    sim.run_until(t_crash + plan.hold)
    assert sim.checker.max_epoch == epoch_at_crash, f"seed {plan.seed}: a view committed without a majority"
    assert all(n.stats["quorum_lost"] <= 1 for n in sim.nodes.values()), "the ERROR was logged more than once"

    for a, gap in zip(killed, plan.restart_gaps):
        sim.run_until(sim.now + gap)
        sim.restart(a, seeds=[x for x in everyone if x != a])
    t_back = sim.now
    if not out.recoverable:
        sim.run_until(t_back + STUCK_WATCH, stop=lambda: sim.checker.max_epoch > epoch_at_crash)
        assert sim.checker.max_epoch == epoch_at_crash, \
            f"seed {plan.seed}: committed without a majority of the voters' identities"
        sim.run_until(sim.now + ERROR_BOUND, stop=everyone_reports)
        assert everyone_reports(), f"seed {plan.seed}: stuck, but not every member says so"
        return out
    sim.run_until(t_back + HEAL_BOUND, stop=lambda: sim.converged() and sim.checker.max_epoch > epoch_at_crash)
    assert sim.converged() and sim.checker.max_epoch > epoch_at_crash, \
        f"seed {plan.seed}: not healed {HEAL_BOUND} s after the restarts"
    out.healed_after = sim.now - t_back
    view = _views(sim)[0]
    assert view.target == TARGET, f"seed {plan.seed}: the job's target was lost"
    assert view.high_water >= STEP, f"seed {plan.seed}: the high water went from {STEP} to {view.high_water}"
    if plan.witnesses:   # a witness saw the steps after the last view: they are not forgotten
        out.notes.append(f"hw {view.high_water}")
        assert view.high_water == STEP + 5, \
            f"seed {plan.seed}: the high water went from {STEP + 5} to {view.high_water}"
    assert view.finished is None
    # The voters settle on live members (a voter whose disk was lost is replaced).
    sim.run_until(sim.now + HEAL_BOUND, stop=lambda: all(not n.missing_voters() for n in sim.nodes.values())
                  and sim.converged() and len(_views(sim)[0].voters) == n_voters)
    assert all(not n.missing_voters() for n in sim.nodes.values()), f"seed {plan.seed}: voters did not settle"
    assert len(_views(sim)[0].voters) == n_voters
    sim.run_until(sim.now + 1.0)   # the next tick of each node clears its report
    assert not any(n.quorum_lost for n in sim.nodes.values())
    for i in plan.kill:
        node = sim.nodes[ts[i]]
        came_back = node.voter_id != node.id
        assert came_back == (i not in plan.lose_disk), \
            f"seed {plan.seed}: {ts[i]} came back as {'the old' if came_back else 'a new'} voter identity"
    return out


@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_majority_loss_heals_with_data_dirs(chunk: int) -> None:
    outs = [run(make_plan(seed)) for seed in range(chunk, N_SCHEDULES, CHUNKS)]
    assert any(o.healed_after is not None for o in outs), "no schedule was recoverable"


def test_schedules_cover_recoverable_and_lost_cases() -> None:
    plans = [make_plan(s) for s in range(N_SCHEDULES)]
    lost = [p for p in plans if p.lose_disk]
    assert len(lost) >= 20, "too few schedules lose a data directory"
    assert any(p.witnesses == 0 for p in plans) and any(p.witnesses == 2 for p in plans)
    assert sum(p.hold > ERROR_BOUND for p in plans) >= N_SCHEDULES // 3


@pytest.mark.parametrize("seed", range(N_OLD))
def test_without_data_dirs_the_same_schedules_stay_stuck(seed: int) -> None:
    """The code before durable voters: a restarted process is a new identity, so the voter set
    keeps its dead majority and nothing is committed again (run() asserts the cluster stays
    stuck and that every member says so)."""
    plan = make_plan(seed)
    if plan.witnesses == 0 and len(plan.kill) == plan.trainers:
        # Every member was a voter and restarts as a new identity: the restarted processes found
        # a second cluster (term 1 again), with neither the job's target nor its high water.
        with pytest.raises(InvariantViolation, match="two leaders in term 1"):
            run(plan, durable=False)
        return
    out = run(plan, durable=False)
    assert not out.recoverable and out.healed_after is None


def sweep(lo: int, hi: int) -> None:
    """Seeds lo..hi-1 outside the suite: failures, and the report and heal times (virtual s)."""
    import logging
    logging.disable(logging.CRITICAL)
    fails, errs, heal = [], [], []
    for s in range(lo, hi):
        plan = make_plan(s)
        try:
            o = run(plan)
        except AssertionError as exc:
            fails.append((s, str(exc)[:200]))
            continue
        if o.error_after is not None and plan.hold > ERROR_BOUND:
            errs.append(o.error_after)
        if o.healed_after is not None:
            heal.append(o.healed_after)
    errs.sort()
    heal.sort()
    print(f"schedules {hi - lo}, failed {len(fails)} {fails[:5]}")
    for name, xs in (("reported after", errs), ("healed after", heal)):
        if xs:
            print(f"{name}: n={len(xs)} p50={xs[len(xs) // 2]:.2f} p99={xs[int(len(xs) * 0.99)]:.2f} "
                  f"max={xs[-1]:.2f} s")


if __name__ == "__main__":
    if sys.argv[1] == "--sweep":
        sweep(int(sys.argv[2]), int(sys.argv[3]))
    else:
        print(run(make_plan(int(sys.argv[1])), durable="--old" not in sys.argv))


@pytest.mark.parametrize("seed", range(5))
def test_voters_restarted_at_other_addresses_are_found_through_gossip(seed: int) -> None:
    """The three trainer voters come back on other ports (a launcher binding port 0) with their
    data directories: nobody knows their new addresses but gossip, which carries each one's voter
    id; Raft reaches them there and the cluster heals."""
    sim = Simulator(seed)
    ws = [_addr("w", i) for i in range(2)]
    ts = [_addr("t", i) for i in range(3)]
    for a in ws + ts:
        sim.add_node(a, seeds=[x for x in ws + ts if x != a], kind=WITNESS_KIND if a in ws else TRAINER_KIND,
                     replica_id=a, durable=a in ts)
    sim.run_until(FORM_BOUND, stop=lambda: sim.converged() and all(len(v.voters) == 5 for v in _views(sim)))
    voters = set(_views(sim)[0].voters)
    epoch = sim.checker.max_epoch
    for t in ts:
        sim.crash(t)
    sim.run_until(sim.now + 3.0)
    assert sim.checker.max_epoch == epoch
    for t in ts:
        moved = t.replace(":7000", ":7100")
        sim.disk[moved] = sim.disk.pop(t)
        sim.add_node(moved, seeds=ws, kind=TRAINER_KIND, replica_id=t, durable=True)
    sim.run_until(sim.now + HEAL_BOUND, stop=sim.converged)
    assert sim.converged() and sim.checker.max_epoch > epoch
    view = _views(sim)[0]
    assert set(view.voters) == voters
    assert {m.addr for m in view.members if m.voter} == {t.replace(":7000", ":7100") for t in ts}
