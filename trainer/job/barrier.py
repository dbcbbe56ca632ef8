"""The end barrier (``finish()``): every replica says it is done at the same step, joiners still
catching up get there too, and the leader writes ``finished`` into the view, where a late
restart reads it. Kept apart so that the end is decided from the view and the replica's own
state alone (``p2pft/core/lifecycle.py``'s ``end_word``), never from the per-step hooks.

Its one call back into the step kernel is ``idle_round``: a round with the joiners at the end
IS a commit (it may commit their step, so the kernel runs its attempt and commit hooks on the
job's life as for any step), and the barrier reads nothing those hooks write.

A replica left out of the views since its last commit (``p2pft/core/viewplan.py``'s
``must_check_end``) may hold a step the others redid without it: its allreduce of the job's last
step can finish while theirs fail, or it took their last steps from their log onto such a step.
It says done, and takes the end as its own, only once a finished peer's signatures of its last
steps agree with its own (``lifecycle.end_checked``); when they differ it catches up from a
snapshot while the job is not finished, and otherwise leaves with ``JobFinished`` naming the
step it holds, as a replica behind the end does.
"""
from __future__ import annotations

import time

from ...core.lifecycle import EndWord, SigCheck, end_checked, end_word, signatures_agree
from ...core.meta import Status
from ...core.view import Role, View
from ...core import viewplan
from ...transport import CommError
from ...transport.stream import fetch_state
from ..kernel.errors import JobFinished, StepTimeout, Stopped
from ..kernel.options import JobOptions
from ..kernel.ports import LifePort, RuntimePort
from ..kernel.requests import StateRequest
from .pause import SIG_PEERS, SIG_TIMEOUT_S
from .ranks import POLL_S, Ranks, log

IDLE_ROUND_TIMEOUT_S = 5.0  # one round with the joiners at the end barrier
SETTLE_S = 10.0             # a joiner at the end waits this long to hand over before saying done


class EndBarrier:
    """One rank's end barrier; `finishing` is True while it waits for the others."""

    def __init__(self, port: LifePort, options: JobOptions, ranks: Ranks) -> None:
        self.port = port
        self.options = options
        self.ranks = ranks
        self.finishing = False
        self._checked = False    # rank 0: our last steps agreed with a finished peer's (or we caught up)
        self._owe_done = False   # rank 0: 'done' held back until then

    def wait(self, timeout: float | None = None) -> int:
        """Collective, once the replica joined: says 'done' at this step, waits (bounded) until
        every participant has and the view says the job finished, serving snapshots and reduce
        rounds to joiners still catching up meanwhile; returns the step the job finished at.
        Raises JobFinished for a replica behind the end, StepTimeout after `timeout` (default
        ``finish_timeout``), Stopped on a stop request."""
        limit = timeout if timeout is not None else self.options.finish_timeout
        deadline = time.monotonic() + limit
        p = self.port
        if not p.synced:
            self._settle(deadline)
        self._checked = self._owe_done = False
        if p.rt is not None:
            if p.synced and self._unchecked(p.rt.view):
                self._owe_done = True
                log.warning("at the end at step %d, left out of the views since its last commit: it may hold a "
                            "step the others redid without it; checking with a finished peer before saying done",
                            p.step)
            elif p.synced:
                p.rt.set_status(Status.DONE, p.step)
                log.info("done at step %d: waiting for the others at the end barrier", p.step)
            else:
                log.info("at the end still catching up at step %d; waiting for the job to finish", p.step)
        self.finishing = True
        try:
            while True:
                word, end = self.ranks.decided(lambda: self._end_look(deadline))
                if word is EndWord.FINISHED:
                    break
                if word is EndWord.REJOIN:   # every rank: a step of ours was redone without us
                    p.catchup.start("its last step was redone without it")
                if word is EndWord.BEHIND:
                    assert end is not None
                    log.warning("the job finished at step %d while this replica held step %d: it leaves without "
                                "the job's final weights", end, p.step)
                    raise JobFinished(int(end), self.options.target, held=p.step)
                if word is EndWord.STOP:
                    raise Stopped("stop requested at the end barrier")
                if word is EndWord.TIMEOUT:
                    raise StepTimeout(f"the job did not finish within {limit} s of reaching step {p.step}")
                p.donor.serve_queued()
                if word is EndWord.ROUND:
                    p.idle_round(IDLE_ROUND_TIMEOUT_S)   # the one re-entry into the kernel (module docstring)
        finally:
            self.finishing = False
        assert end is not None
        log.info("the job finished at step %d", end)
        return int(end)

    def _unchecked(self, view: View | None) -> bool:
        """Rank 0: left out since our last commit, and not yet checked (``must_check_end``)."""
        p = self.port
        return p.synced and not self._checked and viewplan.must_check_end(p.plan_memory, view, self.ranks.rt.node_id)

    def _end_look(self, deadline: float) -> tuple[EndWord, int | None]:
        """Rank 0: one look at the view at the end barrier (``end_word`` decides; a check of our
        last steps with a finished peer, ``end_checked``)."""
        rt, p = self.ranks.rt, self.port
        view = rt.view
        unchecked = self._unchecked(view)
        if self._owe_done and p.synced and not unchecked:   # checked, or caught up since
            self._owe_done = False
            rt.set_status(Status.DONE, p.step)
            log.info("done at step %d: waiting for the others at the end barrier", p.step)
        word = end_word(view, p.step, p.synced, p.stopping, time.monotonic() >= deadline,
                        view is not None and bool(view.joiners) and self._all_done(view),
                        unchecked=unchecked, peer_done=unchecked and self._peer_done(view))
        if word is EndWord.CHECK:
            assert view is not None
            result = self._check(view)
            word = end_checked(result, view.finished is not None)
            if word in (EndWord.FINISHED, EndWord.DONE):
                self._checked = True
                p.membership_checked()   # the idle rounds' plans must not take it for left out either
                if word is EndWord.DONE:
                    self._owe_done = True   # said at the next look
            elif word is EndWord.REJOIN:
                self._checked = self._owe_done = True   # a snapshot of the others' state: done once in
                log.warning("at the end at step %d: a finished peer holds other contributors for step(s) %s than "
                            "this replica, redone without it; catching up from a snapshot before saying done",
                            p.step, list(viewplan.end_check_steps(p.plan_memory, p.step)))
        if word is EndWord.WAIT:
            rt.wait_view(lambda v: v.finished is not None or p.stopping, POLL_S, loop_timeout=p.loop_timeout)
        return word, (view.finished if view is not None else None)

    def _peer_done(self, view: View | None) -> bool:
        """Rank 0: another member says done at our step (it holds the end: check with it)."""
        rt, step = self.ranks.rt, self.port.step
        if view is None:
            return False
        for m in view.members:
            meta = rt.member_meta(m.node) if m.node != rt.node_id else None
            if meta is not None and meta.status is Status.DONE and meta.step == step:
                return True
        return False

    def _check(self, view: View) -> SigCheck:
        """Rank 0: our signatures of our last steps (``end_check_steps``) against a finished
        peer's: one done at our step, or a participant of the view that says the job finished;
        the first peer that knows one of them says."""
        rt, p = self.ranks.rt, self.port
        steps = viewplan.end_check_steps(p.plan_memory, p.step)
        mine = {s: p.recent.signature(s) for s in steps}
        if all(sig is None for sig in mine.values()):
            return signatures_agree([])
        done: list[str] = []
        for m in view.members:
            meta = rt.member_meta(m.node) if m.node != rt.node_id else None
            if meta is not None and meta.status is Status.DONE and meta.step == p.step:
                done.append(m.node)
        if view.finished is not None:
            done += [m.node for m in (*view.participants, *view.paused) if m.node not in done]
        peers = [peer for node in done if (peer := view.member(node)) is not None and peer.node != rt.node_id
                 and peer.role is not Role.WITNESS and peer.data_addrs]
        for peer in peers[:SIG_PEERS]:
            theirs = {s: _signature(peer.data_addrs[0], s, p.secret, p.ds.host) if mine[s] is not None else None
                      for s in steps}
            result = signatures_agree([(mine[s], theirs[s]) for s in steps])
            if result is not SigCheck.UNKNOWN:
                log.info("at the end, step(s) %s checked with %s: %s", list(steps), peer.node, result.value)
                return result
        return SigCheck.UNKNOWN

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
            if not self.ranks.decided(lambda: _settle_look(self.ranks.rt, end, p.loop_timeout)):
                return

    def _all_done(self, view: View) -> bool:
        rt, step = self.ranks.rt, self.port.step
        for m in view.participants:
            meta = rt.member_meta(m.node)
            if meta is None or meta.status is not Status.DONE or meta.step != step:
                return False
        return True


def _signature(addr: str, step: int, secret: bytes | None, source_host: str | None) -> str | None:
    """A peer's signature of committed step `step` (None: it does not know it, or no answer)."""
    try:
        snap = fetch_state(addr, StateRequest.signature(step).to_wire(), secret=secret, timeout=SIG_TIMEOUT_S,
                           source_host=source_host)
    except CommError:
        return None
    sig = snap.meta.get("sig")
    return sig if isinstance(sig, str) else None


def _settle_look(rt: RuntimePort, end: float, loop_timeout: float | None) -> bool:
    """Rank 0: wait a little for the worker; False when settling is over (time, or the end)."""
    if time.monotonic() >= end:
        return False
    rt.wait_view(lambda v: v.finished is not None, POLL_S, loop_timeout=loop_timeout)
    return not (rt.view is not None and rt.view.finished is not None)


__all__ = ["EndBarrier", "IDLE_ROUND_TIMEOUT_S", "SETTLE_S"]
