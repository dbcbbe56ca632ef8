"""The job's life as the leader writes it into each view: its target, its end, and whether a
cluster that lost every participant may resume, and from which step.

The views carry the job state (``View.target``, ``View.finished``, ``View.high_water``), so every
member holds it, witnesses included: it outlives every trainer dying. The leader derives the
next values from the current view and the trainers' gossip metadata (``MemberMeta.target``,
``allow_scratch``, status ``done``). Pure bookkeeping: no clock of its own, no I/O.
"""
from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass

from .meta import Status
from .view import JobTarget, View

log = logging.getLogger(__name__)

RESUME_GRACE_S = 5.0     # with no participant left, wait this long for one at the high-water step
FINISH_GRACE_S = 20.0    # joiners get this long to reach the end once every participant has
#: statuses of a trainer that holds a state it can train from (at its meta step); one at the
#: end barrier holds the committed state of its step too, so it is never demoted for saying so
HOLDS_STATE = (Status.READY, Status.FRESH, Status.DONE)
#: ... and of one that holds the cluster's committed state while it steps out (a pause)
HOLDS_COMMITTED = (Status.READY, Status.FRESH, Status.PAUSED, Status.DONE)


@dataclass(frozen=True, slots=True)
class Trainer:
    """What the job planner reads of one live trainer (its newest incarnation)."""

    node: str
    start: float
    status: Status | None
    step: int                    # the step its status was set at
    target: JobTarget | None
    allow_scratch: bool
    stalled: bool = False        # its loop stopped beating: it is left out, and cannot train from its state


@dataclass(frozen=True, slots=True)
class JobState:
    """The job fields of the next view, and the step a headless cluster resumes from."""

    target: JobTarget | None
    finished: int | None
    high_water: int
    resume_at: int | None        # only when no participant is left: None = nobody may train yet


class JobPlanner:
    """Leader-side memory between reconciliations: since when the cluster is headless, since
    when every participant waits at the end, and what was already logged."""

    def __init__(self, me: str, stats: Counter[str]) -> None:
        self.me = me
        self.stats = stats
        self._headless_since: float | None = None
        self._done_since: float | None = None
        self._refused_at: int | None = None   # high water of the refusal last logged
        self._resume_said: tuple[int, int] | None = None   # (high water, step) of the resume last logged

    def next_state(self, cur: View, trainers: list[Trainer], high_water: int, headless: bool,
                   now: float) -> JobState:
        target, finished = self._target(cur, trainers)
        if finished is None:
            finished = self._finished(cur, trainers, now)
        resume_at = None
        if headless and finished is None:
            resume_at, high_water = self._resume(trainers, high_water, now)
        else:
            self._headless_since = None
        return JobState(target, finished, high_water, resume_at)

    @staticmethod
    def _target(cur: View, trainers: list[Trainer]) -> tuple[JobTarget | None, int | None]:
        """The view's target, else the oldest trainer's declaration. A finished job with a
        trainer declaring a further target of the same kind is extended (no longer finished);
        any other disagreement is the declaring trainer's error to report (see the trainer)."""
        declared = sorted((t for t in trainers if t.target is not None), key=lambda t: (t.start, t.node))
        if cur.target is None:
            return (declared[0].target if declared else None), cur.finished
        if cur.finished is not None:
            further = [t.target for t in declared if t.target is not None and t.target.kind is cur.target.kind
                       and t.target.n > cur.target.n]
            if further:
                return max(further, key=lambda t: t.n), None
        return cur.target, cur.finished

    def _finished(self, cur: View, trainers: list[Trainer], now: float) -> int | None:
        """The end barrier: every participant says 'done' at one step S; joiners get
        FINISH_GRACE_S to reach S too (a joiner that cannot is told the job finished). A
        paused member counts like a participant: it comes back to the job's last step and
        says 'done' there too, so no replica leaves the job with a stale step's weights."""
        by_node = {t.node: t for t in trainers}
        parts = [by_node[m.node] for m in (*cur.participants, *cur.paused) if m.node in by_node]
        ends = {t.step for t in parts if t.status is Status.DONE}
        if not parts or len(ends) != 1 or any(t.status is not Status.DONE for t in parts):
            self._done_since = None
            return None
        end = ends.pop()
        joiners = [by_node[m.node] for m in cur.joiners if m.node in by_node]
        if self._done_since is None:
            self._done_since = now
        if all(t.status is Status.DONE and t.step == end for t in joiners) or now - self._done_since >= FINISH_GRACE_S:
            self._done_since = None
            log.info("every participant reached the end at step %d: the job is finished", end, extra={"node": self.me})
            return end
        return None

    def _resume(self, trainers: list[Trainer], high_water: int, now: float) -> tuple[int | None, int]:
        """Every participant is gone. Resume from a trainer at the high-water step; below it
        only after a grace period for one to come back: from the best checkpoint, loudly, and
        from step 0 (a new model: every step of the job lost) only when a trainer was started
        with ``allow_restart_from_scratch``. The high water then starts again from there.
        Otherwise nobody trains, and the trainers refuse, naming the step (trainer/job/life.py)."""
        if self._headless_since is None:
            self._headless_since = now
        # A paused trainer holds the committed state of its step, so it counts here; one whose
        # loop is wedged holds a state nobody can train from.
        held = [t for t in trainers if t.status in HOLDS_COMMITTED and t.step >= 0 and not t.stalled]
        best = max((t.step for t in held), default=None)
        if best is None:
            return None, high_water
        if best >= high_water:
            return best, high_water
        if now - self._headless_since < RESUME_GRACE_S:
            return None, high_water
        if best > 0 or any(t.allow_scratch for t in held):
            if self._resume_said == (high_water, best):   # said once, not at every tick while headless
                return best, best
            self._resume_said = (high_water, best)
            self.stats["resumed_below_high_water"] += 1
            log.warning("no replica holds step %d any more: resuming from step %d (%s)", high_water, best,
                        "a checkpoint" if best > 0 else "allow_restart_from_scratch", extra={"node": self.me})
            return best, best
        if self._refused_at != high_water:
            self._refused_at = high_water
            self.stats["resume_refused"] += 1
            log.warning("no replica holds step %d any more, and none has a checkpoint: no participant until one "
                        "does, or one may start from scratch (allow_restart_from_scratch)", high_water,
                        extra={"node": self.me})
        return None, high_water


__all__ = ["FINISH_GRACE_S", "HOLDS_COMMITTED", "HOLDS_STATE", "JobPlanner", "JobState", "RESUME_GRACE_S", "Trainer"]
