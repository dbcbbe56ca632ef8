"""Training quality under failures: the loss curve with a kill every 10 steps vs. none.

Two clusters of the example language model train side by side: one failure-free, one where a
random replica is SIGKILLed every ``--kill-every-steps`` committed steps (and restarted
``--restart-after`` seconds later), never the last one standing. Both log the loss on the same
fixed held-out batch every ``--eval-every`` steps; we compare the curves at equal steps and draw
both into a PNG.

    python bench/quality.py --steps 300 --json results/quality.json --plot results/quality.png
"""
from __future__ import annotations

import argparse
import json
import random
import signal
import sys
import tempfile
import time
from pathlib import Path

from p2pft.chaos.cluster import ChaosConfig, Cluster
from p2pft.chaos.metrics import read_stats


def evals(cluster: Cluster) -> dict[int, float]:
    out: dict[int, float] = {}
    for p in list(cluster.procs.values()) + cluster.finished:
        for r in read_stats(p.stats):
            if "eval" in r:
                out[int(r["step"])] = float(r["eval"])
    return out


def participating(cluster: Cluster) -> list[int]:
    """Replicas that committed as contributing participants in the last two seconds."""
    now = time.time()
    out = []
    for i, p in cluster.procs.items():
        recs = [r for r in read_stats(p.stats)[-10:] if r.get("kind") is None and r.get("c")]
        if recs and recs[-1].get("role") == "participant" and now - float(recs[-1]["t"]) < 2.0:
            out.append(i)
    return out


def head_step(cluster: Cluster) -> int:
    best = 0
    for p in list(cluster.procs.values()) + cluster.finished:
        for r in read_stats(p.stats)[-5:]:
            if r.get("kind") is None and "step" in r:
                best = max(best, int(r["step"]))
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--kill-every-steps", type=int, default=10)
    ap.add_argument("--restart-after", type=float, default=1.0)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--step-delay", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=1200.0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None)
    args = ap.parse_args()
    cfg = ChaosConfig(replicas=args.replicas, step_delay=args.step_delay, seed=args.seed, digest_every=10,
                      extra_args=("--eval-every", str(args.eval_every), "--steps", str(args.steps)))
    work = Path(tempfile.mkdtemp(prefix="p2pft-quality-"))
    clusters = {name: Cluster(name, cfg, work / name) for name in ("failures", "failure_free")}
    rng = random.Random(args.seed)
    kills = 0
    pending: list[tuple[float, int]] = []
    for c in clusters.values():
        c.start()
    deadline = time.time() + args.timeout
    started = False
    next_kill = args.kill_every_steps
    try:
        while time.time() < deadline:
            if not started and all(any(r.get("kind") == "start" for r in read_stats(p.stats))
                                   for c in clusters.values() for p in c.procs.values()):
                for c in clusters.values():
                    c.go()
                started = True
            f = clusters["failures"]
            step = head_step(f)
            if started and step >= next_kill and step < args.steps - 5:
                next_kill = step + args.kill_every_steps
                live = participating(f)
                if len(live) >= 2:  # never the last replica holding the state
                    victim = rng.choice(live)
                    f.signal(victim, signal.SIGKILL, "kill")
                    kills += 1
                    pending.append((time.time() + args.restart_after, victim))
            for t, i in list(pending):
                if time.time() >= t:
                    pending.remove((t, i))
                    f.spawn(i)
            for c in clusters.values():
                c.reap()
            if all(head_step(c) >= args.steps for c in clusters.values()):
                break  # replicas still joining at the end have nothing left to train
            time.sleep(0.05)
    finally:
        for c in clusters.values():
            c.stop()
    ff, fl = evals(clusters["failure_free"]), evals(clusters["failures"])
    common = sorted(set(ff) & set(fl))
    if not common:
        print("no common eval steps; logs in", work)
        return 1
    last = common[-1]
    rel = (fl[last] - ff[last]) / ff[last]
    rows = [(s, ff[s], fl[s]) for s in common]
    print(f"{'step':>6} {'failure-free':>13} {'with failures':>14}")
    shown = rows[:: max(1, len(rows) // 12)]
    if shown[-1] != rows[-1]:
        shown.append(rows[-1])
    for s, a, b in shown:
        print(f"{s:>6} {a:>13.4f} {b:>14.4f}")
    print(f"kills: {kills}; final step {last}: failures {fl[last]:.4f} vs failure-free {ff[last]:.4f} "
          f"({rel * 100:+.2f}%)")
    out = {"steps": last, "kills": kills, "kill_every_steps": args.kill_every_steps,
           "final_loss_failure_free": ff[last], "final_loss_failures": fl[last], "relative_diff": rel,
           "curve": rows}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2))
    if args.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(8, 4.5))
        ax.plot([r[0] for r in rows], [r[1] for r in rows], label="failure-free")
        ax.plot([r[0] for r in rows], [r[2] for r in rows], label=f"a kill at most every {args.kill_every_steps} "
                f"steps, never the last participant ({kills} kills)")
        ax.set_xlabel("committed step")
        ax.set_ylabel("held-out loss")
        ax.set_title(f"TinyLM, {args.replicas} replicas: final loss {rel * 100:+.2f}% vs failure-free")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.plot, dpi=110)
    return 0 if abs(rel) <= 0.02 else 1


if __name__ == "__main__":
    sys.exit(main())
