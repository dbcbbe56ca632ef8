"""``DiLoCo``: semi-synchronous training on the step protocol (DiLoCo and Streaming DiLoCo).

The same step engine as ``FaultTolerant`` at a coarser grain. The engine's model is a copy of
the user's model holding the *global* weights and its optimizer is the *outer* optimizer; one
engine step is one *sync*. Between two syncs every contributing replica runs ``span`` inner
steps on its own (the user's) model with the user's optimizer; at the sync it packs the
pseudo-gradient (global minus local) of the sync's fragment as the step's "gradient". The
engine then does what it does for any step: the contributor count and mask travel in the
reduced header, a failed allreduce is retried with the saved pseudo-gradient on the next data
epoch, the mean is applied by the outer optimizer identically on every replica, the cursor
commits the samples of the contributors' inner steps (the others' become holes), and a
restarted replica catches up the global weights, the outer optimizer and the cursor from a
snapshot in the background while taking part in each sync with zeros. See docs/diloco.md.
"""
from __future__ import annotations

import copy
import logging
import threading
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ...core.view import Role
from ...runtime import Runtime
from ...transport.device import SideStream, written_event
from ..kernel.attempt import Entry, StepResult
from ..kernel.engine import StepEngine, data_server_of
from ..kernel.errors import StepTimeout, Stopped
from .ft import WHOLE_STATE
from ..kernel.group import LocalGroup
from ..kernel.options import JobOptions
from ..kernel.options import (DILOCO_LOOP_TIMEOUT_S, Capacity, CheckpointOptions, DataPlaneOptions, EngineOptions,
                              Timeouts, UpdateRule)
from ..kernel.optstep import GradHook, OptimizerStep
from .outer import FragmentSchedule, merge, outer_sgd, pseudo_gradient, split_fragments
from .pgcodec import Compression, PseudoGradCodec
from ..kernel.stepbuf import StepBuffer
from ..state.user import Stateful

log = logging.getLogger(__name__)

OuterFactory = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]
JOIN_MARGIN_S = 30.0   # beyond the step timeout, how long span end waits for a sync in flight
PROMOTION_WAIT_S = 0.25  # a replica that just caught up waits this long for the view that promotes it


@dataclass
class DiLoCoResult:
    """What one ``DiLoCo.commit()`` did: an inner step, and at the end of a span, a sync."""

    inner_step: int                 # inner steps in the replicated numbering after this call
    syncs: int                      # committed syncs (outer steps; fragment syncs when streaming)
    inner: bool                     # this call took an inner optimizer step
    fragment: int | None = None     # the fragment the sync ending here carried (None: no sync)
    outer: StepResult | None = None  # the engine's result of that sync (trained ranges, contributors)


class DiLoCo(StepEngine):
    """DiLoCo around an ordinary loop, for a replica of one rank (``p2pft.trainer.DiLoCo``).

    ``begin()`` gives the samples of one inner step ([] while the replica contributes nothing);
    ``commit()`` takes the inner optimizer step and, every ``span`` of them, the sync."""

    # Syncs are seconds apart: a restarted replica takes its snapshot (the global weights, the
    # outer optimizer, the cursor) at once and holds the sync it is at, instead of logging one
    # first (docs/diloco.md, "Failures").
    eager_catchup = True

    def __init__(self, runtime: Runtime, model: torch.nn.Module, inner_optimizer: torch.optim.Optimizer, *,
                 sync_every: int, batch_per_replica: int, outer_optimizer: OuterFactory = outer_sgd,
                 fragments: int = 1, overlap: int = 0, alpha: float = 0.0, compression: str = "none",
                 lr_policy: str = "none", nominal_replicas: int | None = None,
                 lr_scheduler: Any = None, grad_scaler: Any = None, grad_hook: GradHook | None = None,
                 after_step: GradHook | None = None, outer_lr_scheduler: Callable[[Any], Any] | None = None,
                 outer_grad_hook: GradHook | None = None, state: dict[str, Stateful] | None = None,
                 max_slots: int = Capacity.max_slots, recent_keep: int = Capacity.recent_keep,
                 replay_cap_bytes: int = Capacity.replay_cap_bytes,
                 step_timeout: float = Timeouts.step_timeout,
                 state_rate_limit: float | None = DataPlaneOptions.state_rate_limit,
                 loop_timeout: float | None = DILOCO_LOOP_TIMEOUT_S,
                 data_plane: str | None = DataPlaneOptions.data_plane, checkpoint_dir: str | None = None,
                 checkpoint_every: int = 0, resume: bool = True,
                 total_steps: int | None = None, total_samples: int | None = None,
                 min_replicas: int = JobOptions.min_replicas, start_timeout: float = JobOptions.start_timeout,
                 resume_grace: float = JobOptions.resume_grace,
                 allow_restart_from_scratch: bool = JobOptions.allow_restart_from_scratch,
                 on_finished: str = JobOptions.on_finished.value,
                 initial_state: str = JobOptions.initial_state.value,
                 finish_timeout: float = JobOptions.finish_timeout) -> None:
        # loop_timeout: the leader leaves out a replica whose loop is silent this long; a sync
        # may wait in the ring up to comm_timeout, which DiLoCo needs longer than a step's.
        self.schedule = FragmentSchedule(sync_every, fragments, overlap, alpha)
        # total_steps counts inner steps, as the loop does; the kernel's steps are syncs.
        span = self.schedule.span
        if total_steps is not None and (isinstance(total_steps, bool) or not isinstance(total_steps, int)
                                        or total_steps < 1 or total_steps % span):
            raise ValueError(f"total_steps={total_steps!r} (inner steps) must be a positive multiple of the span "
                             f"between syncs ({span})")
        self.codec_kind = Compression.parse(compression)
        if not callable(outer_optimizer):
            raise TypeError("outer_optimizer must be a factory: params -> torch.optim.Optimizer")
        self.local_model = model
        self.inner_opt = inner_optimizer
        glob = copy.deepcopy(model)  # the global weights: what syncs update and snapshots carry
        for p in glob.parameters():
            p.grad = None
        self.global_model = glob
        self._gparams = [p for p in glob.parameters() if p.requires_grad]
        self._lparams = [p for p in model.parameters() if p.requires_grad]
        outer = outer_optimizer(self._gparams)
        if {id(p) for g in outer.param_groups for p in g["params"]} != {id(p) for p in self._gparams}:
            raise ValueError("the outer optimizer must hold exactly the parameters it is given")
        options = EngineOptions(
            batch_per_replica=batch_per_replica * self.schedule.span,
            timeouts=Timeouts(step_timeout=step_timeout, comm_timeout=runtime.comm_timeout, loop_timeout=loop_timeout),
            update=UpdateRule(lr_policy=lr_policy, nominal_replicas=nominal_replicas, grad_hook=outer_grad_hook,
                              lr_scheduler=outer_lr_scheduler(outer) if outer_lr_scheduler is not None else None),
            capacity=Capacity(max_slots=max_slots, recent_keep=recent_keep, replay_cap_bytes=replay_cap_bytes),
            data=DataPlaneOptions(data_plane=data_plane, secret=runtime.secret, state_rate_limit=state_rate_limit),
            state=dict(state or {}),
            job=JobOptions.make(total_steps=None if total_steps is None else total_steps // span,
                                total_samples=total_samples, min_replicas=min_replicas,
                                start_timeout=start_timeout, resume_grace=resume_grace,
                                allow_restart_from_scratch=allow_restart_from_scratch, on_finished=on_finished,
                                initial_state=initial_state, finish_timeout=finish_timeout),
            checkpoint=CheckpointOptions.of(checkpoint_dir, checkpoint_every, resume))
        super().__init__(glob, outer, group=LocalGroup(), runtime=runtime, data_server=data_server_of(runtime),
                         state_io=WHOLE_STATE, options=options)
        self.batch = batch_per_replica
        # A joiner answers each sync at once and a fast replica reaches it early: both wait in
        # the ring for the others' span, so a new ring may take up to comm_timeout to connect.
        self.comms.connect_timeout = self.comm_timeout
        self.inner_step_fn = OptimizerStep(inner_optimizer, lr_policy="none", lr_scheduler=lr_scheduler,
                                           grad_scaler=grad_scaler, grad_hook=grad_hook, after_step=after_step)
        self.inner_scheduler = lr_scheduler
        self._sched_steps = 0
        self._groups = split_fragments(self._gparams, fragments)
        self.bufs = self._fragment_buffers(max_slots)
        self.buf = self.bufs[0]
        self.codecs = [PseudoGradCodec(self.codec_kind, b.grad_numel, b.flat.device) for b in self.bufs]
        self._side = SideStream(self.bufs[0].flat)   # the overlapped sync's stream (a no-op on CPU)
        self._k = 0                  # inner steps run in the current span
        self._base = 0               # engine step at the start of the current span
        self._span_idx: list[int] = []
        self._contributing = False
        self._fresh = True           # local weights must restart from the global ones
        self._inflight: threading.Thread | None = None
        self._inflight_out: list[Any] = []
        self.inner_steps_run = 0     # inner steps this process ran (kept or not)
        self._start_control()

    # ------------------------------------------------------------------ layout
    def _fragment_buffers(self, max_slots: int) -> list[StepBuffer]:
        """One step buffer per fragment, all of one size (a zero pad parameter fills the
        smaller ones): a replica that catches up answers a sync with zeros before it knows
        which fragment the others send."""
        if len(self._groups) == 1:
            return [self.buf]
        sizes = [sum(self._gparams[i].numel() for i in g) for g in self._groups]
        top = max(sizes)
        dev = self._gparams[0].device
        bufs = []
        for g, size in zip(self._groups, sizes):
            params = [self._gparams[i] for i in g]
            if size < top:
                params.append(torch.nn.Parameter(torch.zeros(top - size, device=dev)))
            bufs.append(StepBuffer(params, max_slots=max_slots))
        return bufs

    @property
    def inner_step(self) -> int:
        """Inner steps in the replicated numbering: syncs at the span's start x span + this span's."""
        return self._base * self.schedule.span + self._k

    # ------------------------------------------------------------------ the loop
    def begin(self, stop: bool = False) -> list[int]:
        """This inner step's sample indices ([] = the replica contributes nothing to the next
        sync). At a span's start this is the engine's collective begin."""
        self.beat()
        if self._k == 0:
            self._span_idx = super().begin(stop)
            # Inner steps touch only the local model: the global weights and the outer optimizer
            # (the state a joiner pulls) stay a committed state until the sync, so donors may
            # copy them meanwhile instead of at the next sync only. (A pause still waits for the
            # span's end: ``in_step`` stays set.)
            self.serving.idle()
            self._base = self.step
            was = self._contributing
            self._contributing = bool(self._span_idx)
            if self._contributing and (self._fresh or not was):
                self._restart_local()
            if self._contributing != was:
                log.info("%s from sync %d (inner step %d)", "contributing" if self._contributing else
                         "sitting out the syncs (not a participant, or catching up)", self.step, self.inner_step)
        elif stop or self.stopping:
            raise Stopped("stop requested")
        if not self._contributing:
            return []
        b = len(self._span_idx) // self.schedule.span
        return self._span_idx[self._k * b:(self._k + 1) * b]

    def zero_grad(self) -> None:
        """Clear the local model's gradients (the inner optimizer's)."""
        self.inner_opt.zero_grad(set_to_none=True)

    def commit(self) -> DiLoCoResult:
        """The inner optimizer step; at the end of a span, the sync (its allreduce in the
        background during the last `overlap` inner steps)."""
        if not self._contributing:
            was_synced = self.synced
            res = self._sync_now()
            self._fresh = True
            self._base = self.step
            if self.synced and not was_synced:
                self._await_promotion()
            return DiLoCoResult(self.inner_step, self.step, False, _fragment_of(res, self), res)
        self.inner_step_fn(1)
        self._k += 1
        self.inner_steps_run += 1
        self._sched_steps += self.inner_scheduler is not None
        s = self.schedule
        if self._k == s.send_at and s.overlap:
            self._launch()
        if self._k < s.span:
            return DiLoCoResult(self.inner_step, self.step, True)
        frag = s.fragment(self._base)
        res = self._join() if s.overlap else self._sync_now()
        self._after_sync(frag, res)
        self._k = 0
        self._base = self.step
        return DiLoCoResult(self.inner_step, self.step, True, frag, res)

    # ------------------------------------------------------------------ syncs
    def _load_pseudo_gradient(self, frag: int) -> None:
        """Fragment `frag`'s gradient slots of the global copy <- global - local."""
        idx = self._groups[frag]
        gp = [self._gparams[i] for i in idx]
        for p in self.bufs[frag].params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in gp if p.grad is not None]
        pseudo_gradient([p.detach() for p in gp], [self._lparams[i].detach() for i in idx], grads)
        for p in self.bufs[frag].params[len(idx):]:   # the pad, if any
            assert p.grad is not None
            p.grad.zero_()

    def _await_promotion(self) -> None:
        """Just caught up (a hand-over at this sync): the leader makes a ready joiner a
        participant within a view change, tens of ms. Waiting that long for it, bounded, lets
        this replica take a slot for the span that starts now and contribute at the next sync,
        instead of sitting out a whole span first."""
        rt = self.rt
        if rt is None:
            return
        me = rt.node_id
        got = rt.wait_view(lambda v: v.role_of(me) is Role.PARTICIPANT or self.stopping, PROMOTION_WAIT_S,
                           loop_timeout=self.loop_timeout)
        log.info("caught up at sync %d: %s", self.step, "a participant from this span on" if got is not None
                 else "not yet a participant; sitting out one more span")

    def _sync_now(self) -> StepResult:
        """The engine's commit of the current sync, on this thread."""
        if self._contributing:
            self._load_pseudo_gradient(self.schedule.fragment(self.step))
        if self.synced:
            self.buf = self.bufs[self.schedule.fragment(self.step)]
        return self.commit_step()

    def _launch(self) -> None:
        """Take the pseudo-gradient now and reduce it on a thread while inner steps go on."""
        self._load_pseudo_gradient(self.schedule.fragment(self.step))
        self.buf = self.bufs[self.schedule.fragment(self.step)]
        ready = written_event(self.buf.flat)   # the pseudo-gradient, as this thread's stream wrote it
        out: list[Any] = []

        def run() -> None:
            try:   # on a stream of its own: neither serialized with training nor racing its writes
                with self._side.use(after=ready):
                    out.append(self.commit_step())
            except BaseException as exc:  # handed to the training thread at the span's end
                out.append(exc)
        self._inflight_out = out
        self._inflight = threading.Thread(target=run, name=f"p2pft-sync-{self.step}", daemon=True)
        self._inflight.start()

    def _join(self) -> StepResult:
        t = self._inflight
        assert t is not None
        t.join(self.step_timeout + JOIN_MARGIN_S)
        if t.is_alive():
            raise StepTimeout(f"the sync of step {self.step} did not end within {self.step_timeout} s")
        self._inflight = None
        self._side.join(self.buf.flat)   # the training stream waits for the sync's device work
        got = self._inflight_out[0]
        if isinstance(got, BaseException):
            raise got
        return got

    def _after_sync(self, frag: int, res: StepResult) -> None:
        """Merge the synced fragment into the local weights; restart all of them from the global
        ones when the sync did not hold our pseudo-gradient or other syncs were applied too."""
        if res.fast_forwarded or res.trained is None:
            self._fresh = True
            log.info("sync %d: our pseudo-gradient is not in a committed mean (fast-forwarded %d); local "
                     "weights restart from the global ones", res.step, res.fast_forwarded)
            return
        idx = self._groups[frag]
        merge([self._lparams[i].data for i in idx], [self._gparams[i].data for i in idx], self.schedule.alpha)

    def _restart_local(self) -> None:
        """Local weights <- global; the inner scheduler advanced to the replicated inner step."""
        merge([p.data for p in self._lparams], [p.data for p in self._gparams], 0.0)
        target = self.step * self.schedule.span
        if self.inner_scheduler is not None and self._sched_steps < target:
            # The schedule is moved to the replicated inner step before this replica's first
            # inner optimizer step (a restart, or a replica that sat out syncs): PyTorch warns
            # about a scheduler stepped before its optimizer, which here is the point.
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before")
                while self._sched_steps < target:
                    self.inner_scheduler.step()
                    self._sched_steps += 1
        self._fresh = False

    # ------------------------------------------------------------------ the outer step
    def _reduce(self, comm: Any, att: Any) -> None:
        """The engine's allreduce of the current sync's buffer, through the codec."""
        codec = self.codecs[self.bufs.index(self.buf)]
        codec.reduce(comm, self.buf.flat, contribute=att.contribute, timeout=self.comm_timeout, world=len(att.addrs),
                     header=self._sends(att))

    def apply(self, e: Entry) -> None:
        """The outer step of sync `e.step`: the mean pseudo-gradient of its fragment, through the
        outer optimizer (parameters of other fragments hold no gradient, so it leaves them and
        their momentum alone). Identical on every replica and in a replay."""
        if e.step != self.step:
            raise AssertionError(f"applying sync {e.step} at sync {self.step}")
        frag = self.schedule.fragment(e.step)
        buf = self.bufs[frag]
        buf.unpack(float(e.count), source=e.flat)
        mine = set(self._groups[frag])
        others = [(p, p.grad) for i, p in enumerate(self._gparams) if i not in mine]
        for p, _ in others:
            p.grad = None
        try:
            self.optimizer_step(e.count)
        finally:
            for p, g in others:
                p.grad = g
        if not buf.zero_grads():
            for p in buf.params:
                p.grad = None
        self.cursor.commit(e.mask)
        self.step += 1
        self.recent.append(e)

    def bytes_reduced(self) -> int:
        """Payload bytes this replica handed to the ring over all syncs (header excluded)."""
        return sum(c.payload_bytes for c in self.codecs)

    def close(self) -> None:
        if self._inflight is not None:
            self._inflight.join(self.step_timeout + JOIN_MARGIN_S)
        super().close()


def _fragment_of(res: StepResult, dl: DiLoCo) -> int | None:
    """The fragment of the sync a result committed (None when it committed nothing)."""
    return dl.schedule.fragment(res.step - 1) if res.committed and res.step > 0 else None


__all__ = ["DiLoCo", "DiLoCoResult"]
