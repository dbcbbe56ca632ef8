"""Where a restarted replica's seconds go, from the kill to its first step as a participant.

Two replicas of the example job (``trainer/examples/replica.py``) and two witnesses (``p2pft
peer``, the voters that outlive a replica) run; one replica is SIGKILLed and started again (as a
launcher would), ``--restarts`` times. From the restarted process's own
records (its start record, its first view, the catch-up events, its first commit as a
participant) each restart is split into phases:

======================  ====================================================================
spawn                   ``Popen`` until the interpreter runs the script's first line
imports                 torch, p2pft and the example's modules
model                   building the model and optimizer
runtime start           binding the ports, the control plane's first gossip
engine                  ``FaultTolerant(...)``: step buffer, data server, side channel
first view              until the leader puts the new process in a view (as a joiner)
to snapshot request     until the catch-up worker asks a donor for its state
snapshot + replay       fetch, restore, replay of the logged steps, hand-over ('ready')
promotion               until its first committed step as a participant
======================  ====================================================================

    python bench/startup.py                      # 3 restarts, table on stdout
    python bench/startup.py --restarts 5 --json results/startup.json
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from p2pft.chaos.records import read_stats
from p2pft.deploy.ports import free_ports
from p2pft.deploy.procs import spawn as spawn_child, terminate

PHASES = ("spawn", "imports", "model", "runtime start", "engine", "first view", "to snapshot request",
          "snapshot + replay", "promotion")


def commits(path: Path) -> list[dict[str, Any]]:
    return [r for r in read_stats(path) if r.get("kind") is None and r.get("c")]


def phases(recs: list[dict[str, Any]], t_spawn: float) -> dict[str, float] | None:
    """The phases of one start of a replica, from its records (None: it did not get that far)."""
    start = next((r for r in recs if r.get("kind") == "start"), None)
    view = next((r for r in recs if r.get("kind") == "first_view"), None)
    fetch = next((r for r in recs if r.get("event") == "catchup_fetch"), None)
    done = next((r for r in recs if r.get("event") == "catchup_done"), None)
    part = next((r for r in recs if r.get("kind") is None and r.get("c") and r.get("role") == "participant"), None)
    if not (start and view and done and part):
        return None
    marks = [t_spawn, float(start["t_process"]), float(start["t_imported"]), float(start["t_model"]),
             float(start["t_runtime"]), float(start["t_engine"]), max(float(view["t_view"]), float(start["t_engine"])),
             float(fetch["t"] if fetch else done["t"]), float(done["t"]), float(part["t"])]
    return {name: round(max(0.0, b - a), 3) for name, a, b in zip(PHASES, marks, marks[1:])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--restarts", type=int, default=3)
    ap.add_argument("--step-delay", type=float, default=0.05)
    ap.add_argument("--warmup-steps", type=int, default=10, help="steps before each kill")
    ap.add_argument("--timeout", type=float, default=120.0, help="per wait (s)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--keep", action="store_true", help="keep the run's directory (logs, stats)")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="p2pft-startup-"))
    ports = free_ports(4)
    addrs = [f"127.0.0.1:{p}" for p in ports[:2]]
    witnesses = [f"127.0.0.1:{p}" for p in ports[2:]]
    procs: dict[str, subprocess.Popen[bytes]] = {}

    def spawn_witness(k: int) -> None:
        seeds = ",".join(a for a in addrs + witnesses if a != witnesses[k])
        log = open(tmp / f"w{k}.log", "wb")
        procs[f"w{k}"] = spawn_child([sys.executable, "-m", "p2pft", "--log-level", "INFO", "peer", "--listen",
                                      witnesses[k], "--seeds", seeds, "--replica-id", f"w{k}"],
                                     stdout=subprocess.DEVNULL, stderr=log)
        log.close()

    def spawn(i: int, name: str) -> float:
        seeds = ",".join(a for j, a in enumerate(addrs) if j != i)
        seeds = ",".join([seeds] + witnesses)
        cmd = [sys.executable, "-m", "p2pft.trainer.examples.replica", "--replica-id", f"r{i}", "--listen",
               addrs[i], "--seeds", seeds, "--batch", "4", "--step-delay", str(args.step_delay),
               "--stats", str(tmp / f"{name}.jsonl"), "--digest-every", "0", "--log-level", "INFO",
               "--progress", "off"] + (["--min-replicas", "2"] if name.endswith("-0") else [])
        log = open(tmp / f"{name}.log", "wb")
        t = time.time()
        procs[name] = spawn_child(cmd, stdout=subprocess.DEVNULL, stderr=log,
                                  env=dict(os.environ, OMP_NUM_THREADS="1"))
        log.close()
        return t

    def wait(cond: Any, what: str) -> None:
        deadline = time.time() + args.timeout
        while time.time() < deadline:
            if cond():
                return
            for name, p in procs.items():
                if p.poll() is not None and p.returncode != -signal.SIGKILL:
                    raise SystemExit(f"{name} exited ({p.returncode}); see {tmp}/{name}.log")
            time.sleep(0.05)
        raise SystemExit(f"timed out waiting for {what}; logs in {tmp}")

    def last(name: str) -> int:
        c = commits(tmp / f"{name}.jsonl")
        return int(c[-1]["step"]) if c else -1

    runs: list[dict[str, float]] = []
    try:
        spawn_witness(0)
        spawn_witness(1)
        t_cold = [spawn(0, "r0-0"), spawn(1, "r1-0")]
        wait(lambda: min(last("r0-0"), last("r1-0")) >= 1, "the first step of a cold start")
        cold = max(float(commits(tmp / f"r{i}-0.jsonl")[0]["t"]) for i in range(2)) - min(t_cold)
        victim = "r1-0"
        for k in range(1, args.restarts + 1):
            at = last("r0-0")
            wait(lambda: last("r0-0") >= at + args.warmup_steps, "warm-up steps")
            procs[victim].send_signal(signal.SIGKILL)
            procs[victim].wait(timeout=10)
            name = f"r1-{k}"
            t_spawn = spawn(1, name)
            wait(lambda: phases(read_stats(tmp / f"{name}.jsonl"), t_spawn) is not None, f"{name} to take part")
            ph = phases(read_stats(tmp / f"{name}.jsonl"), t_spawn)
            assert ph is not None
            runs.append(ph)
            victim = name
    finally:
        terminate(list(procs.values()), grace=20)
    med = {p: round(statistics.median(r[p] for r in runs), 3) for p in PHASES}
    total = [round(sum(r.values()), 3) for r in runs]
    print(f"{'phase':<24}{'median s':>10}  " + "  ".join(f"{'run ' + str(i + 1):>7}" for i in range(len(runs))))
    for p in PHASES:
        print(f"{p:<24}{med[p]:>10.3f}  " + "  ".join(f"{r[p]:>7.3f}" for r in runs))
    print(f"{'kill -> participant':<24}{statistics.median(total):>10.3f}  " + "  ".join(f"{t:>7.3f}" for t in total))
    print(f"{'cold start (2 replicas)':<24}{cold:>10.3f}  (spawn -> both committed step 1)")
    out = {"phases_median_s": med, "runs": runs, "total_s": total, "cold_start_2_s": round(cold, 3),
           "cpus": os.cpu_count(), "step_delay_s": args.step_delay}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2))
    if not args.keep:
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        print(f"logs and stats in {tmp}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
