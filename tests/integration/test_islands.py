"""DiLoCo across islands: 2 FSDP replicas x 2 ranks (gloo inside), DiLoCo between them, 2
witnesses, real processes on loopback (``trainer/examples/hsdp_replica.py --sync-every``).

Island B is SIGKILLed whole (its launcher and every rank) mid-run and restarted. Checked from the
islands' own records: A keeps syncing alone (1 contributor) with a bounded gap; the restarted B
catches up shard by shard and contributes again; at equal syncs both islands hold bitwise equal
per-shard digests (global weights and outer optimizer state); committed syncs never go back, no
sample is trained twice; both end at the job's last inner step with one full digest, exit 0.
"""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from replica_harness import check_invariants, records, steps
from test_hsdp import Cluster, _alive

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

SPAN = 4           # inner steps per sync
SYNCS = 50         # the job's end: SYNCS * SPAN inner steps (long enough for B to come back)


def test_diloco_islands_survive_the_loss_of_a_whole_island(tmp_path: Path) -> None:
    c = Cluster(tmp_path)
    extra = ("--sync-every", str(SPAN), "--steps", str(SPAN * SYNCS), "--digest-every", "1",
             "--step-delay", "0.05", "--rank-timeout", "3")
    c.spawn_witnesses()
    c.spawn("a", "a", extra)
    c.spawn("b", "b0", extra)
    pids: list[int] = []
    try:
        c.wait(lambda: c.last_step("a") >= 3 and c.last_step("b0") >= 3, 90, "3 syncs on both islands")
        start = [r for r in records(c.stats["b0"]) if r.get("kind") == "start"][0]
        pids = [int(p) for p in start["pids"]]
        c.procs["b0"].kill()          # the whole island: its launcher and every rank
        for p in pids:
            os.kill(p, signal.SIGKILL)
        t_kill = time.time()
        c.wait(lambda: c.procs["b0"].poll() is not None, 10, "B's launcher to die", allow_exit=("b0",))
        c.gone = ("b0",)
        t_restart = time.time()
        c.spawn("b", "b1", extra)   # at once: A syncs alone while B's ranks start
        c.wait(lambda: any(r["c"] and r["n"] == 1 for r in steps(c.stats["a"]) if r["t"] > t_kill), 30,
               "A to sync alone", allow_exit=c.gone)
        c.wait(lambda: any(r["c"] and r["role"] == "participant" and r["n"] == 2 for r in steps(c.stats["b1"])),
               90, "the restarted B to contribute", allow_exit=c.gone)
        c.wait(lambda: c.procs["a"].poll() is not None and c.procs["b1"].poll() is not None, 120,
               "both islands to finish the job", allow_exit=c.gone + ("a", "b1"))
    finally:
        rcs = c.stop_all()
        for p in pids:
            if _alive(p):
                os.kill(p, signal.SIGKILL)
    assert rcs["a"] == 0 and rcs["b1"] == 0, f"exit statuses {rcs}"
    assert not any(_alive(p) for p in pids)
    digests = check_invariants({"a": c.stats["a"], "b0": c.stats["b0"], "b1": c.stats["b1"]})
    a_syncs = [r for r in steps(c.stats["a"]) if r["c"]]
    t_back = min(r["t"] for r in steps(c.stats["b1"]) if r["c"] and r["n"] == 2)
    during = [r for r in a_syncs if t_kill < r["t"] < t_back]
    assert sum(1 for r in during if r["n"] == 1) >= 2, "A did not sync alone while B was away"
    before = max(r["t"] for r in a_syncs if r["t"] <= t_kill)
    gaps = [y["t"] - x["t"] for x, y in zip([{"t": before}] + during, during)]
    assert max(gaps) < 10.0, f"A's longest gap between syncs while B was away: {max(gaps):.2f} s"
    # B caught up on every rank and contributed; per-shard digests equal at equal syncs.
    assert any(r.get("event") == "catchup_done" for r in records(c.stats["b1"]) if r.get("kind") == "event")
    common = sorted({r["step"] for r in steps(c.stats["a"]) if "digest" in r}
                    & {r["step"] for r in steps(c.stats["b1"]) if "digest" in r})
    assert len(common) >= 2 and all(len(digests[s].split(",")) == 2 for s in common)
    ends = {n: [r for r in records(c.stats[n]) if r.get("kind") == "exit"][-1] for n in ("a", "b1")}
    assert ends["a"]["step"] == ends["b1"]["step"] == SYNCS
    assert ends["a"]["digest"] == ends["b1"]["digest"] and ends["a"]["full"] == ends["b1"]["full"]
    print(f"\nislands: A's first sync alone {during[0]['t'] - t_kill:.2f} s after the kill, longest gap "
          f"{max(gaps):.2f} s; restart -> B contributes {t_back - t_restart:.2f} s; equal shard digests at syncs "
          f"{common}")
