"""HSDP: 2 replicas x 2 ranks (FSDP2 over gloo inside, p2pft across) + 2 witnesses, real
processes on loopback. One rank of replica B is SIGKILLed (or SIGSTOPped); B's launcher tears B
down; the test restarts B whole; B catches up shard by shard and contributes again. One cluster
goes through three such faults in turn (rank 1, the leader rank, rank 1 stopped), another
through one with the shards over the NCCL stand-in.

Checked from the replicas' own records:
- replica A never stops: it commits during B's absence (alone: 1 contributor), its longest gap
  between commits stays bounded, and it exits 0 (no survivor crash, one incarnation);
- B's launcher exits non-zero after the kill and leaves no rank behind;
- the restarted B caught up (catch-up event on every rank: the verdicts agree) and contributes;
- at equal committed steps, A's and B's per-shard parameter + optimizer digests are bitwise
  equal for every shard; committed steps never go back; no sample is trained twice.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from replica_harness import ProcessSet, check_invariants, ports, records, steps

from p2pft.deploy.procs import pid_alive

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

# Run the example by path: its launcher then starts without importing torch (``-m`` would
# import the p2pft.trainer package first), so a restarted replica's ranks start seconds sooner.
SCRIPT = str(Path(__file__).resolve().parents[2] / "trainer" / "examples" / "hsdp_replica.py")


FAKES = str(Path(__file__).resolve().parents[1] / "fakes")


class Cluster(ProcessSet):
    stop_timeout = 30.0

    def __init__(self, tmp: Path, nccl: bool = False) -> None:
        super().__init__(tmp)
        # nccl: every rank's cross-replica shard goes over the CPU stand-in of CuPy's NCCL
        # (tests/fakes), one stand-in device per rank, as on a GPU node.
        self.env = dict(os.environ, OMP_NUM_THREADS="1")
        if nccl:
            self.env.update(P2PFT_DATA_PLANE="nccl",
                            PYTHONPATH=os.pathsep.join(filter(None, [FAKES, os.environ.get("PYTHONPATH")])))
        a, b, w0, w1 = (f"127.0.0.1:{p}" for p in ports(4))
        self.b_pids: list[int] = []            # the ranks of B's incarnation under a fault
        self.gone: tuple[str, ...] = ()        # B's torn-down incarnations (their exit is expected)
        self.addr = {"a": a, "b": b}
        self.witnesses = [w0, w1]

    new_session = False   # each process in a session of its own (a whole replica killed with killpg)

    def _popen(self, name: str, cmd: list[str]) -> None:
        with open(self.tmp / f"{name}.log", "wb") as log:
            self.procs[name] = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log,
                                                env=self.env, start_new_session=self.new_session)

    def spawn_witnesses(self) -> None:
        everyone = list(self.addr.values()) + self.witnesses
        for k, addr in enumerate(self.witnesses):
            self._popen(f"w{k}", [sys.executable, "-m", "p2pft", "--log-level", "INFO", "peer", "--listen", addr,
                                  "--seeds", ",".join(a for a in everyone if a != addr), "--replica-id", f"w{k}"])

    def spawn(self, rid: str, name: str, extra: tuple[str, ...] = ()) -> None:
        seeds = [a for r, a in self.addr.items() if r != rid] + self.witnesses
        self.stats[name] = self.tmp / f"{name}.jsonl"
        self._popen(name, [sys.executable, SCRIPT, "--nproc-per-node", "2", "--replica-id", rid,
                           "--listen", self.addr[rid], "--seeds", ",".join(seeds), "--stats", str(self.stats[name]),
                           "--min-replicas", "2", "--step-delay", "0.05", "--batch", "4", "--digest-every", "2",
                           "--log-level", "INFO", *extra])


RANK_TIMEOUT = 3.0


def _phase(c: Cluster, old: str, new: str, victim: int, sig: int) -> dict[str, Any]:
    """One fault of replica B: `sig` to rank `victim` of B's incarnation `old`; B's launcher
    tears B down; A commits alone; B restarts as `new`, catches up and contributes again.
    Returns what the checks after the run need."""
    start = [r for r in records(c.stats[old]) if r.get("kind") == "start"][0]
    b_pids = [int(p) for p in start["pids"]]
    c.b_pids = b_pids   # killed at the end unless seen gone (a pid seen gone may be reused)
    os.kill(b_pids[victim], sig)  # one rank of replica B
    t_kill = time.time()
    at_kill = c.last_step("a")
    c.wait(lambda: c.procs[old].poll() is not None, 10 + RANK_TIMEOUT, "B's launcher to tear B down",
           allow_exit=c.gone + (old,))
    assert c.procs[old].returncode != 0
    c.gone += (old,)
    time.sleep(0.3)
    assert not any(pid_alive(p) for p in b_pids), "a rank of the torn-down replica B is still running"
    c.b_pids = []
    c.wait(lambda: any(r["c"] and r["n"] == 1 for r in steps(c.stats["a"]) if r["t"] > t_kill), 20,
           "A to commit alone", allow_exit=c.gone)
    c.wait(lambda: c.last_step("a") >= at_kill + 5, 20, "A to commit 5 steps after the kill", allow_exit=c.gone)
    t_restart = time.time()
    c.spawn("b", new, ("--rank-timeout", str(RANK_TIMEOUT)))
    c.wait(lambda: any(r["c"] and r["role"] == "participant" and r["n"] == 2 for r in steps(c.stats[new])),
           60, "the restarted B to contribute", allow_exit=c.gone)
    t_back = min(r["t"] for r in steps(c.stats[new]) if r["c"] and r["n"] == 2)

    def common_digest() -> bool:
        da = {r["step"] for r in steps(c.stats["a"]) if "digest" in r and r["t"] > t_back}
        db = {r["step"] for r in steps(c.stats[new]) if "digest" in r and r["t"] > t_back}
        return len(da & db) >= 2
    c.wait(common_digest, 30, "two common digest steps after B is back", allow_exit=c.gone)
    return {"victim": victim, "sig": sig, "new": new, "t_kill": t_kill, "t_back": t_back, "t_restart": t_restart}


# Three faults of B in one cluster, one after another (rank 1 SIGKILLed, then the leader rank,
# then rank 1 SIGSTOPped), and rank 1 SIGKILLed with the shards over the NCCL stand-in.
@pytest.mark.parametrize("faults,nccl", [(((1, signal.SIGKILL), (0, signal.SIGKILL), (1, signal.SIGSTOP)), False),
                                         (((1, signal.SIGKILL),), True)],
                         ids=["rank1-leader-stop", "rank1-nccl-standin"])
def test_hsdp_rank_faults_survivor_continues_and_replica_rejoins(tmp_path: Path, faults: tuple[tuple[int, int], ...],
                                                                nccl: bool) -> None:
    """SIGSTOP of one rank: its sockets stay open and rank 0 still gossips, so only rank 0's
    ping watchdog (--rank-timeout) can take the stalled replica out; A then continues. With
    `nccl`, a kill with the shards reduced over the NCCL stand-in."""
    t0 = time.time()
    c = Cluster(tmp_path, nccl)
    c.spawn_witnesses()
    c.spawn("a", "a")
    c.spawn("b", "b0", ("--rank-timeout", str(RANK_TIMEOUT)))
    phases: list[dict[str, Any]] = []
    try:
        c.wait(lambda: c.last_step("a") >= 6 and c.last_step("b0") >= 6, 60, "6 steps on both replicas")
        for k, (victim, sig) in enumerate(faults):
            phases.append(_phase(c, f"b{k}", f"b{k + 1}", victim, sig))
    finally:
        rcs = c.stop_all()
        for p in c.b_pids:
            if pid_alive(p):
                os.kill(p, signal.SIGKILL)
    last = f"b{len(faults)}"
    assert rcs["a"] == 0 and rcs[last] == 0, f"exit statuses {rcs}"
    digests = check_invariants(dict(c.stats))
    a_steps = [r for r in steps(c.stats["a"]) if r["c"]]
    a_digest = {r["step"] for r in steps(c.stats["a"]) if "digest" in r}
    for ph in phases:
        victim, sig, new, t_kill, t_back = ph["victim"], ph["sig"], ph["new"], ph["t_kill"], ph["t_back"]
        bound = 5.0 if sig == signal.SIGKILL else RANK_TIMEOUT + 5.0
        # A never stopped: commits throughout B's absence, bounded gap.
        during = [r for r in a_steps if t_kill < r["t"] < t_back]
        assert during and during[0]["t"] - t_kill < bound, "A stalled after the kill"
        gaps = [y["t"] - x["t"] for x, y in zip(during, during[1:])]
        first_gap = during[0]["t"] - max(r["t"] for r in a_steps if r["t"] <= t_kill)
        longest = max(gaps + [first_gap])
        assert longest < bound, f"A's longest commit gap while B was away: {longest:.2f} s"
        assert sum(1 for r in during if r["n"] == 1) >= 5
        # B caught up on every rank and contributed again; digests equal per shard at equal steps.
        events = [r for r in records(c.stats[new]) if r.get("kind") == "event"]
        done = [e for e in events if e.get("event") == "catchup_done"]
        assert done, f"the restarted B ({new}) did not catch up"
        compared = sorted({r["step"] for r in steps(c.stats[new]) if "digest" in r} & a_digest)
        assert len(compared) >= 2 and all(len(digests[s].split(",")) == 2 for s in compared)
        start = [r for r in records(c.stats[new]) if r.get("kind") == "start"][0]
        print(f"\nHSDP, rank {victim} of B {signal.Signals(sig).name}: first commit of A alone "
              f"{during[0]['t'] - t_kill:.2f} s after the kill, A's longest gap {longest:.2f} s; restart -> B "
              f"contributes {t_back - ph['t_restart']:.2f} s "
              f"(launch -> ranks up {start['t'] - start['t_launch']:.2f} s, "
              f"then {t_back - start['t']:.2f} s: join, snapshot {done[0].get('fetch_s', 0):.3f} s, replay "
              f"{done[0].get('replayed')}, promotion); digests equal at steps {compared}")
    if nccl:  # the shards really went over the stand-in's NCCL, on both replicas, every shard
        for name in ("a", last):
            text = (c.tmp / f"{name}.log").read_text()
            for shard in (0, 1):
                assert re.search(rf"nccl communicator epoch=\d+ shard={shard} rank=\d+ world=2 ready", text), \
                    f"{name}: no 2-replica NCCL communicator for shard {shard}"
    print(f"total {time.time() - t0:.1f} s")
