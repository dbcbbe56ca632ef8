"""A host lost without a reset, in the simulator: crash → every view without it, with and
without the data plane's evidence.

Five peers (a three-replica job and two witnesses) form; after a random phase a random
non-leader crashes silently (the simulator has no connections, so nothing is refused: the SWIM
path alone). With ``data plane`` on, two of the survivors (the lost host's ring neighbours)
report it as the data plane does (``Node.report_failure``, a suspicion with themselves as
accuser) at the time the ring finds it: up to one step (``--step``) until their next send to
it, then ``Profile.data_ack_timeout``, then up to one 50 ms receive slice.

    python bench/hostloss_sim.py                 # 60 seeds, 0 % and 5 % message loss
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "sim"))
from test_membership_sim import excluded_everywhere, form  # noqa: E402

from p2pft.core.config import DEFAULT  # noqa: E402

SLICE_S = 0.05   # the ring's receive slice: how often a starved rank looks at its right connection


def detect(seed: int, data_plane: bool, loss: float, step: float) -> float:
    """Virtual seconds from the crash until no live node's view holds the victim."""
    sim, addrs = form(5, seed)
    sim.loss = loss
    rng = random.Random(seed * 7 + 1)
    sim.run_until(sim.now + rng.uniform(0, 1.0))
    leader = sim.leader()
    victim = rng.choice([a for a in addrs if sim.nodes[a] is not leader])
    vid = sim.nodes[victim].id
    t0 = sim.now
    sim.crash(victim)
    if data_plane:
        for a in rng.sample([a for a in addrs if a != victim], 2):
            t = t0 + rng.uniform(0, step) + DEFAULT.data_ack_timeout + rng.uniform(0, SLICE_S)
            sim.at(t, lambda a=a: sim.call(a, lambda n, now: n.report_failure(vid, now)))
    sim.run_until(t0 + 8.0, stop=lambda: excluded_everywhere(sim, vid))
    return sim.now - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=60)
    p.add_argument("--losses", default="0,0.05", help="comma list of message loss rates")
    p.add_argument("--step", type=float, default=0.15, help="seconds per training step")
    args = p.parse_args()
    print("| message loss | data-plane evidence | p50 | p90 | max |\n|---|---|---|---|---|")
    for loss in (float(x) for x in args.losses.split(",")):
        for dp in (False, True):
            xs = sorted(detect(s, dp, loss, args.step) for s in range(args.seeds))
            print(f"| {loss:.0%} | {'yes' if dp else 'no'} | {statistics.median(xs):.2f} | "
                  f"{xs[int(0.9 * len(xs))]:.2f} | {xs[-1]:.2f} |")


if __name__ == "__main__":
    main()
