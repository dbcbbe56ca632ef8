"""Rebuilding the committed history from stats files (p2pft/chaos/oracle.py), without training."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from p2pft.chaos.oracle import OracleError, rebuild

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
        {"step": 1, "c": 1, "n": 2, "lr": 0.1, "tr": [[4, 8]], "slot": 1, "dr": [0, 2]},
    ])
    b = _write(tmp_path / "r1-0.jsonl", [
        _start(),
        {"kind": "begin", "step": 0, "slot": 0, "tr": [[0, 4]]},
        {"step": 1, "c": 1, "n": 2, "lr": 0.1, "tr": [[0, 4]], "slot": 0, "dr": [1, 2]},
    ])
    h = rebuild([a, b])
    assert h.recipe == RECIPE and h.unresolved == []
    (st,) = h.steps
    assert st.count == 2 and st.recorded_lr == 0.1
    assert [c.ranges for c in st.contributions] == [((0, 4),), ((4, 8),)]   # slot order
    assert [c.ring for c in st.contributions] == [(1, 2), (0, 2)]


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
