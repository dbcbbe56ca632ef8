"""Non-blocking catch-up on the joiner's side, for every rank of a replica.

While a replica catches up, its training thread keeps answering the others' allreduces with
zeros on time (survivors never wait for a joiner) and hands each reduced step to ``on_reduced``,
which logs it. A background worker per rank pulls this rank's snapshot from a donor, restores
it, and replays the log through the replica's own optimizer. The transfer runs at a lower CPU
priority (here and on the donor); the restore and the replay at normal priority, since the
replay must outrun the others' steps to ever finish.

Hand-over: a worker that has replayed every logged step says so (``ready_step``); when every
rank of the replica is ready at the step just reduced, each applies that step itself and the
replica is synced again: all ranks switch at the same step, and no reduced step is lost or
applied twice (the log and the hand-over share one lock).
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any


from ...core.meta import Status
from ...core.step import ReplayLog
from ...core.view import shard_addr
from ...transport import CommError
from ...transport.device import Event, joined_event, written_event
from ...transport.stream import StateSnapshot, fetch_state
from ..kernel.attempt import Entry
from .donor import lower_thread_priority
from ..kernel.ports import CatchupPort
from ..kernel.retry import LogLimiter
from ..kernel.requests import StateRequest

log = logging.getLogger(__name__)

CATCHUP_TIMEOUT_S = 600.0   # one worker's budget; the next logged step starts another
FETCH_TIMEOUT_S = 120.0     # one snapshot transfer
FETCH_RETRY_S = 0.2
IDLE_WAIT_S = 0.5           # a worker at the head of the log waits this long per look


class Catchup:
    def __init__(self, engine: CatchupPort, replay_cap_bytes: int, eager: bool = False) -> None:
        self.e = engine
        # Eager (DiLoCo): pull a snapshot as soon as the replica is on the data plane, without
        # waiting for a reduced step to log first, and hand over as soon as the snapshot is the
        # head. Its steps are seconds apart, so each step waited for is seconds of a restarted
        # replica not contributing; a step reduced meanwhile is in the log or in the snapshot.
        self.eager = eager
        self.lock = threading.Lock()
        self._cond = threading.Condition(self.lock)
        # Held by a worker while it writes the replica's state: a worker stopped by a pause may
        # still be restoring when the next one starts; they never write at once.
        self._writing = threading.Lock()
        self.log: ReplayLog[Entry] = ReplayLog(replay_cap_bytes)
        self._gen = 0             # bumped by every start and hand-over: a stale worker stops
        self._worker_gen: int | None = None  # generation of the running worker, if any
        self._at_head = False     # restored and replayed everything logged so far
        self._held: int | None = None   # step of the snapshot restored by the worker
        self.donor: tuple[str, tuple[str, ...]] | None = None  # latest plan's choice
        self._say = LogLimiter()  # a donor that keeps refusing must not fill the log
        self.end_step: int | None = None   # the job's last step, when known (a steps target)

    # ------------------------------------------------------------------ training thread
    def start(self, why: str, again: bool = False) -> None:
        """Leave the synced state and catch up (`again`: start over when already catching up,
        e.g. after a pause stopped the worker)."""
        e = self.e
        with self.lock:
            if not e.synced and not again:
                return
            e.mark_synced(False)
            self.log.clear()
            self._gen += 1
            self._at_head = False
            self._held = None
            self._quiet = False
        # What the training stream has queued on the state so far (the last optimizer step's
        # kernels): a snapshot's copies into CUDA tensors are ordered after it, not on a fetch
        # thread's default stream.
        self._written = _last_write(e.model)
        if e.rt is not None:
            e.rt.set_status(Status.JOINING, e.step)
        e.events.append({"t": time.time(), "kind": "catchup_start", "step": e.step, "why": why})

    def kick(self) -> None:
        """Training thread, each attempt: an eager catch-up starts its worker now (the donor of
        the attempt is known) rather than after the first reduced step."""
        with self.lock:
            if self.eager and not self.e.synced and self._worker_gen != self._gen:
                self._worker_gen = self._gen
                threading.Thread(target=self._work, args=(self._gen,), daemon=True, name="p2pft-catchup").start()

    def ready_step(self) -> int | None:
        """The step this rank would hand over at (None: not at the head of the log)."""
        with self.lock:
            return self.e.step if (not self.e.synced and self._at_head and not self.log) else None

    def on_reduced(self, entry: Entry, all_ready: bool) -> bool:
        """Log one reduced step, or apply it and hand over when every rank is at the head.
        True when this replica committed the step (it is synced again)."""
        e = self.e
        with self.lock:
            if all_ready and self._at_head and not self.log and e.step == entry.step:
                e.apply(entry)
                self._hand_over()
                done = True
            else:
                self.log.append(entry, keep_from=self._held)
                self._wake_worker(quiet=False)
                done = False
        if done:
            self._say_done(self._replayed)
            log.info("caught up at step %d: snapshot of step %s from %s (%.2f s), replayed %d step(s)",
                     e.step, self._held_done, self._donor_done, self._fetch_s or 0.0, self._replayed)
        return done

    def on_idle(self, all_ready: bool) -> bool:
        """Nobody contributed to the step just reduced (the others are paused, or there are
        none): the cluster's state is not moving, so a snapshot of a donor's current state is
        the head. Pull one (no log needed) and hand over once every rank restored it.
        True when this replica is synced again (at the snapshot's step, nothing applied)."""
        e = self.e
        with self.lock:
            if all_ready and self._at_head and not self.log and self._held is not None:
                self._quiet = False
                self._hand_over()
                done = True
            else:
                self._wake_worker(quiet=True)
                done = False
        if done:
            self._say_done(0)
            log.info("caught up at step %d while nobody contributed: snapshot from %s (%.2f s)", e.step,
                     self._donor_done, self._fetch_s or 0.0)
        return done

    def take_head(self, step: int) -> bool:
        """Off the ring, every rank restored a snapshot of `step` and nothing was reduced since
        (the replica took part in no round): that state is the head, so hand over now, between
        rounds, and train the rest of the span (``kernel/offring.py``). True when synced."""
        e = self.e
        with self.lock:
            if e.synced or not (self._at_head and not self.log and self._held is not None and e.step == step):
                return False
            self._hand_over()
        self._say_done(0)
        log.info("caught up at step %d between rounds: snapshot from %s (%.2f s)", e.step, self._donor_done,
                 self._fetch_s or 0.0)
        return True

    def _hand_over(self) -> None:
        """Under the lock: this replica holds the cluster's state again (the training thread
        commits from here on)."""
        self.e.mark_synced(True)
        self._gen += 1
        self._at_head = False
        self._cond.notify_all()

    def _wake_worker(self, quiet: bool) -> None:
        """Under the lock: a reduced round arrived (quiet: one nobody contributed to); start
        this generation's worker if it is not running."""
        self._at_head = self._at_head and quiet
        self._quiet = quiet
        self._cond.notify_all()
        if self._worker_gen != self._gen:
            self._worker_gen = self._gen
            threading.Thread(target=self._work, args=(self._gen,), daemon=True, name="p2pft-catchup").start()

    def _say_done(self, replayed: int) -> None:
        e = self.e
        if e.rt is not None:
            e.rt.set_status(Status.READY, e.step)
        e.events.append({"t": time.time(), "kind": "catchup_done", "step": e.step,
                         "snapshot_step": self._held_done, "replayed": replayed, "fetch_s": self._fetch_s})

    def at_head(self, step: int) -> bool:
        """Synced, or restored and replayed everything logged, at `step`: ready to hand over
        at the end of the job."""
        with self.lock:
            return self.e.synced or (self._at_head and not self.log and self.e.step == step)

    def settle(self, step: int) -> bool:
        """The job ended at `step`, so no reduced step will come to hand over at: a worker at
        the head of the log there hands over now. True when the replica is synced."""
        e = self.e
        with self.lock:
            if e.synced:
                return True
            if not (self._at_head and not self.log and e.step == step):
                return False
            self._hand_over()
        log.info("caught up at the end of the job, step %d", step)
        return True

    def stop(self) -> None:
        with self.lock:
            self._gen += 1
            self._cond.notify_all()

    # ------------------------------------------------------------------ worker
    _held_done: int | None = None
    _donor_done: str | None = None
    _fetch_s: float | None = None
    _replayed = 0
    _written: Event | None = None          # the training stream's last write of the state (start)
    _worker_written: Event | None = None   # the worker's last restore or replayed step
    _quiet = False   # rounds are idle: a snapshot of the donor's current state is the head

    def _alive(self, gen: int, deadline: float) -> bool:
        return gen == self._gen and not self.e.stopping and time.monotonic() < deadline

    def _work(self, gen: int) -> None:
        deadline = time.monotonic() + CATCHUP_TIMEOUT_S
        try:
            restored = False
            while self._alive(gen, deadline):
                if not restored:
                    restored = self._restore_one(gen, deadline)
                    continue
                with self.lock:
                    if not self._alive(gen, deadline):
                        return
                    if not self.log:
                        self._at_head = True
                        self._cond.wait(IDLE_WAIT_S)
                        continue
                    entry = self.log.pop_first()
                if entry.step < self.e.step:   # reduced before the snapshot's step: it holds it
                    continue
                if entry.step != self.e.step:
                    log.info("replay log has a gap at step %d (want %d); pulling a newer snapshot",
                             entry.step, self.e.step)
                    restored = False
                    continue
                with self._writing:
                    if not self._alive(gen, deadline):
                        return
                    self.e.apply(entry)
                    self._worker_written = _last_write(self.e.model)
                self._replayed += 1
        finally:
            with self.lock:
                if gen == self._gen:
                    self._worker_gen = None  # generation of the running worker, if any

    def _restore_one(self, gen: int, deadline: float) -> bool:
        """Fetch a snapshot the log reaches, restore it; True once restored."""
        with self.lock:
            first = self.log.first
            if first is None and not (self._quiet or self.eager):
                self._cond.wait(IDLE_WAIT_S)
                return False
            first = first if first is not None else 0
        try:
            snap = self._fetch_low_priority(first)
        except Exception as exc:
            self._say(log, logging.INFO, "fetch_failed", "snapshot fetch failed (%s); will retry", exc)
            time.sleep(FETCH_RETRY_S)
            return False
        s0 = int(snap.meta["step"])
        while True:  # the snapshot may be ahead of our log: wait for the log to reach it
            with self.lock:
                if not self.log and (self._quiet or self.eager):
                    # Nothing reduced since it asked (quiet), or nothing logged yet (eager): the
                    # donor's state is the head; a step reduced meanwhile comes in the log.
                    self._held = s0
                    break
                if not self.log or self.log.predates(s0):
                    log.info("snapshot of step %d predates the replay log; pulling a newer one", s0)
                    return False
                # At the job's last step no further step is reduced: the step just before it is
                # the log's last, and the snapshot then holds everything. Eager: the log's next
                # entries are the snapshot's step on (steps reduce in order).
                reach = s0 - 1 if (s0 == self.end_step or self.eager) else s0
                if self.log.last is not None and self.log.last >= reach:
                    self.log.drop_before(s0)
                    self._held = s0
                    break
            if not self._alive(gen, deadline):
                return False
            time.sleep(0.01)
        with self._writing:
            if not self._alive(gen, deadline):
                return False
            self.e.restore_snapshot(snap)
            self._worker_written = _last_write(self.e.model)
        self._held_done, self._donor_done = s0, snap.meta.get("_donor")
        self._fetch_s, self._replayed = snap.meta.get("_fetch_s"), 0
        return True

    def _fetch_low_priority(self, min_step: int) -> StateSnapshot:
        """Fetch on a thread of its own whose priority is lowered (a thread cannot raise its
        priority back without privileges)."""
        box: "list[StateSnapshot | BaseException]" = []

        def run() -> None:
            lower_thread_priority()
            try:
                box.append(self._fetch(min_step))
            except BaseException as exc:  # handed to the worker, which retries
                box.append(exc)
        th = threading.Thread(target=run, daemon=True, name="p2pft-catchup-fetch")
        th.start()
        th.join()  # fetch_state's own timeout bounds it
        if isinstance(box[0], BaseException):
            raise box[0]
        return box[0]

    def _fetch(self, min_step: int) -> StateSnapshot:
        e = self.e
        if self.donor is None:
            raise CommError("no participant to pull a snapshot from")
        node, addrs = self.donor
        addr = shard_addr(addrs, e.shard, node)
        replica = node.rsplit(".", 1)[0]  # node ids are "<replica id>.<incarnation>"
        self._say(log, logging.INFO, f"fetching from {node}",
                  "fetching a snapshot of step >= %d from %s (%s, shard %d)", min_step, replica, node, e.shard)
        e.events.append({"t": time.time(), "kind": "catchup_fetch", "donor": replica, "min_step": min_step})
        t0 = time.monotonic()
        into = e.state_io.receive_into(e.model, e.opt) if e.state_io.receive_into else None
        first = next(iter(into.values()), None) if into else None
        after = joined_event(first, [self._written, self._worker_written]) if first is not None else None
        snap = fetch_state(addr, StateRequest.snapshot(min_step, e.shard).to_wire(), secret=e.secret,
                           timeout=FETCH_TIMEOUT_S, rate_limit_bytes_per_s=e.state_rate_limit,
                           into=into, source_host=e.ds.host, after=after)
        if int(snap.meta.get("shard", e.shard)) != e.shard:
            raise CommError(f"donor sent shard {snap.meta.get('shard')} for shard {e.shard}")
        snap.meta["_donor"] = node
        snap.meta["_fetch_s"] = time.monotonic() - t0
        return snap

    def held_bytes(self) -> dict[str, int]:
        with self.lock:
            return {"entries": len(self.log), "bytes": self.log.nbytes}


def _last_write(model: Any) -> Event | None:
    """An event on the calling thread's current stream after the work queued so far on the
    model's device (None on CPU)."""
    params = getattr(model, "parameters", None)
    p = next(iter(params()), None) if callable(params) else None
    return written_event(p) if p is not None else None


__all__ = ["Catchup"]
