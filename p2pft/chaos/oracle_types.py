"""What the replay oracles share: the rebuilt history of a run, the result, and the sums and
comparisons that make a replay bitwise (the ring's summation order)."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

Ranges = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Contribution:
    source: str              # the stats file (one process incarnation)
    slot: int | None
    ranges: Ranges


@dataclass
class Committed:
    """One committed step as every replica applied it."""

    index: int               # 0-based: the step that took the replicas from `index` to `index + 1`
    count: int
    contributions: list[Contribution]
    recorded_lr: float | None = None
    ring: tuple[int, dict[int, int]] | None = None   # (ring size, slot -> data rank) that reduced it


@dataclass
class History:
    recipe: dict[str, Any]
    steps: list[Committed]
    unresolved: list[int] = field(default_factory=list)   # steps whose contributors are not all known
    ran: dict[int, dict[str, Contribution]] = field(default_factory=dict)   # step -> `begin` lines, by source


@dataclass
class OracleResult:
    steps: int                       # steps replayed
    compared: list[str]              # weight files compared (survivors)
    max_abs_diff: float
    max_rel_diff: float              # max over tensors of max|diff| / max|oracle weight|
    abs_diff_by_step: dict[int, float]   # the largest abs difference at each compared step
    lr_max_abs_diff: float           # recomputed lr vs the lr the replicas recorded
    unresolved_steps: int
    ring_order_steps: int            # steps summed in the ring's order (the others: in slot order)
    cursor_mismatches: int           # contributor ranges that are not the data cursor's assignment
    seconds: float

    def row(self) -> dict[str, Any]:
        return {f"oracle_{k}": v for k, v in asdict(self).items()}


class OracleError(RuntimeError):
    """The stats do not describe a replayable run (no recipe, missing steps, no weights)."""


def places(st: Committed) -> tuple[int, list[int]] | None:
    """(ring size, each contribution's data rank) in the ring that reduced the step; None when
    that ring was not recorded or does not place every contribution."""
    if st.ring is None:
        return None
    world, ranks = st.ring
    if any(c.slot not in ranks for c in st.contributions):
        return None
    return world, [ranks[c.slot] for c in st.contributions]  # type: ignore[index]


def ring_sum(grads: list[Any], ring: tuple[int, list[int]] | None, size: int) -> tuple[Any, bool]:
    """The sum of the contributors' flat gradients. In the ring's order when every contributor
    has its place (segment k of the buffer is summed from data rank k onwards, around the ring;
    ranks that did not contribute add zeros): then bitwise what the replicas applied.
    Otherwise in slot order."""
    import torch

    from ..transport.ring import segments
    if ring is None or len(set(ring[1])) != len(grads):
        total = torch.zeros_like(grads[0])
        for g in grads:
            total.add_(g)
        return total, False
    world, ranks = ring
    by_rank = dict(zip(ranks, grads))
    n = grads[0].numel()
    total = torch.empty_like(grads[0])
    for k, (off, ln) in enumerate(segments(size * 4, 4, world)):
        a, b = min(off // 4, n), min((off + ln) // 4, n)
        if a >= b:
            continue
        acc = by_rank[k][a:b].clone() if k in by_rank else torch.zeros(b - a)
        for j in range(1, world):
            g = by_rank.get((k + j) % world)
            acc = acc + (g[a:b] if g is not None else torch.zeros(b - a))
        total[a:b] = acc
    return total, True


def compare(model: Any, theirs: dict[str, Any]) -> tuple[float, float]:
    abs_d, rel_d = 0.0, 0.0
    for name, p in model.named_parameters():
        d = float((p.detach() - theirs[name]).abs().max())
        abs_d = max(abs_d, d)
        rel_d = max(rel_d, d / max(float(p.detach().abs().max()), 1e-30))
    return abs_d, rel_d


def lr_factor(policy: str, count: int, planned: int) -> float:
    """The learning-rate factor trainer/kernel/optstep.py applies for `count` contributors of `planned`."""
    return {"none": 1.0, "linear": count / planned, "sqrt": math.sqrt(count / planned)}[policy]


def set_mean_grads(params: list[Any], total: Any, count: float) -> None:
    """Each parameter's gradient: its segment of the summed flat buffer over the contributors
    (their count, less the untrained fraction of partial ones: ``partial_divisor``)."""
    import torch
    off = 0
    for p in params:
        p.grad = torch.div(total[off:off + p.numel()], float(count)).view(p.shape)
        off += p.numel()


def untrained(c: Contribution, samples_per_slot: int) -> int:
    """Samples of its slot's assignment a contribution left untrained (a DiLoCo partial span)."""
    return samples_per_slot - sum(b - a for a, b in c.ranges)


def partial_divisor(contributions: list[Contribution], samples_per_slot: int) -> float:
    """What the kernel divides a sum by (``Entry.divisor``): the contributor count, less the
    untrained fraction of partial contributions; the count itself when every one is whole."""
    short = sum(untrained(c, samples_per_slot) for c in contributions)
    return float(len(contributions)) if not short else len(contributions) - short / samples_per_slot


def cursor_mismatches(history: History, upto: int, samples_per_slot: int) -> int:
    """Check the rebuilt ranges against the replicated data cursor run over the same masks (a
    slot takes `samples_per_slot` samples a step: the batch, or H batches for a DiLoCo sync; a
    partial contribution the first of them, its untrained rest handed out again)."""
    from ..trainer.kernel.cursor import DataCursor
    cur = DataCursor(samples_per_slot)
    bad = 0
    for st in history.steps[:upto]:
        slots = [c.slot for c in st.contributions]
        if any(s is None for s in slots):
            bad += 1
            continue
        short = {c.slot: untrained(c, samples_per_slot) for c in st.contributions if c.slot is not None}
        short = {s: n for s, n in short.items() if n}
        bad += sum(1 for c in st.contributions if c.slot is not None
                   and tuple(map(tuple, cur.trained(c.slot, short.get(c.slot, 0)))) != c.ranges)
        try:
            cur.commit([i in slots for i in range(cur.max_slots)], short)
        except ValueError:   # a contribution that claims more samples than a slot has, or none
            bad += 1
    return bad
