"""A job's start and end around the step loop: one component every algorithm composes.

``start()`` (run by the first ``begin()``) joins the group: it declares the job's target, waits
(bounded) for ``min_replicas`` participants, refuses a job that already finished or whose
progress no peer and no checkpoint holds any more, and makes the first participants start
from one state (the lead's, as DDP broadcasts rank 0's; for an FSDP replica, rank i takes
shard i of the lead replica's rank i). ``finish()`` is the end barrier: every replica says it
is done at the same step, joiners that are still catching up get there too, and the leader
writes ``finished`` into the view, where a late restart reads it. ``is_leader`` names one
participant for side work (evaluation, logging, checkpoints), fixed per step.

Every rank of a replica calls the same methods at the same points: rank 0 (the only one that
reads the views) decides, and the ranks take its decision through the replica's group, so
they raise the same error, load the same step and leave the end barrier together.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from ...core.lifecycle import Admit, Declared, EndWord, Fetch, admit, end_word, initial_fetch
from ...core.meta import Status
from ...core.view import Role, TargetKind, View, shard_addr
from ...runtime import Runtime
from ...transport import CommTimeout, PeerFailed
from ...transport.backend import DataPlaneError
from ...transport.stream import StateSnapshot, fetch_state
from ..kernel.attempt import Attempt, Plan
from ..kernel.errors import (InitialStateMismatch, JobConfigError, JobError, JobFinished, MissingStateError,
                             StepTimeout, Stopped)
from ..kernel.options import InitialState, JobOptions, OnFinished
from ..kernel.ports import LifePort
from ..kernel.requests import RequestKind, StateRequest
from .pause import last_step_agreed

log = logging.getLogger(__name__)

POLL_S = 0.1                # one look at the view while waiting for the group or the end
FETCH_INITIAL_TIMEOUT_S = 30.0
ATTEMPT_TIMEOUT_S = 5.0     # one try at the lead's data port; the view is read again between tries
IDLE_ROUND_TIMEOUT_S = 5.0  # one round with the joiners at the end barrier
SETTLE_S = 10.0             # a joiner at the end waits this long to hand over before saying done
VERDICT_SEEN_S = 5.0        # the lead, before it raises: time for the checkers to read its verdict


@dataclass(frozen=True)
class InitialPlan:
    how: Fetch
    lead: str = ""                                  # the lead's replica id
    lead_node: str = ""
    addrs: tuple[str, ...] = ()                     # the lead's data address per shard


class JobLife:
    """The job's life of one rank of a replica (``engine.life``); the algorithm's public
    ``start``, ``done``, ``finish``, ``is_leader`` and ``leader`` are these."""

    def __init__(self, port: LifePort, options: JobOptions) -> None:
        self.port = port
        self.options = options
        self.started = False
        self.ended: int | None = None          # the finished step this replica saw
        self.finishing = False
        self._initial: tuple[StateSnapshot, str] | None = None
        self._lead = False                     # is_leader, fixed at the last begin()
        self._leader: str | None = None
        self._checks = InitialChecks()         # the lead's record of the others' digest checks
        port.serving.register(RequestKind.INITIAL, self._initial_state)
        port.serving.register(RequestKind.CHECKED, self._checks.report)

    @property
    def rt(self) -> Runtime:
        rt = self.port.rt
        assert rt is not None, "rank 0 decides the job's life"
        return rt

    def _decided(self, decide: Callable[[], Any]) -> Any:
        """Rank 0 decides, every rank of the replica gets the same value; an error decided
        is raised on every rank."""
        got = self.port.group.broadcast(_capture(decide) if self.port.rt is not None else None)
        if isinstance(got, JobFinished):
            self.ended = got.step     # what rank 0 learned, every rank knows (``done``)
        if isinstance(got, BaseException):
            raise got
        return got

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

    def lead_now(self) -> tuple[bool, str | None]:
        """Rank 0: (this replica leads, the leader's replica id) in the current view."""
        view = self.rt.view
        lead = view.lead() if view is not None else None
        mine = lead is not None and lead.node == self.rt.node_id and self.port.synced
        return mine, (lead.replica_id if lead is not None else None)

    def on_commit(self, lead: bool) -> None:
        """Every rank, for each step it commits: does this replica lead that step (the lowest
        contributing slot of its committed mask)? One replica per committed step does."""
        self._lead = lead

    def on_begin(self, lead: tuple[bool, str | None], finished: int | None) -> None:
        """Every rank, in ``begin()``: rank 0's reading of the view, agreed by the ranks."""
        self._lead, self._leader = lead
        if finished is not None and not self.finishing:
            self.ended = finished

    # ------------------------------------------------------------------ start
    def start(self) -> None:
        """Collective. Join the group (idempotent; the first ``begin()`` calls it). Raises
        JobFinished, MissingStateError, JobConfigError, InitialStateMismatch, or StepTimeout when
        no view takes this replica within ``start_timeout``."""
        if self.started:
            return
        deadline = time.monotonic() + self.options.start_timeout
        plan: InitialPlan = self._decided(lambda: self._form(deadline))
        if plan.how is Fetch.CATCH_UP:
            self.port.catchup.start("the group started without this replica")
        elif plan.how is Fetch.HOLD:
            self._hold_initial()
        elif plan.how is Fetch.FROM:
            self._take_initial(plan, deadline)
        elif self.port.step > 0 and not self._decided(self._resumed_agrees):
            self.port.catchup.start("its last step was redone without it")
        if self._initial is not None and self.options.initial_state is InitialState.CHECK:
            self._decided(lambda: self._collect_checks(deadline))
        self.started = True
        if self.port.rt is not None:
            view = self.rt.view
            self._lead, self._leader = self.lead_now()
            log.info("in the group at step %d: %d participant(s), leader %s", self.port.step,
                     len(view.participants) if view is not None else 0, self._leader)

    def _form(self, deadline: float) -> InitialPlan:
        """Rank 0: wait for the group, check the job's state, and say how the state at step 0
        is agreed."""
        rt, o = self.rt, self.options
        rt.declare_job(o.target, o.allow_restart_from_scratch)
        view = self._joined(deadline)
        view = self._check_recorded(view, deadline)
        # Only a job's first participants wait for each other: a participant that others already
        # train with (a restart from a checkpoint at their step) would hold up their allreduces.
        if o.min_replicas > 1 and self.port.step == 0 and view.role_of(rt.node_id) is Role.PARTICIPANT:
            view = self._wait(lambda v: len(v.participants) >= o.min_replicas or v.role_of(rt.node_id) is Role.JOINER
                              or v.finished is not None, deadline, f"{o.min_replicas} participants", fail=False)
            view = self._joined(deadline)
            if len(view.participants) < o.min_replicas and view.role_of(rt.node_id) is Role.PARTICIPANT:
                log.warning("no view with %d participants within %g s: starting with %d", o.min_replicas,
                            o.start_timeout, len(view.participants))
        if self.port.step == 0 and not view.high_water and not view.participants:
            log.info("no replica holds any state of this job: starting a new job at step 0")
        self._raise_if_unusable()   # e.g. a refusal seen while the group formed, by a peer since gone
        return self._initial_plan()

    def _resumed_agrees(self) -> bool:
        """Rank 0, resuming at step s > 0 (a checkpoint): is its step s - 1 the others'? A
        replica that committed a step alone and died at once (its checkpoint written, its step
        not yet gossiped) finds the others redid that step without it; at the head it would
        otherwise train on (or finish the job) with other weights than theirs. Asked as a
        pause's return asks (``last_step_agreed``): True when no peer knows the step (one far
        behind catches up by snapshot anyway)."""
        p, rt = self.port, self.rt
        ok = last_step_agreed(rt, p.recent.signature(p.step - 1), p.step - 1, p.secret, p.ds.host)
        if not ok:
            log.warning("resumed at step %d, but the others redid step %d without this replica: catching up from "
                        "a snapshot", p.step, p.step - 1)
        return ok

    def _raise_if_unusable(self) -> None:
        """Rank 0: the data plane can never work for this job (one of its communicators was
        refused for good, say explicit NCCL with two replicas on one device): say so, stop."""
        broken = self.port.comms.unusable()
        if broken is not None:
            err = DataPlaneError(f"the data plane cannot work for this job: {type(broken).__name__}: {broken}")
            log.error("%s", err)
            raise err

    def _wait(self, pred: Callable[[View], bool], deadline: float, what: str, fail: bool = True) -> View:
        rt = self.rt
        while True:
            if self.port.stopping:
                raise Stopped("stop requested")
            v = rt.wait_view(lambda v: pred(v) or self.port.stopping,
                             min(POLL_S * 5, max(0.0, deadline - time.monotonic())),
                             loop_timeout=self.port.loop_timeout)
            if v is not None and pred(v):
                return v
            if time.monotonic() >= deadline:
                if fail or rt.view is None:
                    raise StepTimeout(f"no view with {what} within {self.options.start_timeout} s")
                return rt.view

    @property
    def _declared(self) -> Declared:
        o = self.options
        return Declared(o.target, o.allow_restart_from_scratch, o.on_finished is OnFinished.WAIT)

    def _joined(self, deadline: float) -> View:
        """Rank 0, at the start: the view that lets this replica in."""
        view = self._admitted(deadline, at_start=True)
        assert view is not None   # at the start, admit waits until a view lists us
        return view

    def _admitted(self, deadline: float, at_start: bool) -> View | None:
        """Rank 0: look at the views until ``admit`` lets this replica in, raising the job's
        error on the way (``p2pft/core/lifecycle.py`` decides; the simulator's trainers call the
        same function). Before a step (not `at_start`), a view that does not list us yet is
        the step's business (a rejoin), not the job's."""
        rt, o, p = self.rt, self.options, self.port
        grace_end: float | None = None
        said: set[Admit] = set()
        while True:
            if p.stopping:
                raise Stopped("stop requested")
            view, now = rt.view, time.monotonic()
            verdict = admit(view, rt.node_id, p.step, self._declared,
                            grace_over=grace_end is not None and now >= grace_end, finishing=self.finishing)
            if verdict is Admit.IN or (verdict is Admit.WAIT and not at_start):
                return view    # None only before a step: not listed yet (a rejoin)
            assert view is not None or verdict is Admit.WAIT
            if verdict is Admit.FINISHED:
                assert view is not None and view.finished is not None
                self.ended = view.finished
                if at_start:
                    log.info("the job already finished at step %d%s: nothing to train", view.finished,
                             f" (target {view.target})" if view.target else "")
                    raise JobFinished(view.finished, view.target)
                log.info("the job finished at step %d with this replica at step %d", view.finished, p.step)
                raise JobFinished(view.finished, view.target,
                                  held=p.step if p.step != view.finished or not p.synced else None)
            if verdict is Admit.CONFIG_ERROR:
                assert view is not None
                log.error("this replica declares the job's end as %s, but the group runs to %s", o.target, view.target)
                raise JobConfigError(f"this replica declares the job's end as {o.target}, but the group runs to "
                                     f"{view.target}")
            if verdict is Admit.REFUSE:
                assert view is not None
                log.error("the job reached step %d, but no running replica holds it and this replica has no "
                          "checkpoint: refusing to train from step 0 (allow_restart_from_scratch / "
                          "--allow-restart-from-scratch to do it anyway)", view.high_water)
                raise MissingStateError(view.high_water, p.step)
            if verdict is Admit.GRACE and grace_end is None:
                grace_end = now + o.resume_grace
            if verdict not in said and view is not None:
                said.add(verdict)
                self._say(verdict, view)
            if now >= deadline:
                what = {Admit.WAIT: "this replica in it", Admit.FURTHER: "a further target"}.get(verdict,
                                                                                                 "a participant")
                raise StepTimeout(f"no view with {what} within {o.start_timeout} s")
            wait = min(POLL_S * 5, deadline - now, (grace_end - now) if grace_end is not None and grace_end > now
                       else POLL_S * 5)
            rt.wait_view(lambda v: v is not view or p.stopping, max(0.0, wait), loop_timeout=p.loop_timeout)

    def _say(self, verdict: Admit, view: View) -> None:
        """The INFO (or WARNING) line of a wait, once per kind of wait."""
        step = self.port.step
        if verdict is Admit.FURTHER:
            log.info("the job finished at step %s; waiting for a further target", view.finished)
        elif verdict is Admit.OFFER:
            log.info("the job reached step %d and no replica trains now; offering this replica's step %d",
                     view.high_water, step)
        elif verdict is Admit.GRACE:
            log.info("the job reached step %d and no replica trains now; waiting up to %g s for one that holds it",
                     view.high_water, self.options.resume_grace)
        elif verdict is Admit.SCRATCH:
            log.warning("the job reached step %d, but no replica holds it: training again from step 0, as allowed",
                        view.high_water)

    def _check_recorded(self, view: View, deadline: float) -> View:
        """Rank 0, at step 0 with no checkpoint: this replica's data directory records that the
        job reached a later step (``Runtime.recorded_step``), which the views may have lost (they
        carry the job's step as of their last commit; a total loss, witnesses included, takes
        the rest). Unless a member holds some state of the job within `resume_grace`, refuse to
        train a new model under the job's name, as ``_check_high_water`` does."""
        rt, o = self.rt, self.options
        rec = rt.recorded_step
        if self.port.step != 0 or not rec:
            return view
        rec = max(rec, view.high_water)

        def held(v: View) -> bool:   # any trainer but us with a state past step 0 (a checkpoint, say)
            return v.finished is not None or any(m.node != rt.node_id and m.role is not Role.WITNESS
                                                 and rt.member_step(m.node) > 0 for m in v.members)
        if held(view):
            return view
        log.info("this replica's data directory records step %d of this job and no member holds any of it; waiting "
                 "up to %g s for one that does", rec, o.resume_grace)
        v = self._wait(held, min(deadline, time.monotonic() + o.resume_grace), "a member holding the job", fail=False)
        if held(v):
            return self._joined(deadline)
        if o.allow_restart_from_scratch:
            log.warning("the job reached step %d (recorded in %s), but no replica holds it: training again from step "
                        "0, as allowed", rec, rt.data_dir)
            return v
        log.error("the job reached step %d (recorded in %s), but no running replica holds it and this replica has no "
                  "checkpoint: refusing to train from step 0 (allow_restart_from_scratch / "
                  "--allow-restart-from-scratch to do it anyway)", rec, rt.data_dir)
        raise MissingStateError(rec, 0)

    # ------------------------------------------------------------------ same start everywhere
    def _initial_plan(self) -> InitialPlan:
        """Rank 0: how the state at step 0 is agreed (``initial_fetch``)."""
        rt = self.rt
        view = rt.view
        how = initial_fetch(view, rt.node_id, self.port.step, rt.member_step,
                            agree=self.options.initial_state is not InitialState.OFF)
        if how is Fetch.CATCH_UP:
            log.info("the group started without this replica: catching up from a snapshot instead of "
                     "taking the initial state")
        if how in (Fetch.HOLD, Fetch.FROM):
            assert view is not None
            return self._lead_plan(view)
        return InitialPlan(how)

    def _lead_plan(self, view: View) -> InitialPlan:
        lead = view.lead()
        if lead is None:
            return InitialPlan(Fetch.NONE)
        if lead.node == self.rt.node_id:
            return InitialPlan(Fetch.HOLD)
        return InitialPlan(Fetch.FROM, lead=lead.replica_id, lead_node=lead.node, addrs=tuple(lead.data_addrs))

    def _take_initial(self, plan: InitialPlan, deadline: float) -> None:
        """Collective: every rank pulls its shard of the lead's step-0 state (or its digest);
        rank 0 picks the lead again after a failed round (it may have moved, died or gone on)."""
        p = self.port
        mode = self.options.initial_state
        end = min(deadline, time.monotonic() + FETCH_INITIAL_TIMEOUT_S)
        last: str | None = None
        while True:
            got: StateSnapshot | BaseException
            try:
                addr = shard_addr(plan.addrs, p.shard, plan.lead_node)
                got = fetch_state(addr, StateRequest.initial(mode is InitialState.CHECK, p.shard).to_wire(),
                                  secret=p.secret, timeout=max(0.1, min(ATTEMPT_TIMEOUT_S, end - time.monotonic())),
                                  into=p.receive_into() if mode is InitialState.BROADCAST else None,
                                  source_host=p.ds.host)
            except Exception as exc:  # not held yet (the lead is still starting), or gone: look again
                got = exc
            errors = [g for g in p.group.agree(None if isinstance(got, StateSnapshot) else _failure(got))
                      if g is not None]
            if not errors:
                assert isinstance(got, StateSnapshot)
                self._check_initial(plan, got, mode)
                return
            last = errors[0][1]
            plan = self._decided(lambda: self._retry_initial(plan, errors, end))
            if plan.how is Fetch.HOLD:
                self._hold_initial()
                return
            if plan.how is Fetch.CATCH_UP:
                p.catchup.start("the group started without this replica")
                return
            if plan.how is Fetch.NONE:
                return
            if time.monotonic() >= end:
                raise StepTimeout(f"could not get the initial state from the leader within "
                                  f"{FETCH_INITIAL_TIMEOUT_S} s: {last}")

    def _retry_initial(self, plan: InitialPlan, errors: list[tuple[bool, str]], end: float) -> InitialPlan:
        """Rank 0, after a failed round: report an unreachable lead, notice one that went on
        without us, wait a little, and name the lead of the current view."""
        rt, p = self.rt, self.port
        if p.stopping:
            raise Stopped("stop requested")
        self._raise_if_unusable()   # the data plane can never work here: do not wait for the lead
        if any(unreachable for unreachable, _ in errors):
            # Evidence like a failed ring connect: a lead whose data port we cannot reach is
            # probed and, past the bound, left out, and the next view names another.
            rt.report_failure(plan.lead_node)
        elif rt.member_step(plan.lead_node) > 0:
            # The group started without us (the lead trained alone, or committed before we
            # asked): its step-0 copy is gone. Catch up from a snapshot as a joiner does.
            log.info("the lead %s is past step 0: catching up instead of taking the initial state", plan.lead)
            return InitialPlan(Fetch.CATCH_UP)
        if time.monotonic() < end:
            rt.wait_view(lambda v: False, POLL_S, loop_timeout=p.loop_timeout)
        view = rt.view
        return self._lead_plan(view) if view is not None else plan

    def _check_initial(self, plan: InitialPlan, snap: StateSnapshot, mode: InitialState) -> None:
        """Every rank: load the lead's shard (broadcast) and compare digests; a mismatch on any
        rank is one error on every rank."""
        p = self.port
        want = str(snap.meta["digest"])
        if mode is InitialState.BROADCAST:
            with p.state_mutation():     # no donor copies a half-loaded state
                p.load_state(snap.meta, snap.tensors)
        mine = p.digest()
        same = p.group.agree(mine == want)
        if mode is InitialState.CHECK:
            end = time.monotonic() + FETCH_INITIAL_TIMEOUT_S
            self._decided(lambda: self._report_check(plan, all(same), end))
        if not all(same):
            log.error("initial state differs from the leader %s's before step 0 (digest %s here, %s there)",
                      plan.lead, mine[:12], want[:12])
            raise InitialStateMismatch(f"initial state differs from replica {plan.lead}'s before step 0 "
                                       f"(digest {mine[:12]} here, {want[:12]} there): seed every replica alike, "
                                       "or use initial_state='broadcast'")
        log.info("%s the initial state of %s (digest %s)",
                 "took" if mode is InitialState.BROADCAST else "checked", plan.lead, mine[:12])
        p.events.append({"t": time.time(), "kind": "initial_state", "from": plan.lead, "digest": mine})

    def _report_check(self, plan: InitialPlan, ok: bool, deadline: float) -> None:
        """Rank 0 of a replica that checked the lead's digest: tell the lead (so that it does
        not train on alone past a failed check) and wait, bounded, for its verdict over every
        check. A failed check elsewhere raises here too; an unreachable lead leaves our own
        outcome to decide (the view then names another lead)."""
        rt = self.rt
        addr = shard_addr(plan.addrs, 0, plan.lead_node)
        while True:
            try:
                got = fetch_state(addr, StateRequest.checked(ok, rt.replica_id).to_wire(), secret=self.port.secret,
                                  timeout=max(0.1, min(ATTEMPT_TIMEOUT_S, deadline - time.monotonic())),
                                  source_host=self.port.ds.host)
                verdict, bad = got.meta.get("verdict"), list(got.meta.get("bad", []))
            except Exception as exc:   # the lead is gone or does not answer: our own outcome stands
                log.info("no verdict on the initial state from the lead %s (%s)", plan.lead, exc)
                return
            if verdict == "mismatch" and ok:
                log.error("the initial state of replica(s) %s differs from the leader %s's before step 0 (ours "
                          "matches): the job's replicas do not start alike; stopping", ", ".join(bad), plan.lead)
                raise InitialStateMismatch(f"the initial state of replica(s) {', '.join(bad)} differs from replica "
                                           f"{plan.lead}'s before step 0: seed every replica alike, or use "
                                           "initial_state='broadcast'")
            if verdict != "pending" or time.monotonic() >= deadline or self.port.stopping:
                return
            time.sleep(POLL_S)

    def _collect_checks(self, deadline: float) -> None:
        """Rank 0 of the lead with initial_state='check': wait (bounded) until every other
        participant at step 0 has reported its check, or left the view; one failed check is an
        InitialStateMismatch here too, after the checkers had a moment to read the verdict."""
        rt, p = self.rt, self.port
        end = min(deadline, time.monotonic() + FETCH_INITIAL_TIMEOUT_S)
        while True:
            view = rt.view
            others = {m.replica_id for m in (view.participants if view is not None else [])
                      if m.node != rt.node_id and rt.member_step(m.node) == 0}
            missing = others - self._checks.heard()
            if not missing or time.monotonic() >= end or p.stopping:
                break
            rt.wait_view(lambda v: False, POLL_S, loop_timeout=p.loop_timeout)
        bad = self._checks.decide()
        if missing:
            log.warning("no initial-state check from %s within %g s: starting without their word",
                        ", ".join(sorted(missing)), FETCH_INITIAL_TIMEOUT_S)
        if not bad:
            return
        digest = self._initial[1][:12] if self._initial is not None else "?"
        log.error("the initial state of replica(s) %s differs from this leader's before step 0 (digest %s): the "
                  "job's replicas do not start alike; stopping", ", ".join(bad), digest)
        self._checks.wait_seen(VERDICT_SEEN_S)
        raise InitialStateMismatch(f"the initial state of replica(s) {', '.join(bad)} differs from this leader's "
                                   "before step 0: seed every replica alike, or use initial_state='broadcast'")

    def _hold_initial(self) -> None:
        """The lead (every rank): keep a copy of this shard's state at step 0 for the others."""
        meta, tensors = self.port.capture_state()
        self._initial = (StateSnapshot(meta=meta, tensors=tensors), self.port.digest())
        log.info("holding the initial state for the group (digest %s)", self._initial[1][:12])

    def _initial_state(self, request: StateRequest) -> StateSnapshot | None:
        """Transport thread: the state (or only its digest) the lead holds for step 0."""
        held = self._initial
        if held is None:
            return None
        snap, digest = held
        if request.digest_only:
            return StateSnapshot(meta={"digest": digest}, tensors={})
        return StateSnapshot(meta={**snap.meta, "digest": digest}, tensors=snap.tensors)

    # ------------------------------------------------------------------ the kernel's hooks
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
            self._admitted(time.monotonic() + self.options.start_timeout, at_start=False)

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

    def after_commit(self) -> None:
        if self._initial is not None and self.port.step > 0:
            self._initial = None  # every first participant is past step 0: nobody pulls it any more

    # ------------------------------------------------------------------ the end barrier
    def finish(self, timeout: float | None = None) -> int:
        """Collective: the end barrier; returns the step the job finished at. Says 'done' at
        this step, waits (bounded) until every participant has and the view says the job
        finished, serving snapshots and reduce rounds to joiners still catching up meanwhile.
        Raises JobFinished for a replica that never trained (it started after the end),
        StepTimeout after ``timeout`` (default ``finish_timeout``), Stopped on a stop request."""
        if not self.started:
            self.start()   # a late restart learns here that the job ended without it
        limit = timeout if timeout is not None else self.options.finish_timeout
        deadline = time.monotonic() + limit
        p = self.port
        if not p.synced:
            self._settle(deadline)
        if p.rt is not None:
            if p.synced:
                p.rt.set_status(Status.DONE, p.step)
                log.info("done at step %d: waiting for the others at the end barrier", p.step)
            else:
                log.info("at the end still catching up at step %d; waiting for the job to finish", p.step)
        self.finishing = True
        try:
            while True:
                word, end = self._decided(lambda: self._end_look(deadline))
                if word is EndWord.FINISHED:
                    break
                if word is EndWord.BEHIND:
                    self.ended = end
                    log.warning("the job finished at step %d while this replica held step %d: it leaves without "
                                "the job's final weights", end, p.step)
                    raise JobFinished(int(end), self.options.target, held=p.step)
                if word is EndWord.STOP:
                    raise Stopped("stop requested at the end barrier")
                if word is EndWord.TIMEOUT:
                    raise StepTimeout(f"the job did not finish within {limit} s of reaching step {p.step}")
                p.serving.serve_queued()
                if word is EndWord.ROUND:
                    p.idle_round(IDLE_ROUND_TIMEOUT_S)
        finally:
            self.finishing = False
        self.ended = end
        log.info("the job finished at step %d", end)
        return int(end)

    def _end_look(self, deadline: float) -> tuple[EndWord, int | None]:
        """Rank 0: one look at the view at the end barrier (``end_word`` decides)."""
        rt, p = self.rt, self.port
        view = rt.view
        word = end_word(view, p.step, p.synced, p.stopping, time.monotonic() >= deadline,
                        view is not None and bool(view.joiners) and self._all_done(view))
        if word is EndWord.WAIT:
            rt.wait_view(lambda v: v.finished is not None or p.stopping, POLL_S, loop_timeout=p.loop_timeout)
        return word, (view.finished if view is not None else None)

    def _settle(self, deadline: float) -> None:
        """Collective: a joiner whose replay reached the end hands over here (no step follows
        to do it), every rank at once."""
        p = self.port
        end = min(deadline, time.monotonic() + SETTLE_S)
        while True:
            ready = all(p.group.agree(p.catchup.at_head(p.step)))
            if ready:
                p.catchup.settle(p.step)
                return
            word = self._decided(lambda: _settle_look(self.rt, end, p.loop_timeout))
            if not word:
                return

    def _all_done(self, view: View) -> bool:
        rt, step = self.rt, self.port.step
        for m in view.participants:
            meta = rt.member_meta(m.node)
            if meta is None or meta.status is not Status.DONE or meta.step != step:
                return False
        return True


class InitialChecks:
    """The lead's record of the others' initial-state checks (written by transport threads):
    'pending' until the lead decides, then 'ok' or 'mismatch' with the replicas that differ."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ok: dict[str, bool] = {}
        self._verdict = "pending"
        self._bad: list[str] = []
        self._seen: set[str] = set()
        self._all_seen = threading.Event()

    def report(self, req: StateRequest) -> StateSnapshot:
        """Transport thread: record one check, answer with the verdict so far."""
        with self._lock:
            self._ok.setdefault(req.who, req.ok)
            self._ok[req.who] = self._ok[req.who] and req.ok
            if self._verdict != "pending":
                self._seen.add(req.who)
                if self._seen >= set(self._ok):
                    self._all_seen.set()
            return StateSnapshot(meta={"verdict": self._verdict, "bad": list(self._bad)}, tensors={})

    def heard(self) -> set[str]:
        with self._lock:
            return set(self._ok)

    def decide(self) -> list[str]:
        """The verdict over the checks heard: the replicas whose check failed."""
        with self._lock:
            self._bad = sorted(w for w, ok in self._ok.items() if not ok)
            self._verdict = "mismatch" if self._bad else "ok"
            return list(self._bad)

    def wait_seen(self, timeout: float) -> None:
        """Until every checker read the verdict (bounded): the lead is about to stop."""
        self._all_seen.wait(timeout)


def _settle_look(rt: Runtime, end: float, loop_timeout: float | None) -> bool:
    """Rank 0: wait a little for the worker; False when settling is over (time, or the end)."""
    if time.monotonic() >= end:
        return False
    rt.wait_view(lambda v: v.finished is not None, POLL_S, loop_timeout=loop_timeout)
    return not (rt.view is not None and rt.view.finished is not None)


def _capture(fn: Callable[[], Any]) -> Any:
    """The value of `fn`, or the job error it raised (to be raised on every rank)."""
    try:
        return fn()
    except (JobError, DataPlaneError) as exc:
        return exc


def _failure(exc: BaseException) -> tuple[bool, str]:
    """(the lead's data port is unreachable, what happened) of a failed fetch."""
    return isinstance(exc, (PeerFailed, CommTimeout)), f"{type(exc).__name__}: {exc}"


__all__ = ["InitialState", "InitialStateMismatch", "JobConfigError", "JobFinished", "JobLife", "JobOptions",
           "MissingStateError", "OnFinished"]
