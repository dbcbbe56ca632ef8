"""Network partitions between real processes, through fault proxies (p2pft.chaos.netfault).

Three training replicas (the example job) and two `p2pft peer` witnesses, each process on its
own loopback IP 127.x.y.N, binding there and advertising a proxy in front of its control port
and its data port. One cluster serves the tests of this module, in order:

1. minority partition: one replica is cut off from everyone, both directions, control and data.
   The majority (two replicas, two witnesses) excludes it and keeps committing; the cut replica
   commits nothing. After the heal it finds out it was excluded, catches up and contributes
   again; digests agree at equal steps; nobody crashed.
2. one-way partitions: everything the replica sends is lost while what it receives arrives, and
   the other way round. The same outcome (it cannot answer probes, or hear them, so it is
   excluded) and the same recovery.
3. a degraded network (delay with jitter, occasional retransmission stalls) on every link:
   nobody is excluded and all three keep contributing.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
from replica_harness import ProcessSet, check_invariants, records, steps

from p2pft.chaos.netfault import ANY, NetFault
from p2pft.deploy.ports import free_ports

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

REPLICAS = 3
WITNESSES = 2
_rng = random.Random(os.getpid() * 7919)
_NET = f"127.{_rng.randrange(10, 250)}.{_rng.randrange(1, 250)}"


def _ip(k: int) -> str:
    return f"{_NET}.{k + 1}"


def _free_port(host: str) -> int:
    return free_ports(1, host)[0]


class NetCluster(ProcessSet):
    """Replicas r0..r2 and witnesses w0, w1, each on its own IP behind proxies."""

    def __init__(self, tmp: Path) -> None:
        super().__init__(tmp)
        self.nf = NetFault(seed=11).start()
        self.names = [f"r{i}" for i in range(REPLICAS)] + [f"w{k}" for k in range(WITNESSES)]
        self.ip = {n: _ip(k) for k, n in enumerate(self.names)}
        self.real: dict[str, str] = {}
        self.adv: dict[str, str] = {}
        self.data_real: dict[str, str] = {}
        self.data_adv: dict[str, str] = {}
        for n in self.names:
            h = self.ip[n]
            self.real[n] = f"{h}:{_free_port(h)}"
            self.adv[n] = self.nf.add_proxy(f"{h}:0", self.real[n])
            if n.startswith("r"):
                self.data_real[n] = f"{h}:{_free_port(h)}"
                self.data_adv[n] = self.nf.add_proxy(f"{h}:0", self.data_real[n])

    def seeds(self, me: str) -> str:
        return ",".join(a for n, a in self.adv.items() if n != me)

    def start(self) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        env = {k: v for k, v in env.items() if not k.startswith("P2PFT_")}
        for n in self.names:
            logf = open(self.tmp / f"{n}.log", "wb")
            if n.startswith("w"):
                cmd = [sys.executable, "-m", "p2pft", "--log-level", "INFO", "peer", "--listen", self.real[n],
                       "--advertise", self.adv[n], "--seeds", self.seeds(n), "--replica-id", n]
            else:
                self.stats[n] = self.tmp / f"{n}.jsonl"
                cmd = [sys.executable, "-m", "p2pft.trainer.examples.replica", "--replica-id", n,
                       "--listen", self.real[n], "--advertise", self.adv[n], "--data-listen", self.data_real[n],
                       "--advertise-data", self.data_adv[n], "--seeds", self.seeds(n), "--stats",
                       str(self.stats[n]), "--step-delay", "0.05", "--digest-every", "5", "--batch", "4",
                       "--min-replicas", str(REPLICAS), "--log-level", "INFO"]
            self.procs[n] = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=logf, env=env)
            logf.close()

    def commits(self, n: str, after: float, before: float = float("inf")) -> list[dict[str, Any]]:
        return [r for r in steps(self.stats[n]) if r.get("c") and after < r["t"] < before]

    def all_contribute(self, since: float) -> bool:
        return all(any(r["n"] == REPLICAS for r in self.commits(f"r{i}", since)) for i in range(REPLICAS))

    def stop(self) -> dict[str, int | None]:
        rcs = self.stop_all()
        self.nf.stop()
        return rcs


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NetCluster]:
    c = NetCluster(tmp_path_factory.mktemp("partition"))
    c.start()
    try:
        t = c.wait(lambda: all(c.last_step(f"r{i}") >= 10 for i in range(REPLICAS)), 120,
                   "10 steps on every replica")
        print(f"\ncluster formed and trained 10 steps in {t:.1f} s")
        yield c
    finally:
        rcs = c.stop()
        assert all(rc == 0 for rc in rcs.values()), rcs    # nobody crashed
        # No divergence: the same digest at the same step everywhere and no sample trained twice,
        # over every commit that was built upon. A cut can orphan the one commit in flight:
        # a replica may receive the last all-gather frames while its own are lost, so it
        # finishes an allreduce that the others fail and redo without it. It is then excluded,
        # and its catch-up from a snapshot discards that commit before it commits again.
        kept, orphans = _without_orphans(c.stats, c.tmp)
        print(f"\norphaned commits (finished by a cut replica alone, discarded by its catch-up): {orphans}")
        assert sum(orphans.values()) <= 4, orphans          # at most one per cut (3 cuts) + slack
        check_invariants(kept)


def _without_orphans(stats: dict[str, Path], tmp: Path) -> tuple[dict[str, Path], dict[str, int]]:
    """Copies of the stats files without orphaned commits: a commit whose replica's next
    commit-or-catch-up record is a completed catch-up from a snapshot (so nothing was built on
    it: the snapshot replaced that state)."""
    kept: dict[str, Path] = {}
    orphans: dict[str, int] = {}
    counts: dict[int, set[int]] = {}      # step -> contributor counts of its commits, everywhere
    for path in stats.values():
        for r in steps(path):
            if r.get("c"):
                counts.setdefault(int(r["step"]), set()).add(int(r["n"]))
    for name, path in stats.items():
        recs = records(path)
        drop: set[int] = set()
        for i, r in enumerate(recs):
            if not (r.get("kind") is None and r.get("c")):
                continue
            for nxt in recs[i + 1:]:
                if nxt.get("kind") is None and nxt.get("c"):
                    break
                if nxt.get("event") == "catchup_done":
                    drop.add(i)
                    break
        # Reported: the dropped commits that really differ from another replica's commit of
        # that step (another number of contributors); the others were ordinary commits.
        orphans[name] = sum(1 for i in drop if len(counts[int(recs[i]["step"])]) > 1)
        out = tmp / f"{name}.kept.jsonl"
        out.write_text("".join(json.dumps(r) + "\n" for i, r in enumerate(recs) if i not in drop))
        kept[name] = out
    return kept, orphans


def _cut_and_heal(c: NetCluster, cut: Callable[[], None], label: str, hold: float) -> dict[str, float]:
    victim, others = "r2", ["r0", "r1"]
    c.wait(lambda: c.all_contribute(time.time() - 2.0), 60, "all three replicas contributing")
    cut()
    t_cut = time.time()
    took = c.wait(lambda: any(r["n"] == 2 for r in c.commits("r0", t_cut)), 30,
                  "the majority to commit without the cut replica")
    at = c.last_step("r0")
    c.wait(lambda: c.last_step("r0") >= at + 10 and time.time() - t_cut >= hold, 30 + hold,
           f"10 more majority steps and {hold} s of cut")
    t_heal = time.time()
    # The cut replica committed nothing during the cut (1 s of grace for a commit whose
    # allreduce had already finished when the cut began).
    during = c.commits(victim, t_cut + 1.0, t_heal)
    assert not during, f"{label}: the cut replica committed {len(during)} steps during the cut"
    majority = {n: len(c.commits(n, t_cut, t_heal)) for n in others}
    assert all(v >= 10 for v in majority.values()), majority
    c.nf.heal()
    c.wait(lambda: any(r.get("event") == "catchup_done" and r["t"] > t_heal for r in records(c.stats[victim])), 60,
           f"{label}: the cut replica to catch up")
    back = c.wait(lambda: any(r["n"] == REPLICAS for r in c.commits(victim, t_heal)), 60,
                  f"{label}: the cut replica to contribute again")
    t_back = min(r["t"] for r in c.commits(victim, t_heal) if r["n"] == REPLICAS)
    target = c.last_step("r0") + 5
    c.wait(lambda: all(c.last_step(f"r{i}") >= target for i in range(REPLICAS)), 30, "5 more steps everywhere")
    excluded = any(r.get("view") and victim not in [m[0] for m in r["view"]]
                   for r in steps(c.stats["r0"]) if t_cut < r["t"] < t_heal)
    assert excluded, f"{label}: the majority never committed a view without the cut replica"
    out = {"exclusion_s": took, "majority_steps_during_cut": min(majority.values()), "cut_s": t_heal - t_cut,
           "heal_to_contributing_s": t_back - t_heal}
    print(f"\n{label}: {out}")
    assert back < 60
    return out


def test_minority_partition_majority_goes_on_minority_catches_up(cluster: NetCluster) -> None:
    # Healed before the cut replica's allreduce times out (10 s): the heal resets its connections.
    _cut_and_heal(cluster, lambda: cluster.nf.isolate(cluster.ip["r2"]), "isolate r2", hold=4.0)


def test_one_way_partition_outgoing_lost(cluster: NetCluster) -> None:
    ip2 = cluster.ip["r2"]
    # The cut replica still hears everything: it learns from the leader's views that it was
    # excluded, and for longer than the allreduce timeout (10 s) nothing it sends gets through.
    _cut_and_heal(cluster, lambda: cluster.nf.one_way(ip2, ANY), "one-way r2 -> everyone", hold=12.0)


def test_one_way_partition_incoming_lost(cluster: NetCluster) -> None:
    # The other way round: the cut replica hears nothing (it suspects everyone and says so),
    # while what it sends still arrives; the majority must not be disturbed by it.
    ip2 = cluster.ip["r2"]
    _cut_and_heal(cluster, lambda: cluster.nf.one_way(ANY, ip2), "one-way everyone -> r2", hold=4.0)


def test_delay_jitter_and_stalls_remove_nobody(cluster: NetCluster) -> None:
    c = cluster
    c.wait(lambda: c.all_contribute(time.time() - 2.0), 60, "all three replicas contributing")
    # Every link: 10 ms +- 5 ms per chunk each way, and 2 % of chunks stall for an RTO of 200 ms.
    c.nf.degrade(ANY, ANY, delay=0.01, jitter=0.005, drop=0.02, rto=0.2)
    t0 = time.time()
    at = c.last_step("r0")
    try:
        c.wait(lambda: c.last_step("r0") >= at + 20, 60, "20 steps on a degraded network")
    finally:
        c.nf.heal()
    t1 = time.time()
    for i in range(REPLICAS):
        done = c.commits(f"r{i}", t0, t1)
        full = [r for r in done if r["n"] == REPLICAS]
        assert len(full) >= 15, f"r{i}: only {len(full)} of {len(done)} commits had all three replicas"
    views = [r["view"] for r in steps(c.stats["r0"]) if t0 < r["t"] < t1 and r.get("view")]
    removed = [v for v in views if len(v) < REPLICAS + WITNESSES]
    print(f"\ndegraded network: {c.last_step('r0') - at} steps in {t1 - t0:.1f} s, stalls "
          f"{c.nf.counters['stalls']}, views during it {len(views)}, with someone missing {len(removed)}")
    assert not removed, removed
