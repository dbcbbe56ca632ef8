"""Rebuilding the committed history from stats files (p2pft/chaos/oracle.py), without training."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from p2pft.chaos.oracle import OracleError, _places, rebuild

RECIPE = {"batch": 4, "seq_len": 8}


def _write(path: Path, recs: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def _start() -> dict:
    return {"kind": "start", "recipe": RECIPE, "step": 0}


def test_counts_ranges_and_slot_order(tmp_path: Path) -> None:
    a = _write(tmp_path / "r0-0.jsonl", [
        _start(),
        {"kind": "begin", "step": 0, "slot": 1, "tr": [[4, 8]]},
        {"step": 1, "c": 1, "n": 2, "lr": 0.1, "tr": [[4, 8]], "slot": 1, "ts": 0, "sr": [[0, 1], [1, 0]], "dw": 2},
    ])
    b = _write(tmp_path / "r1-0.jsonl", [
        _start(),
        {"kind": "begin", "step": 0, "slot": 0, "tr": [[0, 4]]},
        {"step": 1, "c": 1, "n": 2, "lr": 0.1, "tr": [[0, 4]], "slot": 0, "ts": 0, "sr": [[0, 1], [1, 0]], "dw": 2},
    ])
    h = rebuild([a, b])
    assert h.recipe == RECIPE and h.unresolved == []
    (st,) = h.steps
    assert st.count == 2 and st.recorded_lr == 0.1
    assert [c.ranges for c in st.contributions] == [((0, 4),), ((4, 8),)]   # slot order
    assert _places(st) == (2, [1, 0])   # a ring of 2: slot 0 is data rank 1, slot 1 data rank 0


def test_a_contributor_killed_before_its_step_line_is_taken_from_its_begin_line(tmp_path: Path) -> None:
    survivor = _write(tmp_path / "r0-0.jsonl", [
        _start(),
        {"step": 1, "c": 1, "n": 2, "tr": [[0, 4]], "slot": 0},
        {"step": 2, "c": 1, "n": 1, "tr": [[8, 12]], "slot": 0},
    ])
    killed = _write(tmp_path / "r1-0.jsonl", [_start(), {"kind": "begin", "step": 0, "slot": 1, "tr": [[4, 8]]}])
    h = rebuild([survivor, killed])
    assert h.unresolved == []
    assert [len(s.contributions) for s in h.steps] == [2, 1]
    assert h.steps[0].contributions[1].source == "r1-0.jsonl"


def test_a_killed_contributor_is_summed_in_its_ring_place_from_the_survivors_record(tmp_path: Path) -> None:
    """Killed after the allreduce but before its step line: its ring place is in the survivors'."""
    ring = {"sr": [[0, 0], [1, 2], [2, 1]], "dw": 4}   # data rank 3 is a joiner (no slot)
    survivors = [_write(tmp_path / f"r{i}-0.jsonl", [
        _start(), {"step": 1, "c": 1, "n": 3, "tr": [[4 * i, 4 * i + 4]], "slot": i, "ts": 0, **ring}])
        for i in (0, 1)]
    killed = _write(tmp_path / "r2-0.jsonl", [_start(), {"kind": "begin", "step": 0, "slot": 2, "tr": [[8, 12]]}])
    h = rebuild([*survivors, killed])
    (st,) = h.steps
    assert h.unresolved == [] and [c.slot for c in st.contributions] == [0, 1, 2]
    assert _places(st) == (4, [0, 2, 1])
    other = _write(tmp_path / "r3-0.jsonl", [_start(), {"step": 1, "c": 1, "n": 3, "sr": [[0, 1]], "dw": 4}])
    with pytest.raises(OracleError, match="two rings"):
        rebuild([*survivors, other])


def test_ranges_fast_forwarded_before_a_commit_belong_to_the_step_they_were_trained_for(tmp_path: Path) -> None:
    """r1's allreduce of step 0 failed where r0's succeeded: r1 then fast-forwards step 0 (which
    holds its gradients) and commits step 1 (which does not) in one call; its line says so."""
    ahead = _write(tmp_path / "r0-0.jsonl", [
        _start(),
        {"step": 1, "c": 1, "n": 2, "tr": [[0, 4]], "slot": 0, "ts": 0},
        {"step": 2, "c": 1, "n": 1, "tr": [[8, 12]], "slot": 0, "ts": 1},
    ])
    behind = _write(tmp_path / "r1-0.jsonl",
                    [_start(), {"step": 2, "c": 1, "n": 1, "ff": 1, "tr": [[4, 8]], "slot": 1, "ts": 0}])
    h = rebuild([ahead, behind])
    assert h.unresolved == []
    assert [[c.ranges for c in s.contributions] for s in h.steps] == [[((0, 4),), ((4, 8),)], [((8, 12),)]]


def test_fast_forwarded_ranges_belong_to_the_first_step_applied(tmp_path: Path) -> None:
    ahead = _write(tmp_path / "r0-0.jsonl", [
        _start(),
        {"step": 1, "c": 1, "n": 2, "tr": [[0, 4]], "slot": 0},
        {"step": 2, "c": 1, "n": 1, "tr": [[8, 12]], "slot": 0},
    ])
    behind = _write(tmp_path / "r1-0.jsonl",
                    [_start(), {"step": 2, "c": 0, "n": 0, "ff": 2, "tr": [[4, 8]], "slot": 1}])
    h = rebuild([ahead, behind])
    assert h.unresolved == [] and len(h.steps[0].contributions) == 2


def test_missing_contributors_and_disagreements_are_reported(tmp_path: Path) -> None:
    a = _write(tmp_path / "r0-0.jsonl", [_start(), {"step": 1, "c": 1, "n": 3, "tr": [[0, 4]], "slot": 0}])
    assert rebuild([a]).unresolved == [0]
    b = _write(tmp_path / "r1-0.jsonl", [_start(), {"step": 1, "c": 1, "n": 2}])
    with pytest.raises(OracleError, match="contributors"):
        rebuild([a, b])
    with pytest.raises(OracleError, match="recipe"):
        rebuild([_write(tmp_path / "x-0.jsonl", [{"step": 1, "c": 1, "n": 1}])])


def test_a_ring_named_by_a_view_that_had_not_seen_a_promotion_yet_is_completed(tmp_path: Path) -> None:
    """A DiLoCo replica back mid-span contributes at once; a survivor whose view still showed it as
    a joiner names fewer slots in the ring. Within one data epoch a slot's rank never differs, so
    the fuller record is the ring; two that disagree on a slot are still an error."""
    full = {"sr": [[0, 1], [1, 0], [2, 2]], "dw": 3}
    older = {"sr": [[0, 1], [1, 0]], "dw": 3}
    recs = [_write(tmp_path / f"r{i}-0.jsonl", [_start(), {"step": 1, "c": 1, "n": 3, "tr": [[4 * i, 4 * i + 4]],
                                                            "slot": i, "ts": 0, **ring}])
            for i, ring in ((0, older), (1, full), (2, full))]
    for order in (recs, recs[::-1]):
        (st,) = rebuild(order).steps
        assert _places(st) == (3, [1, 0, 2])
    bad = _write(tmp_path / "r3-0.jsonl", [_start(), {"step": 1, "c": 1, "n": 3, "sr": [[0, 2], [1, 0]], "dw": 3}])
    with pytest.raises(OracleError, match="two rings"):
        rebuild(recs + [bad])
