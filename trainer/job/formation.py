"""Forming the group and admission: how a replica gets into the job (rank 0 decides).

It exists so that the question "may this replica train, and from where?" has one home: it
declares the job's target, waits (bounded) for ``min_replicas`` participants, and refuses a job
that already finished, runs to another target, or whose progress no peer and no checkpoint
holds any more. ``p2pft/core/lifecycle.py``'s ``admit`` decides over each view (the simulator's
trainers call the same function); this module waits on the views and says the errors.
"""
from __future__ import annotations

import time
from typing import Callable

from ...core.lifecycle import Admit, Declared, admit
from ...core.view import Role, View
from ..kernel.errors import JobConfigError, JobFinished, MissingStateError, StepTimeout, Stopped
from ..kernel.options import JobOptions, OnFinished
from ..kernel.ports import RecoveryParts
from .pause import last_step_agreed
from .ranks import POLL_S, Ranks, log, raise_if_unusable


class Formation:
    """Rank 0's half of joining the job: the group forms, the job's state admits us."""

    def __init__(self, port: RecoveryParts, options: JobOptions, ranks: Ranks) -> None:
        self.port = port
        self.options = options
        self.ranks = ranks

    def form(self, deadline: float, finishing: bool) -> None:
        """Rank 0: wait for the group and check the job's state (raising the job's error)."""
        rt, o = self.ranks.rt, self.options
        rt.declare_job(o.target, o.allow_restart_from_scratch)
        view = self._joined(deadline, finishing)
        view = self._check_recorded(view, deadline, finishing)
        # Only a job's first participants wait for each other: a participant that others already
        # train with (a restart from a checkpoint at their step) would hold up their allreduces.
        if o.min_replicas > 1 and self.port.step == 0 and view.role_of(rt.node_id) is Role.PARTICIPANT:
            view = self._wait(lambda v: len(v.participants) >= o.min_replicas or v.role_of(rt.node_id) is Role.JOINER
                              or v.finished is not None, deadline, f"{o.min_replicas} participants", fail=False)
            view = self._joined(deadline, finishing)
            if len(view.participants) < o.min_replicas and view.role_of(rt.node_id) is Role.PARTICIPANT:
                log.warning("no view with %d participants within %g s: starting with %d", o.min_replicas,
                            o.start_timeout, len(view.participants))
        if self.port.step == 0 and not view.high_water and not view.participants:
            log.info("no replica holds any state of this job: starting a new job at step 0")
        raise_if_unusable(self.port)   # e.g. a refusal seen while the group formed, by a peer since gone

    def resumed_agrees(self) -> bool:
        """Rank 0, resuming at step s > 0 (a checkpoint): is its step s - 1 the others'? A
        replica that committed a step alone and died at once (its checkpoint written, its step
        not yet gossiped) finds the others redid that step without it; at the head it would
        otherwise train on (or finish the job) with other weights than theirs. Asked as a
        pause's return asks (``last_step_agreed``): True when no peer knows the step (one far
        behind catches up by snapshot anyway)."""
        p, rt = self.port, self.ranks.rt
        ok = last_step_agreed(rt, p.recent.signature(p.step - 1), p.step - 1, p.secret, p.ds.host)
        if not ok:
            log.warning("resumed at step %d, but the others redid step %d without this replica: catching up from "
                        "a snapshot", p.step, p.step - 1)
        return ok

    def _wait(self, pred: Callable[[View], bool], deadline: float, what: str, fail: bool = True) -> View:
        rt = self.ranks.rt
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

    def _joined(self, deadline: float, finishing: bool) -> View:
        """Rank 0, at the start: the view that lets this replica in."""
        view = self.admitted(deadline, at_start=True, finishing=finishing)
        assert view is not None   # at the start, admit waits until a view lists us
        return view

    def admitted(self, deadline: float, at_start: bool, finishing: bool) -> View | None:
        """Rank 0: look at the views until ``admit`` lets this replica in, raising the job's
        error on the way (``p2pft/core/lifecycle.py`` decides; the simulator's trainers call the
        same function). Before a step (not `at_start`), a view that does not list us yet is
        the step's business (a rejoin), not the job's."""
        rt, o, p = self.ranks.rt, self.options, self.port
        grace_end: float | None = None
        said: set[Admit] = set()
        while True:
            if p.stopping:
                raise Stopped("stop requested")
            view, now = rt.view, time.monotonic()
            verdict = admit(view, rt.node_id, p.step, self._declared,
                            grace_over=grace_end is not None and now >= grace_end, finishing=finishing)
            if verdict is Admit.IN or (verdict is Admit.WAIT and not at_start):
                return view    # None only before a step: not listed yet (a rejoin)
            assert view is not None or verdict is Admit.WAIT
            if verdict is Admit.FINISHED:
                assert view is not None and view.finished is not None
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

    def _check_recorded(self, view: View, deadline: float, finishing: bool) -> View:
        """Rank 0, at step 0 with no checkpoint: this replica's data directory records that the
        job reached a later step (``Runtime.recorded_step``), which the views may have lost (they
        carry the job's step as of their last commit; a total loss, witnesses included, takes
        the rest). Unless a member holds some state of the job within `resume_grace`, refuse to
        train a new model under the job's name, as ``admit``'s REFUSE does for the views."""
        rt, o = self.ranks.rt, self.options
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
            return self._joined(deadline, finishing)
        if o.allow_restart_from_scratch:
            log.warning("the job reached step %d (recorded in %s), but no replica holds it: training again from step "
                        "0, as allowed", rec, rt.data_dir)
            return v
        log.error("the job reached step %d (recorded in %s), but no running replica holds it and this replica has no "
                  "checkpoint: refusing to train from step 0 (allow_restart_from_scratch / "
                  "--allow-restart-from-scratch to do it anyway)", rec, rt.data_dir)
        raise MissingStateError(rec, 0)


__all__ = ["Formation"]
