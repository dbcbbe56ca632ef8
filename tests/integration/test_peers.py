"""16 real `p2pft peer` processes on loopback: SIGKILL, restart and SIGTERM.

Bounds here are generous correctness bounds (the machine running the tests may be loaded);
bench/membership.py --real measures the actual p50/p99.
"""
from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest

from p2pft.net import aio

pytestmark = pytest.mark.slow

N = 16
KILLS = 5
EXCLUDE_BOUND = 2.0      # s from SIGKILL until every survivor's committed view lacks the peer
REJOIN_BOUND = 5.0       # s from restarting a process until every view holds it (includes interpreter start)
LEAVE_BOUND = 2.0        # s from SIGTERM until every other view lacks the peer
FORM_BOUND = 40.0


class Cluster:
    def __init__(self, peers: Any, addrs: list[str], seeds: list[str]) -> None:
        self.peers = peers
        self.addrs = addrs
        self.seeds = seeds
        self.by_addr = {p.addr: p for p in peers.all}

    def spawn(self, addr: str) -> None:
        self.by_addr[addr] = self.peers.spawn(addr, seeds=self.seeds, log_level="WARNING")


def _converged(reps: dict[str, dict[str, Any] | None], addrs: list[str], ctl: Any) -> bool:
    if any(reps.get(a) is None for a in addrs):
        return False
    epochs = {reps[a]["epoch"] for a in addrs}           # type: ignore[index]
    members = {frozenset(ctl.member_addrs(reps[a])) for a in addrs}
    voters = sum(1 for m in reps[addrs[0]]["members"] if m["voter"])  # type: ignore[index]
    return len(epochs) == 1 and members == {frozenset(addrs)} and voters == 5   # voters settled too


@pytest.fixture(scope="module")
def cluster(module_peers: Any, ctl: Any) -> Cluster:
    addrs = [f"127.0.0.1:{p}" for p in ctl.free_ports(N)]
    seeds = sorted(addrs)[:3]        # every peer gets the same seed list, as a launcher would
    for a in addrs:
        module_peers.spawn(a, seeds=seeds, log_level="WARNING")

    async def formed() -> None:
        async def ok() -> bool:
            return _converged(await ctl.reports(addrs), addrs, ctl)
        await ctl.wait_until(ok, FORM_BOUND, interval=0.1, what=f"{N} peers to agree on one view")

    aio.run(formed())
    return Cluster(module_peers, addrs, seeds)


async def test_sixteen_peers_agree_on_one_view(cluster: Cluster, ctl: Any) -> None:
    reps = await ctl.reports(cluster.addrs)
    assert _converged(reps, cluster.addrs, ctl)
    rep = reps[cluster.addrs[0]]
    assert rep is not None
    ids = ctl.member_ids(rep)
    assert rep["leader"] in ids
    voters = [m for m in rep["members"] if m["voter"]]
    assert len(voters) == 5                              # max_voters, odd
    assert {m["role"] for m in rep["members"]} == {"witness"}
    # Nobody is dead; under load a probe can time out and make a peer suspect for a moment,
    # which the peer refutes: every member is alive again, in every peer's view, within seconds.
    async def all_alive() -> bool:
        reps = await ctl.reports(cluster.addrs)
        return all(r is not None and all(m["state"] == "alive" for m in r["members"]) for r in reps.values())
    await ctl.wait_until(all_alive, 10.0, interval=0.1, what="every member alive in every peer's view")


async def test_sigkill_is_excluded_everywhere_and_a_restart_rejoins(cluster: Cluster, ctl: Any) -> None:
    rng = random.Random(16)
    excl: list[float] = []
    rejoin: list[float] = []
    for k in range(KILLS):
        reps = await ctl.reports(cluster.addrs)
        assert _converged(reps, cluster.addrs, ctl), "cluster not settled before a kill"
        leader = reps[cluster.addrs[0]]["leader"]        # type: ignore[index]
        by_id = {m["node"]: m["addr"] for m in reps[cluster.addrs[0]]["members"]}  # type: ignore[index]
        if k == 2:
            victim = by_id[leader]                        # one of the kills is the Raft leader
        else:
            victim = rng.choice(sorted(a for a in cluster.addrs if a != by_id[leader]))
        victim_id = next(n for n, a in by_id.items() if a == victim)
        survivors = [a for a in cluster.addrs if a != victim]

        cluster.by_addr[victim].kill()

        async def excluded() -> bool:
            got = await ctl.reports(survivors, timeout=1.0)
            return all(r is not None and victim_id not in ctl.member_ids(r) for r in got.values())

        excl.append(await ctl.wait_until(excluded, EXCLUDE_BOUND + 3.0, interval=0.02,
                                         what=f"{victim} excluded after SIGKILL"))
        assert excl[-1] <= EXCLUDE_BOUND, f"kill {k}: {victim} excluded only after {excl[-1]:.2f} s"

        cluster.spawn(victim)                             # same address, new process, new identity

        async def back() -> bool:
            got = await ctl.reports(cluster.addrs, timeout=1.0)
            if not _converged(got, cluster.addrs, ctl):
                return False
            new_id = next(m["node"] for m in got[victim]["members"] if m["addr"] == victim)  # type: ignore[index]
            return new_id != victim_id

        rejoin.append(await ctl.wait_until(back, REJOIN_BOUND + 5.0, interval=0.05, what=f"{victim} back"))
        assert rejoin[-1] <= REJOIN_BOUND, f"kill {k}: {victim} back only after {rejoin[-1]:.2f} s"
    print(f"\nexclusion after SIGKILL: {[round(x, 3) for x in excl]} s; "
          f"restart to every view: {[round(x, 3) for x in rejoin]} s")


async def test_sigterm_leaves_quickly_and_exits_cleanly(cluster: Cluster, ctl: Any) -> None:
    reps = await ctl.reports(cluster.addrs)
    assert _converged(reps, cluster.addrs, ctl)
    rep0 = reps[cluster.addrs[0]]
    assert rep0 is not None
    leaver = next(m for m in rep0["members"] if m["node"] != rep0["leader"] and not m["voter"])
    others = [a for a in cluster.addrs if a != leaver["addr"]]
    peer = cluster.by_addr[leaver["addr"]]
    peer.terminate()

    async def gone() -> bool:
        got = await ctl.reports(others, timeout=1.0)
        return all(r is not None and leaver["node"] not in ctl.member_ids(r) for r in got.values())

    took = await ctl.wait_until(gone, LEAVE_BOUND + 3.0, interval=0.02, what="graceful leave")
    assert took <= LEAVE_BOUND
    assert await asyncio.to_thread(peer.proc.wait, 10) == 0
    got = await ctl.reports(others)
    assert all(r is not None and r["epoch"] >= rep0["epoch"] + 1 for r in got.values())
