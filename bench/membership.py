"""Membership benchmark: crash detection, false removals and message cost, simulated and real.

Simulator runs use the real Node code and the default profile on a virtual network and clock:
peers join through up to 3 earlier peers, then with message loss a few random non-leaders and
finally the Raft leader are crashed, one at a time. Detection is crash -> "every live node has
a committed view without it". A false-removal run keeps every peer alive under heavy loss and
counts views that drop a live peer and gossip 'dead' declarations about live peers.

Real runs start `p2pft peer` processes on loopback, SIGKILL one at a time (one of them the
Raft leader), restart each at the same address, and poll every peer's committed view.

    python bench/membership.py                        # sim 100 + 1,000 peers, 10 sim. minutes at 1,000
    python bench/membership.py --minutes 2 --fr-peers 300          # a shorter false-removal run
    python bench/membership.py --real --peers 16 --skip-sim --skip-fr
    python bench/membership.py --json membership.json

Big simulations check safety with a cheap fingerprint of each view (epoch, size, voters, first
and last member) instead of the full comparison the tests use, which is O(members) per event.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Sequence

from p2pft.core.config import DEFAULT
from p2pft.deploy.ports import free_ports
from p2pft.deploy.procs import spawn as spawn_child
from p2pft.sim.cluster import InvariantChecker, InvariantViolation, SimEvent, Simulator, ViewCommitted

TARGETS = {
    "real_exclusion_p50_s": 0.5,
    "real_exclusion_max_s": 1.0,
    "real_restart_max_s": 1.0,
    "sim_1000_detection_p99_s": 3.0,
    "msgs_flatness": 0.20,
    "false_removals": 0,
}


def pct(xs: Sequence[float], q: float) -> float | None:
    """Percentile with linear interpolation (q in 0..100); None for no data."""
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


# ------------------------------------------------------------------------------------ simulator
class FingerprintChecker(InvariantChecker):
    """One leader per term; epochs grow per node; one view per epoch, compared by fingerprint.
    Also counts views that drop a member which was never crashed (false removals)."""

    def __init__(self) -> None:
        super().__init__()
        self.crashed: set[str] = set()
        self.false_removals: list[tuple[float, str]] = []
        self._members: dict[str, dict[str, Any]] = {}

    def on_event(self, ev: SimEvent) -> None:
        if not isinstance(ev, ViewCommitted):
            super().on_event(ev)
            return
        node, now, payload = ev.node, ev.now, ev.view
        epoch = payload.epoch
        if epoch <= self.last_epoch.get(node, 0):
            raise InvariantViolation(f"t={now:.3f}: {node} epoch went from {self.last_epoch[node]} to {epoch}")
        self.last_epoch[node] = epoch
        ms = payload.members
        key = (epoch, len(ms), tuple(payload.voters), ms[0].node if ms else "", ms[-1].node if ms else "")
        if self.views.setdefault(epoch, key) != key:
            raise InvariantViolation(f"t={now:.3f}: two views for epoch {epoch}")
        self.max_epoch = max(self.max_epoch, epoch)
        # False removals, seen from the first node to commit each epoch (all agree anyway).
        if epoch not in self._members:
            ids = {m.node for m in ms}
            prev = self._members.get(epoch - 1)
            if prev is not None:
                for gone in prev["ids"] - ids:
                    if gone not in self.crashed:
                        self.false_removals.append((now, gone))
            self._members[epoch] = {"ids": ids}
            self._members.pop(epoch - 2, None)


def form(n: int, seed: int, checker: InvariantChecker, spacing: float = 0.002) -> Simulator:
    """n peers joining through up to 3 random earlier peers; returns once every node holds the
    same view of all n and knows all n in gossip."""
    sim = Simulator(seed, checker=checker)
    rng = random.Random(seed)
    addrs = [f"10.{i // 250}.{i % 250}.1:7000" for i in range(n)]
    sim.add_node(addrs[0])
    for i, a in enumerate(addrs[1:], start=1):
        seeds = rng.sample(addrs[:i], min(3, i))
        sim.at(spacing * i, lambda a=a, seeds=seeds: sim.add_node(a, seeds=seeds))
    calls = [0]

    def formed() -> bool:
        calls[0] += 1
        if calls[0] % 1000 or len(sim.nodes) < n:
            return False
        ld = sim.leader()
        if ld is None or ld.view is None or len(ld.view.members) != n:
            return False
        e = ld.view.epoch
        # The view, and every node's gossip table too (a mass join takes a while to spread).
        return all(x.view is not None and x.view.epoch == e and x.gossip.alive_count() == n
                   for x in sim.nodes.values())

    sim.run_until(spacing * n + 120.0, stop=formed)
    calls[0] = -1
    if not formed():
        raise RuntimeError(f"{n} simulated peers did not converge")
    return sim


def false_dead(sim: Simulator, crashed_ids: set[str]) -> int:
    """Live members some live node currently holds dead."""
    live = sim.live_ids()
    return sum(1 for x in sim.nodes.values() for m in x.gossip.members.values()
               if m.state == "dead" and m.node in live and m.node not in crashed_ids)


def formed_cluster(n: int, seed: int) -> tuple[Simulator, FingerprintChecker, float]:
    t_cpu = time.process_time()
    checker = FingerprintChecker()
    sim = form(n, seed, checker)
    cpu = time.process_time() - t_cpu
    print(f"  [{n} peers] formed (views and gossip) at {sim.now:.1f} s virtual, {cpu:.0f} s CPU",
          file=sys.stderr, flush=True)
    return sim, checker, cpu


def sim_false_removals(sim: Simulator, checker: FingerprintChecker, loss: float, minutes: float) -> dict[str, Any]:
    """No crash, heavy loss, from right after forming (the busiest time for gossip)."""
    t_wall, t_cpu = time.monotonic(), time.process_time()
    n = len(sim.nodes)
    sim.loss = loss
    epoch0 = checker.max_epoch
    removals0 = len(checker.false_removals)
    sent0, t0 = sum(sim.sent.values()), sim.now
    incs0 = sum(x.gossip.inc for x in sim.nodes.values())
    total = minutes * 60.0
    step = min(60.0, total)
    while sim.now - t0 < total - 1e-9:
        sim.run_until(min(t0 + total, sim.now + step))
        print(f"  [{n} peers, {loss:.0%} loss] {sim.now - t0:6.0f} s simulated, {time.process_time() - t_cpu:7.1f} s "
              f"CPU, false removals {len(checker.false_removals) - removals0}, views {checker.max_epoch - epoch0}",
              file=sys.stderr, flush=True)
    span = sim.now - t0
    return {
        "name": f"sim-{n}-false-removals", "kind": "sim", "peers": n, "loss": loss, "minutes": minutes,
        "detection_p50_s": None, "detection_p99_s": None,
        "false_removals": len(checker.false_removals) - removals0, "false_dead": false_dead(sim, set()),
        "views_committed": checker.max_epoch - epoch0,
        "refutations": sum(x.gossip.inc for x in sim.nodes.values()) - incs0,
        "msgs_per_node_per_s": (sum(sim.sent.values()) - sent0) / n / span,
        "virtual_s": span, "cpu_s": time.process_time() - t_cpu, "wall_s": time.monotonic() - t_wall,
    }


def sim_detection(sim: Simulator, checker: FingerprintChecker, loss: float, crashes: int, seed: int,
                  settle: float, window: float) -> dict[str, Any]:
    """Crash random non-leaders, then the leader; each must leave every live node's view."""
    t_wall, t_cpu = time.monotonic(), time.process_time()
    n = len(sim.nodes)
    sim.loss = loss
    sim.run_until(sim.now + settle)
    sent0 = sum(sim.sent.values())
    sim.run_until(sim.now + window)
    mpn = (sum(sim.sent.values()) - sent0) / n / window
    removals0 = len(checker.false_removals)
    rng = random.Random(seed + 1)
    times: list[float] = []
    leader_time = None
    for i in range(crashes):
        ld = sim.leader()
        assert ld is not None
        is_leader = i == crashes - 1
        victim = ld.addr if is_leader else rng.choice(sorted(a for a in sim.nodes if a != ld.addr))
        vid = sim.nodes[victim].id
        checker.crashed.add(vid)
        tc = sim.now
        sim.crash(victim)
        # Track who has committed a view without the victim from the view events themselves:
        # polling every node's view after every event would cost O(peers x members) per event.
        excluded: set[str] = set()

        def on_view(ev: SimEvent) -> None:
            if isinstance(ev, ViewCommitted) and ev.view.member(vid) is None:
                excluded.add(ev.addr)

        def gone() -> bool:
            return len(excluded) >= len(sim.nodes) and all(a in excluded for a in sim.nodes)

        sim.on_event = on_view
        sim.run_until(tc + 30.0, stop=gone)
        sim.on_event = None
        if not gone():
            raise RuntimeError(f"crash of {victim} not detected within 30 s virtual")
        times.append(sim.now - tc)
        if is_leader:
            leader_time = times[-1]
        print(f"  [{n} peers] crash {i + 1}/{crashes}{' (leader)' if is_leader else ''}: excluded everywhere "
              f"after {times[-1]:.3f} s virtual ({time.process_time() - t_cpu:.0f} s CPU so far)",
              file=sys.stderr, flush=True)
        sim.run_until(sim.now + 2.0)
    return {
        "name": f"sim-{n}", "kind": "sim", "peers": n, "loss": loss, "crashes": crashes,
        "detection_s": [round(t, 4) for t in times],
        "detection_p50_s": pct(times, 50), "detection_p99_s": pct(times, 99), "detection_max_s": max(times),
        "leader_detection_s": leader_time,
        "false_removals": len(checker.false_removals) - removals0, "false_dead": false_dead(sim, checker.crashed),
        "msgs_per_node_per_s": mpn, "virtual_s": settle + window + sum(times) + 2.0 * crashes,
        "cpu_s": time.process_time() - t_cpu, "wall_s": time.monotonic() - t_wall,
    }


# ------------------------------------------------------------------------------------ real peers
def _free_ports(n: int) -> list[int]:
    return free_ports(n)


def _peer_cmd() -> list[str]:
    script = Path(sys.executable).with_name("p2pft")
    return [str(script)] if script.exists() else [sys.executable, "-m", "p2pft.cli"]


async def _ask(addr: str, mtype: str = "admin.members") -> dict[str, Any] | None:
    from p2pft.net.admin import admin_request
    try:
        return await admin_request(addr, mtype, timeout=1.0)
    except (OSError, asyncio.TimeoutError, ConnectionError):
        return None


async def _all(addrs: list[str], mtype: str = "admin.members") -> dict[str, dict[str, Any] | None]:
    got = await asyncio.gather(*(_ask(a, mtype) for a in addrs))
    return dict(zip(addrs, got))


async def _poll(pred: Any, timeout: float, interval: float = 0.01) -> float:
    t0 = time.monotonic()
    while not await pred():
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"condition not met within {timeout} s")
        await asyncio.sleep(interval)
    return time.monotonic() - t0


async def real_run(n: int, kills: int, seed: int, window: float) -> dict[str, Any]:
    t_wall = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="p2pft-bench-"))
    addrs = [f"127.0.0.1:{p}" for p in _free_ports(n)]
    seeds = sorted(addrs)[:3]
    procs: dict[str, subprocess.Popen[bytes]] = {}
    env = {k: v for k, v in os.environ.items() if not k.startswith("P2PFT_")}

    def spawn(a: str) -> Path:
        ready = tmp / f"ready-{a.rsplit(':', 1)[1]}-{time.monotonic_ns()}"
        log = open(tmp / f"{a.rsplit(':', 1)[1]}.log", "ab")
        procs[a] = spawn_child(_peer_cmd() + ["--log-level", "WARNING", "peer", "--listen", a, "--seeds",
                                              ",".join(seeds), "--ready-file", str(ready)],
                               stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        log.close()
        return ready

    def settled(reps: dict[str, dict[str, Any] | None]) -> bool:
        if any(r is None for r in reps.values()):
            return False
        first = reps[addrs[0]]
        assert first is not None
        return (len({r["epoch"] for r in reps.values() if r}) == 1
                and all({m["addr"] for m in r["members"]} == set(addrs) for r in reps.values() if r)
                and sum(1 for m in first["members"] if m["voter"]) == min(5, n if n % 2 else n - 1))

    excl: list[float] = []
    restart_from_start: list[float] = []
    restart_from_bind: list[float] = []
    false_removals = 0
    try:
        for a in addrs:
            spawn(a)

        async def ok() -> bool:
            return settled(await _all(addrs))

        formed = await _poll(ok, 60.0, 0.05)
        stats0 = await _all(addrs, "admin.stats")
        t_s = time.monotonic()
        await asyncio.sleep(window)
        stats1 = await _all(addrs, "admin.stats")
        frames = sum((stats1[a] or {}).get("counters", {}).get("frames_sent", 0)
                     - (stats0[a] or {}).get("counters", {}).get("frames_sent", 0) for a in addrs)
        mpn = frames / n / (time.monotonic() - t_s)
        rng = random.Random(seed)
        for k in range(kills):
            reps = await _all(addrs)
            first = reps[addrs[0]]
            assert first is not None
            by_id = {m["node"]: m["addr"] for m in first["members"]}
            leader_addr = by_id[first["leader"]]
            victim = leader_addr if k == kills // 2 else rng.choice(sorted(a for a in addrs if a != leader_addr))
            vid = next(i for i, a in by_id.items() if a == victim)
            keep = {i for i, a in by_id.items() if a != victim}
            survivors = [a for a in addrs if a != victim]
            procs[victim].send_signal(signal.SIGKILL)
            procs[victim].wait()

            async def excluded() -> bool:
                nonlocal false_removals
                got = await _all(survivors)
                ids = [{m["node"] for m in r["members"]} if r else None for r in got.values()]
                false_removals += sum(1 for s in ids if s is not None and not keep <= s)
                return all(s is not None and vid not in s for s in ids)

            excl.append(await _poll(excluded, 10.0))
            t_start = time.monotonic()
            ready = spawn(victim)
            t_bind: float | None = None

            async def back() -> bool:
                nonlocal t_bind
                if t_bind is None and ready.exists():
                    t_bind = time.monotonic()
                got = await _all(addrs)
                if not settled(got):
                    return False
                r = got[victim]
                return r is not None and any(m["addr"] == victim and m["node"] != vid for m in r["members"])

            await _poll(back, 15.0)
            t_done = time.monotonic()
            restart_from_start.append(t_done - t_start)
            if t_bind is not None:
                restart_from_bind.append(t_done - t_bind)
            await asyncio.sleep(0.5)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
        for p in procs.values():
            p.wait()
    return {
        "name": f"real-{n}", "kind": "real", "peers": n, "loss": 0.0, "kills": kills, "formed_s": formed,
        "detection_s": [round(x, 4) for x in excl],
        "detection_p50_s": pct(excl, 50), "detection_p99_s": pct(excl, 99), "detection_max_s": max(excl),
        "restart_s": [round(x, 4) for x in restart_from_start],
        "restart_p50_s": pct(restart_from_start, 50), "restart_max_s": max(restart_from_start),
        "restart_from_bind_max_s": max(restart_from_bind) if restart_from_bind else None,
        "false_removals": false_removals, "msgs_per_node_per_s": mpn, "wall_s": time.monotonic() - t_wall,
        "logs": str(tmp),
    }


# ------------------------------------------------------------------------------------ report
def fmt(x: Any, nd: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{nd}f}"
    return str(x)


def table(rows: list[dict[str, Any]]) -> str:
    cols = [("config", "name"), ("peers", "peers"), ("loss", "loss"), ("det p50 s", "detection_p50_s"),
            ("det p99 s", "detection_p99_s"), ("det max s", "detection_max_s"), ("restart max s", "restart_max_s"),
            ("false rem.", "false_removals"), ("msgs/node/s", "msgs_per_node_per_s"), ("cpu s", "cpu_s"),
            ("wall s", "wall_s")]
    data = [[h for h, _ in cols]] + [[fmt(r.get(k)) for _, k in cols] for r in rows]
    w = [max(len(row[i]) for row in data) for i in range(len(cols))]
    return "\n".join("  ".join(c.rjust(w[i]) for i, c in enumerate(row)) for row in data)


def check_targets(rows: list[dict[str, Any]]) -> list[tuple[str, str, bool]]:
    out = []
    by = {r["name"]: r for r in rows}
    real = next((r for r in rows if r["kind"] == "real"), None)
    if real:
        out.append((f"real {real['peers']}: exclusion p50 < {TARGETS['real_exclusion_p50_s']} s",
                    fmt(real["detection_p50_s"]), real["detection_p50_s"] < TARGETS["real_exclusion_p50_s"]))
        out.append((f"real {real['peers']}: exclusion max < {TARGETS['real_exclusion_max_s']} s",
                    fmt(real["detection_max_s"]), real["detection_max_s"] < TARGETS["real_exclusion_max_s"]))
        out.append((f"real {real['peers']}: restarted peer in every view < {TARGETS['real_restart_max_s']} s "
                    "of its start", fmt(real["restart_max_s"]), real["restart_max_s"] < TARGETS["real_restart_max_s"]))
    big = max((r for r in rows if r["kind"] == "sim" and r.get("detection_p99_s") is not None),
              key=lambda r: r["peers"], default=None)
    if big:
        out.append((f"sim {big['peers']}: detection p99 <= {TARGETS['sim_1000_detection_p99_s']} s",
                    fmt(big["detection_p99_s"]), big["detection_p99_s"] <= TARGETS["sim_1000_detection_p99_s"]))
    sims = sorted((r for r in rows if r["kind"] == "sim" and r.get("detection_p99_s") is not None),
                  key=lambda r: r["peers"])
    if len(sims) >= 2:
        a, b = sims[0]["msgs_per_node_per_s"], sims[-1]["msgs_per_node_per_s"]
        ratio = abs(b - a) / a
        out.append((f"msgs/node/s flat {sims[0]['peers']} -> {sims[-1]['peers']} (within 20%)",
                    f"{a:.2f} -> {b:.2f} ({(b - a) / a:+.0%})", ratio <= TARGETS["msgs_flatness"]))
    for r in rows:
        if r.get("false_removals") is not None:
            out.append((f"{r['name']}: zero false removals", str(r["false_removals"]), r["false_removals"] == 0))
    _ = by
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--sim-peers", default="100,1000", help="comma-separated cluster sizes for detection runs")
    p.add_argument("--loss", type=float, default=0.01, help="message loss in detection runs")
    p.add_argument("--crashes", type=int, default=10, help="crashes per detection run (the last is the leader)")
    p.add_argument("--settle", type=float, default=10.0, help="virtual s after forming before measuring")
    p.add_argument("--window", type=float, default=10.0, help="virtual s over which msgs/node/s is measured")
    p.add_argument("--fr-peers", type=int, default=1000, help="peers in the false-removal run")
    p.add_argument("--fr-loss", type=float, default=0.05, help="message loss in the false-removal run")
    p.add_argument("--minutes", type=float, default=10.0, help="simulated minutes of the false-removal run")
    p.add_argument("--real", action="store_true", help="also run real `p2pft peer` processes")
    p.add_argument("--peers", type=int, default=16, help="real peer processes")
    p.add_argument("--kills", type=int, default=5, help="SIGKILLs in the real run")
    p.add_argument("--skip-sim", action="store_true", help="no simulated detection runs")
    p.add_argument("--skip-fr", action="store_true", help="no false-removal run")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", metavar="FILE", help="write the results as JSON")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    gc.set_threshold(100_000, 50, 100)   # big simulations allocate many small, long-lived dicts
    rows: list[dict[str, Any]] = []
    sizes = [] if args.skip_sim else [int(x) for x in args.sim_peers.split(",") if x]
    if not args.skip_fr and args.fr_peers not in sizes:
        sizes.append(args.fr_peers)
    for n in sizes:
        # One formed cluster per size (forming 1,000 peers is the costly part): first the
        # false-removal run if this is its size, then the crashes.
        print(f"simulating {n} peers ...", file=sys.stderr, flush=True)
        sim, checker, form_cpu = formed_cluster(n, args.seed)
        if not args.skip_fr and n == args.fr_peers:
            print(f"false-removal run: {n} peers, {args.fr_loss:.0%} loss, {args.minutes:g} simulated minutes ...",
                  file=sys.stderr, flush=True)
            rows.append(sim_false_removals(sim, checker, args.fr_loss, args.minutes))
        if not args.skip_sim and n in [int(x) for x in args.sim_peers.split(",") if x]:
            print(f"detection run: {n} peers, {args.loss:.0%} loss, {args.crashes} crashes ...", file=sys.stderr,
                  flush=True)
            row = sim_detection(sim, checker, args.loss, args.crashes, args.seed, args.settle, args.window)
            row["form_cpu_s"] = form_cpu
            rows.append(row)
    if args.real:
        print(f"real run: {args.peers} peer processes, {args.kills} SIGKILLs ...", file=sys.stderr, flush=True)
        rows.append(asyncio.run(real_run(args.peers, args.kills, args.seed, window=5.0)))
    checks = check_targets(rows)
    result = {"profile": asdict(DEFAULT), "configs": rows,
              "targets": [{"target": t, "measured": m, "met": ok} for t, m, ok in checks]}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(table(rows))
    if checks:
        print()
        w = max(len(t) for t, _, _ in checks)
        for t, m, ok in checks:
            print(f"{'PASS' if ok else 'MISS'}  {t.ljust(w)}  {m}")
    for r in rows:
        if r["kind"] == "sim" and r.get("detection_s"):
            print(f"{r['name']}: detections {r['detection_s']} (last = leader)")
        if r["kind"] == "real":
            print(f"{r['name']}: exclusions {r['detection_s']} s, restarts {r['restart_s']} s (from process start)")
    _ = statistics
    return 0


if __name__ == "__main__":
    sys.exit(main())
