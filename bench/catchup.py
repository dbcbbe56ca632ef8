"""Non-blocking catch-up of a large replica: the survivors must not slow down.

Two replicas train a plain MLP of ``--params`` parameters with AdamW (50M parameters: about
600 MB of weights and optimizer state) and ``--step-delay`` seconds of emulated accelerator time
per step. A third replica then starts fresh and joins: it takes part in every allreduce with
zero gradients from its first view, pulls a snapshot from a survivor in the background, replays
the logged mean gradients, and is promoted. We report the survivors' median step time before and
during the catch-up, how long the catch-up took (in steps too: it may take far longer than one
step), and whether the joiner ends bitwise equal to the survivors (state digests at equal steps).

    python bench/catchup.py --params 50000000 --json results/catchup.json
    python bench/catchup.py --quick          # 5M parameters, for a fast look
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from p2pft.deploy.ports import free_ports
from p2pft.chaos.records import read_stats
from p2pft.deploy.procs import spawn as spawn_child, terminate


def commits(path: Path) -> list[dict[str, Any]]:
    return [r for r in read_stats(path) if r.get("kind") is None and r.get("c")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=int, default=50_000_000)
    ap.add_argument("--step-delay", type=float, default=0.1)
    ap.add_argument("--warmup-steps", type=int, default=15, help="survivor steps before the joiner starts")
    ap.add_argument("--after-steps", type=int, default=15, help="steps to run after the joiner is promoted")
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--quick", action="store_true", help="5M parameters")
    ap.add_argument("--pin", action="store_true",
                    help="the two survivors on core 0, the joiner alone on core 1 (taskset): the donor-side "
                         "cost of a catch-up, without the joiner competing for the survivors' core")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.quick:
        args.params = 5_000_000
    tmp = Path(tempfile.mkdtemp(prefix="p2pft-catchup-"))
    addrs = [f"127.0.0.1:{p}" for p in free_ports(3)]
    procs: dict[int, subprocess.Popen[bytes]] = {}

    def spawn(i: int) -> None:
        seeds = ",".join(a for j, a in enumerate(addrs) if j != i)
        cmd = [sys.executable, "-m", "p2pft.trainer.examples.replica", "--replica-id", f"r{i}", "--listen",
               addrs[i], "--seeds", seeds, "--mlp-params", str(args.params), "--batch", "8", "--step-delay",
               str(args.step_delay), "--stats", str(tmp / f"r{i}.jsonl"), "--digest-every", "1",
               "--log-level", "INFO", "--min-replicas", "2" if i < 2 else "1"]
        if args.pin:  # survivors share core 0, the joiner has core 1 to itself
            cmd = ["taskset", "-c", "0" if i < 2 else "1", *cmd]
        log = open(tmp / f"r{i}.log", "wb")
        procs[i] = spawn_child(cmd, stdout=subprocess.DEVNULL, stderr=log, env=dict(os.environ, OMP_NUM_THREADS="1"))
        log.close()

    def wait(cond: Any, what: str) -> None:
        deadline = time.time() + args.timeout
        while time.time() < deadline:
            if cond():
                return
            for i, p in procs.items():
                if p.poll() is not None:
                    raise SystemExit(f"replica r{i} exited ({p.returncode}); see {tmp}/r{i}.log")
            time.sleep(0.2)
        raise SystemExit(f"timed out waiting for {what}; logs in {tmp}")

    try:
        spawn(0)
        spawn(1)
        wait(lambda: len(commits(tmp / "r0.jsonl")) >= args.warmup_steps, "survivors' warm-up")
        t_join = time.time()
        spawn(2)
        wait(lambda: any(r.get("event") == "catchup_done" for r in read_stats(tmp / "r2.jsonl")), "catch-up")
        wait(lambda: any(r.get("c") and r.get("role") == "participant" for r in commits(tmp / "r2.jsonl")),
             "promotion")
        target = max(r["step"] for r in commits(tmp / "r0.jsonl")) + args.after_steps
        wait(lambda: all(max((r["step"] for r in commits(tmp / f"r{i}.jsonl")), default=0) >= target
                         for i in range(3)), "steps after promotion")
    finally:
        terminate(list(procs.values()), grace=60)
    r0 = commits(tmp / "r0.jsonl")
    j = read_stats(tmp / "r2.jsonl")
    start = next(r for r in j if r.get("kind") == "start")
    done = next(r for r in j if r.get("event") == "catchup_done")
    t_start, t_done = float(start["t"]), float(done["t"])

    def step_times(lo: float, hi: float) -> list[float]:
        ts = [float(r["t"]) for r in r0]
        return [b - a for a, b in zip(ts, ts[1:]) if lo <= a and b <= hi]

    before = step_times(0, t_join)
    during = step_times(t_start, t_done)
    # Once promoted the joiner trains too: on a host with fewer cores than replicas that alone
    # slows every replica, so the steps after promotion are the baseline for what a third
    # replica costs, separate from what the catch-up costs.
    t_three = min((float(r["t"]) for r in r0 if r.get("n") == 3), default=float("inf"))
    after = step_times(t_three, float("inf"))
    steps_during = sum(1 for r in r0 if t_start <= r["t"] <= t_done)
    digests: dict[int, set[str]] = {}
    for i in range(3):
        for r in commits(tmp / f"r{i}.jsonl"):
            if "digest" in r:
                digests.setdefault(int(r["step"]), set()).add(r["digest"])
    joiner_steps = {int(r["step"]) for r in commits(tmp / "r2.jsonl") if "digest" in r}
    compared = [s for s in joiner_steps if len(digests.get(s, ())) >= 1 and s in
                {int(r["step"]) for r in r0 if "digest" in r}]
    equal = all(len(digests[s]) == 1 for s in compared) and bool(compared)
    med_before = statistics.median(before) if before else float("nan")
    med_during = statistics.median(during) if during else float("nan")
    med_after = statistics.median(after) if after else float("nan")
    out = {
        "params": args.params, "state_mb": round(args.params * 3 * 4 / 1e6, 1),
        "step_delay_s": args.step_delay,
        "survivor_step_p50_before_s": round(med_before, 4),
        "survivor_step_p50_during_s": round(med_during, 4),
        "slowdown": round(med_during / med_before - 1.0, 4) if before and during else None,
        "survivor_step_p50_after_s": round(med_after, 4),
        "slowdown_vs_after": round(med_during / med_after - 1.0, 4) if after and during else None,
        "cpus": os.cpu_count(),
        "catchup_s": round(t_done - t_start, 3), "catchup_steps": steps_during,
        "snapshot_fetch_s": done.get("fetch_s"), "replayed_steps": done.get("replayed"),
        "joiner_bitwise_equal": equal, "steps_compared": len(compared),
    }
    print(f"{'parameters':<32}{args.params:>14,}")
    print(f"{'weights + AdamW state (MB)':<32}{out['state_mb']:>14}")
    print(f"{'survivor step p50 before (s)':<32}{out['survivor_step_p50_before_s']:>14}")
    print(f"{'survivor step p50 during (s)':<32}{out['survivor_step_p50_during_s']:>14}")
    print(f"{'slowdown during catch-up':<32}{(out['slowdown'] or 0) * 100:>13.1f}%")
    print(f"{'survivor step p50 after (s)':<32}{out['survivor_step_p50_after_s']:>14}  (3 replicas training)")
    print(f"{'during vs after promotion':<32}{(out['slowdown_vs_after'] or 0) * 100:>13.1f}%")
    print(f"{'catch-up time (s)':<32}{out['catchup_s']:>14}")
    print(f"{'survivor steps during catch-up':<32}{out['catchup_steps']:>14}")
    print(f"{'snapshot fetch (s)':<32}{out['snapshot_fetch_s'] or 0:>14.2f}")
    print(f"{'replayed steps':<32}{out['replayed_steps']:>14}")
    print(f"{'joiner bitwise equal':<32}{str(out['joiner_bitwise_equal']):>14} ({len(compared)} steps)")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
