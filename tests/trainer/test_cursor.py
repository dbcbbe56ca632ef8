"""DataCursor: every sample trained exactly once over the committed steps."""
from __future__ import annotations

from collections import Counter

import msgpack
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from p2pft.trainer.kernel.cursor import CursorOverflowError, DataCursor


def _mask(max_slots: int, true_slots: set[int] | list[int]) -> list[bool]:
    return [i in set(true_slots) for i in range(max_slots)]


def test_fresh_cursor_hands_out_consecutive_batches() -> None:
    c = DataCursor(batch_per_slot=4, max_slots=8)
    assert [c.assign(i) for i in range(3)] == [[(0, 4)], [(4, 8)], [(8, 12)]]
    c.commit(_mask(8, {0, 1, 2}))
    assert c.frontier == 12 and c.holes == []
    assert c.assign(0) == [(12, 16)]
    assert c.indices(1) == [16, 17, 18, 19]


def test_skipped_slot_becomes_hole_and_is_reissued_first() -> None:
    c = DataCursor(batch_per_slot=4, max_slots=8)
    c.commit(_mask(8, {0, 2}))  # slot 1 died mid-step
    assert c.frontier == 12
    assert c.holes == [(4, 8)]
    assert c.assign(0) == [(4, 8)]
    assert c.assign(1) == [(12, 16)]
    c.commit(_mask(8, {0, 1}))
    assert c.holes == [] and c.frontier == 16


def test_piece_spans_several_holes_and_the_frontier() -> None:
    c = DataCursor(batch_per_slot=3, max_slots=8)
    c.load_state_dict({"batch_per_slot": 3, "max_slots": 8, "frontier": 20, "holes": [[2, 4], [10, 11], [15, 17]]})
    assert c.assign(0) == [(2, 4), (10, 11)]
    assert c.assign(1) == [(15, 17), (20, 21)]
    assert c.assign(2) == [(21, 24)]
    c.commit(_mask(8, {1}))
    assert c.holes == [(2, 4), (10, 11)]
    assert c.frontier == 21


def test_failed_step_changes_nothing_and_retry_sees_same_assignment() -> None:
    c = DataCursor(batch_per_slot=2, max_slots=4)
    c.commit(_mask(4, {0, 2}))
    before = c.state_dict()
    pieces = [c.assign(i) for i in range(4)]
    c.commit([0.0, 0.0, 0.0, 0.0])
    assert c.state_dict() == before
    assert [c.assign(i) for i in range(4)] == pieces


def test_float_mask_from_allreduced_tail() -> None:
    c = DataCursor(batch_per_slot=2, max_slots=4)
    c.commit([1.0, 0.0, 1.0, 0.0])
    assert c.holes == [(2, 4)] and c.frontier == 6


@pytest.mark.parametrize(
    "mask, message",
    [([True] * 3, "expected max_slots = 4"), ([1.0, float("nan"), 0, 0], "mask\\[1\\]"), ([1, "x", 0, 0], "type str")],
)
def test_bad_mask_is_rejected(mask: list, message: str) -> None:
    c = DataCursor(batch_per_slot=2, max_slots=4)
    with pytest.raises(ValueError, match=message):
        c.commit(mask)


@pytest.mark.parametrize("kwargs", [{"batch_per_slot": 0}, {"batch_per_slot": 2, "max_slots": 0},
                                    {"batch_per_slot": 1.5}])
def test_bad_config_is_rejected(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        DataCursor(**kwargs)


def test_a_partial_contribution_leaves_its_untrained_tail_to_be_trained_again() -> None:
    c = DataCursor(batch_per_slot=4, max_slots=4)
    c.commit(_mask(4, {0, 1, 2}), {0: 3, 2: 1})   # slot 0 trained 1 sample, slot 2 trained 3
    assert c.holes == [(1, 4)] and c.frontier == 11   # slot 2's last sample was never handed out
    assert c.assign(0) == [(1, 4), (11, 12)]
    with pytest.raises(ValueError, match="untrained"):
        c.commit(_mask(4, {0}), {0: 4})   # a contributor that trained nothing is not one
    assert c.holes == [(1, 4)] and c.frontier == 11


def test_bad_slot_is_rejected() -> None:
    c = DataCursor(batch_per_slot=2, max_slots=4)
    with pytest.raises(ValueError, match="slot must be an int in \\[0, 4\\)"):
        c.assign(4)


def test_hole_overflow_raises_and_leaves_state_intact() -> None:
    c = DataCursor(batch_per_slot=1, max_slots=8, max_holes=2)
    c.commit(_mask(8, {1, 3}))  # holes [0,1), [2,3)
    before = c.state_dict()
    with pytest.raises(CursorOverflowError, match="max_holes = 2"):
        c.commit(_mask(8, {2, 4, 6}))
    assert c.state_dict() == before


@pytest.mark.parametrize(
    "holes",
    [[[3, 2]], [[0, 2], [2, 4]], [[5, 6], [0, 1]], [[0, 11]], [[0, 1.5]]],
)
def test_load_rejects_inconsistent_holes(holes: list) -> None:
    c = DataCursor(batch_per_slot=2, max_slots=4)
    with pytest.raises(ValueError, match="hole"):
        c.load_state_dict({"batch_per_slot": 2, "max_slots": 4, "frontier": 10, "holes": holes})


def test_load_rejects_other_configuration() -> None:
    with pytest.raises(ValueError, match="batch_per_slot"):
        DataCursor(2, 4).load_state_dict(DataCursor(3, 4).state_dict())


# One step of a run: which slots are alive, whether the allreduce failed (nothing committed), and
# per slot how many samples at the end of its batch it left untrained (a partial span; capped below
# the batch, as a contributor trained at least one sample).
step_strategy = st.tuples(st.sets(st.integers(0, 7)), st.booleans(),
                          st.lists(st.integers(0, 4), min_size=8, max_size=8))


@settings(max_examples=150, deadline=None)
@given(
    batch=st.integers(1, 5),
    max_slots=st.integers(1, 8),
    steps=st.lists(step_strategy, max_size=30),
    reload_at=st.integers(0, 30),
)
# Holes left past the last contributor of a later step must stay holes.
@example(batch=1, max_slots=4, steps=[({1, 3}, False, [0] * 8), ({0}, False, [0] * 8)], reload_at=1)
# A slot that dies, a failed retry, then the slot set shrinks.
@example(batch=2, max_slots=3, steps=[({0, 2}, False, [0] * 8), ({0, 1}, True, [0] * 8), ({1}, False, [0] * 8)],
         reload_at=0)
# The last contributor trains part of its batch: its tail stays fresh; a partial one before others: a hole.
@example(batch=4, max_slots=3, steps=[({0, 2}, False, [0, 0, 3] + [0] * 5), ({0, 1}, False, [2] + [0] * 7)],
         reload_at=1)
def test_every_sample_is_trained_exactly_once(
    batch: int, max_slots: int, steps: list[tuple[set[int], bool, list[int]]], reload_at: int
) -> None:
    cursor = DataCursor(batch, max_slots, max_holes=10_000)
    replica = DataCursor(batch, max_slots, max_holes=10_000)  # a second replica seeing the same masks
    trained: Counter[int] = Counter()
    for n, (alive, failed, shorts) in enumerate(steps):
        if n == reload_at:  # a joiner takes the replicated state in the middle of the run
            replica = DataCursor.from_state_dict(msgpack.unpackb(msgpack.packb(cursor.state_dict())))
        contributors = set() if failed else {s for s in alive if s < max_slots}
        pieces = {s: cursor.assign(s) for s in range(max_slots)}
        flat = [i for s in range(max_slots) for a, b in pieces[s] for i in range(a, b)]
        assert len(flat) == len(set(flat)) == batch * max_slots  # slots never overlap
        if cursor.holes:  # untrained samples go out before fresh ones
            assert pieces[0][0][0] == cursor.holes[0][0]
        mask = _mask(max_slots, contributors)
        short = {s: min(shorts[s], batch - 1) for s in contributors if min(shorts[s], batch - 1)}
        # A partial contributor trained the first samples of its batch, in assignment order.
        step_samples = [i for s in sorted(contributors)
                        for i in [i for a, b in pieces[s] for i in range(a, b)][:batch - short.get(s, 0)]]
        assert cursor.consumed(mask, short) == _ranges(sorted(step_samples))
        for s in contributors:
            assert cursor.trained(s, short.get(s, 0)) == _ranges(
                [i for a, b in pieces[s] for i in range(a, b)][:batch - short.get(s, 0)])
        trained.update(step_samples)
        assert all(v == 1 for v in trained.values()), "a sample was trained twice"
        cursor.commit(mask, short)
        replica.commit(mask, short)
        assert replica == cursor
        assert all(a < b <= cursor.frontier for a, b in cursor.holes)
        assert all(p[1] < q[0] for p, q in zip(cursor.holes, cursor.holes[1:]))
    in_holes = {i for a, b in cursor.holes for i in range(a, b)}
    for i in range(cursor.frontier):
        assert trained[i] == (0 if i in in_holes else 1), f"sample {i}"
    assert all(i < cursor.frontier for i in trained)
    # With every slot contributing, the holes drain first and are all gone after enough steps.
    full = [True] * max_slots
    for _ in range(-(-cursor.hole_samples // (batch * max_slots))):
        trained.update(i for a, b in cursor.consumed(full) for i in range(a, b))
        cursor.commit(full)
    assert cursor.holes == []
    assert all(trained[i] == 1 for i in range(cursor.frontier))


def _ranges(samples: list[int]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for i in samples:
        if out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out
