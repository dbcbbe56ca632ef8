"""Trainers in the simulator: a job's life over the real ``Node`` code and the real decisions.

Each ``SimTrainer`` runs the README's loop (``start()``, ``while not done: begin/commit``, a
pause after some commits, ``finish()``) as a state machine on the virtual clock. What it
decides, it decides with ``p2pft/core/lifecycle.py`` (``admit``, ``initial_fetch``,
``leads_step``, ``end_word``, ``end_checked``): the functions ``trainer/job/life.py`` and
``trainer/job/barrier.py`` call; and each look before a reduce is ``p2pft/core/viewplan.py``'s
``plan_view``, as in the engine (rejoin, demote, the donor, behind, the log held for a member
back from a pause), as the end barrier's look is its ``must_check_end`` (a trainer left out
since its last commit compares its last steps' signatures, who contributed, with a finished
peer's). The leader's half (``JobPlanner``) runs inside each ``Node`` as in production. The data
plane is modelled, not run: one round per communicator (data epoch) every ``STEP_S``, where a
step commits when every participant of the newest view has its allreduce under way (planned, not
paused or busy, no link down), each counting as its own plan says. A state is a digest chain
(``digest(s+1) = H(digest(s), s+1, contributors)``), so two trainers hold the same weights
exactly when they hold the same digest, and a step applied onto another state (a log replayed, a
reduced step received) gives another. A catch-up takes ``SNAPSHOT_S`` and ends with the donor's
state; a trainer whose steps a peer's log still holds (its last ``RECENT_KEEP``, or from a
paused member's ``hold_from``) replays them at once (the fast-forward log). Faults beside kills
and pauses: a long backward (``busy``: the loop neither looks nor beats) and a step whose
allreduce finished at one trainer only (``SimJob.splits``).

``JobChecker`` holds the job-level invariants (see ``tests/sim/test_job_invariants.py``):

- one state per step: the replicas that commit a step hold the same state, and every gradient
  in its mean was computed on that state, for the slot it is counted as;
- the end: every trainer that returns from ``finish()`` holds the job's final step and state,
  and every trainer listed as a participant or paused in the first view that says the job
  finished returns it (a pause across the end comes back to the final state);
- one leader per step: at most one trainer claims ``is_leader`` for a committed step;
- no new job over an old one: no group commits step 1 from a state not descended from the
  job's while any live member, trainer or checkpoint holds evidence of the job (unless a
  trainer declared ``allow_restart_from_scratch``);
- every wait is bounded: each trainer returns or raises one of the job's errors.
"""
from __future__ import annotations

import enum
import hashlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

from ..core.lifecycle import (Admit, Declared, EndWord, Fetch, SigCheck, admit, end_checked, end_word, initial_fetch,
                              leads_step, signatures_agree)
from ..core.meta import MemberMeta, Status
from ..core.node import Node
from ..core.view import JobTarget, Member, Role, View
from ..core import viewplan
from ..core.viewplan import PlanMemory, Reduce, end_check_steps, plan_view
from .cluster import InvariantViolation, SimEvent, Simulator, ViewCommitted

TICK_S = 0.05          # one look of each trainer's loop
STEP_S = 0.25          # one training step
SNAPSHOT_S = 0.6       # one catch-up from a donor's snapshot
RECENT_KEEP = 2        # steps of log a peer serves to one that fast-forwards
LOOP_TIMEOUT = 4.0
ANNOUNCED_S = 0.5      # a trainer's status reaches the leader within this (gossip, a batch window)


class Phase(enum.Enum):
    FORMING = "forming"        # in start()
    ACTIVE = "active"          # in the loop: training (participant) or catching up (joiner)
    PAUSED = "paused"          # in a pause (evaluation, a checkpoint)
    FINISHING = "finishing"    # in finish()
    OVER = "over"              # returned from finish(), or raised


@dataclass(frozen=True)
class Outcome:
    """How a trainer's loop ended: ``error`` is None when finish() returned."""

    t: float
    step: int
    digest: str
    error: str | None = None
    finished: int | None = None    # what finish() returned, or the step the error names


@dataclass(frozen=True)
class TrainerConfig:
    target: JobTarget
    min_replicas: int = 1
    allow_scratch: bool = False
    checkpoint_every: int | None = None
    start_timeout: float = 60.0
    finish_timeout: float = 60.0
    step_timeout: float = 40.0
    resume_grace: float = 15.0           # JobOptions' default
    eval_every: int | None = None         # the leader pauses to evaluate after every n-th step it leads
    eval_s: float = 0.5


def _h(*parts: object) -> str:
    return hashlib.blake2b(repr(parts).encode(), digest_size=8).hexdigest()


@dataclass
class Checkpoint:
    step: int
    digest: str
    root: str
    sig: str | None = None     # its last step's signature (``meta["sig"]``)


class SimTrainer:
    """One replica process: its loop's state, driven by ``SimJob`` every ``TICK_S``."""

    def __init__(self, job: SimJob, addr: str, cfg: TrainerConfig, incarnation: int) -> None:
        self.job, self.addr, self.cfg = job, addr, cfg
        self.phase = Phase.FORMING
        ck = job.checkpoints.get(addr) if cfg.checkpoint_every else None
        self.step = ck.step if ck else 0
        self.digest = ck.digest if ck else _h("init", addr, incarnation)   # replicas need not seed alike
        self.root = ck.root if ck else self.digest                          # the step-0 state it descends from
        self.synced = ck is not None      # holds a committed state of the job (a checkpoint's, or agreed)
        self.announced_at = job.sim.now if ck is None else float("inf")   # said its state (FRESH at its step)
        self.deadline = job.sim.now + cfg.start_timeout
        self.grace_end: float | None = None
        self.transfer: tuple[float, str] | None = None    # (done at, donor node id)
        self.pause_until = 0.0
        self.pauses: dict[int, float] = {}                 # after committing step s: pause this long
        self.last_commit = job.sim.now
        self.lead_step: int | None = None                  # the step whose commit named us its leader
        self.side_work: int | None = None                  # committed step whose side work the loop does next
        self.lead_claims: list[int] = []
        self._declared_sent = False
        self.outcome: Outcome | None = None
        self.alive = True
        self._reported: set[tuple[int, str]] = set()
        self.history: dict[int, str] = {self.step: self.digest}   # step -> digest, along the state it holds
        # The signature of each step applied here, by ``Entry.step`` (the step it was applied at):
        # who contributed (``recent.step_signature``); a snapshot keeps only its last step's.
        self.sigs: dict[int, str] = {ck.step - 1: ck.sig} if ck is not None and ck.sig is not None else {}
        self.end_checked = False           # the end barrier's check of our last steps is done
        self.owe_done = False              # the end barrier holds 'done' back until then
        self.log_from = self.step          # the oldest step whose reduced buffer its log still holds
        self.memory = PlanMemory()         # the view plan's memory of earlier looks (the engine's)
        self.began: tuple[int, str, int | None] | None = None   # the step begun: (step, digest, slot)
        self.attempt: tuple[View, Reduce] | None = None          # the last look's plan, for this step
        self.in_flight = False             # its allreduce waits for the next round of the data plane
        self.holding: int | None = None    # the plan's hold_from: keep the log from this step on
        self.catch_from: str | None = None  # the plan's donor (the engine's catchup.donor)
        self.busy_until = 0.0              # a long backward: the loop neither looks nor beats

    @property
    def node(self) -> Node | None:
        return self.job.sim.nodes.get(self.addr) if self.alive else None

    @property
    def node_id(self) -> str | None:
        n = self.node
        return n.id if n is not None else None

    @property
    def view(self) -> View | None:
        n = self.node
        return n.view if n is not None else None

    @property
    def declared(self) -> Declared:
        return Declared(self.cfg.target, self.cfg.allow_scratch)

    @property
    def done(self) -> bool:
        return self.synced and self.step >= self.cfg.target.n

    def call(self, fn: Callable[[Node, float], None]) -> None:
        self.job.sim.call(self.addr, fn)

    def set_status(self, status: Status, step: int | None = None) -> None:
        self.call(lambda n, now: n.set_status(status, now, step))

    # ------------------------------------------------------------------ the loop
    def tick(self, now: float) -> None:
        node = self.node
        if node is None or self.phase is Phase.OVER or now < self.busy_until:
            return
        if self.phase is not Phase.PAUSED or self.pause_until > now:   # the pause's thread beats too
            self.call(lambda n, t: n.loop_beat(t, LOOP_TIMEOUT))
        if self.phase is Phase.FORMING:
            self._forming(now)
        elif self.phase is Phase.ACTIVE:
            self._active(now)
        elif self.phase is Phase.PAUSED:
            if now >= self.pause_until:
                self._leave_pause(now)
        elif self.phase is Phase.FINISHING:
            self._finishing(now)

    def _end(self, now: float, error: str | None, finished: int | None = None) -> None:
        self.outcome = Outcome(now, self.step, self.digest, error, finished)
        self.phase = Phase.OVER
        self.job.checker.on_outcome(self, now)
        self.call(lambda n, t: n.leave(t))   # the process exits

    def _admit(self, now: float, at_start: bool) -> Admit | None:
        """``admit``; None when the loop goes on (in, or not listed yet before a step)."""
        view = self.view
        verdict = admit(view, self.node_id or "", self.step, self.declared,
                        grace_over=self.grace_end is not None and now >= self.grace_end)
        if verdict is Admit.IN or (verdict is Admit.WAIT and not at_start):
            return None
        if verdict is Admit.FINISHED:
            assert view is not None and view.finished is not None
            held = None if (at_start and self.step == 0) or (self.synced and self.step == view.finished) else self.step
            self._end(now, "JobFinished" if held is None else "JobFinished(held)", view.finished)
        elif verdict is Admit.CONFIG_ERROR:
            self._end(now, "JobConfigError")
        elif verdict is Admit.REFUSE:
            self._end(now, "MissingStateError", view.high_water if view else None)
        else:
            if verdict is Admit.GRACE and self.grace_end is None:
                self.grace_end = now + self.cfg.resume_grace
            if now >= self.deadline:
                self._end(now, "StepTimeout")
        return verdict

    def _forming(self, now: float) -> None:
        node = self.node
        assert node is not None
        if not self._declared_sent:
            self._declared_sent = True
            self.call(lambda n, t: n.declare_job(self.cfg.target, self.cfg.allow_scratch, t))
            self.set_status(Status.FRESH, self.step)
            self.announced_at = now
        if self._admit(now, at_start=True) is not None:
            return
        view = self.view
        me = self.node_id
        assert view is not None and me is not None
        if (self.cfg.min_replicas > 1 and self.step == 0 and view.role_of(me) is Role.PARTICIPANT
                and len(view.participants) < self.cfg.min_replicas and now < self.deadline):
            return
        how = initial_fetch(view, me, self.step, node.member_step)
        if how is Fetch.FROM:
            lead = view.lead()
            src = self.job.by_node(lead.node) if lead is not None else None
            if src is None or src.phase is Phase.FORMING or not src.synced:
                return                     # not held yet (the lead is still starting): look again
            if src.step > 0:
                how = Fetch.CATCH_UP       # the lead went on without us
            else:
                self.digest, self.root = src.digest, src.root
                self.history = {0: src.digest}
        if how is Fetch.NONE and self.step > 0 and self._redone():
            how = Fetch.CATCH_UP           # the others redid our last step without us (``_resumed_agrees``)
        if how is Fetch.CATCH_UP:
            self.synced = False
            self.set_status(Status.JOINING, self.step)
        else:
            self.synced = True
        self.phase = Phase.ACTIVE

    def _redone(self) -> bool:
        """Does a peer at our step hold another state for it (``last_step_agreed``)?"""
        peer = next((t for t in self.job.trainers.values() if t is not self and t.alive and t.synced
                     and t.step == self.step and t.phase is not Phase.FORMING), None)
        return peer is not None and peer.digest != self.digest

    def _active(self, now: float) -> None:
        if self.side_work is not None:
            self._side_work(now)
            if self.phase is not Phase.ACTIVE:
                return
        if self.done:
            if self._unchecked():         # left out since its last commit: check first (EndBarrier)
                self.owe_done = True
                self.job.stats["end_unchecked"] += 1
            else:
                self.set_status(Status.DONE, self.step)
            self.phase = Phase.FINISHING
            self.deadline = now + self.cfg.finish_timeout
            return
        if self._admit(now, at_start=False) is not None:
            return
        view, node = self.view, self.node
        if view is None or node is None:
            return
        if self.in_flight and self.attempt is not None and self.attempt[1].data_epoch == view.data_epoch:
            if not self.synced:       # in the allreduce (not aborted by a new data epoch): no look
                self._catch_up(now, self.catch_from)
            return
        if self.began is None:        # begin(): a synced participant trains for its slot
            me = view.member(node.id)
            slot = me.slot if self.synced and me is not None and me.role is Role.PARTICIPANT else None
            self.began = (self.step, self.digest, slot)
        # commit(): the engine's look at the view (StepEngine._view_plan)
        plan = plan_view(self.memory, view, node.id, slot=self.began[2], synced=self.synced, step=self.step,
                         world=1, member_step=node.member_step, member_meta=lambda n: _meta_of(node, n))
        self.memory = plan.memory
        self.job.stats.update(f"note:{n.kind.value}" for n in plan.notes)
        att = plan.decision
        if not isinstance(att, Reduce):
            if not self.synced:       # the catch-up goes on in the background meanwhile
                self._catch_up(now, self.catch_from)
            return
        self.attempt, self.in_flight = (view, att), True
        self.holding = att.hold_from
        self.catch_from = att.donor[0] if att.donor is not None else None
        if att.rejoin and self.synced:
            self.job.stats["rejoin"] += 1
            self._unsync()                # left out: a snapshot before contributing again
        if not self.synced:
            self._catch_up(now, self.catch_from)
            return
        if att.role is Role.JOINER:
            head = self.job.head(view)
            if head is not None and head.step > self.step:
                if self._follow(head):
                    self.job.stats["fast_forward"] += 1
                else:
                    return
            elif head is None and att.behind:
                # Nobody contributes and the donor holds a later step (a paused member): take
                # its state (the engine's _idle, "behind").
                self.job.stats["behind"] += 1
                self._unsync()
                self._catch_up(now, self.catch_from)
                return
            if head is not None:      # at the head: current (with nobody training, nothing to say)
                self.set_status(Status.READY, self.step)
        else:
            # Peers at the end barrier past our step reduce no more: take their last steps
            # from their log (the kernel's ``done_ahead``), or a snapshot when too far behind.
            ahead = [t for m in view.participants if (t := self.job.by_node(m.node)) is not None
                     and t.phase is Phase.FINISHING and t.step > self.step]
            if ahead:
                if self._follow(max(ahead, key=lambda t: t.step)):
                    self.job.stats["fast_forward"] += 1
                return
        if now - self.last_commit > self.cfg.step_timeout:
            self._end(now, "StepTimeout")     # the engine's deadline of one commit()

    def _follow(self, src: SimTrainer) -> bool:
        """Take `src`'s newer state: replayed from its log when that log still holds our step,
        on its lineage (True), else this trainer catches up by a snapshot (False). A replay
        applies the steps onto the state we hold: where `src` held another state at our step
        (we hold a step the others redid without us), the result is another state again."""
        if src.log_from <= self.step < src.step and src.root == self.root:
            if src.history.get(self.step) == self.digest:
                self._copy(src, replay=True)
            else:
                self.job.stats["replayed_onto_another_state"] += 1
                self.sigs.update({k: v for k, v in src.sigs.items() if self.step <= k < src.step})
                digest = self.digest
                for s in range(self.step + 1, src.step + 1):
                    digest = _h("replayed", digest, s)
                    self.history[s] = digest
                self._set_state(src.step, digest)
            return True
        self._unsync()
        return False

    def _unsync(self) -> None:
        """Catch up from a snapshot: no longer holding the committed state."""
        self.synced = False
        self.transfer = None
        self.set_status(Status.JOINING, self.step)

    def _copy(self, src: SimTrainer, replay: bool = False) -> None:
        """Take `src`'s state: by a replay of its log (ours goes on), or a snapshot (no log)."""
        self.root = src.root
        self.history = dict(src.history)
        if replay:
            self.sigs.update({k: v for k, v in src.sigs.items() if self.step <= k < src.step})
        else:
            last = src.sigs.get(src.step - 1)
            self.sigs = {src.step - 1: last} if last is not None else {}
        self._set_state(src.step, src.digest, keep_log=replay)

    def _set_state(self, step: int, digest: str, keep_log: bool = True) -> None:
        """A new state: the step begun is over (begin() again, and look again before reducing)."""
        self.step, self.digest = step, digest
        self.history[step] = digest
        if not keep_log:
            self.log_from = step
        self.began = self.attempt = None
        self.last_commit = self.job.sim.now
        self.publish_step()

    def applied(self, step: int, digest: str, sig: str) -> None:
        """A step reduced by our own allreduce applied onto our state (``PlanMemory.after_reduce``,
        `sig` its contributors): the log keeps the last RECENT_KEEP steps, or from the step held
        for a member back from a pause (``RecentSteps.hold``)."""
        keep = step - RECENT_KEEP if self.holding is None else min(step - RECENT_KEEP, self.holding)
        self.log_from = max(self.log_from, keep)
        self.sigs[step - 1] = sig
        self.memory = self.memory.after_reduce(step - 1)
        self._set_state(step, digest)

    def publish_step(self) -> None:
        step = self.step
        self.call(lambda n, now: n.set_step(step))

    def report_failure(self, node: str) -> None:
        """The data plane could not reach `node` (a reset on loopback: certain)."""
        self.call(lambda n, now: n.report_failure(node, now, True))

    def _catch_up(self, now: float, donor_node: str | None) -> None:
        """A snapshot from the plan's donor (the end barrier's replicas when it names none)."""
        if self.transfer is not None:
            done_at, donor_id = self.transfer
            donor = self.job.by_node(donor_id)
            if donor is None or not donor.synced:
                self.transfer = None       # the donor died or lost its state: another one
                return
            if now < done_at:
                return
            self.transfer = None
            att = self.attempt
            self._copy(donor)
            if self.in_flight:        # its allreduce goes on: the next reduced step is applied by it
                self.attempt = att
            self.job.stats["snapshot"] += 1
            self.synced = True
            self.set_status(Status.READY, self.step)
            return
        donor = self.job.donor(donor_node, exclude=self.node_id)
        if donor is not None:
            self.transfer = (now + SNAPSHOT_S, donor.node_id or "")

    # ------------------------------------------------------------------ pauses
    def busy(self, now: float, seconds: float) -> None:
        """A long backward (or a loop starved of CPU): no look at the views, no beat."""
        self.busy_until = max(self.busy_until, now + seconds)

    def after_commit(self, now: float, lead: bool) -> None:
        """commit() returned: the user's code after it runs at the loop's next look."""
        self.last_commit = now
        self.lead_step = self.step if lead else None
        self.side_work = self.step
        if self.cfg.checkpoint_every and self.step % self.cfg.checkpoint_every == 0:
            self.job.checkpoints[self.addr] = Checkpoint(self.step, self.digest, self.root,
                                                         self.sigs.get(self.step - 1))

    def _side_work(self, now: float) -> None:
        """The README loop's code after a commit: the leader of the step evaluates in a pause."""
        step, self.side_work = self.side_work, None
        assert step is not None
        pause = self.pauses.pop(step, None)
        if self.cfg.eval_every and step % self.cfg.eval_every == 0 and self.job.leader_rule(self):
            self.lead_claims.append(step)
            self.job.checker.on_lead_claim(self, step, now)
            pause = max(pause or 0.0, self.cfg.eval_s)
        if pause:
            self.pause(now, pause)

    def pause(self, now: float, seconds: float) -> None:
        if self.phase is not Phase.ACTIVE:
            return
        self.began = self.attempt = None
        self.transfer = None              # its catch-up stops: it catches up again afterwards
        self.set_status(Status.PAUSED, self.step if self.synced else -1)
        self.phase = Phase.PAUSED
        self.pause_until = now + seconds

    def _leave_pause(self, now: float) -> None:
        self.phase = Phase.ACTIVE
        self.last_commit = now
        self.memory = self.memory.after_pause()     # the engine's rejoined_after_pause
        self.began = self.attempt = None
        if self.synced:
            self.set_status(Status.READY, self.step)
        else:
            self.set_status(Status.JOINING, self.step)
        if self.done:                 # the loop ends at once: finish() says 'done' right after 'ready'
            self._active(now)

    # ------------------------------------------------------------------ the end barrier
    def _unchecked(self) -> bool:
        return self.synced and not self.end_checked and viewplan.must_check_end(self.memory, self.view, self.node_id)

    def _finishing(self, now: float) -> None:
        view, node = self.view, self.node
        if not self.synced and view is not None and view.role_of(self.node_id) in (Role.JOINER, Role.PARTICIPANT):
            self._catch_up(now, None)     # the idle rounds' catch-up: a snapshot of a finished peer's state
        unchecked = self._unchecked()
        if self.owe_done and self.synced and not unchecked:
            self.owe_done = False
            self.set_status(Status.DONE, self.step)
        peer_done = unchecked and view is not None and node is not None and any(
            (meta := _meta_of(node, m.node)) is not None and meta.status is Status.DONE and meta.step == self.step
            for m in view.members if m.node != node.id)
        word = end_word(view, self.step, self.synced, False, now >= self.deadline,
                        view is not None and bool(view.joiners) and self.job.all_done(view, self.step),
                        unchecked=unchecked, peer_done=peer_done)
        if word is EndWord.CHECK:
            assert view is not None
            word = end_checked(self._check_end(view), view.finished is not None)
            self.job.stats[f"end_check:{word.value}"] += 1
            if word in (EndWord.FINISHED, EndWord.DONE):
                self.end_checked = True
                self.memory = self.memory.after_pause()    # the engine's membership_checked
                self.owe_done = self.owe_done or word is EndWord.DONE
            elif word is EndWord.REJOIN:
                self.end_checked = self.owe_done = True
                self._unsync()            # a snapshot of the others' state before 'done'
        if word is EndWord.FINISHED:
            assert view is not None
            self._end(now, None, view.finished)
        elif word is EndWord.BEHIND:
            assert view is not None
            self._end(now, "JobFinished(held)", view.finished)
        elif word is EndWord.TIMEOUT:
            self._end(now, "StepTimeout")

    def _check_end(self, view: View) -> SigCheck:
        """``EndBarrier._check``: our signatures of our last steps against the first finished peer
        that knows one (done at our step in gossip, or a participant of the view that says the
        job finished); a peer answers while it is in its end barrier and reachable."""
        steps = end_check_steps(self.memory, self.step)
        mine = {s: self.sigs.get(s) for s in steps}
        if all(sig is None for sig in mine.values()):
            return signatures_agree([])
        node = self.node
        assert node is not None
        holders = {m.node for m in (*view.participants, *view.paused)} if view.finished is not None else set()
        for m in view.members:
            t = self.job.by_node(m.node)
            meta = _meta_of(node, m.node)
            done = meta is not None and meta.status is Status.DONE and meta.step == self.step
            if (t is None or t is self or not (done or m.node in holders) or t.phase is not Phase.FINISHING
                    or (self.addr, t.addr) in self.job.sim.blocked):
                continue
            result = signatures_agree([(mine[s], t.sigs.get(s) if mine[s] is not None else None) for s in steps])
            if result is not SigCheck.UNKNOWN:
                return result
        return SigCheck.UNKNOWN


def view_lead_rule(t: SimTrainer) -> bool:
    """``is_leader`` as the view's lead read when asked (the code before leads_step): a peer that
    reads the view after the leader paused names itself for the same step."""
    view, me = t.view, t.node_id
    lead = view.lead() if view is not None else None
    return lead is not None and lead.node == me


def mask_lead_rule(t: SimTrainer) -> bool:
    """``is_leader`` as the trainer computes it: the commit's mask named us (``leads_step``)."""
    return t.lead_step is not None and t.lead_step == t.step


@dataclass
class JobChecker:
    """The job-level invariants, checked as events happen and at the end (``final``)."""

    job: SimJob | None = None
    states: dict[int, tuple[str, str]] = field(default_factory=dict)   # step -> (digest, root) committed
    root: str | None = None                 # the job's step-0 state (the first step 1's)
    finished: int | None = None
    finished_at: float | None = None
    owed: set[str] = field(default_factory=set)     # addrs that must return the final state
    claims: dict[tuple[int, str], str] = field(default_factory=dict)   # (step, its state) -> the leader
    regress_at: float | None = None         # when the views' high water first went back (a resume below it)
    max_high_water: int = 0
    orphans: set[int] = field(default_factory=set)   # steps committed by one trainer only (a split)
    violations: list[str] = field(default_factory=list)

    def fail(self, msg: str) -> None:
        self.violations.append(msg)
        raise InvariantViolation(msg)

    def on_commit(self, group: list[SimTrainer], step: int, now: float,
                  contributions: list[tuple[SimTrainer, tuple[int, str, int | None] | None, int | None]]
                  | None = None, base: str | None = None) -> None:
        """`group` committed `step` from the state `base`; `contributions`: each contributor, the
        step it began (step, state, slot) and the slot its gradients count as."""
        states = {(t.digest, t.root) for t in group}
        if len(states) != 1:
            self.fail(f"t={now:.2f}: step {step} committed by trainers holding {len(states)} states: "
                      f"{[(t.addr, t.digest) for t in group]}")
        digest, root = states.pop()
        for t, began, slot in contributions or ():
            if began is None or began[:2] != (step - 1, base):
                self.fail(f"t={now:.2f}: {t.addr}'s gradients in step {step} were computed on another state "
                          f"({began}) than the one the step applies to ({step - 1}, {base})")
            elif began[2] != slot:
                self.fail(f"t={now:.2f}: {t.addr}'s gradients for slot {began[2]} counted as slot {slot} in step "
                          f"{step}")
        if step == 1 and self.root is not None and root != self.root:
            assert self.job is not None
            evidence = self.job.evidence(self.root)
            if self.max_high_water > 0:
                evidence.append(f"the views (high water {self.max_high_water})")
            if evidence and not any(t.cfg.allow_scratch for t in group):
                self.fail(f"t={now:.2f}: a new job trained from step 0 ({[t.addr for t in group]}) while "
                          f"{evidence} held the job's")
        if step == 1 and root != self.root:
            if self.root is not None:     # a new job where nothing held the old one: its own record
                self.states, self.claims, self.finished, self.owed = {}, {}, None, set()
                self.regress_at, self.max_high_water = None, 0
            self.root = root
        prev = self.states.get(step)
        if step in self.orphans:     # the others redo (or adopt) a step one trainer alone committed
            self.orphans.discard(step)
            prev = None
        if prev is not None and prev[0] != digest:
            # A step committed again with another state: only when nobody holds the first one
            # any more (a resume from an older checkpoint, said loudly); else progress was thrown away.
            assert self.job is not None
            # Who had said it held more when the leader resumed below it. A process that said so
            # later (started since, or within ANNOUNCED_S of the resume: its gossip still on the
            # way) joins the resumed job: a loss the leader's WARNING names, not this defect.
            since = self.regress_at if self.regress_at is not None else now
            ahead = [t.addr for t in self.job.trainers.values() if t.alive and t.synced and t not in group
                     and t.root == prev[1] and t.step >= step and t.announced_at + ANNOUNCED_S <= since]
            if ahead:
                self.fail(f"t={now:.2f}: step {step} committed again by {[t.addr for t in group]} while {ahead} "
                          f"hold the job at step {step} or later")
        self.states[step] = (digest, root)

    def on_orphan(self, t: SimTrainer, step: int) -> None:
        """`t` alone committed `step` (its allreduce finished, the others' failed): the job's
        state of that step, unless the others commit it again without it."""
        if step not in self.states:
            self.states[step] = (t.digest, t.root)
            self.orphans.add(step)

    def forget_views(self) -> None:
        """Every member lost with its data directory: no view of the old job exists any more."""
        self.max_high_water = 0

    def on_lead_claim(self, t: SimTrainer, step: int, now: float) -> None:
        other = self.claims.setdefault((step, t.digest), t.addr)
        if other != t.addr:
            self.fail(f"t={now:.2f}: two leaders for step {step}: {other} and {t.addr}")

    def on_view(self, view: View, now: float, job: SimJob) -> None:
        if view.high_water < self.max_high_water and self.regress_at is None:
            self.regress_at = now
        self.max_high_water = max(self.max_high_water, view.high_water)
        if view.finished is not None and self.finished is None:
            self.finished, self.finished_at = view.finished, now
            for m in (*view.participants, *view.paused):
                t = job.by_node(m.node)
                if (t is not None and t.synced and t.root == self.root and t.step > 0    # it holds the job,
                        and t.phase in (Phase.ACTIVE, Phase.PAUSED, Phase.FINISHING)):   # in its loop
                    self.owed.add(t.addr)

    def on_outcome(self, t: SimTrainer, now: float) -> None:
        o = t.outcome
        assert o is not None
        if o.error is None:
            final = self.states.get(o.step)
            if o.finished != o.step or final is None or final[0] != o.digest:
                self.fail(f"t={now:.2f}: {t.addr} returned from finish() with step {o.step} (digest {o.digest}) "
                          f"but the job finished at {o.finished} with {final}")
        elif t.addr in self.owed:
            self.fail(f"t={now:.2f}: {t.addr} was in the job when it finished at {self.finished} but left with "
                      f"{o.error} at step {o.step}")


class SimJob:
    """Trainers over a ``Simulator``: their loops, the modelled data plane, and the checker."""

    def __init__(self, sim: Simulator, leader_rule: Callable[[SimTrainer], bool] = mask_lead_rule) -> None:
        self.sim = sim
        self.trainers: dict[str, SimTrainer] = {}
        self.checkpoints: dict[str, Checkpoint] = {}    # addr -> its newest checkpoint (a disk: survives a kill)
        self.incarnations: dict[str, int] = {}
        self.splits: dict[int, str] = {}     # step -> the addr whose allreduce of it alone finishes
        self.leader_rule = leader_rule
        self.stats: Counter[str] = Counter()
        self.checker = JobChecker(job=self)
        self._prev_event = sim.on_event
        sim.on_event = self._on_event
        sim.at(sim.now + STEP_S, self._plane)

    def _on_event(self, ev: SimEvent) -> None:
        if self._prev_event is not None:
            self._prev_event(ev)
        if isinstance(ev, ViewCommitted):
            self.checker.on_view(ev.view, self.sim.now, self)

    def add(self, addr: str, cfg: TrainerConfig) -> SimTrainer:
        inc = self.incarnations.get(addr, -1) + 1
        self.incarnations[addr] = inc
        t = SimTrainer(self, addr, cfg, inc)
        self.trainers[addr] = t
        # Each process's loop looks at its own moments: replicas read the views at different times.
        self.sim.at(self.sim.now + self.sim.rng.uniform(0.0, TICK_S), lambda: self._tick(t))
        return t

    def _tick(self, t: SimTrainer) -> None:
        if not t.alive or self.trainers.get(t.addr) is not t:
            return
        if t.addr in self.sim.nodes:
            t.tick(self.sim.now)
        if t.phase is not Phase.OVER:
            self.sim.at(self.sim.now + TICK_S, lambda: self._tick(t))

    def crash(self, addr: str, lose_disk: bool = False) -> None:
        """SIGKILL the process at `addr` (a trainer's or a witness's); its checkpoints stay."""
        t = self.trainers.get(addr)
        if t is not None:
            t.alive = False
        self.sim.crash(addr, lose_disk=lose_disk)

    def restart(self, addr: str, cfg: TrainerConfig | None = None) -> None:
        """The same command again at `addr` (a trainer when `cfg` is given, else a witness)."""
        if addr in self.sim.nodes:
            return                  # running already
        self.sim.restart(addr)
        if cfg is not None:
            self.add(addr, cfg)

    # ------------------------------------------------------------------ lookups
    def by_node(self, node_id: str | None) -> SimTrainer | None:
        for t in self.trainers.values():
            if t.alive and t.node_id == node_id and node_id is not None:
                return t
        return None

    def head(self, view: View) -> SimTrainer | None:
        """The trainer at the highest step among the view's participants (the data plane's head)."""
        ts = [t for m in view.participants if (t := self.by_node(m.node)) is not None and t.synced]
        return max(ts, key=lambda t: t.step, default=None)

    def donor(self, node: str | None, exclude: str | None) -> SimTrainer | None:
        """Who serves a snapshot: the view plan's donor, when it holds a state; else, when the
        plan names none, a replica at the end barrier."""
        if node is not None:
            t = self.by_node(node)
            return t if t is not None and t.synced and t.phase is not Phase.FORMING else None
        for t in self.trainers.values():
            if t.alive and t.phase is Phase.FINISHING and t.synced and t.node_id != exclude:
                return t
        return None

    def all_done(self, view: View, step: int) -> bool:
        return all((t := self.by_node(m.node)) is not None and t.phase is Phase.FINISHING and t.step == step
                   for m in view.participants)

    def evidence(self, root: str) -> list[str]:
        """Who holds evidence of the job descended from `root`: a live member's view (its high
        water or its end), a live trainer's state, a checkpoint."""
        out = [f"{a}'s view" for a, n in self.sim.nodes.items() if n.view is not None
               and (n.view.high_water > 0 or n.view.finished is not None)]
        out += [f"trainer {t.addr}" for t in self.trainers.values() if t.alive and t.root == root and t.step > 0]
        out += [f"{a}'s checkpoint" for a, c in self.checkpoints.items() if c.root == root]
        return out

    # ------------------------------------------------------------------ driving
    def _plane(self) -> None:
        """Every STEP_S, one round per communicator (data epoch): its participants commit a
        step when all of them reduce in it."""
        now = self.sim.now
        rounds: dict[int, View] = {}
        for t in self.trainers.values():
            a = t.attempt
            if t.alive and t.phase is Phase.ACTIVE and a is not None and a[1].role is Role.PARTICIPANT:
                v = rounds.get(a[1].data_epoch)
                if v is None or a[0].epoch > v.epoch:
                    rounds[a[1].data_epoch] = a[0]       # the newest view of that communicator
        for view in rounds.values():
            self._commit(view, now)
        for t in self.trainers.values():
            t.in_flight = False     # every allreduce of the round returned (or failed): look again
        self.sim.at(now + STEP_S, self._plane)

    def _reducing(self, t: SimTrainer, data_epoch: int, now: float) -> bool:
        """Is `t`'s allreduce on the communicator of `data_epoch` under way (not aborted by a
        newer data epoch, its loop not elsewhere)?"""
        a, v = t.attempt, t.view
        return (t.alive and t.phase is Phase.ACTIVE and t.side_work is None and now >= t.busy_until
                and t.in_flight and a is not None and a[1].data_epoch == data_epoch
                and v is not None and v.data_epoch == data_epoch)

    def _commit(self, view: View, now: float) -> None:
        d = view.data_epoch
        for m in view.participants:
            t = self.by_node(m.node)
            if t is None:
                # The step's transfer to it fails (a reset, or no answer): its peers report it.
                for s in self.trainers.values():
                    key = (view.epoch, m.node)
                    if s.alive and s.view is not None and s.view.epoch == view.epoch and key not in s._reported:
                        s._reported.add(key)
                        s.report_failure(m.node)
                return
            if not self._reducing(t, d, now):
                return          # paused, computing, or not reducing on this communicator: no step this round
        # Everyone whose allreduce as a participant is on this communicator: the view's
        # participants, and a member whose attempt began in an earlier view of the same data
        # epoch (one that listed it a participant); each counts as its own attempt says.
        members: list[tuple[Member, SimTrainer, Reduce]] = []
        for t in self.trainers.values():
            a = t.attempt
            me = a[0].member(t.node_id) if a is not None else None
            if a is not None and me is not None and a[1].role is Role.PARTICIPANT and self._reducing(t, d, now):
                members.append((me, t, a[1]))
        if any((a.addr, b.addr) in self.sim.blocked for _, a, _ in members for _, b, _ in members):
            return              # a link between them is down: the allreduce cannot finish
        group = [t for _, t, _ in members if t.synced]     # the others catch up: they log the step
        if not group:
            return
        src = max(group, key=lambda x: x.step)
        head = src.step
        contributors = [(m, t) for m, t, att in members if att.contribute]
        behind = [t for t in group if t.step < head]
        for t in behind:
            if not t._follow(src):
                return
        if any(t in behind or (t.began is not None and t.began[0] != head) for _, t in contributors):
            return              # contributors at different steps: the round is discarded (step.decide)
        if head >= group[0].cfg.target.n:
            return
        if not contributors:
            for _, t, _ in members:
                t.began = t.attempt = None     # nobody contributed: begin again (a promoted joiner, with its slot)
            return
        step = head + 1
        ids = tuple(sorted(m.replica_id for m, _ in contributors))
        mask = [False] * (max(m.slot or 0 for m, _ in contributors) + 1)
        for m, _ in contributors:
            if m.slot is not None:
                mask[m.slot] = True
        split = self.splits.pop(step, None)
        cut = next((t for t in group if t.addr == split), None) if len(group) > 1 else None
        if cut is not None:
            # The allreduce finished at `cut` only (it got the last frames, its own were lost): it
            # applies the step, the others do not and report it; they redo the step without it.
            self.stats["split"] += 1
            cut.applied(step, _h(cut.digest, step, ids), _h("sig", step, ids))
            self.checker.on_orphan(cut, step)
            cut.set_status(Status.READY, step)
            cut.after_commit(now, False)
            for t in group:
                if t is not cut:
                    t.report_failure(cut.node_id or "")
            return
        gradients = [(t, t.began, m.slot) for m, t in contributors]
        base = group[0].digest
        for _, t, _ in members:
            if t.synced:
                t.applied(step, _h(t.digest, step, ids), _h("sig", step, ids))
            else:
                t.began = t.attempt = None     # logged: its commit() returned
        self.checker.on_commit(group, step, now, gradients, base)
        for m, t, _ in members:
            if t.synced:
                t.set_status(Status.READY, step)
                t.after_commit(now, leads_step(mask, m.slot))
        # Joiners at the head receive the step too (they apply what is reduced, onto their state);
        # not one whose look at this view would start a catch-up (left out since its last look:
        # the engine's plan of that allreduce says ``rejoin``, and it logs the step instead).
        for t in self.trainers.values():
            v = t.view
            joiner = (t.attempt is not None and t.attempt[1].role is Role.JOINER and self._reducing(t, d, now)) or \
                (v is not None and v.data_epoch == d and v.role_of(t.node_id) is Role.JOINER
                 and not viewplan.track_membership(t.memory, v, v.member(t.node_id))[0].rejoin_pending)
            if (t.alive and t.synced and t.phase is Phase.ACTIVE and joiner and t.step == step - 1
                    and t.root == group[0].root and (t.addr, group[0].addr) not in self.sim.blocked):
                t.applied(step, _h(t.digest, step, ids), _h("sig", step, ids))


def _meta_of(node: Node, member: str) -> MemberMeta | None:
    """What `node`'s gossip says of `member` (``Runtime.member_meta``)."""
    m = node.gossip.members.get(member)
    return m.meta if m is not None else None


__all__ = ["Checkpoint", "JobChecker", "Outcome", "Phase", "SimJob", "SimTrainer", "TrainerConfig", "mask_lead_rule",
           "view_lead_rule"]
