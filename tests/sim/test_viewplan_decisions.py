"""The view plan's decisions under the faults they exist for (simulator): one scripted schedule
per decision of ``p2pft/core/viewplan.py``, the function both the engine and the simulator's
trainers call (``p2pft/sim/trainers.py``).

Each schedule passes with the real decision; with that decision put back wrong (the core
function monkeypatched), the job-level checker (``JobChecker``) or the harness's end check
(every loop ends, with no ``StepTimeout`` while the job's state is held) reports a violation.
The faults beside kills and pauses: a step whose allreduce finished at one trainer only (it holds
a step the others redo without it: ``SimJob.splits``) and a long backward (``SimTrainer.busy``:
its loop neither looks at the views nor beats, so it misses the views that drop it and take it
back).

Two decisions have no schedule of their own that a wrong variant fails. ``hold_from`` is a
cost, not a safety rule: without it a member back from a long pause pulls a snapshot instead of
replaying a peer's log (checked here by the counts). The left-out branch of
``track_membership`` (absent, or a joiner, after being a participant) is backed by the `since`
check: a replica left out is taken back under a new `since`, so without that branch it still
catches up when promoted, before it contributes. A re-slot without a new `since` (the slot check
of ``gradients_count``) does not happen: the leader keeps a participant's slot while it stays one.

The end barrier's own look (``must_check_end``) has a schedule too: a split of the job's
second-to-last step at a trainer whose link is then cut; the others redo it without it and finish,
and it takes their last step from their log onto its own (the kernel's ``done_ahead``).
"""
from __future__ import annotations

from typing import Callable

import pytest

from p2pft.core import viewplan
from p2pft.core.node import TRAINER_KIND, WITNESS_KIND
from p2pft.core.view import JobTarget, Member, Role, TargetKind, View
from p2pft.core.viewplan import PlanMemory, StepOf
from p2pft.sim import trainers as job_mod
from p2pft.sim.cluster import InvariantViolation, Simulator
from p2pft.sim.trainers import Phase, SimJob, SimTrainer, TrainerConfig

END_BOUND = 150.0      # virtual s from the last fault to every loop having ended
STEP_BOUND = 60.0      # virtual s a schedule waits for the job to reach a fault's step


def _addr(kind: str, i: int) -> str:
    return f"10.0.{0 if kind == 't' else 1}.{i + 1}:7000"


class Schedule:
    """Trainers and witnesses on the real ``Node`` code, the README's loop in each trainer."""

    def __init__(self, seed: int, trainers: int, cfg: TrainerConfig, witnesses: int = 2) -> None:
        self.sim = Simulator(seed)
        self.ts = [_addr("t", i) for i in range(trainers)]
        ws = [_addr("w", i) for i in range(witnesses)]
        self.everyone = self.ts + ws
        for a in self.everyone:
            self.sim.add_node(a, seeds=[x for x in self.everyone if x != a],
                              kind=TRAINER_KIND if a in self.ts else WITNESS_KIND, replica_id=a)
        self.cfg = cfg
        self.job = SimJob(self.sim)
        for a in self.ts:
            self.job.add(a, cfg)
        self.last_fault = 0.0

    def t(self, i: int) -> SimTrainer:
        return self.job.trainers[self.ts[i]]

    def until(self, cond: Callable[[], bool], what: str, bound: float = STEP_BOUND) -> None:
        self.sim.run_until(self.sim.now + bound, stop=cond)
        if not cond():
            raise AssertionError(f"the schedule never got to: {what} (t={self.sim.now:.2f})")

    def at_step(self, step: int) -> None:
        self.until(lambda: max(t.step for t in self.job.trainers.values() if t.alive) >= step, f"step {step}")

    def crash(self, i: int, down: float | None = None) -> None:
        a = self.ts[i]
        self.job.crash(a)
        if down is not None:
            self.sim.at(self.sim.now + down, lambda: self.job.restart(a, self.cfg))
            self.last_fault = max(self.last_fault, self.sim.now + down)

    def finish(self, may_leave: tuple[int, ...] = ()) -> dict[str, tuple[str | None, int]]:
        """Run to the end; every live loop ends, returning the job's end (the state was never lost),
        or, for the trainers `may_leave` names, leaving behind it (``JobFinished`` naming its step)."""
        job = self.job
        self.sim.run_until(max(self.sim.now, self.last_fault) + END_BOUND,
                           stop=lambda: all(t.phase is Phase.OVER for t in job.trainers.values() if t.alive))
        out = {a: ((t.outcome.error, t.outcome.step) if t.outcome else ("still running", t.step))
               for a, t in job.trainers.items() if t.alive}
        behind = {self.ts[i] for i in may_leave}
        for a, (err, step) in out.items():
            if err is not None and not (err == "JobFinished(held)" and a in behind):
                raise InvariantViolation(f"{a} ended with {err} at step {step} ({job.trainers[a].phase}): {out}")
        return out

    def split(self, i: int, step: int, cut_s: float, busy_s: float = 0.0) -> None:
        """`step`'s allreduce finishes at trainer `i` only: its own last frames are lost (its
        link goes down for `cut_s`), so the others drop it and redo the step without it. Its
        loop then computes for `busy_s` without a look at the views."""
        a = self.ts[i]
        self.job.splits[step] = a
        self.until(lambda: self.job.stats["split"] == 1, f"the split of step {step}")
        self.sim.partition([a], [x for x in self.everyone if x != a])
        self.sim.at(self.sim.now + cut_s, self.sim.heal)
        self.t(i).busy(self.sim.now, busy_s)
        self.last_fault = self.sim.now + max(cut_s, busy_s)


def _cfg(target: int = 24, min_replicas: int = 1, step_timeout: float = 40.0) -> TrainerConfig:
    return TrainerConfig(JobTarget(TargetKind.STEPS, target), min_replicas=min_replicas, step_timeout=step_timeout)


@pytest.fixture
def long_loop_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """The trainers declare a loop timeout past their long backward (not left out as stalled)."""
    monkeypatch.setattr(job_mod, "LOOP_TIMEOUT", 30.0)


# ---------------------------------------------------------------------- rejoin: the membership's `since`
def _taken_back_unseen(seed: int) -> Schedule:
    """Step 9's allreduce finishes at trainer 2 only, and its loop is in a long backward: the
    others drop it and redo step 9 without it, and the leader takes it back as a participant
    before it looks again. Only its membership's `since` says it was left out."""
    s = Schedule(seed, 3, _cfg(target=40, min_replicas=3))
    s.at_step(7)
    s.split(2, 9, cut_s=1.1, busy_s=6.0)
    s.finish()
    return s


def _no_since(memory: PlanMemory, view: View | None, me: Member | None) -> tuple[PlanMemory, viewplan.Note | None]:
    """``track_membership`` without the `since` check: only the looks that see it left out count."""
    if me is not None and me.role is Role.PARTICIPANT:
        return PlanMemory(True, me.since, memory.rejoin_pending, memory.returning), None
    if memory.was_participant and view is not None:
        return PlanMemory(False, None, True, memory.returning), None
    return memory, None


@pytest.mark.usefixtures("long_loop_timeout")
@pytest.mark.parametrize("seed", range(3))
def test_a_replica_taken_back_unseen_catches_up(seed: int) -> None:
    s = _taken_back_unseen(seed)
    assert s.job.stats["note:taken_back"] >= 1 and s.job.stats["rejoin"] >= 1, s.job.stats


@pytest.mark.usefixtures("long_loop_timeout")
def test_without_the_since_check_a_replica_taken_back_trains_on_its_own_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """It goes on as a participant at the step it alone committed: two states for one step."""
    monkeypatch.setattr(viewplan, "track_membership", _no_since)
    with pytest.raises(InvariantViolation, match="holding 2 states"):
        _taken_back_unseen(0)


# ---------------------------------------------------------------------- demote: its gradients no longer count
def _stale_gradients(seed: int) -> Schedule:
    """As above, and the others are in their backward of the step they redid until it looks
    again: its first reduce after being taken back meets theirs, at the same step number."""
    s = Schedule(seed, 3, _cfg(target=40, min_replicas=3))
    s.at_step(7)
    s.split(2, 9, cut_s=1.1, busy_s=3.0)
    back = s.t(2).busy_until
    s.until(lambda: 9 not in s.job.checker.orphans, "the others redo step 9")
    for i in (0, 1):
        s.t(i).busy(s.sim.now, back + 0.02 - s.sim.now)
    s.finish()
    return s


def _counts_when_left_out(slot: int | None, synced: bool, rejoin: bool, me: Member) -> bool:
    """``gradients_count`` that keeps the gradients of a replica found left out (only the slot
    and the role checked)."""
    return slot is not None and synced and me.role is Role.PARTICIPANT and me.slot == slot


@pytest.mark.usefixtures("long_loop_timeout")
@pytest.mark.parametrize("seed", range(3))
def test_the_gradients_of_a_replica_left_out_do_not_count(seed: int) -> None:
    s = _stale_gradients(seed)
    assert s.job.stats["rejoin"] >= 1, s.job.stats


@pytest.mark.usefixtures("long_loop_timeout")
def test_gradients_kept_when_left_out_enter_the_others_mean(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its gradients of step 9, computed on the state only it holds, go into the others' step 10."""
    monkeypatch.setattr(viewplan, "gradients_count", _counts_when_left_out)
    with pytest.raises(InvariantViolation, match="computed on another state"):
        _stale_gradients(0)


# ---------------------------------------------------------------------- sole holder
def _left_out_alone(seed: int) -> Schedule:
    """Trainer 0 dies for good, and trainer 1's loop stalls past its loop timeout meanwhile: it
    is left out, and taken back when it beats again, with nobody else holding the job's state."""
    s = Schedule(seed, 2, _cfg(min_replicas=2))
    s.at_step(6)
    s.crash(0)
    s.t(1).busy(s.sim.now, 8.0)
    s.last_fault = s.sim.now + 8.0
    s.finish()
    return s


@pytest.mark.parametrize("seed", range(3))
def test_a_replica_left_out_alone_offers_its_state(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    held: list[bool] = []
    real = viewplan.sole_holder

    def spy(rejoin: bool, donor: Member | None, synced: bool) -> bool:
        held.append(real(rejoin, donor, synced))
        return held[-1]
    monkeypatch.setattr(viewplan, "sole_holder", spy)
    s = _left_out_alone(seed)
    assert any(held) and s.t(1).outcome is not None and s.t(1).outcome.finished == 24


def test_without_the_sole_holder_rule_the_last_holder_waits_for_a_snapshot_from_nobody(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(viewplan, "sole_holder", lambda rejoin, donor, synced: False)
    with pytest.raises(InvariantViolation, match="still running|StepTimeout|MissingStateError"):
        _left_out_alone(0)


# ---------------------------------------------------------------------- behind a paused donor
def _behind_the_paused(seed: int) -> Schedule:
    """Trainer 0 pauses at step 4; trainer 1 trains on and pauses at step 10 for longer than
    trainer 0's step timeout. Back first, trainer 0 is a joiner holding step 4 with nobody
    training: its donor, the paused trainer 1, holds step 10."""
    s = Schedule(seed, 2, _cfg(min_replicas=2, step_timeout=10.0))
    s.t(0).pauses[4] = 4.0
    s.t(1).pauses[10] = 40.0
    s.last_fault = 50.0
    s.finish()
    return s


@pytest.mark.parametrize("seed", range(3))
def test_a_joiner_behind_a_paused_donor_takes_its_state(seed: int) -> None:
    s = _behind_the_paused(seed)
    assert s.job.stats["behind"] >= 1, s.job.stats


def test_a_joiner_not_told_it_is_behind_times_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(viewplan, "is_behind", lambda me, donor, synced, step, member_step: False)
    with pytest.raises(InvariantViolation, match="StepTimeout"):
        _behind_the_paused(0)


# ---------------------------------------------------------------------- the paused donor
def _paused_at_two_steps(seed: int) -> Schedule:
    """Trainer 0 pauses at step 4, trainers 1 and 2 at step 10, all for long; trainer 2 is
    killed in its pause and restarted (a fresh process at step 0): with no participant, it
    catches up from a paused member."""
    s = Schedule(seed, 3, _cfg(min_replicas=3, step_timeout=10.0))
    s.t(0).pauses[4] = 40.0
    s.t(1).pauses[10] = 40.0
    s.t(2).pauses[10] = 40.0
    s.until(lambda: s.t(2).phase is Phase.PAUSED and s.t(1).phase is Phase.PAUSED, "trainers 1 and 2 paused")
    s.crash(2, down=1.0)
    s.finish()
    return s


def _nearest_paused(view: View, me: str, member_step: StepOf) -> Member | None:
    """``paused_donor`` choosing the paused member at the lowest step."""
    return min((m for m in view.paused if m.node != me), key=lambda m: (member_step(m.node), m.node), default=None)


@pytest.mark.parametrize("seed", range(3))
def test_a_joiner_with_nobody_training_catches_up_from_the_furthest_paused_member(seed: int) -> None:
    s = _paused_at_two_steps(seed)
    assert s.job.stats["snapshot"] >= 1, s.job.stats


def test_a_joiner_catching_up_from_an_older_paused_member_times_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(viewplan, "paused_donor", _nearest_paused)
    with pytest.raises(InvariantViolation, match="StepTimeout"):
        _paused_at_two_steps(0)


# ---------------------------------------------------------------------- hold_from
def _long_pause(seed: int) -> Schedule:
    """Trainer 0 pauses at step 3 for 3 s: the others commit about a dozen steps meanwhile, far
    more than a peer's log keeps (RECENT_KEEP)."""
    s = Schedule(seed, 3, _cfg(target=32, min_replicas=3))
    s.t(0).pauses[3] = 3.0
    s.finish()
    return s


@pytest.mark.parametrize("seed", range(3))
def test_a_member_back_from_a_long_pause_replays_the_others_log(seed: int) -> None:
    s = _long_pause(seed)
    assert s.job.stats["fast_forward"] >= 1 and s.job.stats["snapshot"] == 0, s.job.stats


def test_without_hold_from_it_pulls_a_snapshot(monkeypatch: pytest.MonkeyPatch) -> None:
    """No invariant breaks (a snapshot is a correct catch-up): the cost does."""
    monkeypatch.setattr(viewplan, "hold_from", lambda returning, view, me, member_meta: ((), None))
    s = _long_pause(0)
    assert s.job.stats["snapshot"] >= 1, s.job.stats


# ---------------------------------------------------------------------- the end barrier: left out since its last commit
def _left_out_at_the_end(seed: int, at: int = 15) -> Schedule:
    """Step `at`'s allreduce finishes at trainer 2 only and its link is cut: the others drop it,
    redo the step without it and reach the end (16). Trainer 2 takes their last step from their
    log onto its own step 15 (or, at 16, holds its own last step) and waits at the end barrier;
    the first view it sees after the cut may already say the job finished."""
    s = Schedule(seed, 3, _cfg(target=16, min_replicas=3))
    s.at_step(13)
    s.split(2, at, cut_s=1.1)
    s.finish(may_leave=(2,))
    return s


@pytest.mark.parametrize("at", [15, 16])
@pytest.mark.parametrize("seed", range(6))
def test_a_replica_left_out_before_the_end_never_returns_other_weights(seed: int, at: int) -> None:
    """The checker fails a trainer that returns from finish() with another state than the job's
    final one; trainer 2 returns the end only where a finished peer's signatures agreed, and
    otherwise leaves with JobFinished naming the step it holds."""
    s = _left_out_at_the_end(seed, at)
    assert all(s.t(i).outcome is not None and (s.t(i).outcome.error, s.t(i).outcome.step) == (None, 16)
               for i in (0, 1)), s.job.stats
    o = s.t(2).outcome
    assert o is not None and (o.error is None or o.error == "JobFinished(held)"), o
    if s.job.stats["replayed_onto_another_state"]:   # it took the others' last step onto its own
        assert o.error == "JobFinished(held)" and s.job.stats["end_check:behind"] >= 1, (o, s.job.stats)


def test_without_the_end_check_a_replica_left_out_returns_a_redone_step_as_the_end(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The end barrier before ``must_check_end`` (synced at the finished step was enough): in most
    seeds trainer 2 returns from finish() with its own step 15 under the others' step 16."""
    monkeypatch.setattr(viewplan, "must_check_end", lambda memory, view, node: False)
    failed = 0
    for seed in range(6):
        try:
            _left_out_at_the_end(seed)
        except InvariantViolation as exc:
            assert "returned from finish() with step 16" in str(exc), exc
            failed += 1
    assert failed >= 3, f"the old end barrier failed {failed} of 6 seeds"
