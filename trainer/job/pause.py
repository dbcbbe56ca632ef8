"""Pauses that are not failures: ``with ft.pause("eval"):``.

A replica that steps out of the steps for a while (evaluation, a checkpoint, slow logging)
says so: its status becomes 'paused', the leader takes it off the data plane (role ``paused``,
no slot) in the next view, and the others commit without it instead of waiting for its data
and failing (``no data from rank 0``). Meanwhile:

- a background thread keeps its loop beat, so a pause longer than ``loop_timeout`` is not a
  stalled loop (and the leader does not count a paused trainer as stalled either);
- it still counts for the cluster's head step, and it serves snapshots of the committed state
  it paused at to joiners (``donor.py``), so a joiner catches up during the pause;
- it contributes nothing, and nothing it does in the pause is applied.

On the way back it checks that its last committed step is the others' (a peer's signature of
that step: its contributor set): a step it committed just before the pause may have been redone
by the others without it (a peer failed during that step's all-gather); then it catches up from
a snapshot. Otherwise it says 'ready' (or 'fresh', as before the pause) at its step: at the head
the leader makes it a participant at once; behind, it is a joiner whose next reduced header
makes it fast-forward from a peer's short log (which the others keep from its step on while it
is paused, up to the replay cap: ``recent.RecentSteps.hold``), or catch up from a snapshot when
it missed more steps than that log holds.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Iterator

from ...core.meta import Status
from ...transport import CommError
from ...transport.stream import fetch_state
from ...core.view import Role
from ..kernel.ports import PausePort, RuntimePort
from ..kernel.requests import StateRequest

log = logging.getLogger("p2pft.trainer.kernel.engine")

SIG_TIMEOUT_S = 2.0     # one peer's answer to "your signature of step s"
SIG_PEERS = 4           # peers asked at most, in view order, until one knows the step


class PauseBeat:
    """Beats the loop from a thread while the loop itself is in a pause."""

    def __init__(self, rt: RuntimePort, loop_timeout: float) -> None:
        self.rt = rt
        self.loop_timeout = loop_timeout
        self._stop = threading.Event()
        self._th = threading.Thread(target=self._run, daemon=True, name="p2pft-pause-beat")
        self._th.start()

    def _run(self) -> None:
        every = min(1.0, self.loop_timeout / 4)
        while not self._stop.wait(every) and not self.rt.closed:
            self.rt.loop_beat(self.loop_timeout)

    def stop(self) -> None:
        self._stop.set()
        self._th.join(timeout=2.0)


def last_step_agreed(rt: RuntimePort, mine: str | None, step: int, secret: bytes | None,
                     source_host: str | None = None) -> bool:
    """Rank 0: does the first peer that knows committed step `step` hold the same signature?
    True when no peer knows it (nobody redid it: the others are behind, they fast-forward
    from our log) or when we have no signature (our state came from a snapshot)."""
    view = rt.view
    if mine is None or view is None:
        return True
    peers = [m for m in view.members if m.role is not Role.WITNESS and m.node != rt.node_id and m.data_addrs]
    for m in peers[:SIG_PEERS]:
        try:
            snap = fetch_state(m.data_addrs[0], StateRequest.signature(step).to_wire(), secret=secret,
                               timeout=SIG_TIMEOUT_S, source_host=source_host)
        except CommError:
            continue
        theirs = snap.meta.get("sig")
        if isinstance(theirs, str):
            return theirs == mine
    return True


class Pauses:
    """The pause of one rank of a replica (every rank enters and leaves it together)."""

    def __init__(self, engine: PausePort) -> None:
        self.e = engine
        self.why: str | None = None
        self._beat: PauseBeat | None = None
        self._status_before = Status.READY
        self._t0 = 0.0

    @contextlib.contextmanager
    def __call__(self, why: str = "pause") -> Iterator[None]:
        self.enter(why)
        try:
            yield
        finally:
            self.leave()

    def enter(self, why: str) -> None:
        e = self.e
        if self.why is not None:
            raise RuntimeError(f"already in a pause ({self.why!r})")
        if e.in_step:
            raise RuntimeError("pause() between begin() and commit(): pause after a commit, before the next begin")
        e.beat()
        self.why, self._t0 = why, time.monotonic()
        e.donor.idle()  # requests queued during the last step: answered now
        if not e.synced:
            e.catchup.stop()  # its state is not a committed one: it catches up again afterwards
        rt: RuntimePort | None = e.rt
        if rt is not None:
            self._status_before = rt.status
            rt.set_status(Status.PAUSED, e.step if e.synced else -1)
            if e.loop_timeout:
                self._beat = PauseBeat(rt, e.loop_timeout)
        e.events.append({"t": time.time(), "kind": "pause", "why": why, "step": e.step})
        log.info("pausing (%s) at step %d: the others commit without this replica meanwhile", why, e.step)

    def leave(self) -> None:
        try:
            self._leave()
        finally:
            self.why = None

    def _leave(self) -> None:
        e = self.e
        if self._beat is not None:
            self._beat.stop()
            self._beat = None
        e.beat()
        rt: RuntimePort | None = e.rt
        ok = True
        if rt is not None and e.synced and e.step > 0 and not e.stopping:
            ok = last_step_agreed(rt, e.recent.signature(e.step - 1), e.step - 1, e.secret, e.ds.host)
        ok = bool(e.group.broadcast(ok if rt is not None else None))
        e.donor.idle()  # what waited for the pause to end (FSDP shards are copied only here)
        e.rejoined_after_pause()
        seconds = time.monotonic() - self._t0
        if not e.synced:
            e.catchup.start("paused", again=True)
        elif not ok:
            log.warning("back from a pause at step %d: the others redid step %d without this replica; catching "
                        "up from a snapshot", e.step, e.step - 1)
            e.catchup.start("paused")
        elif rt is not None:
            before = self._status_before
            rt.set_status(before if before in (Status.READY, Status.FRESH) else Status.READY, e.step)
        e.events.append({"t": time.time(), "kind": "resume", "why": self.why, "step": e.step,
                         "seconds": round(seconds, 3)})
        log.info("back from a pause (%s) of %.1f s at step %d", self.why, seconds, e.step)


__all__ = ["PauseBeat", "Pauses", "SIG_PEERS", "SIG_TIMEOUT_S", "last_step_agreed"]
