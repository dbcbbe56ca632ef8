"""bench/wan.py --ranks 2 at its smallest: 2 islands x 2 ranks (FSDP2, gloo inside), p2pft's DiLoCo
between them over rate-limited proxy links on loopback, no failures. Checked from the islands'
records: every sync committed with both islands, every record carries both ranks' shard digests
and the islands' digests are equal at every sync they share, no crash, the launchers' whole
islands gone at the end, and r0's gathered global weights evaluated. And the islands' columns
from records alone: digests at the end, syncs from a restart's ready to its own contribution,
work kept in a commit learned from a peer's log."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

from p2pft.deploy.procs import pid_alive

BENCH = Path(__file__).resolve().parents[2] / "bench" / "wan.py"


def _wan() -> Any:
    spec = importlib.util.spec_from_file_location("wan_bench_islands", BENCH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["wan_bench_islands"] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_diloco_over_two_islands_of_two_ranks(tmp_path: Path) -> None:
    wan = _wan()
    a = wan.parse(["--quick", "--ranks", "2", "--replicas", "2", "--links", "proxy", "--systems", "sync,diloco",
                   "--failures", "none", "--duration", "8", "--sync-every", "5"])
    recs, info = wan.run_one("diloco", False, a, tmp_path)
    row = wan.summarize("diloco", False, recs, info, None)
    assert info["crashes"] == 0 and row.survivor_crashes == 0, info
    syncs = {p: [r for r in recs if r["proc"] == p and r.get("kind") is None] for p in info["procs"]}
    assert sorted(syncs) == ["diloco-none-r0-0", "diloco-none-r1-0"]
    for p, mine in syncs.items():
        assert len(mine) >= 2, f"{p} recorded {len(mine)} syncs"
        assert all(r["c"] and r["n"] == 2 and r["kept"] == r["ran"] > 0 for r in mine), mine
        assert all(len(r["digest"].split(",")) == 2 for r in mine)   # one digest per rank's shard
    a0 = {r["step"]: r["digest"] for r in syncs["diloco-none-r0-0"]}
    a1 = {r["step"]: r["digest"] for r in syncs["diloco-none-r1-0"]}
    common = sorted(set(a0) & set(a1))
    assert len(common) >= 2 and all(a0[s] == a1[s] for s in common)
    assert row.same_digests_end == f"yes at {common[-1]}"
    assert row.divergent_steps == 0 and row.survivor_work_kept == 1.0
    assert row.curve and all(v == v for _, _, v in row.curve)   # r0's whole global weights evaluated
    pids = [p for r in recs if r.get("kind") == "start" for p in r["pids"]]
    assert len(pids) == 4 and not any(pid_alive(p) for p in pids)   # every rank of both islands gone


def _sync(proc: str, t: float, step: int, **kw: Any) -> dict[str, Any]:
    return {"proc": proc, "t": t, "step": step, "c": 1, "n": 3, "ran": 20, "kept": 20, "samples": 0, **kw}


def test_island_columns_from_records() -> None:
    wan = _wan()
    r0, r1, r1b, r2 = "diloco-kill-r0-0", "diloco-kill-r1-0", "diloco-kill-r1-1", "diloco-kill-r2-0"
    d = {s: f"a{s},b{s}" for s in range(1, 7)}
    recs = [_sync(r0, 100.0 + 2 * s, s, digest=d[s]) for s in (1, 2, 3, 5, 6)]
    # Sync 4: r0's attempt failed and it applied the commit from a peer's log, its work in the mean.
    recs.append(_sync(r0, 108.0, 4, c=0, n=0, ff=1))
    recs += [_sync(r1, 102.0, 1, digest=d[1])]
    recs += [_sync(r2, 100.0 + 2 * s, s, digest=d[s]) for s in range(1, 7)]
    # r1 back: holds sync 3 when ready, trains a partial span into sync 4, then whole spans.
    recs += [{"proc": r1b, "kind": "ready", "t": 107.0, "step": 3, "digest": d[3]},
             _sync(r1b, 108.1, 4, ran=6, kept=6), _sync(r1b, 110.1, 5, digest=d[5]),
             _sync(r1b, 112.1, 6, digest="x,y")]
    info = {"t_first": 100.0, "t_end": 113.0, "killed": [r1], "procs": sorted([r0, r1, r1b, r2]),
            "spawned": {r0: 90.0, r1: 90.0, r1b: 104.0, r2: 90.0}, "tmp": "", "kills": 1, "crashes": 0,
            "links": "proxy", "bytes_per_replica": 0, "batch": 8, "ranks": 2}
    row = wan.summarize("diloco", True, recs, info, None)
    assert row.restart_syncs == {"r1-1": 1}
    assert row.restarts_not_due == ["r1-1"]          # spawned too late in a 13 s run to be due
    assert row.same_digests_end == "no at 6"         # r1-1's last digest differs
    assert row.samples_in_syncs == (6 * 20 + 1 * 20 + 6 * 20 + 6 + 2 * 20) * 8   # r0's sync 4 counts
    assert row.stall_max_s == 2.0                    # r0's sync 4 (applied from a peer's log) ends a gap
    recs[-1]["digest"] = d[6]
    assert wan.summarize("diloco", True, recs, info, None).same_digests_end == "yes at 6"
    table = wan.table([row])
    assert "r1-1: 1" in table and "same per-shard digests at the end" in table


def test_the_own_core_clock_takes_each_commits_busiest_rank_and_the_link() -> None:
    """On shared cores the islands' wall time is the CPU's share; with a core per rank each commit
    would take its busiest rank's CPU-seconds, plus its bytes at the link rate (which no core
    speeds up)."""
    wan = _wan()
    r0 = "diloco-none-r0-0"
    recs = [{"proc": r0, "kind": "ready", "t": 100.0, "cpu": [10.0, 12.0]},
            {**_sync(r0, 103.0, 1), "cpu": [10.5, 12.2]},     # ranks used 0.5 and 0.2 CPU-s
            {**_sync(r0, 106.0, 2), "cpu": [10.6, 12.6]},     # 0.1 and 0.4
            {"proc": "diloco-none-r1-0", "kind": "ready", "t": 100.0, "cpu": [99.0, 99.0]}]   # not r0's
    # 2 commits moved 1.25 MB over a 5 Mbit/s link: 1 s of link each.
    got = wan.own_cores(recs, 100.0, 1_250_000, 5.0)
    assert [t for t, _ in got] == [3.0, 6.0] and [c for _, c in got] == pytest.approx([1.5, 2.9])
    assert wan.own_cores(recs, 100.0, 1_250_000, 0.0) == []             # no rate: no clock
    assert wan.own_cores([r for r in recs if "cpu" not in r], 100.0, 1.0, 5.0) == []   # a one-rank run
