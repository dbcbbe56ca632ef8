"""The replicated data cursor: which samples each slot trains on, and what a commit consumed.

Every replica holds the same cursor and applies the same contribution mask after each committed
allreduce, so all replicas agree on the state without exchanging it. Samples whose slot did not
contribute (a replica died mid-step, a slot was empty) become *holes* and are handed out again
before any fresh sample, so each sample is trained exactly once over the committed steps even
when steps are retried or the set of participants changes.

The stream is the non-negative integers; a dataset maps an index to a sample modulo its length.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

Range = tuple[int, int]


class CursorOverflowError(RuntimeError):
    """Too many disjoint holes: the participants' slots are too fragmented to track."""


def _append_merged(out: list[Range], start: int, end: int) -> None:
    """Append [start, end) to a sorted range list, merging with the last range if adjacent."""
    if start >= end:
        return
    if out and out[-1][1] == start:
        out[-1] = (out[-1][0], end)
    else:
        out.append((start, end))


def _is_true(value: bool | int | float, slot: int) -> bool:
    """Read one mask entry; floats come from an allreduced tail, so 1.0 means contributed."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"mask[{slot}] = {value!r}: expected a bool or a non-negative number")
        return value > 0.5
    raise ValueError(f"mask[{slot}] has type {type(value).__name__}: expected bool, int or float")


class DataCursor:
    """Assigns sample ranges to slots and advances deterministically on each committed mask."""

    def __init__(self, batch_per_slot: int, max_slots: int = 256, max_holes: int | None = None) -> None:
        if isinstance(batch_per_slot, bool) or not isinstance(batch_per_slot, int) or batch_per_slot < 1:
            raise ValueError(f"batch_per_slot must be a positive int, got {batch_per_slot!r}")
        if isinstance(max_slots, bool) or not isinstance(max_slots, int) or max_slots < 1:
            raise ValueError(f"max_slots must be a positive int, got {max_slots!r}")
        if max_holes is None:
            max_holes = 4 * max_slots
        if isinstance(max_holes, bool) or not isinstance(max_holes, int) or max_holes < 1:
            raise ValueError(f"max_holes must be a positive int, got {max_holes!r}")
        self.batch_per_slot = batch_per_slot
        self.max_slots = max_slots
        self.max_holes = max_holes
        self.frontier = 0
        self.holes: list[Range] = []

    # ----------------------------------------------------------------- queries
    @property
    def hole_samples(self) -> int:
        """Number of samples below the frontier that still wait to be trained."""
        return sum(e - s for s, e in self.holes)

    def _map_positions(self, positions: Sequence[Range]) -> list[Range]:
        """Map sorted ranges of positions in "holes, then [frontier, inf)" to sample ranges."""
        out: list[Range] = []
        holes = self.holes
        total_holes = self.hole_samples
        hi = 0
        hole_pos = 0  # position of holes[hi][0] in the sequence
        for pstart, pend in positions:
            p = pstart
            while p < pend:
                while hi < len(holes) and hole_pos + (holes[hi][1] - holes[hi][0]) <= p:
                    hole_pos += holes[hi][1] - holes[hi][0]
                    hi += 1
                if hi < len(holes):
                    hstart, hend = holes[hi]
                    start = hstart + (p - hole_pos)
                    take = min(pend - p, hole_pos + (hend - hstart) - p)
                else:
                    start = self.frontier + (p - total_holes)
                    take = pend - p
                _append_merged(out, start, start + take)
                p += take
        return out

    def _check_slot(self, slot: int) -> None:
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < self.max_slots:
            raise ValueError(f"slot must be an int in [0, {self.max_slots}), got {slot!r}")

    def assign(self, slot: int) -> list[Range]:
        """The half-open sample ranges slot `slot` trains on at the current state."""
        self._check_slot(slot)
        b = self.batch_per_slot
        return self._map_positions([(slot * b, (slot + 1) * b)])

    def indices(self, slot: int) -> list[int]:
        """`assign(slot)` flattened to a list of sample indices (exactly batch_per_slot of them)."""
        return [i for start, end in self.assign(slot) for i in range(start, end)]

    def _contributors(self, mask: Sequence[bool | int | float]) -> list[int]:
        if len(mask) != self.max_slots:
            raise ValueError(f"mask has {len(mask)} entries, expected max_slots = {self.max_slots}")
        return [i for i, v in enumerate(mask) if _is_true(v, i)]

    def _used(self, contributors: list[int], short: Mapping[int, int] | None) -> list[Range]:
        """Positions the contributors trained: each slot's batch, less the untrained tail of a
        partial one (`short`: slot -> samples left at the end of its batch)."""
        b = self.batch_per_slot
        used: list[Range] = []
        for slot in contributors:
            n = (short or {}).get(slot, 0)
            if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n < b:
                raise ValueError(f"slot {slot} left {n!r} samples untrained: expected an int in [0, {b})")
            _append_merged(used, slot * b, (slot + 1) * b - n)
        return used

    def consumed(self, mask: Sequence[bool | int | float], short: Mapping[int, int] | None = None) -> list[Range]:
        """The sample ranges a commit with `mask` (and `short`) would mark as trained (sorted, merged)."""
        return self._map_positions(self._used(self._contributors(mask), short))

    def trained(self, slot: int, short: int = 0) -> list[Range]:
        """The ranges of `assign(slot)` a contribution that left `short` samples untrained trained."""
        return self._map_positions(self._used([slot], {slot: short} if short else None))

    # ----------------------------------------------------------------- update
    def commit(self, mask: Sequence[bool | int | float], short: Mapping[int, int] | None = None) -> None:
        """Mark the pieces of slots with a true mask entry as trained; skipped pieces, and the
        untrained tail of a partial contribution (`short`: slot -> samples), become holes.

        The state is unchanged if the mask is invalid or the hole list would overflow, so a replica
        never ends up half-updated.
        """
        contributors = self._contributors(mask)
        if not contributors:
            return  # a failed step consumes nothing
        used = self._used(contributors, short)
        end_pos = used[-1][1]
        total_holes = self.hole_samples
        # Positions left untrained: the gaps between contributors, and any holes past the last one.
        unused: list[Range] = []
        cursor = 0
        for start, end in used:
            _append_merged(unused, cursor, start)
            cursor = end
        _append_merged(unused, cursor, max(cursor, total_holes))
        new_holes = self._map_positions(unused)
        new_frontier = max(self.frontier, self.frontier + end_pos - total_holes)
        if len(new_holes) > self.max_holes:
            raise CursorOverflowError(
                f"commit would leave {len(new_holes)} disjoint holes, more than max_holes = "
                f"{self.max_holes}; slots are too fragmented (assign slots densely from 0)"
            )
        self.holes = new_holes
        self.frontier = new_frontier

    # ----------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """Plain ints and lists, so the cursor travels in msgpack with the rest of the state."""
        return {
            "batch_per_slot": self.batch_per_slot,
            "max_slots": self.max_slots,
            "max_holes": self.max_holes,
            "frontier": self.frontier,
            "holes": [[s, e] for s, e in self.holes],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace the state; the configuration in `state` must match this cursor's."""
        for key in ("batch_per_slot", "max_slots"):
            if state.get(key) != getattr(self, key):
                raise ValueError(
                    f"cursor state has {key} = {state.get(key)!r}, this cursor has {getattr(self, key)!r}"
                )
        frontier = state.get("frontier")
        if isinstance(frontier, bool) or not isinstance(frontier, int) or frontier < 0:
            raise ValueError(f"cursor state frontier must be a non-negative int, got {frontier!r}")
        raw = state.get("holes")
        if not isinstance(raw, (list, tuple)):
            raise ValueError(f"cursor state holes must be a list of [start, end] pairs, got {raw!r}")
        holes: list[Range] = []
        prev_end = -1
        for item in raw:
            if (
                not isinstance(item, (list, tuple))
                or len(item) != 2
                or not all(isinstance(x, int) and not isinstance(x, bool) for x in item)
            ):
                raise ValueError(f"cursor state hole {item!r} is not an [start, end] int pair")
            start, end = item
            if not (0 <= start < end <= frontier) or start <= prev_end:
                raise ValueError(
                    f"cursor state holes must be sorted, disjoint, non-adjacent, non-empty and "
                    f"below frontier {frontier}; got {item!r} after end {prev_end}"
                )
            holes.append((start, end))
            prev_end = end
        max_holes = state.get("max_holes", self.max_holes)
        if len(holes) > max_holes:
            raise ValueError(f"cursor state has {len(holes)} holes, more than max_holes = {max_holes}")
        self.max_holes = max_holes
        self.frontier = frontier
        self.holes = holes

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> DataCursor:
        """Build a cursor with the configuration and state recorded in `state`."""
        try:
            cursor = cls(state["batch_per_slot"], state["max_slots"], state.get("max_holes"))
        except KeyError as exc:
            raise ValueError(f"cursor state is missing {exc.args[0]!r}") from None
        cursor.load_state_dict(state)
        return cursor

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DataCursor):
            return NotImplemented
        return self.state_dict() == other.state_dict()

    __hash__ = None  # type: ignore[assignment]  # mutable

    def __repr__(self) -> str:
        return (
            f"DataCursor(batch_per_slot={self.batch_per_slot}, max_slots={self.max_slots}, "
            f"frontier={self.frontier}, holes={self.holes})"
        )
