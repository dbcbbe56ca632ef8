"""``DiLoCo``: semi-synchronous training on the step protocol (DiLoCo and Streaming DiLoCo).

A composition: ``FragmentMean`` (each sync reduces one fragment's pseudo-gradient, global minus
local, through a codec and applies its mean with the outer optimizer), the step kernel, whose
model is a copy holding the *global* weights and whose optimizer is the *outer* one (a kernel
step is a *sync*), and the kernel's ``Spans`` (a sync every ``span`` inner steps on the user's
model and optimizer). The kernel does the rest as for any step: retries with the saved
pseudo-gradient, exactly-once data, catch-up of a restarted replica. See docs/diloco.md.
"""
from __future__ import annotations

import copy
import logging
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from ...core.view import Role
from ...runtime import Runtime
from ...transport import DataServer
from ...transport.base import Communicator
from ..kernel.algorithm import Round
from ..kernel.attempt import StepResult
from ..kernel.options import Options, UpdateRule
from ..kernel.optstep import GradHook, LRSchedulerLike, OptimizerStep
from ..kernel.span import Spans
from ..kernel.stepbuf import StepBuffer, local
from .front import Front
from .partial import PartialSpan
from .shape import Shape
from .outer import FragmentSchedule, merge, outer_sgd, pseudo_gradient, split_fragments
from .pgcodec import Compression, PseudoGradCodec

log = logging.getLogger(__name__)

OuterFactory = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]
PROMOTION_WAIT_S = 0.25  # a replica that just caught up waits this long for the view that promotes it


@dataclass
class DiLoCoResult:
    """What one ``DiLoCo.commit()`` did: an inner step, and at the end of a span, a sync."""

    inner_step: int                 # inner steps in the replicated numbering after this call
    syncs: int                      # committed syncs (outer steps; fragment syncs when streaming)
    inner: bool                     # this call took an inner optimizer step
    fragment: int | None = None     # the fragment the sync ending here carried (None: no sync)
    outer: StepResult | None = None  # the kernel's result of that sync (trained ranges, contributors)
    short: int = 0                  # that sync's samples this replica left untrained (a partial span)


class FragmentMean:
    """The algorithm of a sync: one fragment's pseudo-gradient, through its codec, applied by the
    outer optimizer to that fragment only (its other parameters and their momentum untouched)."""

    sparse = True   # syncs are seconds apart (docs/diloco.md, "Failures")

    def __init__(self, params: list[torch.nn.Parameter], schedule: FragmentSchedule, max_slots: int,
                 codec: Compression) -> None:
        self.params, self.schedule = params, schedule
        self.groups = split_fragments(params, schedule.fragments)
        # One buffer per fragment, all of one size (a zero pad parameter fills the smaller ones);
        # sizes of this rank's shards (the fragments themselves are cut alike on every rank).
        sizes = [sum(local(params[i]).numel() for i in g) for g in self.groups]
        pads = [[torch.nn.Parameter(torch.zeros(max(sizes) - n, device=params[0].device))] if n < max(sizes) else []
                for n in sizes]
        self.bufs = [StepBuffer([params[i] for i in g] + pad, max_slots=max_slots)
                     for g, pad in zip(self.groups, pads)]
        self.codecs = [PseudoGradCodec(codec, b.grad_numel, b.flat.device) for b in self.bufs]

    def buffer(self, step: int) -> StepBuffer:
        return self.bufs[self.schedule.fragment(step)]

    def reduce(self, comm: Communicator, buf: StepBuffer, r: Round) -> None:
        self.codecs[self.bufs.index(buf)].reduce(comm, buf.flat, contribute=r.contribute, timeout=r.timeout,
                                                 world=r.world, header=r.header)

    def apply(self, step: int, buf: StepBuffer, update: Callable[[], None]) -> None:
        mine = set(self.groups[self.schedule.fragment(step)])
        others = [(p, p.grad) for i, p in enumerate(self.params) if i not in mine]
        for p, _ in others:
            p.grad = None
        try:
            update()
        finally:
            for p, g in others:
                p.grad = g

    def load(self, step: int, mine: list[torch.nn.Parameter]) -> StepBuffer:
        """Sync `step`'s buffer with this replica's pseudo-gradient (global minus `mine`, the
        local weights; this rank's shards of them in an FSDP replica) in it."""
        buf, idx = self.buffer(step), self.groups[self.schedule.fragment(step)]
        for p in buf.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [local(p.grad) for p in buf.params[:len(idx)] if p.grad is not None]
        pseudo_gradient([local(self.params[i].detach()) for i in idx], [local(mine[i].detach()) for i in idx], grads)
        for p in buf.params[len(idx):]:   # the pad, if any
            assert p.grad is not None
            p.grad.zero_()
        return buf


class DiLoCo(Front):
    """DiLoCo around an ordinary loop (``p2pft.trainer.DiLoCo``), for a replica of one rank or
    one rank of an FSDP replica (an *island*: pass its ``data_server`` and ``group``, or build it
    with ``DiLoCo.launch``; rank i syncs its shards with rank i of the other islands).

    ``begin()`` gives the samples of one inner step ([] while the replica contributes nothing);
    ``commit()`` takes the inner optimizer step and, every ``span`` of them, the sync. ``options``
    as every algorithm's (``lr_scheduler``, ``grad_scaler``, ``grad_hook``, ``after_step`` act
    on the inner step; ``lr_policy`` on the outer one, ``none`` by default); ``total_steps``
    counts inner steps (a multiple of the span)."""

    def __init__(self, runtime: Runtime | None, model: torch.nn.Module, inner_optimizer: torch.optim.Optimizer,
                 options: Options | None = None, *, sync_every: int, outer_optimizer: OuterFactory = outer_sgd,
                 fragments: int = 1, overlap: int = 0, alpha: float = 0.0, compression: str = "none",
                 outer_lr_scheduler: Callable[[torch.optim.Optimizer], LRSchedulerLike] | None = None,
                 outer_grad_hook: GradHook | None = None, data_server: DataServer | None = None,
                 group: ProcessGroup | None = None, partial_spans: bool = True, **overrides: object) -> None:
        opts = Options.of(options, **overrides)
        self.schedule = s = FragmentSchedule(sync_every, fragments, overlap, alpha)
        codec = Compression.parse(compression)
        if not callable(outer_optimizer):
            raise TypeError("outer_optimizer must be a factory: params -> torch.optim.Optimizer")
        self.inner_opt = inner_optimizer
        self.global_model = glob = global_copy(model)  # the global weights: what syncs update and snapshots carry
        gparams = [p for p in glob.parameters() if p.requires_grad]
        self._local = [p for p in model.parameters() if p.requires_grad]
        outer = outer_optimizer(gparams)
        if {id(p) for g in outer.param_groups for p in g["params"]} != {id(p) for p in gparams}:
            raise ValueError("the outer optimizer must hold exactly the parameters it is given")
        self.algorithm = FragmentMean(gparams, s, opts.max_slots, codec)
        update = UpdateRule(lr_policy=opts.lr_policy or "none", nominal_replicas=opts.nominal_replicas,
                            grad_hook=outer_grad_hook,
                            lr_scheduler=outer_lr_scheduler(outer) if outer_lr_scheduler is not None else None)
        if data_server is None:
            if runtime is None:
                raise ValueError("a one-rank DiLoCo replica needs its Runtime (an FSDP island's other ranks "
                                 "pass None with their data_server)")
            shape = Shape.one_rank(runtime)
        else:
            # A sync in the background (overlap) agrees over the island on a process group of its
            # own: the training thread's FSDP collectives run on `group` meanwhile.
            agree_on = group
            if s.overlap:
                agree_on = dist.new_group(ranks=dist.get_process_group_ranks(group) if group is not None else None)
            shape = Shape.sharded(runtime, data_server, agree_on)
        self.shape = shape
        self.owned: Shape | None = None   # what ``launch`` opened (the Runtime, the data server): closed with this
        self.kernel = shape.kernel(glob, outer, self.algorithm, opts, span=s.span, update=update)
        self.inner_step_fn = OptimizerStep(inner_optimizer, lr_policy="none", lr_scheduler=opts.lr_scheduler,
                                           grad_scaler=opts.grad_scaler, grad_hook=opts.grad_hook,
                                           after_step=opts.after_step, clip_norm=opts.clip_norm)
        self.inner_scheduler = opts.lr_scheduler
        self.spans = Spans(self.kernel, s.span, self.algorithm.bufs[0])
        # A replica back mid-span trains the rest of it and contributes at the next sync (one
        # fragment, no overlap: its pseudo-gradient then covers exactly its inner steps).
        self.kernel.early_handover = partial_spans and s.fragments == 1 and not s.overlap
        self._partial_next = False   # handed over between syncs: the next span may end early
        self.partial = PartialSpan(self.kernel, self.spans, lambda: self.algorithm.load(self.kernel.step, self._local))
        self._sched_steps = 0
        self._base = 0               # kernel step at the start of the current span
        self._contributing = False
        self._fresh = True           # local weights must restart from the global ones
        self.inner_steps_run = 0     # inner steps this process ran (kept or not)

    @classmethod
    def launch(cls, model: torch.nn.Module, inner_optimizer: torch.optim.Optimizer, options: Options | None = None,
               *, replica_id: str, listen: str, seeds: list[str], secret: bytes | None = None,
               data_host: str | None = None, runtime_kw: dict[str, Any] | None = None,
               group: ProcessGroup | None = None, **kw: Any) -> DiLoCo:
        """Collective over an FSDP island's ranks, as ``HSDP.launch``: data servers, rank 0's
        Runtime, then DiLoCo with `kw` (``sync_every``, ``fragments``, options...)."""
        shape = Shape.launch(replica_id=replica_id, listen=listen, seeds=seeds, secret=secret, data_host=data_host,
                             runtime_kw=runtime_kw, group=group)
        if "comm_timeout" in (runtime_kw or {}):   # every rank's, as rank 0's Runtime has it
            kw.setdefault("comm_timeout", (runtime_kw or {})["comm_timeout"])
        island = cls(shape.runtime, model, inner_optimizer, options, data_server=shape.data_server, group=group,
                     secret=secret, **kw)
        island.owned = shape
        return island

    @property
    def inner_step(self) -> int:
        """Inner steps in the replicated numbering: syncs at the span's start x span + this span's."""
        return self._base * self.schedule.span + self.spans.k

    def begin(self, stop: bool = False) -> list[int]:
        """This inner step's sample indices ([] = the replica contributes nothing to the next
        sync). At a span's start this is the kernel's collective begin."""
        starting = self.spans.starting
        idx = self.spans.begin(stop)
        if starting:
            # Inner steps touch only the local model: the global weights and the outer optimizer
            # (the state a joiner pulls) stay a committed state until the sync, so donors may copy
            # them meanwhile. (A pause still waits for the span's end: ``in_step`` stays set.)
            self.kernel.donor.idle()
            self._base = self.kernel.step
            was, self._contributing = self._contributing, bool(self.spans.samples)
            partial, self._partial_next = self._partial_next and self._contributing, False
            if self._contributing and (self._fresh or not was):
                self._restart_local()
            if self._contributing:
                self._advance_schedule()
            if partial:
                self.partial.start()
            if self._contributing != was:
                log.info("%s from sync %d (inner step %d)", "contributing" if self._contributing else
                         "sitting out the syncs (not a participant, or catching up)", self.step, self.inner_step)
        # Once a partial span's sync has started, the inner step in progress is dropped.
        return idx if self._contributing and not self.partial.sent else []

    def zero_grad(self) -> None:
        """Clear the local model's gradients (the inner optimizer's)."""
        self.inner_opt.zero_grad(set_to_none=True)

    def commit(self) -> DiLoCoResult:
        """The inner optimizer step; at the end of a span, the sync (its allreduce in the
        background during the last `overlap` inner steps)."""
        k, s = self.kernel, self.schedule
        if not self._contributing:
            was_synced = k.synced
            res = self.spans.round()
            self._fresh, self._base = True, k.step
            if k.synced and not was_synced:
                # Handed over between syncs (nothing applied): the span in progress is the one
                # to train, partially; at a reduced sync: the next span, whole.
                self._partial_next = not res.committed
                self._await_promotion()
            frag = s.fragment(res.step - 1) if res.committed and res.step > 0 else None
            return DiLoCoResult(self.inner_step, k.step, False, frag, res)
        with self.partial.lock:   # a one-rank replica's partial span: its watcher may start the sync meanwhile
            if self.partial.sent:
                return self._end_partial()
            self.inner_step_fn(1)
            self.inner_steps_run += 1
            self._sched_steps += self.inner_scheduler is not None
            due = self.spans.stepped()
            if due:   # the span is whole: the watcher, which looks under this lock, starts nothing now
                self.partial.active = False
        ends = None if due else self.partial.ends_here()
        if ends is not None:
            # Back mid-span, an island: a peer has started the sync, so it ends here for us too,
            # with the inner steps taken; the samples of the others go back to the cursor.
            due = True
        short = ends or 0
        partial = self.partial.active
        if s.overlap and self.spans.k == s.send_at:
            self.spans.send(self.algorithm.load(k.step, self._local))
        if not due:
            return DiLoCoResult(self.inner_step, k.step, True)
        frag = s.fragment(self._base)
        if not s.overlap:
            self.algorithm.load(k.step, self._local)
        if partial or ends is not None:
            self._say_partial(short)
        self.partial.finish()
        res = self.spans.round(short)
        self._after_sync(frag, res)
        self._base = k.step
        return DiLoCoResult(self.inner_step, k.step, True, frag, res, short)

    def _end_partial(self) -> DiLoCoResult:
        """A one-rank replica's partial span, whose watcher started the sync from the weights of
        the last inner step: drop the inner step in progress, join the sync, merge."""
        k = self.kernel
        short = self.partial.short or 0
        self.partial.finish()
        self.inner_opt.zero_grad(set_to_none=True)
        self._say_partial(short)
        frag = self.schedule.fragment(self._base)
        res = self.spans.round()
        self._after_sync(frag, res)
        self._base = k.step
        return DiLoCoResult(self.inner_step, k.step, False, frag, res, short)

    def _say_partial(self, short: int) -> None:
        per = max(1, len(self.spans.samples) // self.schedule.span)
        log.info("sync %d: contributing a partial span (%d of %d inner steps)", self.kernel.step,
                 self.schedule.span - short // per, self.schedule.span)

    def _await_promotion(self) -> None:
        """Just caught up at this sync: the leader makes a ready joiner a participant within tens
        of ms; waiting that long lets it contribute at the next sync, not one span later."""
        rt = self.kernel.rt
        if rt is None:
            return
        me = rt.node_id
        got = rt.wait_view(lambda v: v.role_of(me) is Role.PARTICIPANT or self.kernel.stopping, PROMOTION_WAIT_S,
                           loop_timeout=self.kernel.loop_timeout)
        log.info("caught up at sync %d: %s", self.step, "a participant from this span on" if got is not None
                 else "not yet a participant; sitting out one more span")

    def _after_sync(self, frag: int, res: StepResult) -> None:
        """Merge the synced fragment into the local weights; restart all of them from the global
        ones when the sync did not hold our pseudo-gradient or other syncs were applied too."""
        if res.fast_forwarded or res.trained is None:
            self._fresh = True
            log.info("sync %d: our pseudo-gradient is not in a committed mean (fast-forwarded %d); local "
                     "weights restart from the global ones", res.step, res.fast_forwarded)
            return
        g, idx = self.algorithm.params, self.algorithm.groups[frag]
        merge([local(self._local[i].data) for i in idx], [local(g[i].data) for i in idx], self.schedule.alpha)

    def _restart_local(self) -> None:
        """Local weights <- global."""
        merge([local(p.data) for p in self._local], [local(p.data) for p in self.algorithm.params], 0.0)
        self._fresh = False

    def _advance_schedule(self) -> None:
        """The inner scheduler at the replicated inner step before a span's first inner step (a
        replica that restarted, sat out syncs or trained a partial span is behind it)."""
        target = self.step * self.schedule.span
        if self.inner_scheduler is not None and self._sched_steps < target:
            # Moved to the replicated inner step before this replica's first inner optimizer step
            # (a restart, or a replica that sat out syncs): PyTorch warns about a scheduler stepped
            # before its optimizer, which here is the point.
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before")
                while self._sched_steps < target:
                    self.inner_scheduler.step()
                    self._sched_steps += 1

    def close(self) -> None:
        self.partial.finish()
        self.spans.close()
        super().close()
        if self.owned is not None:
            self.owned.close()


def global_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model`'s trainable state that holds the global weights (what syncs update and
    snapshots carry; never run forward by DiLoCo). A plain model is deep-copied (users may
    evaluate it); an FSDP2 model, whose modules hold hooks and process groups, becomes a bare
    module tree with the same parameter and buffer names holding copies of this rank's shards."""
    if not any(hasattr(p, "_local_tensor") for p in model.parameters()):
        glob = copy.deepcopy(model)
        for p in glob.parameters():
            p.grad = None
        return glob
    root = torch.nn.Module()

    def owner(name: str) -> tuple[torch.nn.Module, str]:
        *path, leaf = name.split(".")
        m = root
        for part in path:
            if not hasattr(m, part):
                m.add_module(part, torch.nn.Module())
            m = getattr(m, part)
        return m, leaf

    with torch.no_grad():
        for name, p in model.named_parameters():
            m, leaf = owner(name)
            m.register_parameter(leaf, torch.nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad))
        for name, b in model.named_buffers():
            m, leaf = owner(name)
            m.register_buffer(leaf, b.detach().clone())
    return root


__all__ = ["DiLoCo", "DiLoCoResult", "FragmentMean", "global_copy"]
