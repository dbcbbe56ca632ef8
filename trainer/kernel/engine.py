"""``StepEngine``, the step kernel: the step protocol for one rank of a replica, whatever its
number of ranks, driving an ``Algorithm`` (``algorithm.py``).

Every algorithm is a composition over it: ``FaultTolerant`` (a replica of one rank) and ``HSDP``
(an FSDP replica of many) differ in their ``ReplicaGroup`` and state layout, ``DiLoCo`` and local
SGD in their algorithm and a ``Spans`` front. Its parts above it (catch-up, the donor, pauses,
the job's life, checkpoints) come from the composition root (``trainer/compose.py``) and are
called through ports. Per attempt (docs/architecture.md):

1. rank 0 turns the current view into an ``Attempt`` and broadcasts it in-replica;
2. every rank allreduces its shard of the step buffer on ``(data epoch, shard = its rank)``;
3. the ranks all-gather a ``Verdict`` and take the same decision from the same list
   (``p2pft.core.step.decide``): commit, fast-forward, log for replay, retry or idle; either every
   rank of the replica commits the step or none does. On failure rank 0 reports the peer,
   waits for the next view, and all ranks retry with their saved gradients (no recomputation).
"""
from __future__ import annotations

import contextlib
import functools
import math
import dataclasses
import hashlib
import logging
import threading
import time
from collections import deque
from typing import Any, Iterator, Protocol

import torch

from ...core.meta import Status
from ...core.lifecycle import leads_step
from ...core.step import RETRY_PAUSE_S, Action, Reduced, decide, idle_backoff
from ...core.view import Role, TargetKind
from ...core.viewplan import NoteKind, PlanMemory, Reduce, WaitFor, plan_view
from ...ops.log import set_context
from ...runtime import Runtime
from ...transport import CommAborted, CommError, DataServer, SharedDevice
from ...transport.base import Communicator
from ...transport.addr import parse_hostport
from ...transport.backend import choose_backend, data_plane_from
from ...transport.device import written_event
from ...transport.stream import StateSnapshot
from .algorithm import Algorithm, Round
from .attempt import Attempt, Entry, Plan, StepResult, Verdict
from .comms import ShardComms
from .cursor import DataCursor
from .group import ReplicaGroup
from .options import CheckpointOptions, EngineOptions, JobOptions, exit_replica
from .ports import (CatchupControl, CheckpointControl, CommFactory, DataServerPort, DonorControl, LifeHooks,
                    PauseControl, RuntimePort)
from .offring import ring_calling, wait_off_ring
from .optstep import OptimizerStep
from .recent import RecentSteps, fast_forward
from .retry import LogLimiter, check_usable, recover
from .errors import StepTimeout, Stopped
from .state_io import StateIO
from .stepbuf import StepBuffer
from .user_state import UserState

log = logging.getLogger(__name__)

WAIT_ROLE_S = 1.0           # one look for a view that puts us on the data plane
WAIT_SHARDS_S = 0.5


def _role(att: Attempt) -> str:
    """The attempt's role as a ``StepResult`` names it ("?" before any view)."""
    return att.role.value if att.role is not None else "?"


class Parts(Protocol):
    """The kernel's parts that live above it (catch-up, the donor, pauses, the job's life,
    checkpoints), built by the composition root (``trainer/compose.py``) for the kernel it is
    given: the kernel imports none of them, only their ports."""

    def catchup(self, kernel: StepEngine, replay_cap_bytes: int, eager: bool) -> CatchupControl: ...

    def donor(self, kernel: StepEngine) -> DonorControl: ...

    def pause(self, kernel: StepEngine) -> PauseControl: ...

    def life(self, kernel: StepEngine, options: JobOptions) -> LifeHooks: ...

    def checkpoints(self, kernel: StepEngine, options: CheckpointOptions) -> CheckpointControl: ...


def data_server_of(runtime: Runtime) -> DataServer:
    """The data server a one-rank replica's Runtime owns (bound by ``Runtime.start()``)."""
    if runtime.data is None:
        raise ValueError("the Runtime has no data server: call start() before building the trainer")
    return runtime.data


class StepEngine:
    """One rank's step protocol, driving an ``Algorithm`` (``algorithm.py``: what a round reduces,
    how, and how the mean is applied); its options come grouped in one ``EngineOptions``. It reads
    the control plane and its data server through ports (``RuntimePort``, ``DataServerPort``) and
    builds its communicators with ``comm_factory`` (default: the data server's), so a test runs
    it in one process (tests/trainer/test_kernel_inprocess.py)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, algorithm: Algorithm, *,
                 parts: Parts, group: ReplicaGroup, runtime: RuntimePort | None, data_server: DataServerPort,
                 state_io: StateIO, options: EngineOptions, comm_factory: CommFactory | None = None) -> None:
        batch_per_replica = options.batch_per_replica
        self.group = group
        self.rank = self.shard = group.rank
        self.world = group.world
        if (runtime is not None) != (self.rank == 0):
            raise ValueError("rank 0, and only rank 0, runs the Runtime")
        if runtime is None:  # rank 0's runtime names the node in log lines; the other ranks name themselves
            set_context(node=f"rank{self.rank}")
        if batch_per_replica % self.world:
            raise ValueError(f"batch_per_replica={batch_per_replica} must be divisible by {self.world} ranks")
        self.rt = runtime
        self.model = model
        self.opt = optimizer
        self.ds = data_server
        self.state_io = state_io
        self.options = options
        self._step_cap: float | None = None   # see step_timeout_capped
        cap, upd = options.capacity, options.update
        self.algo = algorithm
        self.buf = algorithm.buffer(0)   # the buffer of the round in flight (``_attempts`` picks it)
        self.cursor = DataCursor(batch_per_replica, cap.max_slots)
        self.optimizer_step = OptimizerStep(optimizer, lr_policy=upd.lr_policy, nominal_replicas=upd.nominal_replicas,
                                            lr_scheduler=upd.lr_scheduler, grad_scaler=upd.grad_scaler,
                                            grad_hook=upd.grad_hook, after_step=upd.after_step,
                                            clip_norm=upd.clip_norm)
        self.user_state = UserState()
        if upd.lr_scheduler is not None:
            self.user_state.register("lr_scheduler", upd.lr_scheduler)
        if upd.grad_scaler is not None:
            self.user_state.register("grad_scaler", upd.grad_scaler)
        for name, obj in options.state.items():
            self.user_state.register(name, obj)
        self.step = 0
        self._synced = True            # see the synced property; written by mark_synced only
        self.events: deque[dict[str, Any]] = deque(maxlen=10_000)
        self.recent = RecentSteps(cap.recent_keep, cap.replay_cap_bytes)  # served to peers that fast-forward
        self.catchup: CatchupControl = parts.catchup(self, cap.replay_cap_bytes, algorithm.sparse)
        # The backend of every communicator, from the data plane asked for (argument, else the
        # runtime's, else $P2PFT_DATA_PLANE) and the step buffer's device: an impossible 'nccl'
        # fails here, before this rank serves state or opens its side channel.
        asked = options.plane.data_plane
        plane = (data_plane_from(asked) if asked is not None
                 else runtime.data_plane if runtime is not None else data_plane_from(None))
        dev = self.buf.flat.device
        self.backend = choose_backend(plane, dev.type)
        self.comms = ShardComms(data_server, self.shard, self.comm_timeout, backend=self.backend,
                                device=dev.index if dev.type == "cuda" else None, factory=comm_factory,
                                secret=options.plane.secret)
        if algorithm.sparse:   # peers may still be in their span: a new ring waits for them that long
            self.comms.connect_timeout = self.comm_timeout
        self.donor: DonorControl = parts.donor(self)   # snapshots, mean gradients and step signatures for peers
        self.in_step = False           # between begin() and the end of commit(): the loop mutates the state
        self.pause: PauseControl = parts.pause(self)   # ``with kernel.pause("eval"):``
        self.life: LifeHooks = parts.life(self, options.job)   # forming, the same start, the end, the leader
        self._idle_rounds = 0
        self._say = LogLimiter()
        self._stop = threading.Event()
        self._slot: int | None = None
        self._trained_slot: int | None = None   # the slot of the round in flight (StepResult.slot)
        self._ranges: list[tuple[int, int]] = []
        self._began_step = -1
        self._plan_memory = PlanMemory()   # rank 0: what one look at the views leaves for the next
        self._attempt_view: Any = None
        self._deadline = 0.0
        # An algorithm of spans that can train a partial one sets this: a replica catching up
        # then waits off the ring between rounds and hands over as soon as it holds the head
        # (``offring.py``); only where the data server sees a round start (its own TCP rings).
        self.early_handover = False
        self.att_epoch = -1            # the data epoch of this replica's latest attempt
        data_server.serve_state(self.donor.provide)
        host = parse_hostport(data_server.addr, "data address").host
        side = self.comms.listen(host) if self.rank != 0 else (host, 0)
        self._ranks: list[tuple[str, int]] = [(str(h), int(p)) for h, p in group.agree(side)[1:]]
        self._on_rank_lost = options.on_rank_lost
        if options.job.target is not None and options.job.target.kind is TargetKind.STEPS:
            self.catchup.end_step = options.job.target.n
        # Disk checkpoints (every rank its shard, off the training thread); a replica that
        # finds one resumes from it before it serves or announces anything.
        self.checkpoints: CheckpointControl | None = (parts.checkpoints(self, options.checkpoint)
                                                      if options.checkpoint is not None else None)
        if self.checkpoints is not None and options.checkpoint is not None and options.checkpoint.resume:
            self.checkpoints.resume()
        self._start_control()   # the state is final: serve it, announce it, follow views

    # ------------------------------------------------------------------ options, read where used
    @property
    def step_timeout(self) -> float:
        t = self.options.timeouts.step_timeout
        return t if self._step_cap is None else min(t, self._step_cap)

    @contextlib.contextmanager
    def step_timeout_capped(self, cap: float) -> Iterator[None]:
        """Training thread: commits inside wait at most `cap` for a view (the end barrier's
        idle rounds), without changing the configured options."""
        saved, self._step_cap = self._step_cap, cap
        try:
            yield
        finally:
            self._step_cap = saved

    @property
    def comm_timeout(self) -> float:
        return self.options.timeouts.comm_timeout

    @property
    def loop_timeout(self) -> float | None:
        """Longest the loop may go without a beat (``Runtime.loop_beat``)."""
        return self.options.timeouts.loop_timeout

    @property
    def rank_timeout(self) -> float:
        return self.options.timeouts.rank_timeout

    @property
    def secret(self) -> bytes | None:
        return self.options.plane.secret

    @property
    def state_rate_limit(self) -> float | None:
        return self.options.plane.state_rate_limit

    def _start_control(self) -> None:
        """Every rank, once the replica's state is final (after a resume): donors may copy it from
        now on. Rank 0 also announces it and follows views."""
        self.donor.idle()
        if self.rt is None:
            return
        self.rt.set_status(Status.FRESH, self.step)  # 'ready' once it commits, or catches up
        self.rt.publish_step(self.step)
        self.beat()
        self.comms.follow_views(self.rt, self._ranks)
        self.comms.watch_ranks(self.rt, self._ranks, self.rank_timeout,
                               self._stop.is_set, self._on_rank_lost)

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    @property
    def synced(self) -> bool:
        """This replica holds the cluster's committed state and trains; False while it catches
        up (the catch-up worker owns the model and the gradients meanwhile)."""
        return self._synced

    def mark_synced(self, synced: bool) -> None:
        """Catch-up's start (False) and hand-over (True), under its lock: the one writer of
        ``synced``."""
        self._synced = synced

    # ------------------------------------------------------------------ the job's life
    def start(self) -> None:
        """Collective: join the group (the first ``begin()`` does it); see ``JobLife.start``."""
        self.life.start()

    @property
    def done(self) -> bool:
        """The job's target is reached here, or the job finished: call ``finish()``."""
        return self.life.done

    def finish(self, timeout: float | None = None) -> int:
        """Collective: the end barrier; the step the job finished at (``JobLife.finish``)."""
        return self.life.finish(timeout)

    @property
    def is_leader(self) -> bool:
        """This replica does the side work (evaluation, logging) of the step begun last: one
        participant per step, the same answer on every rank of the replica."""
        return self.life.is_leader

    @property
    def leader(self) -> str | None:
        """The replica id of the participant doing side work, as of the step begun last."""
        return self.life.leader

    def idle_round(self, timeout: float) -> None:
        """Collective: one reduce round contributing nothing, waiting at most `timeout` for a
        view (the end barrier runs these for joiners still catching up)."""
        self._slot = None
        try:
            with self.step_timeout_capped(timeout):
                self.commit()
        except (StepTimeout, Stopped):
            pass

    # ------------------------------------------------------------------ public loop API
    def begin(self, stop: bool = False) -> list[int]:
        """Collective. This rank's sample indices for the step ([] = the replica contributes
        nothing). The first call joins the group (``start()``). Raises Stopped when any rank
        asked to stop (so all ranks leave together), JobFinished when the job ended."""
        if self.pause.why is not None:
            raise RuntimeError(f"begin() inside a pause ({self.pause.why!r})")
        self.beat()
        if not stop:
            self.life.before_begin()
        slot = None
        lead: tuple[bool, str | None] = (False, None)
        finished = None
        if self.rt is not None:
            me = self.rt.me()
            if me is not None and me.role is Role.PARTICIPANT and self.synced and me.slot is not None:
                slot = me.slot
            lead = self.life.lead_now()
            view = self.rt.view
            finished = view.finished if view is not None else None
        got = self.group.agree((bool(stop or self._stop.is_set()), slot, lead, finished))
        if any(g[0] for g in got):
            raise Stopped("stop requested")
        self.life.on_begin(got[0][2], got[0][3])
        self.donor.busy()  # from here on forward passes and the update mutate the state
        self.in_step = True
        self._slot = got[0][1]
        if self._slot is None:
            self._ranges = []
            return []
        self._ranges = self.cursor.assign(self._slot)
        self._began_step = self.step
        return self.rank_share(self.cursor, self._slot)

    def ring_calling(self) -> bool:
        """Collective: a peer has started a round with this replica since its latest attempt
        (a replica training a partial span stops and joins it)."""
        return ring_calling(self, self.att_epoch)

    def slot_samples(self) -> list[int]:
        """Every sample index the slot of the step begun last trains ([] : none), in order."""
        return [i for a, b in self._ranges for i in range(a, b)]

    def rank_share(self, cursor: DataCursor, slot: int) -> list[int]:
        """This rank's part of the samples `cursor` assigns to `slot` (all of them for one rank)."""
        idx = [i for a, b in cursor.assign(slot) for i in range(a, b)]
        per = len(idx) // self.world
        return idx[self.rank * per:(self.rank + 1) * per]

    @property
    def began_step(self) -> int:
        """The step the ranges of the step begun last were assigned at."""
        return self._began_step

    @property
    def buf_device(self) -> torch.device:
        return self.buf.flat.device

    def receive_into(self) -> dict[str, torch.Tensor] | None:
        """The tensors a snapshot may stream into in place (None: fresh ones)."""
        rin = self.state_io.receive_into
        return rin(self.model, self.opt) if rin is not None else None

    @property
    def current_slot(self) -> int | None:
        """The slot the step begun last trains for (None: this replica contributes nothing)."""
        return self._slot

    def zero_grad(self) -> None:
        if self.synced:  # while catching up, the background worker owns the gradients
            self._clear_grads()

    def _clear_grads(self, buf: StepBuffer | None = None) -> None:
        """Zero a step buffer's gradient views in place, else drop its parameters' gradients."""
        buf = buf or self.buf
        if not buf.zero_grads():
            for p in buf.params:
                p.grad = None

    def commit(self, short: int = 0) -> StepResult:
        """Collective. Allreduce this rank's shard, agree in-replica, retry across views, apply:
        the round's commit (every step for ``FaultTolerant`` and ``HSDP``, every sync for
        ``DiLoCo`` and local SGD). `short`: samples at the end of this round's assignment the
        replica did not train (a partial span): the mean counts its work as that much less, and
        the cursor hands those samples out again."""
        self.donor.busy()
        self.in_step = True
        try:
            return self._attempts(short)
        finally:
            self.in_step = False
            self.donor.idle()

    def _attempts(self, short: int) -> StepResult:
        slot = self._slot
        self._slot = None
        self._trained_slot = slot
        if self.synced:   # a replica catching up answers with zeros in any buffer (all have one size)
            self.buf = self.algo.buffer(self.step)
        if short and slot is not None:
            self._ranges = self.cursor.trained(slot, short)
        self.buf.pack(slot if self.synced else None, self.step, short if slot is not None else 0)
        self.buf.save()
        self._deadline = time.monotonic() + self.step_timeout
        self._idle_rounds = 0
        retries = 0
        off_ring = self.early_handover and self.comms.sees_calls
        while True:
            att = self.group.broadcast(self._plan(slot) if self.rt is not None else None)
            if self.rt is None and att.node:   # this replica's node, as rank 0 knows it
                set_context(node=f"{att.node}/rank{self.rank}", epoch=att.epoch)
            if att.kind is Plan.STOP:
                raise self.life.stopped(att)
            if att.kind is Plan.TIMEOUT:
                raise StepTimeout(f"no view to commit step {self.step} in within {self.step_timeout} s")
            if att.kind is Plan.WAIT:
                continue
            if att.done_ahead and self.synced:
                # The last step committed at some replicas only, and they wait at the end barrier:
                # they reduce no more, so take the steps from their log.
                ahead = dict(att.done_ahead)
                n, mine = fast_forward(self, max(ahead.values()), att, ahead, slot)
                return self._trained(StepResult(self.step, False, 0, retries, _role(att), fast_forwarded=n), mine)
            if att.rejoin and self.synced:
                log.warning("left out of view %d after being a participant at step %d: catching up from a "
                            "snapshot before contributing again", att.epoch, self.step)
                self.events.append({"t": time.time(), "kind": "excluded", "step": self.step, "epoch": att.epoch})
                self.catchup.start("excluded")
            if att.demote and slot is not None:
                slot = None  # demoted or re-slotted while computing: these gradients must not count
                self.buf.pack(None, self.step)
                self.buf.save()
            self.catchup.donor = att.donor
            self.catchup.kick()
            self.recent.hold(att.hold_from)
            self.att_epoch = att.data_epoch
            if off_ring and not self.synced:
                went = wait_off_ring(self, att, self._deadline)
                if went is True:
                    return StepResult(self.step, False, 0, retries, _role(att))
                if went is None:
                    continue
                off_ring = False   # a round started: answer it (and its retries) on the ring
            verdicts = self.group.agree(self._verdict(self._allreduce(att)))
            check_usable(verdicts, self.rank, att.data_epoch)
            outcome = self._decide(att, verdicts, retries, slot)
            if outcome is not None:
                return outcome
            self.buf.restore()
            retries += 1

    def digest(self) -> str:
        """Hash of this rank's parameters, optimizer state and registered state: equal at equal
        steps, across replicas."""
        d = self.state_io.digest(self.model, self.opt)
        return self._combine(d) if self.user_state else d

    def _combine(self, d: str) -> str:
        return hashlib.blake2b(f"{d}|{self.user_state.digest()}|{self.optimizer_step.peak}".encode(),
                               digest_size=32).hexdigest()

    # ------------------------------------------------------------------ replica state
    def capture_state(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """Everything a replica at this step boundary holds: (msgpack-able meta, CPU tensors)."""
        meta, tensors = self.state_io.capture(self.model, self.opt, {})
        extra, user_tensors = self.extras()
        tensors.update(user_tensors)
        return {"step": self.step, "shard": self.shard, "state": meta, **extra}, tensors

    def extras(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """The replicated state besides model and optimizer: data cursor, learning-rate
        factors, registered user state (meta, tensors)."""
        trees, user_tensors = self.user_state.capture()
        meta: dict[str, Any] = {"cursor": self.cursor.state_dict(), "user": trees,
                                "optstep": self.optimizer_step.state_dict()}
        sig = self.recent.signature(self.step - 1) if self.step > 0 else None
        if sig is not None:   # the last step's contributors: a resume checks the others redid nothing
            meta["sig"] = sig
        return meta, user_tensors

    def load_extras(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        """Load what ``extras`` gave (and the step), after the model and optimizer."""
        self.recent.forget_signatures()
        self.cursor.load_state_dict(meta["cursor"])
        self.user_state.restore(meta.get("user", {}), tensors)
        self.optimizer_step.load_state_dict(meta.get("optstep", {}))
        self.step = int(meta["step"])
        if isinstance(meta.get("sig"), str) and self.step > 0:
            self.recent.adopt_signature(self.step - 1, meta["sig"])

    @contextlib.contextmanager
    def state_mutation(self) -> Iterator[None]:
        """Around a change of the replica's state outside a step (e.g. loading a state before
        step 0): no donor copies it half-changed."""
        self.donor.busy()
        try:
            yield
        finally:
            self.donor.idle()

    def load_state(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        """Load a ``capture_state`` snapshot (a donor's, or the lead's initial state)."""
        self.state_io.restore(self.model, self.opt, meta["state"], tensors)
        self.load_extras(meta, tensors)

    def request_stop(self) -> None:
        """Graceful shutdown, safe from a signal handler: a commit in flight raises Stopped on
        every rank instead of retrying for up to the step timeout."""
        self._stop.set()
        self.catchup.stop()
        # Not in the handler's frame: the interrupted thread may hold a communicator's lock.
        threading.Thread(target=self.comms.abort_all, args=("stopping",), daemon=True).start()

    def close(self) -> None:
        self.catchup.stop()
        self.comms.close()
        if self.checkpoints is not None:
            self.checkpoints.close()

    def beat(self) -> None:
        """Tell the control plane the loop runs (rank 0; a no-op on the other ranks)."""
        if self.loop_timeout and self.rt is not None:
            self.rt.loop_beat(self.loop_timeout)

    # ------------------------------------------------------------------ one attempt
    def _plan(self, slot: int | None) -> Attempt:
        """Rank 0: what every rank of the replica does in this attempt, from the current view."""
        rt = self.rt
        assert rt is not None
        if self._stop.is_set():
            return Attempt(Plan.STOP)
        stop = self.life.stop_plan(rt.view)
        if stop is not None:
            return stop
        att = self._view_plan(rt, slot)
        if att.kind is Plan.ALLREDUCE and self.synced and not att.rejoin:   # left out: a snapshot, not a log
            ahead = self.life.done_ahead(att)
            if ahead:
                return dataclasses.replace(att, done_ahead=ahead)
        return att

    def _view_plan(self, rt: RuntimePort, slot: int | None) -> Attempt:
        """Rank 0: the attempt the current view allows (the job's life aside). The decision is
        ``p2pft.core.viewplan.plan_view`` (the simulator's trainers take the same); the clock,
        the beat and the waits for a view stay here."""
        if time.monotonic() > self._deadline:
            return Attempt(Plan.TIMEOUT)
        self.beat()
        view = rt.view
        plan = plan_view(self._plan_memory, view, rt.node_id, slot=slot, synced=self.synced, step=self.step,
                         world=self.world, member_step=rt.member_step, member_meta=rt.member_meta)
        self._plan_memory = plan.memory
        for note in plan.notes:
            if note.kind is NoteKind.TAKEN_BACK:
                log.warning("dropped from the views and taken back since view %d (now a participant again in "
                            "view %d): this replica may hold a step the others redid without it",
                            note.since, note.epoch)
            elif note.kind is NoteKind.SOLE_HOLDER:
                self._say(log, logging.WARNING, "sole", "left out of view %d after being a participant at step "
                          "%d, and no other replica holds the committed state: offering ours to resume from",
                          note.epoch, self.step)
        d = plan.decision
        if not isinstance(d, Reduce):
            if d.why is WaitFor.EPOCH:
                log.error("data-plane members %s do not have %d shards; waiting for another view", list(d.bad),
                          self.world)
                rt.wait_view(lambda v: d.satisfied(v, rt.node_id) or self.stopping, WAIT_SHARDS_S,
                             loop_timeout=self.loop_timeout)
            else:
                rt.wait_view(lambda v: d.satisfied(v, rt.node_id) or self.stopping,
                             timeout=min(WAIT_ROLE_S, max(0.0, self._deadline - time.monotonic())),
                             loop_timeout=self.loop_timeout)
            return Attempt(Plan.WAIT)
        self._attempt_view = view
        return Attempt(Plan.ALLREDUCE, epoch=d.epoch, data_epoch=d.data_epoch, rank=d.rank, addrs=d.addrs,
                       contribute=d.contribute, demote=d.demote, role=d.role, rejoin=d.rejoin, node=d.node,
                       donor=d.donor, behind=d.behind, nodes=d.nodes, hold_from=d.hold_from,
                       slot_ranks=d.slot_ranks)

    def _allreduce(self, att: Attempt) -> BaseException | None:
        try:
            comm = self.comms.get(att.data_epoch, att.rank, att.peers(self.shard))
            self.buf.set_held(att.rank if self.synced else None, self.step)
            self._reduce(comm, att)
            return None
        except CommError as exc:
            return exc
        except Exception as exc:  # e.g. a communicator of this epoch was just closed
            log.debug("allreduce not possible: %r", exc)
            return exc

    def _reduce(self, comm: Communicator, att: Attempt) -> None:
        """Sum this attempt's buffer over the communicator, as the algorithm reduces it. The
        header goes into the sum when this rank contributes, else as zeros with the step it holds
        (``StepBuffer.set_held``) when it holds the committed state; a replica catching up counts
        as zeros (the communicator zeroes it)."""
        self.algo.reduce(comm, self.buf, Round(contribute=att.contribute, header=att.contribute or self.synced,
                                               world=len(att.addrs), timeout=self.comm_timeout))

    def _verdict(self, err: BaseException | None) -> Verdict:
        if err is not None:
            return Verdict(ok=False, comm=isinstance(err, CommError), aborted=isinstance(err, CommAborted),
                           peer=getattr(err, "peer_addr", None), error=f"{type(err).__name__}: {err}"[:300],
                           unusable=isinstance(err, SharedDevice))
        try:
            steps = self.buf.slot_steps()
            count = self.buf.contributors()
            held = self.buf.held_steps()
            short = {s: n for s, n in self.buf.shorts().items() if s in steps}
        except Exception as exc:
            return Verdict(ok=False, error=repr(exc)[:300])
        return Verdict(ok=True, steps=tuple(sorted(steps.items())), count=count, held=tuple(sorted(held.items())),
                       short=tuple(sorted(short.items())), ready=self.catchup.ready_step())

    def _decide(self, att: Attempt, verdicts: list[Verdict], retries: int, slot: int | None) -> StepResult | None:
        """Identical on every rank: a function of the gathered verdicts and replicated state."""
        role = _role(att)
        bad = [v for v in verdicts if not v.ok]
        if not bad and any((v.steps, v.count, v.held, v.short) != (verdicts[0].steps, verdicts[0].count,
                                                                   verdicts[0].held, verdicts[0].short)
                           for v in verdicts):
            log.warning("shards reduced different contributor sets; retrying on a fresh data epoch")
            bad = [Verdict(ok=False, comm=True, aborted=True, error="shards disagree")]
        if bad:
            if self.rt is not None:
                self._recover(bad)
            return None
        reduced = Reduced(dict(verdicts[0].steps), verdicts[0].count, dict(verdicts[0].held))
        d = decide(reduced, self.step, self.synced)
        rank, world = att.rank, len(att.addrs)
        if d.action is Action.IDLE:
            return self._idle(att, verdicts, retries)
        if d.action is Action.RETRY:
            time.sleep(RETRY_PAUSE_S)
            return None
        assert d.step is not None
        mask = [i in reduced.steps for i in range(self.buf.max_slots)]
        flat = self.buf.flat.clone()
        entry = Entry(d.step, flat, reduced.count, mask, ready=written_event(flat), short=dict(verdicts[0].short))
        self.measure(entry)
        ranks = {s: r for s, r in att.slot_ranks if s < len(mask) and mask[s]}
        if d.action is Action.LOG:
            if self.catchup.on_reduced(entry, all(v.ready == d.step for v in verdicts)):
                self._reduced(entry.step)   # handed over: it applied this step from its own reduce
                self.life.note_lead(False)
                self.committed()
                return StepResult(self.step, True, entry.count, retries, role, slot_ranks=ranks, data_rank=rank,
                                  data_world=world)
            return StepResult(self.step, False, entry.count, retries, role, data_rank=rank, data_world=world)
        if d.action is Action.FAST_FORWARD:
            assert d.target is not None
            n, mine = fast_forward(self, d.target, att, reduced.held, slot)
            if not d.commit_after or self.step != d.step:
                return self._trained(StepResult(self.step, False, 0, retries, role, fast_forwarded=n,
                                                data_rank=rank, data_world=world), mine)
        else:
            n, mine = 0, None
        if self._began_step == entry.step and slot is not None and mask[slot]:
            mine = entry
        # The leader of a committed step is its lowest contributing slot: every replica that
        # committed it read the same mask, so exactly one of them leads it.
        self.life.note_lead(leads_step(mask, slot))
        self.apply(entry)
        self._reduced(entry.step)
        self.committed()
        return self._trained(StepResult(self.step, True, entry.count, retries, role, fast_forwarded=n,
                                        slot_ranks=ranks, data_rank=rank, data_world=world), mine)

    def _idle(self, att: Attempt, verdicts: list[Verdict], retries: int) -> StepResult | None:
        """Nobody contributed (the others are paused, or there are none). A joiner catches up
        from a donor's current state meanwhile; a promoted one hands back for a slot; otherwise
        back off (bounded rounds per second) and try again until the step timeout."""
        if not self.synced:
            if self.catchup.on_idle(all(v.ready is not None and v.ready == self.step for v in verdicts)):
                return StepResult(self.step, False, 0, retries, _role(att))
        elif att.behind:
            log.info("at step %d while the donor holds a later one and nobody contributes: catching up from a "
                     "snapshot", self.step)
            self.catchup.start("behind")
            self.catchup.on_idle(False)
        if att.role is Role.PARTICIPANT:  # promoted since begin(): begin again, with a slot
            return StepResult(self.step, False, 0, retries, _role(att))
        self._idle_rounds += 1
        self._say(log, logging.INFO, "idle", "step %d: nobody contributes on data epoch %d (%s); waiting up to "
                  "%.0f s", self.step, att.data_epoch, _role(att), max(0.0, self._deadline - time.monotonic()))
        time.sleep(idle_backoff(self._idle_rounds))
        return None

    def _trained(self, res: StepResult, entry: Entry | None) -> StepResult:
        """`res` with our samples in `entry`'s mean (a fast-forwarded step's, or the committed
        one's): they are the ranges this step began with."""
        if entry is not None:
            res.trained, res.trained_step, res.slot = list(self._ranges), entry.step, self._trained_slot
        return res

    # ------------------------------------------------------------------ the optimizer step
    def apply(self, e: Entry) -> None:
        """One optimizer update from a reduced buffer: identical inputs give identical weights
        (on every replica, and again in a joiner's replay)."""
        if e.step != self.step:
            raise AssertionError(f"applying step {e.step} at step {self.step}")
        buf = self.algo.buffer(e.step)
        buf.unpack(e.divisor(self.cursor.batch_per_slot), source=e.flat)
        self.algo.apply(e.step, buf, functools.partial(self.optimizer_step, e.count, e.norm))
        self._clear_grads(buf)
        self.cursor.commit(e.mask, e.short)
        self.step += 1
        self.recent.append(e)

    def measure(self, e: Entry) -> None:
        """Collective, every rank in lockstep, as an entry is made (a commit, a logged step, a
        fast-forwarded one): with clipping, the mean gradient's global norm over the replica's
        shards, kept on the entry so that applying it, now or in a replay, clips alike."""
        if self.optimizer_step.clip_norm is None or e.norm is not None:
            return
        n = self.algo.buffer(e.step).grad_numel
        mine = float(torch.linalg.vector_norm(e.flat[:n], dtype=torch.float64)) ** 2
        e.norm = math.sqrt(sum(self.group.agree(mine))) / e.divisor(self.cursor.batch_per_slot)

    def committed(self) -> None:
        """After every committed step (a live one, a fast-forward, a hand-over): publish it,
        then the parts that act on commits (the job's life, checkpoints)."""
        self.life.on_step()
        if self.checkpoints is not None:
            self.checkpoints.on_step()
        if self.rt is not None:
            self.rt.publish_step(self.step)
            if self.rt.status is Status.FRESH:  # it committed with the others: it holds their state
                self.rt.set_status(Status.READY, self.step)
        else:
            set_context(step=self.step)
        self.donor.serve_queued()

    def restore_snapshot(self, snap: StateSnapshot) -> None:
        """Catch-up worker: load a donor's snapshot (the training thread does not touch the
        model while the replica is not synced)."""
        self.load_state(snap.meta, snap.tensors)

    # ------------------------------------------------------------------ failures (rank 0)
    def _recover(self, bad: list[Verdict]) -> None:
        assert self.rt is not None
        if self._attempt_view is not None:
            recover(self.rt, self._attempt_view, bad, self.step, self._deadline, lambda: self.stopping,
                    self.loop_timeout, self.events, self._say)

    def rejoined_after_pause(self) -> None:
        """Back from a pause (which checked our last step): being off the data plane meanwhile
        is not being left out of a view (``PlanMemory.after_pause``)."""
        self._plan_memory = self._plan_memory.after_pause()

    @property
    def plan_memory(self) -> PlanMemory:
        """Rank 0: what the view plan's last look left (the end barrier reads whether this
        replica was left out since its last commit: ``viewplan.must_check_end``)."""
        return self._plan_memory

    def membership_checked(self) -> None:
        """Rank 0, at the end barrier: a finished peer's signatures of our last steps agreed, so
        being left out of the views since is not holding a step the others redid (as after a
        pause: ``PlanMemory.after_pause``)."""
        self._plan_memory = self._plan_memory.after_pause()

    def _reduced(self, step: int) -> None:
        """Rank 0: this replica applied `step` from its own allreduce (``PlanMemory.after_reduce``)."""
        if self.rt is not None:
            self._plan_memory = self._plan_memory.after_reduce(step)


__all__ = ["StateIO", "StepEngine", "exit_replica"]
