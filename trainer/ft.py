"""``FaultTolerant``: the step protocol, fast-forward and non-blocking catch-up for one replica.

A training loop calls ``begin()`` (which samples to train on, empty when this replica does not
contribute), runs forward/backward, then ``commit()``. ``commit`` allreduces the step buffer on
the current view's communicator and, on any data-plane error, waits for the next view and
retries with the saved local gradients: no recomputation, no restart. Every rank reads the same
reduced buffer, so all take the same decision:

- all contributors at the same step ``s``: apply the mean gradient, commit step ``s``;
- contributors at different steps (an earlier step committed at some ranks only, because a
  peer died during its all-gather): the ranks behind fetch the missing mean gradients from a
  peer that has them (``fast-forward``) and everybody discards this round;
- this replica is a joiner: it contributes zeros and logs the mean gradient while a snapshot
  is pulled from a donor in the background; then it restores the snapshot, replays the log
  through its own optimizer, and asks to be promoted. Survivors never wait for it.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..node import JOINER, PARTICIPANT
from ..runtime import Runtime
from ..transport import CommError, CommAborted
from ..transport.stream import StateSnapshot, fetch_state
from .checkpoint import AsyncCheckpointer
from .cursor import DataCursor
from .donor import SnapshotRequests, lower_thread_priority
from .lr import LRPolicy, apply_lr_scale, base_lrs, lr_scale
from .state import capture, restore, state_digest
from .stepbuf import StepBuffer

log = logging.getLogger(__name__)


class StepTimeout(RuntimeError):
    """No view in which this replica could commit appeared within the step timeout."""


class Stopped(RuntimeError):
    """request_stop() was called while a step was in flight (graceful shutdown)."""


@dataclass
class StepResult:
    step: int                 # committed step count after this call
    committed: bool           # this call applied an optimizer update
    contributors: int         # replicas whose gradients were in the mean (0 if none applied)
    retries: int              # failed allreduce attempts before the outcome
    role: str                 # this replica's role when the outcome was reached
    fast_forwarded: int = 0   # steps applied from a peer's log (missed commits)
    trained: list[tuple[int, int]] | None = None  # sample ranges of ours in the committed mean


@dataclass
class _Entry:
    step: int
    flat: torch.Tensor        # reduced (summed) buffer, as every contributor saw it
    count: int
    mask: list[bool]


class FaultTolerant:
    """Wraps a model and optimizer of one replica (``p2pft.trainer.FaultTolerant``)."""

    def __init__(self, runtime: Runtime, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                 batch_per_replica: int, nominal_replicas: int | None = None, lr_policy: str = "sqrt",
                 max_slots: int = 256, recent_keep: int = 2, replay_cap_bytes: int = 2 << 30,
                 step_timeout: float = 120.0, checkpoint_dir: str | None = None, checkpoint_every: int = 0,
                 resume: bool = True, state_rate_limit: float | None = None,
                 loop_timeout: float | None = 60.0) -> None:
        self.rt = runtime
        self.model = model
        self.opt = optimizer
        self.buf = StepBuffer([p for p in model.parameters() if p.requires_grad], max_slots=max_slots)
        self.cursor = DataCursor(batch_per_replica, max_slots)
        self.policy = LRPolicy.parse(lr_policy)
        self.nominal = nominal_replicas
        self.base_lrs = base_lrs(optimizer)
        self.step = 0
        self.synced = True
        self.recent: deque[_Entry] = deque(maxlen=max(1, recent_keep))
        self.replay: list[_Entry] = []
        self.replay_cap = replay_cap_bytes
        self.step_timeout = step_timeout
        self.state_rate_limit = state_rate_limit
        self.events: deque[dict[str, Any]] = deque(maxlen=10_000)
        self.digests: dict[int, str] = {}
        self._slot: int | None = None
        self._ranges: list[tuple[int, int]] = []
        self._ranges_step = -1
        self._lock = threading.Lock()
        self._donors = SnapshotRequests()
        self._catchup_gen = 0          # bumped by every catch-up start; a stale worker stops
        self._catchup_running = False  # a background catch-up worker owns model and optimizer
        self.catchup_timeout = 600.0   # one worker's budget; the next logged step starts another
        self._stop = threading.Event()
        self._was_participant = False
        # Longest this loop may go between begin()/commit() calls before the leader leaves the
        # replica out (see Runtime.loop_beat); above the longest step. None: never.
        if loop_timeout is not None and loop_timeout <= runtime.comm_timeout:
            raise ValueError(f"loop_timeout={loop_timeout} s must exceed the communicator timeout "
                             f"({runtime.comm_timeout} s): an allreduce may block that long without a beat")
        self.loop_timeout = loop_timeout
        self.ckpt = AsyncCheckpointer(checkpoint_dir) if checkpoint_dir else None
        self.checkpoint_every = checkpoint_every
        if self.ckpt is not None and resume:
            self._resume_from_checkpoint()
        runtime.data.serve_state(self._provide)
        runtime.set_status("ready", self.step)
        runtime.publish_step(self.step)
        self._beat()

    # ------------------------------------------------------------------ public loop API
    def begin(self) -> list[int]:
        """Sample indices this replica trains on for the current step ([] = contribute nothing)."""
        self._beat()
        view = self.rt.view
        me = self.rt.me(view)
        self._note_role(me, view)
        if me is not None and me["role"] == PARTICIPANT and self.synced and me["slot"] is not None:
            self._slot = int(me["slot"])
            self._ranges = self.cursor.assign(self._slot)
            self._ranges_step = self.step
            return [i for a, b in self._ranges for i in range(a, b)]
        self._slot = None
        return []

    def zero_grad(self) -> None:
        if self.synced:  # while catching up, the background worker owns the gradients
            self.opt.zero_grad(set_to_none=True)

    def commit(self) -> StepResult:
        """Allreduce, retry across views, apply; see the module docstring."""
        slot = self._slot
        self._slot = None
        self.buf.pack_step(slot if self.synced else None, self.step)
        self.buf.save()
        deadline = time.monotonic() + self.step_timeout
        retries = 0
        while True:
            if self._stop.is_set():
                raise Stopped(f"stopped while committing step {self.step}")
            if time.monotonic() > deadline:
                raise StepTimeout(f"no view to commit step {self.step} in within {self.step_timeout} s")
            self._beat()
            view = self.rt.view
            me = self.rt.me(view)
            self._note_role(me, view)
            if me is None or me["role"] not in (PARTICIPANT, JOINER):
                self.rt.wait_view(lambda v: (self.rt.me(v) or {}).get("role") in (PARTICIPANT, JOINER),
                                  timeout=min(1.0, max(0.0, deadline - time.monotonic())),
                                  loop_timeout=self.loop_timeout)
                continue
            still_mine = (slot is not None and self.synced and me["role"] == PARTICIPANT and me["slot"] == slot)
            if slot is not None and not still_mine:
                slot = None  # demoted or re-slotted while computing: these gradients must not count
                self.buf.pack_step(None, self.step)
                self.buf.save()
            try:
                comm = self.rt.communicator(view)
                comm.allreduce(self.buf.flat, contribute=still_mine, timeout=self.rt.comm_timeout)
            except CommError as exc:
                retries += 1
                self._on_comm_error(exc, view, deadline)
                self.buf.restore()
                continue
            except Exception as exc:  # e.g. not on the data plane of a view that just changed
                retries += 1
                log.debug("allreduce not possible yet: %s", exc)
                self.buf.restore()
                self.rt.wait_view(lambda v: self.rt.data_epoch(v) > self.rt.data_epoch(view), 0.2,
                                  loop_timeout=self.loop_timeout)
                continue
            outcome = self._after_allreduce(view, retries, slot if still_mine else None)
            if outcome is not None:
                return outcome
            self.buf.restore()
            retries += 1

    # ------------------------------------------------------------------ after the sum
    def _after_allreduce(self, view: dict[str, Any], retries: int, slot: int | None) -> StepResult | None:
        try:
            steps = self.buf.slot_steps()
        except Exception as exc:
            log.error("inconsistent step buffer (%s); retrying on the next view", exc)
            self.rt.wait_view(lambda v: v["epoch"] > view["epoch"], 1.0, loop_timeout=self.loop_timeout)
            return None
        role = (self.rt.me(view) or {}).get("role", "?")
        if not steps:
            # Nobody contributed (all joiners, or every participant lost its slot): nothing to
            # apply. Hand control back to the loop so that begin() reads the next view's roles.
            time.sleep(0.01)
            return StepResult(self.step, False, 0, retries, role)
        lo, hi = min(steps.values()), max(steps.values())
        if lo != hi:
            # An earlier step committed at some ranks only. Those behind fast-forward; all discard.
            if self.synced and self.step < hi:
                n = self._fast_forward(hi, view, steps)
                if n:
                    return StepResult(self.step, False, 0, retries, role, fast_forwarded=n)
            time.sleep(0.005)
            return None
        s = hi
        entry = _Entry(s, self.buf.flat.clone(), self.buf.contributors(), self.buf.mask())
        with self._lock:
            logged = not self.synced
            if logged:  # checked and logged under the lock the catch-up worker finishes under
                self._log_for_replay(entry)
        if logged:
            return StepResult(self.step, False, entry.count, retries, role)
        if self.step < s:
            n = self._fast_forward(s, view, steps)
            if self.step != s:
                return StepResult(self.step, False, 0, retries, role, fast_forwarded=n)
        elif self.step > s:
            # Contributors are behind us: they will fast-forward from our log; retry.
            time.sleep(0.005)
            return None
        mine = None
        if self._ranges_step == s and slot is not None and entry.mask[slot]:
            mine = list(self._ranges)
        self._apply(entry)
        self._after_commit()
        return StepResult(self.step, True, entry.count, retries, role, trained=mine)

    def _apply(self, e: _Entry) -> None:
        """One optimizer update from a reduced buffer: identical inputs give identical weights."""
        if e.step != self.step:
            raise AssertionError(f"applying step {e.step} at step {self.step}")
        self.buf.unpack(float(e.count), source=e.flat)
        nominal = self.nominal or e.count
        apply_lr_scale(self.opt, self.base_lrs, lr_scale(self.policy, e.count, nominal))
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.cursor.commit(e.mask)
        self.step += 1
        with self._lock:
            self.recent.append(e)

    def _after_commit(self) -> None:
        self.rt.publish_step(self.step)
        if self.ckpt is not None and self.checkpoint_every and self.step % self.checkpoint_every == 0:
            meta, tensors = capture(self.model, self.opt, self._extra_meta())
            self.ckpt.save_async(self.step, meta, tensors)
        self._serve_donor_requests()

    def request_stop(self) -> None:
        """Graceful shutdown from a signal handler or another thread: a commit in flight raises
        Stopped instead of retrying for up to the step timeout."""
        self._stop.set()
        self.rt.abort_communicators("stopping")

    def digest(self) -> str:
        """Hash of parameters and optimizer state: equal at equal steps, across replicas."""
        return state_digest(self.model, self.opt)

    def _beat(self) -> None:
        if self.loop_timeout:
            self.rt.loop_beat(self.loop_timeout)

    # ------------------------------------------------------------------ errors and views
    def _note_role(self, me: dict[str, Any] | None, view: dict[str, Any] | None) -> None:
        """A participant that finds itself left out of a view (absent, or a joiner it did not
        ask to be) may hold a step the others redid without it: its allreduce can finish while
        theirs fail. It must not contribute again from that state: it catches up from a
        snapshot first (the leader, for its part, never re-admits it directly)."""
        role = me["role"] if me is not None else None
        if role == PARTICIPANT:
            self._was_participant = True
        elif self._was_participant and view is not None:
            self._was_participant = False
            if self.synced:
                log.warning("left out of view %d after being a participant at step %d: catching up from a "
                            "snapshot before contributing again", view["epoch"], self.step)
                self.events.append({"t": time.time(), "kind": "excluded", "step": self.step,
                                    "epoch": view["epoch"]})
                self._start_catchup(view)

    def _on_comm_error(self, exc: CommError, view: dict[str, Any], deadline: float) -> None:
        d = self.rt.data_epoch(view)
        peer = self.rt.peer_of_data_addr(exc.peer_addr, view)
        if not isinstance(exc, CommAborted) and peer is not None and peer["node"] != self.rt.node_id:
            self.rt.report_failure(peer["node"])
        self.events.append({"t": time.time(), "kind": "comm_error", "error": type(exc).__name__,
                            "peer": peer["node"] if peer else None, "epoch": view["epoch"]})
        log.info("allreduce on data epoch %d failed (%s); waiting for the next view", d, exc)
        # A dead peer is excluded by the next view within a suspicion timeout or so.
        wait = max(0.0, min(deadline - time.monotonic(), 6 * self.rt.profile.suspicion_min * 4))
        nv = self.rt.wait_view(lambda v: self.rt.data_epoch(v) > d, wait, loop_timeout=self.loop_timeout)
        if nv is None:
            # Nobody was excluded (the peer was only slow or paused briefly): ask for a fresh
            # data epoch so that every member builds a new communicator.
            log.warning("no new view after a failure on data epoch %d; asking for a fresh data epoch", d)
            self.rt.request_new_data_epoch(d)
            self.rt.wait_view(lambda v: self.rt.data_epoch(v) > d, max(0.0, min(deadline - time.monotonic(), 5.0)),
                              loop_timeout=self.loop_timeout)

    # ------------------------------------------------------------------ fast-forward
    def _fast_forward(self, target: int, view: dict[str, Any], steps: dict[int, int]) -> int:
        """Fetch and apply the mean gradients of the steps we missed from a peer that has them."""
        want_from = self.step
        donors = [m for m in view["members"] if m["role"] == PARTICIPANT and m["slot"] is not None
                  and steps.get(m["slot"], -1) >= target and m["node"] != self.rt.node_id]
        for d in donors:
            try:
                snap = fetch_state(d["data_addr"].split(",")[0], {"kind": "grads", "from": want_from, "to": target},
                                   secret=self.rt.secret, timeout=10.0)
            except CommError as exc:
                log.info("fast-forward from %s failed: %s", d["node"], exc)
                continue
            got = snap.meta.get("steps", [])
            if not got or got[0] != want_from:
                continue
            n = 0
            for i, s in enumerate(got):
                self._apply(_Entry(int(s), snap.tensors[f"g{s}"], int(snap.meta["counts"][i]),
                                   [bool(x) for x in snap.meta["masks"][i]]))
                n += 1
            self.events.append({"t": time.time(), "kind": "fast_forward", "from": want_from, "to": self.step})
            log.info("fast-forwarded %d step(s) to %d from %s", n, self.step, d["node"])
            self._after_commit()
            return n
        log.warning("cannot fast-forward from step %d to %d: catching up from a snapshot", want_from, target)
        self._start_catchup(view)
        return 0

    # ------------------------------------------------------------------ catch-up (joiner side)
    def _start_catchup(self, view: dict[str, Any]) -> None:
        with self._lock:
            if not self.synced:
                return
            self.synced = False
            self.replay.clear()
            self._catchup_gen += 1
        self.rt.set_status("joining", self.step)
        self.events.append({"t": time.time(), "kind": "catchup_start", "step": self.step})

    def _log_for_replay(self, e: _Entry) -> None:
        """Training thread, under the lock: keep a reduced step for the catch-up worker."""
        if self.replay and e.step != self.replay[-1].step + 1:
            self.replay.clear()  # a gap: those entries can no longer be replayed in order
        self.replay.append(e)
        size = sum(x.flat.numel() * 4 for x in self.replay)
        while self.replay and size > self.replay_cap:
            size -= self.replay[0].flat.numel() * 4
            self.replay.pop(0)
        if not self._catchup_running:
            self._catchup_running = True
            threading.Thread(target=self._catchup, args=(self._catchup_gen,), daemon=True,
                             name="p2pft-catchup").start()

    def _catchup(self, gen: int) -> None:
        """Background worker: pull a snapshot, restore it, replay the log, hand over.

        It never touches the step buffer, so the joiner's training thread keeps answering the
        survivors' allreduces on time (survivors never wait for a joiner). The transfer, the
        long part, runs at a lower CPU priority (here and on the donor), so on an
        oversubscribed host it takes mostly idle CPU; the restore and the replay run at normal
        priority, since the replay must outrun the survivors' steps to ever finish. The
        handover happens under the lock the training thread logs under, when the log is empty:
        no reduced step is lost or applied twice."""
        deadline = time.monotonic() + self.catchup_timeout
        try:
            while not self._stop.is_set() and gen == self._catchup_gen and time.monotonic() < deadline:
                with self._lock:
                    if not self.replay:
                        return  # the next logged step starts a new worker
                    min_step = self.replay[0].step
                try:
                    snap = self._fetch_snapshot_low_priority(self.rt.view, min_step)
                except Exception as exc:
                    log.info("snapshot fetch failed (%s); will retry", exc)
                    time.sleep(0.2)
                    continue
                if self._restore_and_replay(snap, gen, deadline):
                    return
        finally:
            with self._lock:
                if gen == self._catchup_gen:
                    self._catchup_running = False

    def _fetch_snapshot_low_priority(self, view: dict[str, Any] | None, min_step: int) -> StateSnapshot:
        """Fetch on a thread of its own whose priority is lowered (a thread cannot raise its
        priority back without privileges)."""
        box: "list[StateSnapshot | BaseException]" = []

        def run() -> None:
            lower_thread_priority()
            try:
                box.append(self._fetch_snapshot(view, min_step))
            except BaseException as exc:  # handed to the worker, which retries
                box.append(exc)
        th = threading.Thread(target=run, daemon=True, name="p2pft-catchup-fetch")
        th.start()
        th.join()  # fetch_state's own timeout bounds it
        if isinstance(box[0], BaseException):
            raise box[0]
        return box[0]

    def _fetch_snapshot(self, view: dict[str, Any] | None, min_step: int) -> StateSnapshot:
        donors = [m for m in (view or {"members": []})["members"]
                  if m["role"] == PARTICIPANT and m["node"] != self.rt.node_id]
        if not donors:
            raise CommError("no participant to pull a snapshot from")
        donor = min(donors, key=lambda m: m["slot"] if m["slot"] is not None else 1 << 30)
        log.info("fetching a snapshot of step >= %d from %s (%s)", min_step, donor.get("replica_id"), donor["node"])
        self.events.append({"t": time.time(), "kind": "catchup_fetch", "donor": donor.get("replica_id"),
                            "min_step": min_step})
        t0 = time.monotonic()
        snap = fetch_state(donor["data_addr"].split(",")[0], {"kind": "snapshot", "min_step": min_step},
                           secret=self.rt.secret, timeout=120.0, rate_limit_bytes_per_s=self.state_rate_limit,
                           into=self._receive_into())
        snap.meta["_donor"] = donor["node"]
        snap.meta["_fetch_s"] = time.monotonic() - t0
        return snap

    def _receive_into(self) -> dict[str, torch.Tensor]:
        """The joiner's own tensors, by snapshot name: the stream lands in them in place (no
        fresh allocation, no copy at restore). They hold nothing worth keeping while the
        replica catches up, and nothing reads them until the restore."""
        into = {f"param/{n}": p.data for n, p in self.model.named_parameters()}
        into.update({f"buffer/{n}": b for n, b in self.model.named_buffers()})
        by_param = {id(p): n for n, p in self.model.named_parameters()}
        for p, st in self.opt.state.items():
            name = by_param.get(id(p))
            if name is not None:
                into.update({f"optim/{name}/{k}": v for k, v in st.items() if isinstance(v, torch.Tensor)})
        return into

    def _restore_and_replay(self, snap: StateSnapshot, gen: int, deadline: float) -> bool:
        """True once caught up; False when a newer snapshot is needed (the log moved past it)."""
        s0 = int(snap.meta["step"])
        while True:  # the snapshot may be ahead of our log: wait for the log to reach it
            with self._lock:
                if not self.replay or self.replay[0].step > s0:
                    log.info("snapshot of step %d predates the replay log; pulling a newer one", s0)
                    return False
                if self.replay[-1].step >= s0:
                    while self.replay[0].step < s0:
                        self.replay.pop(0)
                    break
            if self._stop.is_set() or gen != self._catchup_gen or time.monotonic() > deadline:
                return True
            time.sleep(0.01)
        restore(self.model, self.opt, snap.meta["state"], snap.tensors)
        self.cursor.load_state_dict(snap.meta["cursor"])
        self.step = s0
        replayed = 0
        while True:
            with self._lock:
                if gen != self._catchup_gen:
                    return True
                if not self.replay:
                    self.synced = True  # the next reduced step is applied by the training thread
                    break
                e = self.replay.pop(0)
            if e.step != self.step:
                log.info("replay log has a gap at step %d (want %d); pulling a newer snapshot", e.step, self.step)
                return False
            self._apply(e)
            replayed += 1
        self.rt.set_status("ready", self.step)
        self.rt.publish_step(self.step)
        self.events.append({"t": time.time(), "kind": "catchup_done", "step": self.step, "snapshot_step": s0,
                            "replayed": replayed, "fetch_s": snap.meta.get("_fetch_s")})
        log.info("caught up: snapshot of step %d from %s (%.2f s), replayed %d step(s)", s0,
                 snap.meta.get("_donor"), snap.meta.get("_fetch_s", 0.0), replayed)
        return True

    # ------------------------------------------------------------------ donor side
    def _provide(self, request: dict[str, Any]) -> StateSnapshot | None:
        """Transport thread: serve mean gradients from our log, or a snapshot at a step boundary."""
        kind = request.get("kind")
        if kind == "grads":
            lo, hi = int(request["from"]), int(request["to"])
            with self._lock:
                entries = [e for e in self.recent if lo <= e.step < hi]
            if not entries or entries[0].step != lo or len(entries) != hi - lo:
                return None
            return StateSnapshot(meta={"steps": [e.step for e in entries], "counts": [e.count for e in entries],
                                       "masks": [[int(b) for b in e.mask] for e in entries]},
                                 tensors={f"g{e.step}": e.flat for e in entries})
        if kind == "snapshot":
            return self._donors.request(request)
        return None

    def _serve_donor_requests(self) -> None:
        def take() -> StateSnapshot:
            meta, tensors = capture(self.model, self.opt, {})
            return StateSnapshot(meta={"step": self.step, "state": meta, "cursor": self.cursor.state_dict()},
                                 tensors=tensors)
        self._donors.serve(lambda req: self.synced and self.step >= int(req.get("min_step", 0)), take)

    # ------------------------------------------------------------------ checkpoints
    def _extra_meta(self) -> dict[str, Any]:
        return {"step": self.step, "cursor": self.cursor.state_dict()}

    def _resume_from_checkpoint(self) -> None:
        assert self.ckpt is not None
        latest = self.ckpt.latest()
        if latest is None:
            return
        step, meta, tensors = latest
        restore(self.model, self.opt, meta, tensors)
        extra = meta.get("extra", meta)
        self.cursor.load_state_dict(extra["cursor"])
        self.step = int(step)
        log.info("resumed from the disk checkpoint of step %d", self.step)

    def close(self) -> None:
        if self.ckpt is not None:
            self.ckpt.close(timeout=10.0)


def train_loop(ft: FaultTolerant, loss_fn: Callable[[list[int]], torch.Tensor], steps: int,
               on_step: Callable[[StepResult], None] | None = None) -> None:
    """The shortest complete loop: run until `steps` committed steps."""
    while ft.step < steps:
        idx = ft.begin()
        ft.zero_grad()
        if idx:
            loss_fn(idx).backward()
        res = ft.commit()
        if on_step is not None:
            on_step(res)
