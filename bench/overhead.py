"""Failure-free overhead: p2pft against plain torch DDP with Gloo, each alone, back to back.

`p2pft chaos` runs its systems at the same time, so they share the two cores with each other;
this benchmark runs each system alone on the machine, one after the other, in the order
p2pft, ddp, ddp, p2pft, ... (ABBA, so that a drift in the machine's load hits both alike).
Each run trains the chaos harness's job (same model, batch and emulated accelerator time) for
``--duration`` seconds with no failure. p2pft runs with its witnesses; DDP runs with its
rendezvous store, as torchrun would start it.

We report, per run, the steps committed, the median step time and the CPU seconds of all the
system's processes, and the ratio of p2pft's steps to DDP's (mean over the rounds). The target
is p2pft within 2% of DDP's steps.

    python bench/overhead.py --rounds 2 --json results/overhead.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from p2pft.chaos.cluster import ChaosConfig
from p2pft.chaos.interrupt import Interrupt, Interrupted
from p2pft.chaos.run import run_chaos

SYSTEMS = {"p2pft": "failure_free", "ddp": "ddp"}


def one_run(system: str, cfg: ChaosConfig, workdir: Path, interrupt: Interrupt) -> dict[str, Any]:
    """Train `system` alone for cfg.duration seconds; its row of the chaos report."""
    report = run_chaos(cfg, workdir, systems=(SYSTEMS[system],), interrupt=interrupt)
    row = report["systems"][0]
    cpu = row.get("cpu_s") or {}
    steps = int(row["final_step"])
    return {"system": system, "steps": steps, "step_p50_s": row.get("step_time_p50_s"),
            "cpu_s": cpu, "cpu_s_per_step": round(sum(cpu.values()) / steps, 4) if steps else None,
            "crashes": row.get("survivor_crashes"), "interrupted": report.get("interrupted")}


def order(rounds: int) -> list[str]:
    """ABBA: p2pft, ddp, ddp, p2pft, p2pft, ddp, ..."""
    out: list[str] = []
    for r in range(rounds):
        out += ["p2pft", "ddp"] if r % 2 == 0 else ["ddp", "p2pft"]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2, help="runs of each system (alternating ABBA)")
    ap.add_argument("--duration", type=float, default=30.0, help="seconds of training per run")
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--witnesses", type=int, default=2, help="p2pft's witness peers (voters)")
    ap.add_argument("--step-delay", type=float, default=0.1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.rounds < 1 or args.duration <= 0:
        ap.error("--rounds must be at least 1 and --duration positive")
    # No failure within the run: the schedule's first failure lies past its end.
    cfg = ChaosConfig(replicas=args.replicas, duration=args.duration, kill_every=args.duration * 100,
                      step_delay=args.step_delay, witnesses=args.witnesses)
    runs: list[dict[str, Any]] = []
    interrupt = Interrupt()
    with tempfile.TemporaryDirectory(prefix="p2pft-overhead-") as tmp, interrupt.handling():
        for i, system in enumerate(order(args.rounds)):
            try:
                row = one_run(system, cfg, Path(tmp) / f"{i}-{system}", interrupt)
            except Interrupted as exc:   # before this run trained: nothing of it to report
                print(f"run {i + 1}: {exc}", flush=True)
                break
            runs.append(row)
            print(f"run {i + 1}: {system:6s} {row['steps']:4d} steps  step p50 {row['step_p50_s']} s  "
                  f"CPU {sum(row['cpu_s'].values()):.1f} s ({row['cpu_s_per_step']} s/step)", flush=True)
            if interrupt.requested:
                break
    by = {s: [r["steps"] for r in runs if r["system"] == s] for s in SYSTEMS}
    ratio = (statistics.mean(by["p2pft"]) / statistics.mean(by["ddp"])) if by["p2pft"] and by["ddp"] else None
    pairs = [a["steps"] / b["steps"] for a, b in _pairs(runs) if b["steps"]]
    print()
    print(f"{'system':8s} {'steps per run':24s} {'mean':>7s}")
    for s, v in by.items():
        print(f"{s:8s} {' / '.join(map(str, v)):24s} {statistics.mean(v) if v else float('nan'):7.1f}")
    if ratio is not None:
        print(f"p2pft / ddp steps: {ratio:.3f} ({(ratio - 1) * 100:+.1f}%); "
              f"per adjacent pair: {', '.join(f'{p:.3f}' for p in pairs)}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({
            "config": {"duration": args.duration, "replicas": args.replicas, "witnesses": args.witnesses,
                       "step_delay": args.step_delay, "rounds": args.rounds},
            "runs": runs, "steps_ratio": round(ratio, 4) if ratio else None,
            "pair_ratios": [round(p, 4) for p in pairs], "at": time.time()}, indent=2))
    return 0 if not interrupt.requested else 128 + (interrupt.signum or 0)


def _pairs(runs: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(p2pft run, ddp run) for each adjacent pair in run order."""
    out = []
    for a, b in zip(runs[0::2], runs[1::2]):
        out.append((a, b) if a["system"] == "p2pft" else (b, a))
    return out


if __name__ == "__main__":
    raise SystemExit(main())
