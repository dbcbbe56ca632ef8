"""The replay oracle: a chaos run of the GPT recipe, replayed in one plain PyTorch process.

(A DiLoCo run of the recipe, ``sync_every`` in its recipe, is replayed by ``oracle_diloco.py``
from the same records.)

From the replicas' stats files alone it rebuilds what was committed: for each step, the number
of contributing replicas and each contributor's sample ranges (``tr``, confirmed after the
commit; a ``begin`` line written before the commit stands in for a contributor that was killed
between applying the step and writing its line). It then trains from the same initial weights
(same seed): for each step, each contributor's batch in slot order, with the same micro-batching,
gives a gradient; their sum over the contributor count is the mean gradient; then, written here
in plain PyTorch rather than imported, what ``trainer/kernel/optstep.py`` does: ``GradScaler`` unscale,
clipping, the scheduler's lr times the contributor factor for that step only, AdamW, the
scheduler's step. The learning rate is recomputed from the schedule, never read from the stats
(which are compared with it instead). The result is compared with the final weights a surviving
replica saved.

The contributors' gradients are summed in the ring allreduce's order: every surviving replica
records, with each commit, the ring that reduced the step (each contributing slot's data rank
and the ring's size), which covers contributors killed before they could write their own line.
So the weights agree bitwise; a step whose ring nobody recorded is summed in slot order, which
with three or more contributors agrees only to float32 rounding (``ring_order_steps`` counts).
torch is imported only when a replay runs.
"""
from __future__ import annotations

import json
import logging
import sys
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .oracle_types import (Committed, Contribution, History, OracleError, OracleResult, Ranges, compare,
                           cursor_mismatches, lr_factor, places, ring_sum, set_mean_grads)
from .records import read_stats

log = logging.getLogger(__name__)
ORACLE_SYSTEMS = ("p2pft", "failure_free")   # sync rolls back to checkpoints: its history is not one line
_places = places   # its former name


def _ranges(x: Any) -> Ranges:
    return tuple((int(a), int(b)) for a, b in x)


def _one_ring(step: int, seen: tuple[int, dict[int, int]] | None,
              ring: tuple[int, dict[int, int]]) -> tuple[int, dict[int, int]]:
    """The ring of a committed step from two replicas' records. A replica whose view did not
    show a just-promoted peer as a participant yet (it came back mid-span and contributed at
    once: docs/diloco.md, "Partial spans") names fewer slots; within one data epoch a slot's
    data rank never differs, so the record that names more is the ring."""
    if seen is None or seen == ring:
        return ring
    (w0, r0), (w1, r1) = seen, ring
    if w0 == w1 and all(r1.get(k) == v for k, v in r0.items()):
        return ring
    if w0 == w1 and all(r0.get(k) == v for k, v in r1.items()):
        return seen
    raise OracleError(f"step {step}: replicas recorded two rings, {seen} and {ring}")


def rebuild(stats_files: list[Path]) -> History:
    """The committed history of a run, from the stats files of all its process incarnations."""
    recipe: dict[str, Any] | None = None
    counts: dict[int, int] = {}
    lrs: dict[int, float] = {}
    rings: dict[int, tuple[int, dict[int, int]]] = {}
    confirmed: dict[int, dict[str, Contribution]] = defaultdict(dict)
    pending: dict[int, dict[str, Contribution]] = defaultdict(dict)
    for path in stats_files:
        src = path.name
        for rec in read_stats(path):
            kind = rec.get("kind")
            if kind == "start" and "recipe" in rec:
                if recipe is not None and rec["recipe"] != recipe:
                    raise OracleError(f"{src} ran another recipe than the other replicas")
                recipe = rec["recipe"]
            elif kind == "begin":
                pending[int(rec["step"])][src] = Contribution(src, rec.get("slot"), _ranges(rec["tr"]))
            elif kind is None and "step" in rec:
                step, c = int(rec["step"]), bool(rec.get("c"))
                if c:
                    n = int(rec["n"])
                    if counts.setdefault(step - 1, n) != n:
                        raise OracleError(f"step {step}: replicas recorded {counts[step - 1]} and {n} contributors: two "
                                          "histories (did every replica holding the state die, so that "
                                          "training began again from step 0?)")
                    if "lr" in rec:
                        lrs[step - 1] = float(rec["lr"])
                    if rec.get("sr") and rec.get("dw"):
                        ring = (int(rec["dw"]), {int(k): int(r) for k, r in rec["sr"]})
                        rings[step - 1] = _one_ring(step, rings.get(step - 1), ring)
                if rec.get("tr"):
                    if rec.get("ts") is not None:   # the step these ranges were trained for
                        idx = int(rec["ts"])
                    else:                             # lines without it: the committed or first fast-forwarded step
                        idx = step - 1 if c else step - int(rec.get("ff", 1))
                    confirmed[idx][src] = Contribution(src, rec.get("slot"), _ranges(rec["tr"]))
    if recipe is None:
        raise OracleError("no start record with a recipe: these are not gpt.py stats")
    steps, unresolved = [], []
    for idx in range(max(counts, default=-1) + 1):
        n = counts.get(idx)
        have = dict(confirmed.get(idx, {}))
        extra = [c for s, c in pending.get(idx, {}).items() if s not in have]
        if n is not None and len(have) < n and len(have) + len(extra) == n:
            have.update({c.source: c for c in extra})
        if n is None or len(have) != n:
            unresolved.append(idx)
        contribs = sorted(have.values(), key=lambda c: (c.slot if c.slot is not None else 1 << 30, c.ranges))
        steps.append(Committed(idx, n or 0, contribs, lrs.get(idx), rings.get(idx)))
    return History(recipe, steps, unresolved, {k: dict(v) for k, v in pending.items()})


def replay(history: History, targets: dict[str, tuple[int, dict[str, Any]]],
           data_dir: str | None = None, ring_order: bool = True) -> OracleResult:
    """Train the history in this process and compare with `targets` (name -> (step, params))."""
    if history.recipe.get("sync_every"):   # a DiLoCo run: a step is a sync
        from .oracle_diloco import replay_diloco
        return replay_diloco(history, targets, data_dir, ring_order)
    import time

    import torch

    from ..trainer.examples.gpt import Recipe, build, clip, forward_backward
    from ..trainer.kernel.stepbuf import StepBuffer
    t0 = time.monotonic()
    r = Recipe.from_dict(history.recipe)
    last = max((s for s, _ in targets.values()), default=0)
    if last > len(history.steps):
        raise OracleError(f"weights at step {last} but only {len(history.steps)} committed steps recorded")
    torch.set_num_threads(1)   # as the replicas: the same kernels, the same float sums
    model, opt, sched, scaler, data = build(r, data_dir)
    params = [p for p in model.parameters() if p.requires_grad]
    ring_size = StepBuffer(params).flat.numel()   # the allreduced buffer: its segments
    peak, lr_diff, in_ring_order = 0, 0.0, 0
    diffs: list[tuple[float, float]] = []
    by_step: dict[int, float] = {}
    for st in history.steps[:last]:
        if st.count < 1:
            raise OracleError(f"step {st.index} has no known contributors")
        grads = []
        for c in st.contributions:
            opt.zero_grad(set_to_none=True)
            batch = torch.stack([data[i % len(data)] for a, b in c.ranges for i in range(a, b)])
            forward_backward(model, batch, r, scaler)
            grads.append(torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                                    for p in params]))
        total, exact = ring_sum(grads, places(st) if ring_order else None, ring_size)
        in_ring_order += exact
        set_mean_grads(params, total, st.count)
        used = _optimizer_step(opt, sched, scaler, lambda: clip(model, r), r, st.count, peak)
        peak = max(peak, st.count)
        if st.recorded_lr is not None:
            lr_diff = max(lr_diff, abs(used - st.recorded_lr))
        opt.zero_grad(set_to_none=True)
        for name, (step, theirs) in targets.items():
            if step == st.index + 1:
                diffs.append(compare(model, theirs))
                by_step[step] = max(by_step.get(step, 0.0), diffs[-1][0])
    return OracleResult(steps=last, compared=sorted(targets), max_abs_diff=max((d[0] for d in diffs), default=0.0),
                        max_rel_diff=max((d[1] for d in diffs), default=0.0),
                        abs_diff_by_step=dict(sorted(by_step.items())), lr_max_abs_diff=lr_diff,
                        unresolved_steps=sum(1 for i in history.unresolved if i < last), ring_order_steps=in_ring_order,
                        cursor_mismatches=cursor_mismatches(history, last, int(history.recipe["batch"])), seconds=round(time.monotonic() - t0, 1))


def _optimizer_step(opt: Any, sched: Any, scaler: Any, hook: Any, r: Any, count: int, peak: int) -> float:
    """One step as trainer/kernel/optstep.py defines it; returns the lr of param group 0 it ran with."""
    factor = lr_factor(r.lr_policy, count, r.replicas if r.replicas else max(peak, count))
    if scaler is not None:
        scaler.unscale_(opt)
    hook()
    base = [g["lr"] for g in opt.param_groups]
    for g, lr in zip(opt.param_groups, base):
        g["lr"] = lr * factor
    used = float(opt.param_groups[0]["lr"])
    if scaler is not None:
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()
    for g, lr in zip(opt.param_groups, base):
        g["lr"] = lr
    sched.step()
    return used


def check_run(run_dir: Path, data_dir: str | None = None, ring_order: bool = True) -> OracleResult:
    """Replay a run folder (``r<i>-<incarnation>.jsonl`` stats, ``.pt`` final weights) and compare
    with every replica that saved weights at the end."""
    import torch
    stats = sorted(run_dir.glob("r*-*.jsonl"))
    weights = sorted(run_dir.glob("r*-*.pt"))
    if not stats:
        raise OracleError(f"no stats files in {run_dir}")
    if not weights:
        raise OracleError(f"no final weights in {run_dir}: no replica survived to the end?")
    targets = {}
    for w in weights:
        saved = torch.load(w, map_location="cpu")
        targets[w.name] = (int(saved["step"]), saved["params"])
    return replay(rebuild(stats), targets, data_dir, ring_order)


def add_to_report(report: dict[str, Any], runs_dir: Path) -> None:
    """Fill the oracle columns of the systems whose history is a single line of commits."""
    for row in report["systems"]:
        if row["system"] not in ORACLE_SYSTEMS:
            continue
        try:
            row.update(check_run(runs_dir / row["system"]).row())
        except OracleError as exc:
            log.warning("oracle for %s: %s", row["system"], exc)
            row["oracle_error"] = str(exc)


def main(argv: list[str] | None = None) -> int:
    """``python -m p2pft.chaos.oracle RUN_DIR``: replay one run folder and print the result."""
    import argparse
    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("run_dir", type=Path, help="a folder of r<i>-<incarnation>.jsonl stats and .pt weights")
    p.add_argument("--slot-order", action="store_true", help="sum in slot order, not the ring's (rounding shows)")
    p.add_argument("--data-dir", default=None)
    args = p.parse_args(argv)
    try:
        result = check_run(args.run_dir, args.data_dir, ring_order=not args.slot_order)
    except OracleError as exc:
        print(f"oracle: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(asdict(result), indent=1))
    return 0


__all__ = ["Committed", "Contribution", "History", "OracleError", "OracleResult", "add_to_report", "check_run",
           "rebuild", "replay"]

if __name__ == "__main__":
    sys.exit(main())
