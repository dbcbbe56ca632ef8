"""The replay oracle for a DiLoCo run of the GPT recipe (``gpt.py --sync-every H``).

From the same records as a synchronous run (``oracle.rebuild``: per sync, its contributor count,
each contributor's span ranges, the ring that reduced it, and every span a process began), one
plain PyTorch process replays it: a local model, inner AdamW and LambdaLR per replica process
(per stats file: a restarted replica starts with fresh ones, as it does), for each sync each
process that ran a span restarts its local weights from the global ones, advances its inner
schedule to the replicated inner step (sync x H) and runs its H inner steps (AMP, clipping as
the recipe says; a partial span, of a replica back mid-span, the first k of them); the
pseudo-gradients (global minus local) of the processes in the committed mean are summed in the
ring's order and divided by the count (less the untrained fraction of partial spans), and the outer Nesterov SGD (its lr
times the contributor factor) moves the global weights. A span that ran but is not in the mean
(its sync fast-forwarded) still advances that process's AdamW, as it did in the replica. The
global weights are compared with the final weights the survivors saved.
"""
from __future__ import annotations

import copy
import time
import warnings
from dataclasses import dataclass
from typing import Any

from .oracle_types import (Contribution, History, OracleError, OracleResult, compare, cursor_mismatches, lr_factor,
                           partial_divisor, places, ring_sum, set_mean_grads)


@dataclass
class _Inner:
    """One replica process's inner loop: its local model and optimizer state."""

    model: Any
    opt: Any
    sched: Any
    scaler: Any
    sched_steps: int = 0


def replay_diloco(history: History, targets: dict[str, tuple[int, dict[str, Any]]],
                  data_dir: str | None = None, ring_order: bool = True) -> OracleResult:
    """Replay the syncs of `history` and compare with `targets` (name -> (sync, params))."""
    import torch

    from ..trainer.examples.gpt import Recipe, build, clip, forward_backward, optimizer
    from ..trainer.algorithms.outer import outer_sgd
    from ..trainer.kernel.stepbuf import StepBuffer
    t0 = time.monotonic()
    r = Recipe.from_dict(history.recipe)
    h = r.sync_every
    last = max((s for s, _ in targets.values()), default=0)
    if last > len(history.steps):
        raise OracleError(f"weights at sync {last} but only {len(history.steps)} committed syncs recorded")
    torch.set_num_threads(1)
    glob, _, _, _, data = build(r, data_dir)
    params = [p for p in glob.parameters() if p.requires_grad]
    outer = outer_sgd(params, lr=r.outer_lr, momentum=r.outer_momentum)
    ring_size = StepBuffer(params).flat.numel()
    procs: dict[str, _Inner] = {}
    peak, lr_diff, in_ring_order = 0, 0.0, 0
    diffs: list[tuple[float, float]] = []
    by_step: dict[int, float] = {}
    for st in history.steps[:last]:
        if st.count < 1:
            raise OracleError(f"sync {st.index} has no known contributors")
        mean = {c.source for c in st.contributions}
        spans: dict[str, Contribution] = {**history.ran.get(st.index, {}), **{c.source: c for c in st.contributions}}
        pseudo: dict[str, Any] = {}
        for src in sorted(spans):
            inner = procs.get(src)
            if inner is None:
                m = copy.deepcopy(glob)
                opt, sched = optimizer(m, r)
                inner = procs[src] = _Inner(m, opt, sched, torch.amp.GradScaler("cpu") if r.amp == "fp16" else None)
            _span(inner, glob, st.index * h, spans[src], h, r, data, clip, forward_backward)
            if src in mean:
                pseudo[src] = torch.cat([(g.detach() - lp.detach()).reshape(-1)
                                         for g, lp in zip(params, inner.model.parameters())])
        grads = [pseudo[c.source] for c in st.contributions]
        total, exact = ring_sum(grads, places(st) if ring_order else None, ring_size)
        in_ring_order += exact
        # A partial span (a replica back mid-span) counts as the fraction of the span it trained.
        set_mean_grads(params, total, partial_divisor(st.contributions, h * r.batch))
        factor = lr_factor(r.lr_policy, st.count, r.replicas if r.replicas else max(peak, st.count))
        peak = max(peak, st.count)
        base = [g["lr"] for g in outer.param_groups]
        for g, lr in zip(outer.param_groups, base):
            g["lr"] = lr * factor
        used = float(outer.param_groups[0]["lr"])
        outer.step()
        for g, lr in zip(outer.param_groups, base):
            g["lr"] = lr
        outer.zero_grad(set_to_none=True)
        if st.recorded_lr is not None:
            lr_diff = max(lr_diff, abs(used - st.recorded_lr))
        for step, theirs in targets.values():
            if step == st.index + 1:
                diffs.append(compare(glob, theirs))
                by_step[step] = max(by_step.get(step, 0.0), diffs[-1][0])
    return OracleResult(steps=last, compared=sorted(targets), max_abs_diff=max((d[0] for d in diffs), default=0.0),
                        max_rel_diff=max((d[1] for d in diffs), default=0.0),
                        abs_diff_by_step=dict(sorted(by_step.items())), lr_max_abs_diff=lr_diff,
                        unresolved_steps=sum(1 for i in history.unresolved if i < last), ring_order_steps=in_ring_order,
                        cursor_mismatches=cursor_mismatches(history, last, r.batch * h), seconds=round(time.monotonic() - t0, 1))


def fast_forward(inner: _Inner, first: int) -> None:
    """Advance a process's inner schedule to inner step `first`, as the replica does before its
    first inner step (trainer/algorithms/diloco.py): PyTorch warns that a schedule steps before its
    optimizer has; that is the point here, so the warning is silenced at this call."""
    if inner.sched_steps >= first:
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before")
        while inner.sched_steps < first:
            inner.sched.step()
            inner.sched_steps += 1


def _span(inner: _Inner, glob: Any, first: int, c: Contribution, h: int, r: Any, data: Any,
          clip: Any, forward_backward: Any) -> None:
    """One process's span from the global weights: H inner steps as trainer/kernel/optstep.py takes
    them (unscale, clip, AdamW, the schedule's step), written out here."""
    import torch
    with torch.no_grad():
        for lp, gp in zip(inner.model.parameters(), glob.parameters()):
            lp.copy_(gp)
    fast_forward(inner, first)   # a process that starts contributing: the replicated inner step
    idx = [i for a, b in c.ranges for i in range(a, b)]
    if not 0 < len(idx) <= h * r.batch or len(idx) % r.batch:
        raise OracleError(f"{c.source}: a span of {len(idx)} samples, not up to H x batch = {h * r.batch}")
    for k in range(len(idx) // r.batch):   # H inner steps, fewer for a partial span
        inner.opt.zero_grad(set_to_none=True)
        batch = torch.stack([data[i % len(data)] for i in idx[k * r.batch:(k + 1) * r.batch]])
        forward_backward(inner.model, batch, r, inner.scaler)
        if inner.scaler is not None:
            inner.scaler.unscale_(inner.opt)
        clip(inner.model, r)
        if inner.scaler is not None:
            inner.scaler.step(inner.opt)
            inner.scaler.update()
        else:
            inner.opt.step()
        inner.sched.step()
        inner.sched_steps += 1
