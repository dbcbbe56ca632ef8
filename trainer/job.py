"""A job's start and end around the step loop of ``FaultTolerant``.

``start()`` (run by the first ``begin()``) joins the group: it declares the job's target, waits
(bounded) for ``min_replicas`` participants, refuses a job that already finished or whose
progress no peer and no checkpoint holds any more, and makes the first participants start
from one state (the lead's, as DDP broadcasts rank 0's). ``finish()`` is the end barrier: every
replica says it is done at the same step, joiners that are still catching up get there too,
and the leader writes ``finished`` into the view, where a late restart reads it. ``is_leader``
names one participant for side work (evaluation, logging, checkpoints).
"""
from __future__ import annotations

import dataclasses
import enum
import logging
import time
from collections import deque
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..core.meta import Status
from ..transport import CommTimeout, PeerFailed
from ..transport.backend import DataPlaneError
from ..transport.stream import StateSnapshot, fetch_state
from ..core.view import JobTarget, Role, TargetKind, View
from .attempt import Attempt, Plan, StepResult, StepTimeout, Stopped
from .requests import StateRequest

if TYPE_CHECKING:
    import torch

    from ..runtime import Runtime
    from .catchup import Catchup
    from .cursor import DataCursor
    from ..transport.server import DataServer
    from .comms import ShardComms
    from .donor import Donor

log = logging.getLogger(__name__)

POLL_S = 0.1                # one look at the view while waiting for the group or the end
FETCH_INITIAL_TIMEOUT_S = 30.0
ATTEMPT_TIMEOUT_S = 5.0     # one try at the lead's data port; the view is read again between tries
IDLE_ROUND_TIMEOUT_S = 5.0  # one round with the joiners at the end barrier


class JobFinished(Stopped):
    """The job finished (every participant reached its end) before this replica could train:
    nothing to do. A ``Stopped``, so the loop's one ``except Stopped`` covers it; exit 0."""

    def __init__(self, step: int, target: JobTarget | None) -> None:
        self.step, self.target = step, target
        what = f" (target {target})" if target is not None else ""
        super().__init__(f"the job already finished at step {step}{what}: nothing to train")


class MissingStateError(RuntimeError):
    """The cluster reached ``high_water`` but no live peer holds any of its state and this
    replica has no checkpoint: starting from step 0 would silently train a new model."""

    def __init__(self, high_water: int, have_step: int) -> None:
        self.high_water, self.have_step = high_water, have_step
        super().__init__(
            f"the job reached step {high_water}, but no running replica holds it and this replica has no checkpoint: "
            "refusing to train from step 0; start a replica with its checkpoint, or pass "
            "allow_restart_from_scratch=True (--allow-restart-from-scratch) to train a new model")


class JobConfigError(ValueError):
    """This replica's job declaration contradicts the one the group already runs with."""


class InitialStateMismatch(RuntimeError):
    """initial_state='check': the first participants' states differ before step 0."""


class InitialState(str, enum.Enum):
    """How the first participants of a job agree on their state before step 0."""

    BROADCAST = "broadcast"   # take the lead's weights, buffers and registered state (DDP's way)
    CHECK = "check"           # compare digests: a mismatch is an error before step 0
    OFF = "off"               # trust the user


class OnFinished(str, enum.Enum):
    """What a replica that starts after the job finished does."""

    EXIT = "exit"             # raise JobFinished (exit 0)
    WAIT = "wait"             # wait (up to start_timeout) for a further target


@dataclass(frozen=True)
class JobOptions:
    target: JobTarget | None = None
    min_replicas: int = 1
    start_timeout: float = 120.0
    resume_grace: float = 15.0
    allow_restart_from_scratch: bool = False
    on_finished: OnFinished = OnFinished.EXIT
    initial_state: InitialState = InitialState.BROADCAST
    finish_timeout: float = 300.0

    @classmethod
    def make(cls, *, total_steps: int | None, total_samples: int | None, **kw: Any) -> "JobOptions":
        """Checked options (ValueError names the bad one)."""
        if total_steps is not None and total_samples is not None:
            raise ValueError("declare total_steps or total_samples, not both")
        target = None
        if total_steps is not None:
            target = JobTarget(TargetKind.STEPS, total_steps)
        elif total_samples is not None:
            target = JobTarget(TargetKind.SAMPLES, total_samples)
        mr = kw.get("min_replicas", 1)
        if isinstance(mr, bool) or not isinstance(mr, int) or mr < 1:
            raise ValueError(f"min_replicas must be a positive int, got {mr!r}")
        for name in ("start_timeout", "resume_grace", "finish_timeout"):
            if name in kw and not kw[name] > 0:
                raise ValueError(f"{name} must be positive, got {kw[name]!r}")
        kw["on_finished"] = OnFinished(kw.get("on_finished", OnFinished.EXIT))
        kw["initial_state"] = InitialState(kw.get("initial_state", InitialState.BROADCAST))
        return cls(target=target, **kw)


class JobLife:
    """Mixed into ``FaultTolerant`` before ``StepEngine``: its begin/commit/plan hooks wrap the
    engine's (``super()`` is the engine)."""

    job: JobOptions
    if TYPE_CHECKING:  # what the engine provides
        rt: Runtime
        step: int
        synced: bool
        secret: bytes | None
        loop_timeout: float | None
        step_timeout: float
        cursor: DataCursor
        catchup: Catchup
        state_io: Any
        model: torch.nn.Module
        opt: torch.optim.Optimizer
        events: deque[dict[str, Any]]
        _slot: int | None

        @property
        def stopping(self) -> bool: ...
        def capture_state(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]: ...
        def load_state(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None: ...
        def digest(self) -> str: ...
        serving: Donor

        comms: ShardComms
        ds: DataServer

        def state_mutation(self) -> AbstractContextManager[None]: ...
        def step_timeout_capped(self, cap: float) -> AbstractContextManager[None]: ...
    _started = False
    _ended: int | None = None           # the finished step this replica saw
    _initial: tuple[StateSnapshot, str] | None = None
    _finishing = False

    # ------------------------------------------------------------------ queries
    @property
    def done(self) -> bool:
        """This replica reached the declared target (or the job finished): call ``finish()``."""
        view = self.rt.view
        if view is not None and view.finished is not None:
            return True
        t = self.job.target
        if t is None:
            return False
        if t.kind is TargetKind.STEPS:
            return self.step >= t.n
        cur = self.cursor
        return cur.frontier - cur.hole_samples >= t.n

    @property
    def is_leader(self) -> bool:
        """True on the one participant that does side work in the current view (the lowest
        slot): the same answer on every replica reading the same view; when it dies, the view
        that removes it names a survivor."""
        view = self.rt.view
        lead = view.lead() if view is not None else None
        return lead is not None and lead.node == self.rt.node_id and self.synced

    @property
    def leader(self) -> str | None:
        """The replica id of the participant doing side work in the current view."""
        view = self.rt.view
        lead = view.lead() if view is not None else None
        return lead.replica_id if lead is not None else None

    # ------------------------------------------------------------------ start
    def start(self) -> None:
        """Join the group (idempotent; the first ``begin()`` calls it). Raises JobFinished,
        MissingStateError, JobConfigError, InitialStateMismatch, or StepTimeout when no
        view takes this replica within ``start_timeout``."""
        if self._started:
            return
        rt, o = self.rt, self.job
        rt.declare_job(o.target, o.allow_restart_from_scratch)
        deadline = time.monotonic() + o.start_timeout
        # A committed view that says the job finished is enough, whoever it lists: the replicas
        # that finished may have left with the quorum, and a witness still hands that view out.
        view = self._wait(lambda v: v.role_of(rt.node_id) in (Role.PARTICIPANT, Role.JOINER) or v.finished is not None,
                          deadline, "this replica in it")
        view = self._check_finished(view, deadline)
        self._check_target(view)
        view = self._check_high_water(view, deadline)
        # Only a job's first participants wait for each other: a participant that others already
        # train with (a restart from a checkpoint at their step) would hold up their allreduces.
        if o.min_replicas > 1 and self.step == 0 and view.role_of(rt.node_id) is Role.PARTICIPANT:
            view = self._wait(lambda v: len(v.participants) >= o.min_replicas or v.role_of(rt.node_id) is Role.JOINER
                              or v.finished is not None, deadline, f"{o.min_replicas} participants", fail=False)
            self._check_finished(view, deadline)
            if len(view.participants) < o.min_replicas and view.role_of(rt.node_id) is Role.PARTICIPANT:
                log.warning("no view with %d participants within %g s: starting with %d", o.min_replicas,
                            o.start_timeout, len(view.participants))
        self._agree_initial(deadline)
        self._started = True
        log.info("in the group at step %d: %d participant(s), leader %s", self.step,
                 len(view.participants), self.leader)

    def _wait(self, pred: Any, deadline: float, what: str, fail: bool = True) -> View:
        rt = self.rt
        while True:
            if self.stopping:
                raise Stopped("stop requested")
            v = rt.wait_view(lambda v: pred(v) or self.stopping, min(POLL_S * 5, max(0.0, deadline - time.monotonic())),
                             loop_timeout=self.loop_timeout)
            if v is not None and pred(v):
                return v
            if time.monotonic() >= deadline:
                if fail or rt.view is None:
                    raise StepTimeout(f"no view with {what} within {self.job.start_timeout} s")
                return rt.view

    def _check_finished(self, view: View, deadline: float) -> View:
        if view.finished is None:
            return view
        mine = self.job.target
        further = (mine is not None and view.target is not None and mine.kind is view.target.kind
                   and mine.n > view.target.n)
        if further or self.job.on_finished is OnFinished.WAIT:
            log.info("the job finished at step %d; waiting for a further target", view.finished)
            return self._wait(lambda v: v.finished is None, deadline, "a further target")
        self._ended = view.finished
        log.info("the job already finished at step %d%s: nothing to train", view.finished,
                 f" (target {view.target})" if view.target else "")
        raise JobFinished(view.finished, view.target)

    def _check_target(self, view: View) -> None:
        mine, theirs = self.job.target, view.target
        if mine is not None and theirs is not None and mine != theirs and view.finished is None:
            log.error("this replica declares the job's end as %s, but the group runs to %s", mine, theirs)
            raise JobConfigError(f"this replica declares the job's end as {mine}, but the group runs to {theirs}")

    def _check_high_water(self, view: View, deadline: float) -> View:
        """No participant, and the cluster got further than our state. With a checkpoint, the
        leader resumes from the best one after its grace (loudly). Without one (step 0), wait
        `resume_grace` for a replica holding some state, then refuse to train a new model
        under the job's name (or, allowed, let the leader resume from here)."""
        o = self.job
        if view.participants or view.paused or view.high_water <= self.step:
            return view   # someone trains, or holds the committed state while it steps out
        if self.step > 0:
            log.info("the job reached step %d and no replica trains now; offering this replica's step %d",
                     view.high_water, self.step)
            return self._check_finished(self._wait(lambda v: bool(v.participants) or v.finished is not None,
                                                   deadline, "a participant"), deadline)
        log.info("the job reached step %d and no replica trains now; waiting up to %g s for one that holds it",
                 view.high_water, o.resume_grace)
        grace = min(deadline, time.monotonic() + o.resume_grace)
        v = self._wait(lambda v: bool(v.participants or v.paused) or v.finished is not None, grace, "a participant",
                       fail=False)
        if v.participants or v.paused or v.finished is not None:
            return self._check_finished(v, deadline)
        if not o.allow_restart_from_scratch:
            log.error("the job reached step %d, but no running replica holds it and this replica has no checkpoint: "
                      "refusing to train from step 0 (allow_restart_from_scratch / --allow-restart-from-scratch to "
                      "do it anyway)", v.high_water)
            raise MissingStateError(v.high_water, self.step)
        log.warning("the job reached step %d, but no replica holds it: training again from step 0, as allowed",
                    v.high_water)
        return self._wait(lambda v: bool(v.participants), deadline, "a participant after the allowed restart")

    # ------------------------------------------------------------------ same start everywhere
    def _agree_initial(self, deadline: float) -> None:
        """At step 0 with every participant at step 0: the lead keeps a copy of its state for
        the others to pull (or compare digests with), taken before any step. A replica at step
        0 that the group did not start with (a joiner, or participants already past step 0)
        catches up from a snapshot: its state at step 0 is its own, not the job's (replicas need
        not seed alike), so the steps since, replayed from a peer's short log onto it, would
        give other weights than the group's."""
        rt = self.rt
        view = rt.view
        if self.step != 0 or view is None:
            return
        others = [m for m in view.participants if m.node != rt.node_id]
        if view.role_of(rt.node_id) is not Role.PARTICIPANT or any(rt.member_step(m.node) != 0 for m in others):
            if others or any(m.node != rt.node_id for m in view.paused):   # someone holds the job's state
                log.info("the group started without this replica: catching up from a snapshot instead of "
                         "taking the initial state")
                self.catchup.start("the group started without this replica")
            return
        if self.job.initial_state is InitialState.OFF:
            return
        lead = view.lead()
        assert lead is not None
        if lead.node == rt.node_id:
            self._hold_initial()
            return
        mode = self.job.initial_state
        end = min(deadline, time.monotonic() + FETCH_INITIAL_TIMEOUT_S)
        last: Exception | None = None
        while time.monotonic() < end and not self.stopping:
            broken = self.comms.unusable()
            if broken is not None:   # the data plane can never work here: say so, do not wait for the lead
                err = DataPlaneError(f"the data plane cannot work for this job: {type(broken).__name__}: {broken}")
                log.error("%s", err)
                raise err
            lead = (rt.view or view).lead()
            if lead is None:
                return
            if lead.node == rt.node_id:   # the lead was left out meanwhile: this replica leads now
                self._hold_initial()
                return
            try:
                snap = fetch_state(lead.data_addr, StateRequest.initial(mode is InitialState.CHECK).to_wire(),
                                   secret=self.secret, timeout=max(0.1, min(ATTEMPT_TIMEOUT_S, end - time.monotonic())),
                                   into=self._receive_into() if mode is InitialState.BROADCAST else None,
                                   source_host=self.ds.host)
            except Exception as exc:  # not held yet (the lead is still starting), or gone: look again
                last = exc
                if isinstance(exc, (PeerFailed, CommTimeout)):
                    # Evidence like a failed ring connect: a lead whose data port we cannot reach
                    # is probed and, past the bound, left out, and the next view names another.
                    rt.report_failure(lead.node)
                elif rt.member_step(lead.node) > 0:
                    # The group started without us (the lead trained alone, or committed before we
                    # asked): its step-0 copy is gone. Catch up from a snapshot as a joiner does.
                    log.info("the lead %s is past step 0: catching up instead of taking the initial state",
                             lead.replica_id)
                    self.catchup.start("the group started without this replica")
                    return
                rt.wait_view(lambda v: False, POLL_S, loop_timeout=self.loop_timeout)
                continue
            want = str(snap.meta["digest"])
            if mode is InitialState.BROADCAST:
                with self.state_mutation():     # no donor copies a half-loaded state
                    self.load_state(snap.meta, snap.tensors)
            mine = self.digest()
            if mine != want:
                log.error("initial state differs from the leader %s's before step 0 (digest %s here, %s there)",
                          lead.replica_id, mine[:12], want[:12])
                raise InitialStateMismatch(f"initial state differs from replica {lead.replica_id}'s before step 0 "
                                           f"(digest {mine[:12]} here, {want[:12]} there): seed every replica alike, "
                                           "or use initial_state='broadcast'")
            log.info("%s the initial state of %s (digest %s)",
                     "took" if mode is InitialState.BROADCAST else "checked", lead.replica_id, mine[:12])
            self.events.append({"t": time.time(), "kind": "initial_state", "from": lead.replica_id,
                                "digest": mine})
            return
        raise StepTimeout(f"could not get the initial state from the leader within {FETCH_INITIAL_TIMEOUT_S} s: {last}")

    def _hold_initial(self) -> None:
        """The lead: keep a copy of this replica's state at step 0 for the others to pull."""
        meta, tensors = self.capture_state()
        self._initial = (StateSnapshot(meta=meta, tensors=tensors), self.digest())
        log.info("holding the initial state for the group (digest %s)", self._initial[1][:12])

    def _receive_into(self) -> dict[str, Any] | None:
        rin = self.state_io.receive_into
        return rin(self.model, self.opt) if rin is not None else None

    def _initial_state(self, request: StateRequest) -> StateSnapshot | None:
        """Transport thread: the state (or only its digest) the lead holds for step 0."""
        held = self._initial
        if held is None:
            return None
        snap, digest = held
        if request.digest_only:
            return StateSnapshot(meta={"digest": digest}, tensors={})
        return StateSnapshot(meta={**snap.meta, "digest": digest}, tensors=snap.tensors)

    # ------------------------------------------------------------------ the engine's hooks
    def begin(self, stop: bool = False) -> list[int]:
        """``StepEngine.begin`` after joining the group; raises JobFinished (a Stopped) when the
        job finished meanwhile, JobConfigError on a contradicting declaration."""
        if not stop:
            self.start()
            self._job_view_check()
        return super().begin(stop)  # type: ignore[misc]

    def commit(self) -> StepResult:
        """``StepEngine.commit``; a step in flight when the job finished raises JobFinished."""
        try:
            return super().commit()  # type: ignore[misc]
        except Stopped:
            err = self._finished_error()
            if err is not None:
                raise err from None
            raise

    def _plan(self, slot: int | None) -> Attempt:
        att = self._stop_plan(self.rt.view)
        if att is not None:
            return att
        att = super()._plan(slot)  # type: ignore[misc]
        if att.kind is Plan.ALLREDUCE and self.synced and not att.rejoin:   # left out: a snapshot, not a log
            ahead = self._done_ahead(att)
            if ahead:
                return dataclasses.replace(att, done_ahead=ahead)
        return att

    def _done_ahead(self, att: Attempt) -> tuple[tuple[int, int], ...]:
        """Data members at the end barrier past our step: the last step committed at them only
        (a peer died, or a view changed, during its allreduce). They wait for us and reduce no
        more, so a round would wait for them in vain."""
        out = []
        for rank, node in enumerate(att.nodes):
            meta = self.rt.member_meta(node) if node != att.node else None
            if meta is not None and meta.status is Status.DONE and meta.step > self.step:
                out.append((rank, meta.step))
        return tuple(out)

    def _after_commit(self) -> None:
        super()._after_commit()  # type: ignore[misc]
        if self._initial is not None and self.step > 0:
            self._initial = None  # every first participant is past step 0: nobody pulls it any more

    def _job_view_check(self) -> None:
        """Every begin(): the job may have finished (a joiner) or been declared otherwise."""
        view = self.rt.view
        if view is None:
            return
        if view.finished is not None and not self._finishing:
            self._ended = view.finished
            raise JobFinished(view.finished, view.target)
        self._check_target(view)
        if not view.participants and not view.paused and view.high_water > self.step:
            # Every participant died since we joined (as a joiner, behind them): the same check
            # as at the start, so that nobody trains on from an older state without being told.
            self._check_high_water(view, time.monotonic() + self.job.start_timeout)

    def _stop_plan(self, view: View | None) -> Attempt | None:
        """A step in flight when the job finished stops (every rank raises Stopped)."""
        if view is not None and view.finished is not None:
            self._ended = view.finished
            return Attempt(Plan.STOP)
        return None

    def _finished_error(self) -> JobFinished | None:
        if self._ended is None:
            return None
        view = self.rt.view
        return JobFinished(self._ended, view.target if view is not None else None)

    # ------------------------------------------------------------------ the end barrier
    def finish(self, timeout: float | None = None) -> int:
        """The end barrier; returns the step the job finished at. Says 'done' at this step,
        waits (bounded) until every participant has and the view says the job finished,
        serving snapshots and reduce rounds to joiners still catching up meanwhile. Raises
        StepTimeout after ``timeout`` (default ``finish_timeout``), Stopped on a stop request."""
        rt = self.rt
        view = rt.view
        if view is not None and view.finished is not None:
            self._ended = view.finished
            return view.finished
        if not self._started:
            self.start()
        deadline = time.monotonic() + (timeout if timeout is not None else self.job.finish_timeout)
        if not self.synced and not self._settle(deadline):
            log.info("at the end still catching up at step %d; waiting for the job to finish", self.step)
        else:
            rt.set_status(Status.DONE, self.step)
            log.info("done at step %d: waiting for the others at the end barrier", self.step)
        self._finishing = True
        try:
            while True:
                view = rt.view
                if view is not None and view.finished is not None:
                    break
                if self.stopping:
                    raise Stopped("stop requested at the end barrier")
                if time.monotonic() >= deadline:
                    raise StepTimeout(f"the job did not finish within {timeout or self.job.finish_timeout} s "
                                      f"of reaching step {self.step}")
                self.serving.serve_queued()
                if view is not None and view.joiners and self._all_done(view):
                    self._idle_round()   # then the pause below: a round moves the whole buffer
                rt.wait_view(lambda v: v.finished is not None or self.stopping, POLL_S,
                             loop_timeout=self.loop_timeout)
        finally:
            self._finishing = False
        self._ended = view.finished
        log.info("the job finished at step %d", view.finished)
        return view.finished

    def _settle(self, deadline: float) -> bool:
        """A joiner whose replay reached the end hands over here: no step follows to do it."""
        end = min(deadline, time.monotonic() + 10.0)
        while time.monotonic() < end:
            if self.catchup.settle(self.step):
                return True
            self.rt.wait_view(lambda v: v.finished is not None, POLL_S, loop_timeout=self.loop_timeout)
            if self.rt.view is not None and self.rt.view.finished is not None:
                return False
        return False

    def _all_done(self, view: View) -> bool:
        rt = self.rt
        for m in view.participants:
            meta = rt.member_meta(m.node)
            if meta is None or meta.status is not Status.DONE or meta.step != self.step:
                return False
        return True

    def _idle_round(self) -> StepResult | None:
        """One reduce round contributing nothing: every participant is done, so nobody else
        contributes either; joiners still catching up finish theirs (IDLE) and read the view."""
        self._slot = None
        try:
            with self.step_timeout_capped(IDLE_ROUND_TIMEOUT_S):
                return super().commit()  # type: ignore[misc]
        except (StepTimeout, Stopped):
            return None


__all__ = ["InitialState", "InitialStateMismatch", "JobConfigError", "JobFinished", "JobLife", "JobOptions",
           "MissingStateError", "OnFinished"]
