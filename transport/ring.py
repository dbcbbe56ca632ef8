"""Schedules of the pipelined ring: which byte ranges each rank sends and receives, in order.

Pure functions (no I/O) so they can be tested exhaustively. A tensor of `nbytes` is split into
`world` element-aligned segments; each segment into chunks of at most `chunk_bytes`. Every segment
has at least one (possibly empty) frame, so every rank hears from its left neighbour in every
step even for tensors smaller than the world; that is what carries the contributor count.

Reduce-scatter step t (0 <= t < n-1): rank r sends segment (r - t) mod n and receives and adds
segment (r - t - 1) mod n. After it, rank r holds the full sum of segment (r + 1) mod n.
All-gather step t (n-1 <= t < 2n-2), with u = t - (n-1): rank r sends segment (r + 1 - u) mod n
and receives segment (r - u) mod n. In both phases the frame sent in step t+1 for chunk c is the
frame received in step t for chunk c, which is what lets chunks flow through the ring pipelined.
Chunk c travels on lane c mod lanes, so lanes are independent rings.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Frame", "LanePlan", "segments", "allreduce_plan", "broadcast_plan"]


@dataclass(frozen=True, slots=True)
class Frame:
    step: int
    chunk: int
    off: int      # byte offset into the tensor
    nbytes: int


@dataclass(slots=True)
class LanePlan:
    """Frames of one lane: `sends` in wire order; `recvs` in wire order, each with the index in
    `sends` that it unlocks (-1: none) and whether it is added (reduce-scatter) or copied."""

    sends: list[Frame]
    first_sends: int                      # sends[:first_sends] need no input (own data)
    recvs: list[tuple[Frame, bool, int]]  # (frame, reduce, index of the send it unlocks or -1)
    packed: Any = field(default=None, repr=False)  # the same, as native.packed_plan() hands it to C


def segments(nbytes: int, itemsize: int, world: int) -> list[tuple[int, int]]:
    """Element-aligned (offset, length) in bytes of the `world` segments; lengths differ by <= 1 element."""
    if nbytes % itemsize:
        raise ValueError("tensor size is not a whole number of elements")
    nel = nbytes // itemsize
    out = []
    for i in range(world):
        a = i * nel // world
        b = (i + 1) * nel // world
        out.append((a * itemsize, (b - a) * itemsize))
    return out


def _chunks(seg: tuple[int, int], chunk_bytes: int, step: int) -> list[Frame]:
    off, ln = seg
    if ln == 0:
        return [Frame(step, 0, off, 0)]
    return [Frame(step, c, off + a, min(chunk_bytes, ln - a)) for c, a in enumerate(range(0, ln, chunk_bytes))]


def _chunk_bytes(chunk_bytes: int, itemsize: int) -> int:
    if chunk_bytes < itemsize:
        raise ValueError(f"chunk_bytes {chunk_bytes} is smaller than one element ({itemsize} bytes)")
    return chunk_bytes - chunk_bytes % itemsize


def allreduce_plan(nbytes: int, itemsize: int, world: int, rank: int, chunk_bytes: int,
                   lanes: int = 1) -> list[LanePlan]:
    """Per-lane plans of a reduce-scatter + all-gather ring allreduce (world >= 2)."""
    if world < 2:
        raise ValueError("a ring needs at least two ranks")
    cb = _chunk_bytes(chunk_bytes, itemsize)
    segs = segments(nbytes, itemsize, world)
    n = world
    plans = [LanePlan([], 0, []) for _ in range(lanes)]
    # index of (step, chunk) in its lane's send list
    send_index: dict[tuple[int, int], int] = {}
    for t in range(2 * (n - 1)):
        so = (rank - t) % n if t < n - 1 else (rank + 1 - (t - (n - 1))) % n
        for f in _chunks(segs[so], cb, t):
            p = plans[f.chunk % lanes]
            send_index[(t, f.chunk)] = len(p.sends)
            p.sends.append(f)
            if t == 0:
                p.first_sends += 1
    last = 2 * (n - 1) - 1
    for t in range(2 * (n - 1)):
        si = (rank - t - 1) % n if t < n - 1 else (rank - (t - (n - 1))) % n
        for f in _chunks(segs[si], cb, t):
            nxt = send_index[(t + 1, f.chunk)] if t < last else -1
            plans[f.chunk % lanes].recvs.append((f, t < n - 1, nxt))
    return plans


def broadcast_plan(nbytes: int, world: int, rank: int, root: int, chunk_bytes: int,
                   lanes: int = 1) -> list[LanePlan]:
    """Per-lane plans of a pipelined chain broadcast root -> root+1 -> ... -> root-1."""
    if world < 2:
        raise ValueError("a ring needs at least two ranks")
    cb = max(1, chunk_bytes)
    frames = _chunks((0, nbytes), cb, 0)
    plans = [LanePlan([], 0, []) for _ in range(lanes)]
    forwards = (rank + 1) % world != root
    for f in frames:
        p = plans[f.chunk % lanes]
        if rank == root:
            p.sends.append(f)
            p.first_sends += 1
        else:
            nxt = -1
            if forwards:
                nxt = len(p.sends)
                p.sends.append(f)
            p.recvs.append((f, False, nxt))
    return plans
