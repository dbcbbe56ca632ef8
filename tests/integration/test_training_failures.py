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

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow


def _ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _records(path: Path) -> list[dict[str, Any]]:
    out = []
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return out


def _steps(path: Path) -> list[dict[str, Any]]:
    return [r for r in _records(path) if r.get("kind") is None and "step" in r]


class Replicas:
    def __init__(self, tmp: Path, n: int, extra: list[str] | None = None) -> None:
        self.tmp = tmp
        self.addrs = [f"127.0.0.1:{p}" for p in _ports(n)]
        self.extra = extra or []
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.stats: dict[str, Path] = {}

    def spawn(self, i: int, name: str) -> None:
        seeds = ",".join(a for j, a in enumerate(self.addrs) if j != i)
        stats = self.tmp / f"{name}.jsonl"
        cmd = [sys.executable, "-m", "p2pft.trainer.examples.replica", "--replica-id", f"r{i}",
               "--listen", self.addrs[i], "--seeds", seeds, "--stats", str(stats), "--step-delay", "0.05",
               "--digest-every", "5", "--batch", "4", "--log-level", "INFO", *self.extra]
        log = open(self.tmp / f"{name}.log", "wb")
        self.procs[name] = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log,
                                            env=dict(os.environ, OMP_NUM_THREADS="1"))
        log.close()
        self.stats[name] = stats

    def wait(self, cond, timeout: float, what: str) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if cond():
                return
            for name, p in self.procs.items():
                if p.poll() is not None and p.returncode != -signal.SIGKILL:
                    raise AssertionError(f"{name} exited with {p.returncode}: "
                                         f"{(self.tmp / (name + '.log')).read_text()[-2000:]}")
            time.sleep(0.1)
        raise AssertionError(f"timed out after {timeout} s waiting for {what}")

    def last_step(self, name: str) -> int:
        st = _steps(self.stats[name])
        return int(st[-1]["step"]) if st else -1

    def stop_all(self) -> dict[str, int | None]:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        rcs = {}
        for name, p in self.procs.items():
            try:
                rcs[name] = p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                rcs[name] = None
        return rcs


def _check_invariants(stats: dict[str, Path]) -> dict[int, str]:
    digests: dict[int, set[str]] = {}
    trained: dict[int, list[tuple[int, int]]] = {}
    for name, path in stats.items():
        last = -1
        for r in _steps(path):
            assert r["step"] >= last, f"{name}: committed step went back from {last} to {r['step']}"
            last = r["step"]
            if "digest" in r:
                digests.setdefault(r["step"], set()).add(r["digest"])
            if r.get("tr"):
                trained.setdefault(r["step"], [])
                trained[r["step"]].extend(tuple(x) for x in r["tr"])
    bad = {s: d for s, d in digests.items() if len(d) > 1}
    assert not bad, f"replicas diverged at steps {sorted(bad)}"
    seen: dict[int, int] = {}
    for step, ranges in trained.items():
        for a, b in ranges:
            for i in range(a, b):
                assert i not in seen, f"sample {i} trained at step {seen[i]} and again at step {step}"
                seen[i] = step
    return {s: next(iter(d)) for s, d in digests.items()}


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
        survivors = [r for r in _steps(rs.stats["r0-0"]) if r["t"] > t_kill]
        assert survivors and survivors[0]["t"] - t_kill < 3.0, "survivors stalled after the kill"
        assert any(r["n"] == 2 for r in survivors), "survivors never committed a step without the dead replica"
        # Restart it: a new process, new incarnation, same address.
        rs.spawn(1, "r1-1")
        rs.wait(lambda: any(r.get("c") and r.get("role") == "participant" and r.get("n", 0) == 3
                            for r in _steps(rs.stats["r1-1"])), 90, "the restarted replica to contribute")
        target = max(rs.last_step(n) for n in ("r0-0", "r2-0", "r1-1")) + 10
        rs.wait(lambda: all(rs.last_step(n) >= target for n in ("r0-0", "r2-0", "r1-1")), 60,
                "10 more steps with three replicas")
    finally:
        rcs = rs.stop_all()
    assert rcs["r0-0"] == 0 and rcs["r2-0"] == 0 and rcs["r1-1"] == 0, f"exit statuses {rcs}"
    digests = _check_invariants(rs.stats)
    restarted = {r["step"] for r in _steps(rs.stats["r1-1"]) if "digest" in r}
    assert restarted and any(s in digests for s in restarted), "no digest of the restarted replica to compare"
    events = [r for r in _records(rs.stats["r1-1"]) if r.get("kind") == "event"]
    assert any(e.get("event") == "catchup_done" for e in events), "the restarted replica did not catch up"
