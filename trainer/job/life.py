"""A job's start and end around the step loop: the one component every algorithm composes
(``engine.life``), and the hooks the step kernel calls at fixed points of each step.

``start()`` (run by the first ``begin()``) joins the group (``formation.py``: the target,
``min_replicas``, a job that finished or whose progress is lost) and makes the first
participants start from one state (``initial.py``). ``finish()`` is the end barrier
(``barrier.py``). ``is_leader`` names one participant for side work (evaluation, logging,
checkpoints), fixed per step. This module holds what the kernel calls and composes the others;
they never call back into it.

Every rank of a replica calls the same methods at the same points: rank 0 (the only one that
reads the views) decides, and the ranks take its decision through the replica's group
(``ranks.py``), so they raise the same error, load the same step and leave the end barrier
together.
"""
from __future__ import annotations

import time
from typing import Callable, TypeVar

from ...core.lifecycle import Fetch
from ...core.meta import Status
from ...core.view import TargetKind, View
from ..kernel.attempt import Attempt, Plan
from ..kernel.errors import (InitialStateMismatch, JobConfigError, JobFinished, MissingStateError, Stopped)
from ..kernel.options import InitialState, JobOptions, OnFinished
from ..kernel.ports import LifePort, RuntimePort
from .barrier import EndBarrier
from .formation import Formation
from .initial import InitialPlan, SameStart
from .ranks import Ranks, log

T = TypeVar("T")


class JobLife:
    """The job's life of one rank of a replica (``engine.life``); the algorithm's public
    ``start``, ``done``, ``finish``, ``is_leader`` and ``leader`` are these."""

    def __init__(self, port: LifePort, options: JobOptions) -> None:
        self.port = port
        self.options = options
        self.started = False
        self.ended: int | None = None          # the finished step this replica saw
        self._lead = False                     # is_leader, fixed at the last begin()
        self._leader: str | None = None
        self._ranks = Ranks(port)
        self._formation = Formation(port, options, self._ranks)
        self._same_start = SameStart(port, options, self._ranks)   # serves the lead's step-0 state
        self._barrier = EndBarrier(port, options, self._ranks)

    @property
    def rt(self) -> RuntimePort:
        return self._ranks.rt

    @property
    def finishing(self) -> bool:
        """In the end barrier, waiting for the others."""
        return self._barrier.finishing

    def _decided(self, decide: Callable[[], T]) -> T:
        """Rank 0 decides, every rank gets the same value (``Ranks.decided``); a JobFinished
        decided (only forming and the check before a step decide one) is what every rank
        knows from then on (``done``)."""
        try:
            return self._ranks.decided(decide)
        except JobFinished as exc:
            self.ended = exc.step
            raise

    # ------------------------------------------------------------------ queries
    @property
    def done(self) -> bool:
        """This replica reached the declared target, or learned that the job finished: call
        ``finish()``. Read from replicated state only, so every rank of a replica answers alike."""
        if self.ended is not None:
            return True
        t = self.options.target
        if t is None:
            return False
        if t.kind is TargetKind.STEPS:
            return self.port.step >= t.n
        cur = self.port.cursor
        return cur.frontier - cur.hole_samples >= t.n

    @property
    def is_leader(self) -> bool:
        """True on the one replica that does side work for the last step: after a commit, the
        lowest contributing slot of that step's committed mask (the same mask on every replica
        that committed it, so one leader per step, whatever views each read); before the first
        commit, the lowest slot of the view the step began in. The same on every rank of a
        replica; when the leader dies or pauses, the next step names another."""
        return self._lead

    @property
    def leader(self) -> str | None:
        """The replica id of the participant doing side work, as of the step begun last."""
        return self._leader

    # ------------------------------------------------------------------ start
    def start(self) -> None:
        """Collective. Join the group (idempotent; the first ``begin()`` calls it). Raises
        JobFinished, MissingStateError, JobConfigError, InitialStateMismatch, or StepTimeout when
        no view takes this replica within ``start_timeout``."""
        if self.started:
            return
        deadline = time.monotonic() + self.options.start_timeout
        plan = self._decided(lambda: self._form(deadline))
        if plan.how is Fetch.CATCH_UP:
            self.port.catchup.start("the group started without this replica")
        elif plan.how is Fetch.HOLD:
            self._same_start.hold()
        elif plan.how is Fetch.FROM:
            self._same_start.take(plan, deadline)
        elif self.port.step > 0 and not self._decided(self._formation.resumed_agrees):
            self.port.catchup.start("its last step was redone without it")
        self._same_start.collect_checks(deadline)
        self.started = True
        if self.port.rt is not None:
            view = self.rt.view
            self._lead, self._leader = self.lead_now()
            log.info("in the group at step %d: %d participant(s), leader %s", self.port.step,
                     len(view.participants) if view is not None else 0, self._leader)

    def _form(self, deadline: float) -> InitialPlan:
        """Rank 0: wait for the group, check the job's state, and say how the state at step 0
        is agreed."""
        self._formation.form(deadline, self.finishing)
        return self._same_start.plan()

    # ------------------------------------------------------------------ the kernel's hooks
    def lead_now(self) -> tuple[bool, str | None]:
        """Rank 0: (this replica leads, the leader's replica id) in the current view."""
        view = self.rt.view
        lead = view.lead() if view is not None else None
        mine = lead is not None and lead.node == self.rt.node_id and self.port.synced
        return mine, (lead.replica_id if lead is not None else None)

    def note_lead(self, lead: bool) -> None:
        """Every rank, for each step it commits: does this replica lead that step (the lowest
        contributing slot of its committed mask)? One replica per committed step does."""
        self._lead = lead

    def on_begin(self, lead: tuple[bool, str | None], finished: int | None) -> None:
        """Every rank, in ``begin()``: rank 0's reading of the view, agreed by the ranks."""
        self._lead, self._leader = lead
        if finished is not None and not self.finishing:
            self.ended = finished

    def before_begin(self) -> None:
        """Every ``begin()`` (collective): join the group first; the job may have finished
        meanwhile (a joiner) or been declared otherwise."""
        self.start()
        self._decided(self._view_check)

    def _view_check(self) -> None:
        """Rank 0, before each step: the job may have finished meanwhile, been declared
        otherwise, or lost every participant since we joined (as a joiner, behind them): the
        same ``admit`` as at the start, so nobody trains on from an older state untold."""
        if self.rt.view is not None:
            self._formation.admitted(time.monotonic() + self.options.start_timeout, at_start=False,
                                     finishing=self.finishing)

    def stop_plan(self, view: View | None) -> Attempt | None:
        """Rank 0, in each attempt: a step in flight when the job finished stops (every rank
        then raises JobFinished, from the attempt's ``finished``)."""
        if view is not None and view.finished is not None:
            self.ended = view.finished
            return Attempt(Plan.STOP, finished=view.finished, target=view.target)
        return None

    def done_ahead(self, att: Attempt) -> tuple[tuple[int, int], ...]:
        """Rank 0: data members at the end barrier past our step: the last step committed at
        them only (a peer died, or a view changed, during its allreduce). They wait for us and
        reduce no more, so a round would wait for them in vain."""
        out = []
        for rank, node in enumerate(att.nodes):
            meta = self.rt.member_meta(node) if node != att.node else None
            if meta is not None and meta.status is Status.DONE and meta.step > self.port.step:
                out.append((rank, meta.step))
        return tuple(out)

    def stopped(self, att: Attempt) -> Stopped:
        """Every rank: the error a STOP attempt raises."""
        if att.finished is not None:
            self.ended = att.finished
            return JobFinished(att.finished, att.target)
        return Stopped(f"stopped while committing step {self.port.step}")

    def on_step(self) -> None:
        self._same_start.on_step()

    # ------------------------------------------------------------------ the end
    def finish(self, timeout: float | None = None) -> int:
        """Collective: the end barrier; returns the step the job finished at. Says 'done' at
        this step, waits (bounded) until every participant has and the view says the job
        finished, serving snapshots and reduce rounds to joiners still catching up meanwhile.
        Raises JobFinished for a replica that never trained (it started after the end),
        StepTimeout after ``timeout`` (default ``finish_timeout``), Stopped on a stop request."""
        if not self.started:
            self.start()   # a late restart learns here that the job ended without it
        try:
            end = self._barrier.wait(timeout)
        except JobFinished as exc:   # behind the end: it finished, without this replica's weights
            self.ended = exc.step
            raise
        self.ended = end
        return end


__all__ = ["InitialState", "InitialStateMismatch", "JobConfigError", "JobFinished", "JobLife", "JobOptions",
           "MissingStateError", "OnFinished"]
