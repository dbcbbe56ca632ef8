"""Soak: a long chaos run with mixed faults; resources must stay flat and invariants hold.

A p2pft cluster (3 replicas and 2 witness peers by default) trains for ``--minutes`` while a
random fault hits every ``--fault-every`` seconds: SIGKILL + restart, SIGSTOP for longer than the
failure timeout, or SIGSTOP for shorter. Every ``--sample-every`` seconds the RSS, open file
descriptors and threads of every process are read from /proc. After the warm-up, each
long-lived process (the witnesses and any replica incarnation that lived through the whole
sample window) must stay within ``--tolerance`` of its level after its own warm-up (descriptors
and threads may also move by one communicator's worth: 4 and 2); the chaos
invariants (no survivor crash, no divergent step) must hold, and no view may drop a replica
after a pause shorter than the failure timeout (a false removal, read from the processes' logs).

    python bench/soak.py --minutes 30 --json results/soak.json
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from p2pft.chaos.cluster import ChaosConfig, Cluster
from p2pft.chaos.metrics import read_stats, summarize


VIEW_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*p2pft\.net\.driver: view e(\d+): (.*)$")
#: After a pause shorter than the failure timeout, how long a view may still come that drops the
#: paused replica and count as a false removal (detection takes at most about a second).
REMOVAL_WINDOW_S = 5.0


def views_from_logs(folder: Path) -> list[tuple[float, int, set[str]]]:
    """(first time seen, epoch, replica ids) of every view the processes' logs name."""
    first: dict[int, tuple[float, set[str]]] = {}
    for log in folder.glob("*.log"):
        for line in log.read_text(errors="replace").splitlines():
            m = VIEW_LINE.match(line)
            if not m:
                continue
            t = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            epoch = int(m.group(2))
            ids = {tok.split("(", 1)[0] for tok in m.group(3).split()}
            if epoch not in first or t < first[epoch][0]:
                first[epoch] = (t, ids)
    return sorted((t, e, ids) for e, (t, ids) in first.items())


def false_removals(views: list[tuple[float, int, set[str]]], short: list[tuple[float, int]],
                   other: list[tuple[float, int]]) -> list[tuple[float, int, int]]:
    """Short pauses after which a view dropped the paused replica, though no kill or long pause
    hit it in the window: (time after the start, replica, epoch)."""
    out = []
    for t, i in short:
        end = t + REMOVAL_WINDOW_S
        if any(t <= tf <= end and j == i for tf, j in other):
            continue
        gone = [e for tv, e, ids in views if t <= tv <= end and f"r{i}" not in ids]
        if gone:
            out.append((t, i, gone[0]))
    return out


def proc_sample(pid: int) -> dict[str, int] | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    out = {"fds": fds}
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            out["rss_kb"] = int(line.split()[1])
        elif line.startswith("Threads:"):
            out["threads"] = int(line.split()[1])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--fault-every", type=float, default=10.0)
    ap.add_argument("--restart-after", type=float, default=2.0)
    ap.add_argument("--sample-every", type=float, default=5.0)
    ap.add_argument("--warmup", type=float, default=60.0, help="seconds before resource baselines are taken")
    ap.add_argument("--tolerance", type=float, default=0.10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    duration = args.minutes * 60
    cfg = ChaosConfig(replicas=3, duration=duration, kill_every=args.fault_every, restart_after=args.restart_after,
                      seed=args.seed)
    work = Path(tempfile.mkdtemp(prefix="p2pft-soak-"))
    c = Cluster("p2pft", cfg, work)
    rng = random.Random(args.seed)
    c.start()
    deadline = time.time() + 300
    while not all(any(r.get("kind") == "start" for r in read_stats(p.stats)) for p in c.procs.values()):
        if time.time() > deadline:
            raise SystemExit("replicas did not start")
        time.sleep(0.2)
    c.go()
    t0 = time.time()
    samples: dict[str, list[tuple[float, dict[str, int]]]] = {}
    faults: dict[str, int] = {"kill": 0, "pause_long": 0, "pause_short": 0}
    pending: list[tuple[float, str, int]] = []
    short: list[tuple[float, int]] = []      # (time, replica) of each pause shorter than the failure timeout
    other: list[tuple[float, int]] = []      # kills and long pauses: the replica may leave the view
    next_fault, next_sample = t0 + args.fault_every, t0
    try:
        while time.time() - t0 < duration:
            now = time.time()
            if now >= next_fault:
                next_fault += args.fault_every
                victims = c.training()
                if len(victims) >= 2:
                    i = rng.choice(victims)
                    kind = rng.choice(["kill", "kill", "pause_long", "pause_short"])
                    faults[kind] += 1
                    (short if kind == "pause_short" else other).append((now, i))
                    if kind == "kill":
                        c.signal(i, signal.SIGKILL, "kill")
                        pending.append((now + args.restart_after, "spawn", i))
                    else:
                        c.signal(i, signal.SIGSTOP, "pause")
                        c.procs[i].paused = True
                        pending.append((now + (4.0 if kind == "pause_long" else 0.3), "cont", i))
            for item in list(pending):
                if now >= item[0]:
                    pending.remove(item)
                    if item[1] == "spawn":
                        if item[2] not in c.procs:
                            c.spawn(item[2])
                    elif item[2] in c.procs:
                        c.signal(item[2], signal.SIGCONT, "resume")
                        c.procs[item[2]].paused = False
            if now >= next_sample:
                next_sample += args.sample_every
                procs = {f"w{k}": w.popen.pid for k, w in enumerate(c.witness_procs)}
                procs.update({f"r{p.replica}.{p.incarnation}": p.popen.pid for p in c.procs.values()})
                for name, pid in procs.items():
                    s = proc_sample(pid)
                    if s:
                        samples.setdefault(name, []).append((now - t0, s))
            c.reap()
            time.sleep(0.05)
    finally:
        t_end = time.time()
        c.stop()
    row = summarize(c, t_end)
    report: dict[str, Any] = {"minutes": args.minutes, "faults": faults, "processes": {}}
    flat = True
    for name, series in samples.items():
        born = series[0][0]
        after = [s for t, s in series if t >= born + args.warmup]  # each process's own warm-up
        if len(after) < 3:
            continue
        first, last = after[0], after[-1]
        growth = {k: (last[k] - first[k]) / max(1, first[k]) for k in ("rss_kb", "fds", "threads") if k in first}
        # Small counts move by one communicator (its socket pair and lane thread) between two
        # samples: allow that much absolute slack on descriptors and threads, not on memory.
        slack = {"rss_kb": 0, "fds": 4, "threads": 2}
        ok = all(g <= args.tolerance or last[k] - first[k] <= slack[k] for k, g in growth.items())
        flat &= ok
        report["processes"][name] = {"first": first, "last": last, "growth": growth, "flat": ok,
                                     "samples": len(after)}
    report.update({k: row.get(k) for k in ("final_step", "kills", "survivor_crashes", "divergent_steps",
                                           "digest_steps_checked", "stall_max_s")})
    removed = false_removals(views_from_logs(work), short, other)
    report["false_removals"] = [{"t": round(t - t0, 1), "replica": i, "epoch": e} for t, i, e in removed]
    ok_all = flat and row["survivor_crashes"] == 0 and row["divergent_steps"] == 0 and not removed
    report["ok"] = ok_all
    print(f"{'process':<10}{'samples':>8}{'RSS MB first→last':>22}{'fds':>12}{'threads':>12}  flat")
    for name, p in sorted(report["processes"].items()):
        a, b = p["first"], p["last"]
        print(f"{name:<10}{p['samples']:>8}{a['rss_kb'] / 1024:>11.1f}→{b['rss_kb'] / 1024:<10.1f}"
              f"{a['fds']:>5}→{b['fds']:<6}{a['threads']:>5}→{b['threads']:<6}  {p['flat']}")
    print(f"faults {faults}; final step {row['final_step']}; survivor crashes {row['survivor_crashes']}; "
          f"divergent steps {row['divergent_steps']} of {row['digest_steps_checked']} checked; "
          f"false removals after {len(short)} short pauses: {len(removed)} {report['false_removals']}; ok={ok_all}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0 if ok_all else 1


if __name__ == "__main__":
    sys.exit(main())
