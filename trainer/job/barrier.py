"""The end barrier (``finish()``): every replica says it is done at the same step, joiners still
catching up get there too, and the leader writes ``finished`` into the view, where a late
restart reads it. Kept apart so that the end is decided from the view and the replica's own
state alone (``p2pft/core/lifecycle.py``'s ``end_word``), never from the per-step hooks.

Its one call back into the step kernel is ``idle_round``: a round with the joiners at the end
IS a commit (it may commit their step, so the kernel runs its attempt and commit hooks on the
job's life as for any step), and the barrier reads nothing those hooks write.
"""
from __future__ import annotations

import time

from ...core.lifecycle import EndWord, end_word
from ...core.meta import Status
from ...core.view import View
from ..kernel.errors import JobFinished, StepTimeout, Stopped
from ..kernel.options import JobOptions
from ..kernel.ports import LifePort, RuntimePort
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
        if p.rt is not None:
            if p.synced:
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

    def _end_look(self, deadline: float) -> tuple[EndWord, int | None]:
        """Rank 0: one look at the view at the end barrier (``end_word`` decides)."""
        rt, p = self.ranks.rt, self.port
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
            if not self.ranks.decided(lambda: _settle_look(self.ranks.rt, end, p.loop_timeout)):
                return

    def _all_done(self, view: View) -> bool:
        rt, step = self.ranks.rt, self.port.step
        for m in view.participants:
            meta = rt.member_meta(m.node)
            if meta is None or meta.status is not Status.DONE or meta.step != step:
                return False
        return True


def _settle_look(rt: RuntimePort, end: float, loop_timeout: float | None) -> bool:
    """Rank 0: wait a little for the worker; False when settling is over (time, or the end)."""
    if time.monotonic() >= end:
        return False
    rt.wait_view(lambda v: v.finished is not None, POLL_S, loop_timeout=loop_timeout)
    return not (rt.view is not None and rt.view.finished is not None)


__all__ = ["EndBarrier", "IDLE_ROUND_TIMEOUT_S", "SETTLE_S"]
