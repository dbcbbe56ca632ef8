"""Rank 0's side of a failed attempt, and log lines that may repeat for a long time.

A failure that no retry can mend (the data plane cannot work for this job: two ranks of an
explicit NCCL communicator on one device) ends the commit on every rank instead.

After an allreduce fails, rank 0 reports the peers the ranks blamed and waits (bounded) for a
view with a newer data epoch; if none comes (nobody died: a peer was slow or paused briefly),
it asks for a fresh one. A replica that cannot make progress may go through this many times a
second until its step timeout: its log says so once per interval with a count, not every time.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from typing import TYPE_CHECKING, Callable

from ...core.view import View
from ...core.step import FRESH_EPOCH_WAIT_S, NEXT_VIEW_WAIT_S
from ...transport.backend import DataPlaneError
from .attempt import Verdict

if TYPE_CHECKING:
    from .ports import Event, RuntimePort

log = logging.getLogger("p2pft.trainer.kernel.engine")

REPEAT_LOG_S = 10.0   # the same kind of line at most once per this many seconds


class LogLimiter:
    """At most one line per key per `every` seconds; the next one says how many were held back."""

    def __init__(self, every: float = REPEAT_LOG_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.every = every
        self.clock = clock
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def __call__(self, logger: logging.Logger, level: int, key: str, msg: str, *args: object) -> bool:
        """Log `msg % args` unless a line of `key` went out less than `every` seconds ago."""
        now = self.clock()
        last = self._last.get(key)
        if last is not None and now - last < self.every:
            self._held[key] = self._held.get(key, 0) + 1
            return False
        if len(self._last) > 256:  # keys are a few fixed names; bound it anyway
            self._last.clear()
            self._held.clear()
        self._last[key] = now
        held = self._held.pop(key, 0)
        if held:
            msg += " (%d more like this in the last %.0f s)"
            args = (*args, held, now - last if last is not None else 0.0)
        logger.log(level, msg, *args)
        return True


def check_usable(verdicts: list[Verdict], rank: int, data_epoch: int) -> None:
    """Raise DataPlaneError on every rank when a rank's verdict says the data plane cannot work
    (the same verdicts on every rank: all raise together); rank 0 says it in one ERROR line.
    Retrying would fail the same way for ever, and reporting the peer would blame a healthy one."""
    bad = next((v for v in verdicts if v.unusable), None)
    if bad is None:
        return
    err = DataPlaneError(f"the data plane cannot work for this job: {bad.error}")
    if rank == 0:
        log.error("data epoch %d: %s", data_epoch, err)
    raise err


def recover(rt: RuntimePort, view: View, bad: list[Verdict], step: int, deadline: float, stopping: Callable[[], bool],
            loop_timeout: float | None, events: deque[Event], say: LogLimiter) -> None:
    """Report the peers the ranks blamed, then wait (bounded by `deadline`) for a newer data
    epoch; if none comes ask for a fresh one."""
    d = view.data_epoch
    for v in bad:
        peer = view.member_at_data_addr(v.peer)
        if v.comm and not v.aborted and peer is not None and peer.node != rt.node_id:
            rt.report_failure(peer.node)
        events.append({"t": time.time(), "kind": "comm_error", "error": v.error[:80],
                       "peer": peer.node if peer else None, "epoch": view.epoch})
    say(log, logging.INFO, "failed", "step %d failed on data epoch %d (%s); waiting for the next view", step, d,
        "; ".join(v.error for v in bad)[:300])

    def newer(v: View) -> bool:
        return v.data_epoch > d or stopping()

    def left(cap: float) -> float:
        return max(0.0, min(deadline - time.monotonic(), cap))
    if not any(v.comm for v in bad):
        rt.wait_view(newer, NEXT_VIEW_WAIT_S, loop_timeout=loop_timeout)
        return
    wait = left(rt.failure_view_wait)
    if rt.wait_view(newer, wait, loop_timeout=loop_timeout) is None and not stopping():
        say(log, logging.WARNING, "fresh", "no new view after a failure on data epoch %d; asking for a fresh "
            "data epoch", d)
        rt.request_new_data_epoch(d)
        rt.wait_view(newer, left(FRESH_EPOCH_WAIT_S), loop_timeout=loop_timeout)


__all__ = ["LogLimiter", "REPEAT_LOG_S", "check_usable", "recover"]
