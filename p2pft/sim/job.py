"""Trainers in the simulator: a job's life over the real ``Node`` code and the real decisions.

Each ``SimTrainer`` runs the README's loop (``start()``, ``while not done: begin/commit``, a
pause after some commits, ``finish()``) as a state machine on the virtual clock. What it
decides, it decides with ``p2pft/core/lifecycle.py`` (``admit``, ``initial_fetch``,
``leads_step``, ``end_word``): the functions ``trainer/job/life.py`` calls. The leader's half
(``JobPlanner``) runs inside each ``Node`` as in production. The data plane is modelled, not
run: a step commits when every participant of a view holds that view, is at the same step and
is not paused; its state is a digest chain (``digest(s+1) = H(digest(s), s+1, contributors)``),
so two trainers hold the same weights exactly when they hold the same digest. A catch-up takes
``SNAPSHOT_S`` and ends with the donor's state; a joiner at most ``RECENT_KEEP`` steps behind
the head replays them at once (the fast-forward log).

``JobChecker`` holds the job-level invariants (see ``tests/sim/test_job_invariants.py``):

- one state per step: the contributors of a step hold the same state;
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

from ..core.lifecycle import Admit, Declared, EndWord, Fetch, admit, end_word, initial_fetch, leads_step
from ..core.meta import Status
from ..core.node import Node
from ..core.view import JobTarget, Role, View
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
        if node is None or self.phase is Phase.OVER:
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
            self.set_status(Status.DONE, self.step)
            self.phase = Phase.FINISHING
            self.deadline = now + self.cfg.finish_timeout
            return
        if self._admit(now, at_start=False) is not None:
            return
        view, me = self.view, self.node_id
        if view is None or me is None:
            return
        role = view.role_of(me)
        if not self.synced:
            self._catch_up(now, view)
            return
        if role is Role.JOINER:
            head = self.job.head(view)
            if head is not None and head.step > self.step:
                if self._follow(head):
                    self.job.stats["fast_forward"] += 1
                else:
                    return
            if head is not None:      # at the head: current (with nobody training, nothing to say)
                self.set_status(Status.READY, self.step)
        elif role is Role.PARTICIPANT:
            # Peers at the end barrier past our step reduce no more: take their last steps
            # from their log (the kernel's ``done_ahead``), or a snapshot when too far behind.
            ahead = [t for m in view.participants if (t := self.job.by_node(m.node)) is not None
                     and t.phase is Phase.FINISHING and t.step > self.step]
            if ahead:
                if self._follow(max(ahead, key=lambda t: t.step)):
                    self.job.stats["fast_forward"] += 1
            elif now - self.last_commit > self.cfg.step_timeout:
                self._end(now, "StepTimeout")

    def _follow(self, src: SimTrainer) -> bool:
        """Take `src`'s newer state: replayed from its log when at most RECENT_KEEP steps behind
        on its lineage (True), else this trainer catches up by a snapshot (False)."""
        if src.step - self.step <= RECENT_KEEP and src.root == self.root:
            self._copy(src)
            return True
        self.synced = False
        self.set_status(Status.JOINING, self.step)
        return False

    def _copy(self, src: SimTrainer) -> None:
        self.step, self.digest, self.root = src.step, src.digest, src.root
        self.publish_step()

    def publish_step(self) -> None:
        step = self.step
        self.call(lambda n, now: n.set_step(step))

    def report_failure(self, node: str) -> None:
        """The data plane could not reach `node` (a reset on loopback: certain)."""
        self.call(lambda n, now: n.report_failure(node, now, True))

    def _catch_up(self, now: float, view: View) -> None:
        if self.transfer is not None:
            done_at, donor_id = self.transfer
            donor = self.job.by_node(donor_id)
            if donor is None or not donor.synced:
                self.transfer = None       # the donor died or lost its state: another one
                return
            if now < done_at:
                return
            self.transfer = None
            self._copy(donor)
            self.job.stats["snapshot"] += 1
            self.synced = True
            self.last_commit = now
            self.set_status(Status.READY, self.step)
            return
        donor = self.job.donor(view, exclude=self.node_id)
        if donor is not None:
            self.transfer = (now + SNAPSHOT_S, donor.node_id or "")

    # ------------------------------------------------------------------ pauses
    def after_commit(self, now: float, lead: bool) -> None:
        """commit() returned: the user's code after it runs at the loop's next look."""
        self.last_commit = now
        self.lead_step = self.step if lead else None
        self.side_work = self.step
        if self.cfg.checkpoint_every and self.step % self.cfg.checkpoint_every == 0:
            self.job.checkpoints[self.addr] = Checkpoint(self.step, self.digest, self.root)

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
        self.transfer = None              # its catch-up stops: it catches up again afterwards
        self.set_status(Status.PAUSED, self.step if self.synced else -1)
        self.phase = Phase.PAUSED
        self.pause_until = now + seconds

    def _leave_pause(self, now: float) -> None:
        self.phase = Phase.ACTIVE
        self.last_commit = now
        if self.synced:
            self.set_status(Status.READY, self.step)
        else:
            self.set_status(Status.JOINING, self.step)
        if self.done:                 # the loop ends at once: finish() says 'done' right after 'ready'
            self._active(now)

    # ------------------------------------------------------------------ the end barrier
    def _finishing(self, now: float) -> None:
        view = self.view
        word = end_word(view, self.step, self.synced, False, now >= self.deadline,
                        view is not None and bool(view.joiners) and self.job.all_done(view, self.step))
        if word is EndWord.FINISHED:
            assert view is not None
            self._end(now, None, view.finished)
        elif word is EndWord.BEHIND:
            assert view is not None
            self._end(now, "JobFinished(held)", view.finished)
        elif word is EndWord.TIMEOUT:
            self._end(now, "StepTimeout")


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
    violations: list[str] = field(default_factory=list)

    def fail(self, msg: str) -> None:
        self.violations.append(msg)
        raise InvariantViolation(msg)

    def on_commit(self, group: list[SimTrainer], step: int, now: float) -> None:
        states = {(t.digest, t.root) for t in group}
        if len(states) != 1:
            self.fail(f"t={now:.2f}: step {step} committed by trainers holding {len(states)} states: "
                      f"{[(t.addr, t.digest) for t in group]}")
        digest, root = states.pop()
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

    def donor(self, view: View, exclude: str | None) -> SimTrainer | None:
        """Who serves a snapshot: a participant, else a paused member, else one at the end barrier."""
        cands = [m for m in (*view.participants, *view.paused) if m.node != exclude]
        for m in cands:
            t = self.by_node(m.node)
            if t is not None and t.synced and t.phase is not Phase.FORMING:
                return t
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
        """Every STEP_S: each view's participants commit a step when all of them can."""
        now = self.sim.now
        groups: dict[int, tuple[View, list[SimTrainer]]] = {}
        for t in self.trainers.values():
            v = t.view
            if t.alive and v is not None and t.phase is Phase.ACTIVE and v.role_of(t.node_id) is Role.PARTICIPANT:
                groups.setdefault(v.epoch, (v, []))[1].append(t)
        for view, _ in groups.values():
            self._commit(view, now)
        self.sim.at(now + STEP_S, self._plane)

    def _commit(self, view: View, now: float) -> None:
        group: list[SimTrainer] = []
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
            if (t.phase is not Phase.ACTIVE or not t.synced or t.side_work is not None or t.view is None
                    or t.view.epoch != view.epoch):
                return                      # paused, catching up, or on another view: no step this round
            group.append(t)
        if not group:
            return
        src = max(group, key=lambda x: x.step)
        head = src.step
        for t in group:
            if t.step < head and not t._follow(src):
                return
        if head >= group[0].cfg.target.n:
            return
        step = head + 1
        ids = sorted(m.replica_id for m in view.participants)
        digest = _h(group[0].digest, step, tuple(ids))
        slots = sorted(m.slot for m in view.participants if m.slot is not None)
        mask = [False] * ((max(slots) + 1) if slots else 0)
        for sl in slots:
            mask[sl] = True
        for t in group:
            t.step, t.digest = step, digest
        self.checker.on_commit(group, step, now)
        for m, t in zip(view.participants, group):
            t.set_status(Status.READY, step)
            t.after_commit(now, leads_step(mask, m.slot))
        # Joiners at the head receive the step too (they log what is reduced).
        for t in self.trainers.values():
            v = t.view
            if (t.alive and t.synced and t.phase is Phase.ACTIVE and v is not None and v.epoch == view.epoch
                    and v.role_of(t.node_id) is Role.JOINER and t.step == step - 1 and t.root == group[0].root):
                t.step, t.digest = step, digest
                t.publish_step()


__all__ = ["Checkpoint", "JobChecker", "Outcome", "Phase", "SimJob", "SimTrainer", "TrainerConfig", "mask_lead_rule",
           "view_lead_rule"]
