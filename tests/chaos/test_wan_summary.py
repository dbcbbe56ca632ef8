"""bench/wan.py's row from records, without running a cluster: the longest gap without a commit,
work kept only when it was the replica's own, and the torchft recovery check read from its logs."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parents[2] / "bench" / "wan.py"


def _wan() -> Any:
    spec = importlib.util.spec_from_file_location("wan_bench", BENCH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["wan_bench"] = mod
    spec.loader.exec_module(mod)
    return mod


def _sync(proc: str, t: float, step: int, ran: int = 20, kept: int = 20, c: int = 1) -> dict[str, Any]:
    return {"proc": proc, "t": t, "step": step, "c": c, "n": 3, "ran": ran, "kept": kept, "samples": 0}


def _info(tmp: Path, procs: list[str], spawned: dict[str, float]) -> dict[str, Any]:
    return {"t_first": 100.0, "t_end": 200.0, "killed": ["torchft-kill-r1-0"], "procs": procs, "spawned": spawned,
            "tmp": str(tmp), "kills": 1, "crashes": 0, "links": "netns", "bytes_per_replica": 0, "batch": 8}


def test_stall_kept_and_torchft_recovery(tmp_path: Path) -> None:
    wan = _wan()
    r0, r1, r1b = "torchft-kill-r0-0", "torchft-kill-r1-0", "torchft-kill-r1-1"
    # r0 commits every 4 s but once waits 42 s; then 38 s to the end of the run.
    recs = [_sync(r0, t, k + 1) for k, t in enumerate((104, 108, 150, 154, 158, 162))]
    recs += [_sync(r1, 104, 1), _sync(r1, 108, 2),
             {**_sync(r1b, 150, 3, kept=0), "healed": 1}, _sync(r1b, 154, 4),   # heals, then its own work
             {"proc": r0, "kind": "eval", "t": 162.0, "samples": 0, "val": 2.0, "step": 6}]
    (tmp_path / f"{r1b}.log").write_text("... Loaded state dict.\n")
    info = _info(tmp_path, [r0, r1, r1b], {r0: 90.0, r1: 90.0, r1b: 120.0})
    row = wan.summarize("torchft", True, recs, info, None)
    assert row.stall_max_s == 42.0   # the longest gap itself, not minus the median (4 s)
    # Survivors r0 (6 x 20, all kept) and r1-1 (its heal round is not its own work): 140 of 160.
    assert abs(row.survivor_work_kept - 140 / 160) < 1e-9
    assert row.samples_in_syncs == (6 + 2 + 1) * 20 * 8
    assert row.curve[0][1] == row.samples_in_syncs   # torchft's samples: own work, not r0's count
    assert row.restarts_contributing == "1/1" and row.recovery == "ok"

    # A recovery error in torchft's log flags the row; so does a due restart that never healed.
    (tmp_path / f"{r1b}.log").write_text("got exception in recovery: <urlopen error [Errno -3]>\n")
    row = wan.summarize("torchft", True, recs, info, None)
    assert "1 recovery errors" in row.recovery and "never loaded a state dict" in row.recovery

    # A restart due to contribute that never did is flagged for every system.
    own_less = [r for r in recs if not (r.get("proc") == r1b and r.get("step") == 4)]
    row = wan.summarize("diloco", True, own_less, info, None)
    assert row.restarts_contributing == "0/1" and "never contributed" in row.recovery


def test_equal_samples_is_the_systems_own_point_against_the_dense_reference() -> None:
    wan = _wan()
    # Synchronous training: a point every 24 samples, ending at 984.
    ref = [(0.5 * k, 24 * k, 5.0 - 0.002 * 24 * k) for k in range(1, 42)]
    # DiLoCo: a point per sync (480 samples each). The old reading drew a line from 480 to 1440
    # across the sync at 960 and read it at 984; its own point at 960 is what it measured.
    curve = [(1.8, 480, 2.9), (3.0, 960, 2.4), (4.1, 1440, 2.2)]
    s, v, r = wan.equal_samples(curve, ref, 984)
    assert s == 960 and v == 2.4
    assert abs(r - (5.0 - 0.002 * 960)) < 1e-12          # sync's loss at 960, its own point
    s, v, r = wan.equal_samples(curve, ref, 970)          # between the reference's points 960 and 984
    assert s == 960
    s, v, r = wan.equal_samples([(1.0, 500, 3.0)], ref, 984)   # between 480 and 504: linear there
    assert abs(r - (5.0 - 0.002 * 500)) < 1e-9
    assert wan.equal_samples([(1.0, 1440, 2.2)], ref, 984) is None   # no point at or below the limit
    assert wan.equal_samples([(1.0, 10, 4.0)], ref, 984) is None     # below the reference's first point


def test_a_restart_killed_again_before_it_could_come_back_is_not_due(tmp_path: Path) -> None:
    wan = _wan()
    r0, r1b = "diloco-kill-r0-0", "diloco-kill-r1-1"
    recs = [_sync(r0, t, k + 1) for k, t in enumerate(range(102, 200, 2))]   # a sync every 2 s
    info = {**_info(tmp_path, [r0, r1b], {r0: 90.0, r1b: 120.0}), "killed": [r1b]}
    # r1-1 started at 120 and never contributed: due (it lived to the end, 80 s)...
    assert wan.summarize("diloco", True, recs, info, None).restarts_contributing == "0/1"
    # ...but not when it was killed again at 125, 5 s after it started (under 3 syncs + 10 s).
    info["kill_log"] = [{"t": 125.0, "proc": r1b, "phase": ""}]
    row = wan.summarize("diloco", True, recs, info, None)
    assert row.restarts_contributing == "0/0" and row.recovery == "ok"
