"""Real replica processes on loopback training a real model; one is SIGKILLed and restarted.

Invariants checked from the replicas' own records:
- no survivor crashes or restarts because a peer died (exit status 0, one process each);
- committed progress never goes backwards at any replica;
- replicas at the same committed step hold bitwise-identical parameters and optimizer state
  (digests), the restarted one included after its catch-up;
- every sample is trained exactly once over the committed steps (no duplicate, no gap other
  than the holes the replicated cursor still owes).
"""
from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
from replica_harness import Replicas, check_invariants, records, steps

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_kill_one_replica_survivors_continue_and_restart_catches_up(tmp_path: Path) -> None:
    rs = Replicas(tmp_path, 3, ["--min-replicas", "3"])
    for i in range(3):
        rs.spawn(i, f"r{i}-0")
    try:
        rs.wait(lambda: all(rs.last_step(f"r{i}-0") >= 20 for i in range(3)), 90, "20 steps on every replica")
        # SIGKILL r1 in the middle of training.
        rs.procs["r1-0"].send_signal(signal.SIGKILL)
        rs.procs["r1-0"].wait(timeout=5)
        t_kill = time.time()
        at_kill = {n: rs.last_step(n) for n in ("r0-0", "r2-0")}
        rs.wait(lambda: all(rs.last_step(n) >= at_kill[n] + 10 for n in at_kill), 30,
                "survivors to commit 10 more steps after the kill")
        survivors = [r for r in steps(rs.stats["r0-0"]) if r["t"] > t_kill]
        assert survivors and survivors[0]["t"] - t_kill < 3.0, "survivors stalled after the kill"
        assert any(r["n"] == 2 for r in survivors), "survivors never committed a step without the dead replica"
        # Restart it: a new process, new incarnation, same address.
        rs.spawn(1, "r1-1")
        rs.wait(lambda: any(r.get("c") and r.get("role") == "participant" and r.get("n", 0) == 3
                            for r in steps(rs.stats["r1-1"])), 90, "the restarted replica to contribute")
        target = max(rs.last_step(n) for n in ("r0-0", "r2-0", "r1-1")) + 10
        rs.wait(lambda: all(rs.last_step(n) >= target for n in ("r0-0", "r2-0", "r1-1")), 60,
                "10 more steps with three replicas")
    finally:
        rcs = rs.stop_all()
    assert rcs["r0-0"] == 0 and rcs["r2-0"] == 0 and rcs["r1-1"] == 0, f"exit statuses {rcs}"
    digests = check_invariants(rs.stats)
    restarted = {r["step"] for r in steps(rs.stats["r1-1"]) if "digest" in r}
    assert restarted and any(s in digests for s in restarted), "no digest of the restarted replica to compare"
    events = [r for r in records(rs.stats["r1-1"]) if r.get("kind") == "event"]
    assert any(e.get("event") == "catchup_done" for e in events), "the restarted replica did not catch up"
