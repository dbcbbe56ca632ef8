"""Effective training time (ETT) at fleet scale: synchronous training, FT-HSDP, p2pft.

ETT is useful training time over wall time under a failure process. Small clusters cannot show
what happens at 100K GPUs, where the fleet fails every few minutes, so this bench carries the
numbers we can measure (p2pft's stall and rejoin from ``p2pft chaos``, crash-to-view time from
the control-plane simulator) to that scale with a model that first reproduces the FT-HSDP
paper's own figures (arXiv 2602.00277: 44% synchronous, 80% FT-HSDP).

Model (docs/fleet.md has the derivation): failures arrive as a Poisson process in wall time at
the fleet rate ``1 / mtbf``; every failure costs its full price, also when it arrives during an
earlier recovery (recoveries and stalls queue, they do not merge). Then

* synchronous: ``ETT = (1 - recovery/mtbf) * (1 - lost/mtbf)`` where ``lost`` is the expected
  work since the last checkpoint (0 when the recovery figure already includes it);
* FT-HSDP: ``ETT = 1 - (stall + (down - stall) / R) / mtbf``: every replica stops for ``stall``;
  the failed one stays out for ``down`` (failure -> contributing again) while the others run at
  ``(R - 1) / R`` throughput.

The Monte Carlo simulation replays these rules on a seeded Poisson schedule and is the check
that the closed forms say what the rules say. It also sees what the first-order FT-HSDP form
drops (an absent replica costs nothing extra while everyone is stalled by another failure):
``ft_hsdp_ett_overlap`` adds that term and matches the replay to about 0.1 point.

Usage::

    python bench/fleet.py --paper --json fleet.json [--chaos chaos.json] [--plot ett.png]
        [--sim-sizes 12,100,1000] [--crashes 5]
"""
from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

MIN = 60.0

# --------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class FleetInputs:
    """One fleet scenario. Defaults are the FT-HSDP paper's O(100K)-GPU figures."""

    mtbf_s: float = 18 * MIN            # paper: one failure every ~18 minutes at O(100K) GPUs
    replicas: int = 12                  # paper: data-parallel replicas
    sync_recovery_s: float = 10 * MIN   # paper: synchronous stall per failure (detect, restart, reload)
    sync_lost_work_s: float = 0.0       # extra redo per failure; the paper's 10 min already covers it
    ft_stall_s: float = 3 * MIN         # paper: FT-HSDP survivors' stall per failure
    ft_down_s: float = 10 * MIN         # failure -> failed replica contributes again (see docs)


PAPER = FleetInputs()
PAPER_ETT = {"sync_ett": 0.44, "ft_hsdp_ett": 0.80}

# --------------------------------------------------------------------------- analytic model


def lost_work_s(mtbf_s: float, ckpt_interval_s: float) -> float:
    """Expected work redone after a failure that strikes while training, checkpointing every
    ``ckpt_interval_s`` of progress. A run since the last restart lasts X ~ Exp(mtbf) and the
    job loses ``X mod C``; E[X mod C] = mtbf - C / (exp(C / mtbf) - 1), which is C/2 when
    checkpoints are frequent and the whole run when they are rare."""
    if ckpt_interval_s <= 0:
        return 0.0
    x = ckpt_interval_s / mtbf_s
    if x > 700.0:  # exp overflows; the second term is already ~0
        return mtbf_s
    return mtbf_s - ckpt_interval_s / math.expm1(x)


def sync_ett(mtbf_s: float, recovery_s: float, lost_s: float = 0.0) -> float:
    """Synchronous training: each failure stops the whole job for ``recovery_s`` (failures that
    arrive during a recovery queue behind it) and throws away ``lost_s`` of work on average.

    The job trains a fraction ``1 - recovery/mtbf`` of the time (a queue with deterministic
    service); failures hit that training time at rate ``1/mtbf`` and each undoes ``lost_s``.
    """
    if mtbf_s <= 0:
        return 0.0
    busy = recovery_s / mtbf_s
    return max(0.0, 1.0 - busy) * max(0.0, 1.0 - lost_s / mtbf_s)


def ft_hsdp_ett(mtbf_s: float, replicas: int, stall_s: float, down_s: float) -> float:
    """FT-HSDP: each failure stalls every replica for ``stall_s``; the failed replica is out for
    ``down_s`` from the failure (``down_s >= stall_s``), the remaining ``down_s - stall_s`` of
    which the others train at ``(R - 1) / R`` throughput. Costs add per failure."""
    if mtbf_s <= 0 or replicas < 1:
        return 0.0
    degraded = max(0.0, down_s - stall_s) / replicas
    return max(0.0, 1.0 - (stall_s + degraded) / mtbf_s)


def ft_hsdp_ett_overlap(mtbf_s: float, replicas: int, stall_s: float, down_s: float) -> float:
    """``ft_hsdp_ett`` plus the second-order term it drops: a replica that is out costs nothing
    extra while everyone is stalled anyway, and stalls queue (M/D/1), so part of each absence
    falls inside other failures' stalls: the wait for earlier stalls, E[W] = rho*s/(2(1-rho)),
    and stalls of failures arriving within the absence, lambda*(s*D - s^2/2). This is what the
    Monte Carlo replay measures; the first-order form is the paper's arithmetic."""
    if mtbf_s <= 0 or replicas < 1:
        return 0.0
    lam = 1.0 / mtbf_s
    rho = lam * stall_s
    if rho >= 1.0:
        return 0.0
    down = max(down_s, stall_s)
    wait = rho * stall_s / (2.0 * (1.0 - rho))
    later = lam * (stall_s * down - stall_s * stall_s / 2.0)
    free = max(0.0, down - stall_s - wait - later)
    return max(0.0, 1.0 - rho - lam * free / replicas)


def sync_ett_of(inp: FleetInputs) -> float:
    """``sync_ett`` of a scenario."""
    return sync_ett(inp.mtbf_s, inp.sync_recovery_s, inp.sync_lost_work_s)


def ft_ett_of(inp: FleetInputs) -> float:
    """``ft_hsdp_ett`` (first order, the paper's accounting) of a scenario."""
    return ft_hsdp_ett(inp.mtbf_s, inp.replicas, inp.ft_stall_s, inp.ft_down_s)


# --------------------------------------------------------------------------- Monte Carlo


def _failure_times(rng: random.Random, mtbf_s: float, horizon_s: float) -> list[float]:
    out, t = [], rng.expovariate(1.0 / mtbf_s)
    while t < horizon_s:
        out.append(t)
        t += rng.expovariate(1.0 / mtbf_s)
    return out


def mc_sync(mtbf_s: float, recovery_s: float, *, ckpt_interval_s: float = 0.0, failures: int = 20000,
            seed: int = 0) -> float:
    """Replay synchronous training on a seeded Poisson schedule; returns useful / wall.

    Recovery is a single queue: a failure during a recovery adds a full recovery after it. A
    failure while training rolls back to the last checkpoint (taken every ``ckpt_interval_s``
    of progress since the restart; 0 = no rollback beyond the recovery figure)."""
    rng = random.Random(seed)
    horizon = failures * mtbf_s
    free_at = 0.0  # when the current recovery queue drains and training resumes
    useful = 0.0
    for t in _failure_times(rng, mtbf_s, horizon):
        if t >= free_at:
            run = t - free_at
            lost = math.fmod(run, ckpt_interval_s) if ckpt_interval_s > 0 else 0.0
            useful += run - lost
            free_at = t + recovery_s
        else:
            free_at += recovery_s
    if free_at < horizon:
        useful += horizon - free_at
    return useful / horizon


def mc_ft_hsdp(mtbf_s: float, replicas: int, stall_s: float, down_s: float, *, failures: int = 20000,
               seed: int = 0) -> float:
    """Replay FT-HSDP on a seeded Poisson schedule; returns useful / wall.

    Each failure strikes one replica that is up, queues a stall of ``stall_s`` for everyone
    (stalls do not overlap: each is its own view change and restart of the step), and takes
    that replica out for ``down_s`` from the failure. Outside stalls, progress runs at
    ``(R - k) / R`` with k replicas out. Failures when no replica is up are no-ops."""
    rng = random.Random(seed)
    horizon = failures * mtbf_s
    edges: list[tuple[float, int, int]] = []  # (time, d_stalled, d_out)
    stall_free = 0.0
    out_until: list[float] = []  # end times of replicas currently out (pruned lazily)
    for t in _failure_times(rng, mtbf_s, horizon):
        out_until = [e for e in out_until if e > t]
        if len(out_until) >= replicas:
            continue
        start = max(t, stall_free)
        stall_free = start + stall_s
        edges.append((start, 1, 0))
        edges.append((stall_free, -1, 0))
        end = t + max(down_s, stall_s)
        out_until.append(end)
        edges.append((t, 0, 1))
        edges.append((end, 0, -1))
    edges.sort()
    useful, stalled, out, last = 0.0, 0, 0, 0.0
    for when, ds, do in edges:
        when = min(when, horizon)
        if stalled == 0 and when > last:
            useful += (when - last) * (replicas - out) / replicas
        last = max(last, when)
        stalled += ds
        out += do
    if last < horizon and stalled == 0:
        useful += (horizon - last) * (replicas - out) / replicas
    return useful / horizon


# --------------------------------------------------------------------------- chaos input


@dataclass(frozen=True)
class Measured:
    """What a small real run measured for one system (from ``p2pft chaos``)."""

    system: str
    ett: float
    stall_p50_s: float
    stall_max_s: float
    rejoin_p50_s: float
    kills: int
    final_step: int


def load_chaos(path: str | Path) -> dict[str, Measured]:
    """Parse a ``p2pft chaos`` JSON file: a list of per-system rows, or ``{"systems": [...]}``.

    Missing numbers become NaN rather than failing the run: a system that never rejoined
    (torchft restarting from step 0) still has an ETT worth printing."""
    raw = json.loads(Path(path).read_text())
    rows = raw.get("systems") if isinstance(raw, dict) else raw
    if not isinstance(rows, list):
        raise ValueError(f"{path}: expected a list of systems or an object with 'systems'")
    out: dict[str, Measured] = {}
    for row in rows:
        if not isinstance(row, dict) or "system" not in row:
            raise ValueError(f"{path}: every system row needs a 'system' key")

        def num(key: str, row: dict[str, Any] = row) -> float:
            v = row.get(key)
            return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else math.nan

        out[str(row["system"])] = Measured(
            system=str(row["system"]), ett=num("ett"), stall_p50_s=num("stall_p50_s"),
            stall_max_s=num("stall_max_s"), rejoin_p50_s=num("rejoin_p50_s"),
            kills=int(row.get("kills") or 0), final_step=int(row.get("final_step") or 0))
    return out


# --------------------------------------------------------------------------- control-plane sim


def _percentile(xs: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), without needing numpy here."""
    if not xs:
        return math.nan
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


class _Gone:
    """Stop condition "no live node's committed view contains ``victim``", cheap enough to be
    asked after every simulator event: it rechecks only nodes whose view object changed since
    the last call, so a thousand nodes cost a thousand identity tests, not a million lookups."""

    def __init__(self, nodes: dict[str, Any], victim: str, clock: Callable[[], float]) -> None:
        self.nodes = nodes
        self.victim = victim
        self.clock = clock
        self.first: float | None = None  # when the first node held such a view (commit, roughly)
        self.pending: dict[str, Any] = {addr: None for addr in nodes}  # addr -> view last seen

    def __call__(self) -> bool:
        for addr in list(self.pending):
            node = self.nodes.get(addr)
            if node is None:
                del self.pending[addr]
                continue
            view = node.view
            if view is None or view is self.pending[addr]:
                continue
            self.pending[addr] = view
            if view.member(self.victim) is None:
                del self.pending[addr]
                if self.first is None:
                    self.first = self.clock()
        return not self.pending


def _role(node: Any) -> str:
    """'leader', 'voter' or 'member': a crashed Raft leader or voter costs an election or a
    voter replacement on top of detection, so samples are labelled with it."""
    is_leader = getattr(node, "is_leader", None)
    if callable(is_leader) and is_leader():
        return "leader"
    view = node.view
    return "voter" if view is not None and node.id in view.voters else "member"


def measure_view_change(n: int, *, crashes: int = 3, seed: int = 0, loss: float = 0.01, batch: int | None = None,
                        settle_s: float = 2.0, timeout_s: float = 120.0,
                        log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Crash -> every live node holds a committed view without the crashed node, on the real
    control-plane code (``p2pft.sim.cluster.Simulator``) with ``n`` replica leaders and packet loss.

    Nodes join in batches through the first one (a launcher starts replicas in waves, and a
    thousand simultaneous joins through one seed is a storm nobody runs); each crash starts
    from a converged cluster and picks a random live node, the Raft leader included, so
    elections are part of the sample. Convergence is polled between slices of virtual time
    (``Simulator.converged`` is O(N^2)); the crash itself is timed to the event."""
    from p2pft.sim.cluster import Simulator

    wall0 = time.perf_counter()
    sim = Simulator(seed, loss=loss)
    batch = batch or max(50, n // 4)
    clock = [0.0]  # our own record of virtual time, for a simulator that does not expose ``now``

    def now() -> float:
        return float(getattr(sim, "now", clock[0]))

    def run_to(t: float, stop: Callable[[], bool] | None = None) -> None:
        sim.run_until(t, stop=stop)
        clock[0] = now() if hasattr(sim, "now") else max(clock[0], t)

    def settle(dt: float, slice_s: float = 0.25) -> bool:
        """Run until converged (checked every slice) or dt has passed; True when converged."""
        end = now() + dt
        while now() < end:
            run_to(min(end, now() + slice_s))
            if sim.converged():
                return True
        return sim.converged()

    first = "r0000"
    sim.add_node(first)
    run_to(0.5)
    joined = 1
    while joined < n:
        for _ in range(min(batch, n - joined)):
            sim.add_node(f"r{joined:04d}", seeds=[first])
            joined += 1
        settle(timeout_s)
        if log:
            log(f"  n={n}: {joined} joined, t={now():.1f}s virtual, {time.perf_counter() - wall0:.1f}s wall")
    if not settle(timeout_s):
        raise RuntimeError(f"{n} nodes did not converge within {timeout_s}s of virtual time")
    join_virtual = now()

    pick = random.Random(seed * 7919 + n)
    samples: list[float] = []
    firsts: list[float] = []
    roles: list[str] = []
    for _ in range(crashes):
        run_to(now() + settle_s)
        victim_addr = pick.choice(sorted(sim.nodes))
        victim = sim.nodes[victim_addr].id
        roles.append(_role(sim.nodes[victim_addr]))
        sim.crash(victim_addr)
        t0 = now()
        gone = _Gone(sim.nodes, victim, now)
        deadline = t0 + timeout_s
        while not gone() and now() < deadline:
            run_to(min(deadline, now() + 0.01), stop=gone)
        if not gone():
            raise RuntimeError(f"n={n}: crash of {victim} not reflected within {timeout_s}s")
        samples.append(now() - t0)
        firsts.append((gone.first if gone.first is not None else now()) - t0)
        settle(timeout_s)
        if log:
            log(f"  n={n}: crash {len(samples)}/{crashes} ({roles[-1]}) -> first node {firsts[-1]:.3f}s, "
                f"every node {samples[-1]:.3f}s ({time.perf_counter() - wall0:.1f}s wall)")
    return {"replicas": n, "crashes": crashes, "loss": loss, "seed": seed,
            "view_p50_s": _percentile(samples, 50), "view_p99_s": _percentile(samples, 99),
            "view_max_s": max(samples), "samples_s": samples, "first_view_s": firsts,
            "victim_roles": roles,
            "join_virtual_s": join_virtual, "wall_s": time.perf_counter() - wall0}


def view_time_at(sim_rows: Sequence[dict[str, Any]], replicas: int, key: str = "view_p50_s") -> float:
    """Crash-to-view time at ``replicas``, interpolated in log(N) between measured sizes and held
    flat outside them (the control plane's timeouts grow with log N)."""
    pts = sorted((int(r["replicas"]), float(r[key])) for r in sim_rows if not math.isnan(float(r[key])))
    if not pts:
        return 0.0
    if replicas <= pts[0][0]:
        return pts[0][1]
    if replicas >= pts[-1][0]:
        return pts[-1][1]
    for (n0, v0), (n1, v1) in zip(pts, pts[1:]):
        if n0 <= replicas <= n1:
            f = (math.log(replicas) - math.log(n0)) / (math.log(n1) - math.log(n0))
            return v0 + f * (v1 - v0)
    return pts[-1][1]


# --------------------------------------------------------------------------- p2pft prediction


@dataclass(frozen=True)
class P2pftInputs:
    """p2pft's per-failure costs at fleet scale, built from measurements."""

    stall_s: float      # survivors' stall: measured data-plane stall + simulated view change
    rejoin_s: float     # restarted process -> first contributing step (measured)
    relaunch_s: float   # launcher brings the replica's processes back (infrastructure, not ours)

    @property
    def down_s(self) -> float:
        return max(self.stall_s, self.relaunch_s + self.rejoin_s)


def p2pft_inputs(measured: Measured, view_s: float, relaunch_s: float, worst: bool = False) -> P2pftInputs:
    """Measured stall (p50, or max for the pessimistic variant) plus fleet-scale view time.

    Adding the simulated view time on top of the measured stall counts detection twice (the
    measured stall already contains a small cluster's view change): conservative on purpose."""
    stall = measured.stall_max_s if worst else measured.stall_p50_s
    stall = 0.0 if math.isnan(stall) else stall
    rejoin = 0.0 if math.isnan(measured.rejoin_p50_s) else measured.rejoin_p50_s
    return P2pftInputs(stall_s=stall + view_s, rejoin_s=rejoin, relaunch_s=relaunch_s)


def p2pft_ett(inp: FleetInputs, p2p: P2pftInputs) -> float:
    """The FT-HSDP model with p2pft's measured costs in place of the paper's."""
    return ft_hsdp_ett(inp.mtbf_s, inp.replicas, p2p.stall_s, p2p.down_s)


# --------------------------------------------------------------------------- sweeps and output


def sweep(base: FleetInputs, replicas: Iterable[int], mtbf_min: Iterable[float],
          p2p_for: Callable[[int], P2pftInputs] | None) -> dict[str, list[dict[str, Any]]]:
    """ETT of each system against replica count (at the base MTBF) and against MTBF (at the base
    replica count). The fleet size is fixed, so the MTBF does not change with R."""

    def row(inp: FleetInputs) -> dict[str, Any]:
        r: dict[str, Any] = {"replicas": inp.replicas, "mtbf_min": inp.mtbf_s / MIN,
                             "sync_ett": sync_ett_of(inp), "ft_hsdp_ett": ft_ett_of(inp),
                             "ft_hsdp_ett_overlap": ft_hsdp_ett_overlap(inp.mtbf_s, inp.replicas, inp.ft_stall_s,
                                                                        inp.ft_down_s)}
        if p2p_for is not None:
            r["p2pft_ett"] = p2pft_ett(inp, p2p_for(inp.replicas))
        return r

    return {"by_replicas": [row(replace(base, replicas=int(r))) for r in replicas],
            "by_mtbf": [row(replace(base, mtbf_s=float(m) * MIN)) for m in mtbf_min]}


def _pct(x: float | None) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.1f}%"


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """A rich table when rich is installed, aligned plain text otherwise."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(columns)]
        print(f"\n{title}")
        print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
        for r in rows:
            print("  ".join(v.rjust(w) for v, w in zip(r, widths)))
        return
    table = Table(title=title)
    for c in columns:
        table.add_column(c, justify="right")
    for r in rows:
        table.add_row(*r)
    Console().print(table)


def plot(path: str, base: FleetInputs, p2p_for: Callable[[int], P2pftInputs] | None) -> None:
    """ETT against MTBF for the three systems (log-spaced MTBF, 3 min to 6 h)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [3 * (120 ** (i / 99)) for i in range(100)]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(xs, [sync_ett_of(replace(base, mtbf_s=x * MIN)) for x in xs], label="synchronous")
    ax.plot(xs, [ft_ett_of(replace(base, mtbf_s=x * MIN)) for x in xs], label="FT-HSDP (paper inputs)")
    if p2p_for is not None:
        p2p = p2p_for(base.replicas)
        ax.plot(xs, [p2pft_ett(replace(base, mtbf_s=x * MIN), p2p) for x in xs], label="p2pft (predicted)")
    ax.axvline(base.mtbf_s / MIN, color="grey", ls=":", lw=1)
    ax.set_xscale("log")
    ax.set_xlabel("fleet MTBF (minutes)")
    ax.set_ylabel("effective training time")
    ax.set_ylim(0, 1)
    ax.set_title(f"ETT vs failure rate, {base.replicas} replicas")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--paper", action="store_true",
                   help="the FT-HSDP paper's inputs (they are the defaults; explicit overrides still apply)")
    p.add_argument("--json", metavar="FILE", help="write results as JSON")
    p.add_argument("--chaos", metavar="CHAOS_JSON", help="p2pft chaos output: adds the p2pft prediction")
    p.add_argument("--plot", metavar="FILE.png", help="draw ETT vs MTBF")
    p.add_argument("--mtbf-min", type=float, default=PAPER.mtbf_s / MIN, help="fleet MTBF in minutes")
    p.add_argument("--replicas", type=int, default=PAPER.replicas)
    p.add_argument("--sync-recovery-min", type=float, default=PAPER.sync_recovery_s / MIN)
    p.add_argument("--ckpt-interval-min", type=float, default=0.0,
                   help="synchronous checkpoint interval; adds lost work (0: inside the recovery figure)")
    p.add_argument("--ft-stall-min", type=float, default=PAPER.ft_stall_s / MIN)
    p.add_argument("--ft-down-min", type=float, default=PAPER.ft_down_s / MIN,
                   help="failure -> failed replica contributing again, FT-HSDP")
    p.add_argument("--relaunch-min", type=float, default=PAPER.ft_down_s / MIN,
                   help="p2pft: infrastructure time to bring a replica's processes back")
    p.add_argument("--sweep-replicas", default="4,8,12,24,48")
    p.add_argument("--sweep-mtbf", default="6,18,60")
    p.add_argument("--sim-sizes", default="12,100", help="replica leaders to simulate ('' to skip)")
    p.add_argument("--crashes", type=int, default=5, help="crashes per simulated size")
    p.add_argument("--loss", type=float, default=0.01, help="simulated packet loss")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--mc-failures", type=int, default=20000, help="failures per Monte Carlo run")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    base = FleetInputs(mtbf_s=args.mtbf_min * MIN, replicas=args.replicas,
                       sync_recovery_s=args.sync_recovery_min * MIN,
                       sync_lost_work_s=lost_work_s(args.mtbf_min * MIN, args.ckpt_interval_min * MIN),
                       ft_stall_s=args.ft_stall_min * MIN, ft_down_s=args.ft_down_min * MIN)
    say: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731

    preset = "paper" if base == PAPER else "custom"
    if args.paper and preset != "paper":
        say("note: --paper with overridden inputs; results are for the overridden scenario")
    result: dict[str, Any] = {"preset": preset, "inputs": asdict(base), "paper_reported": PAPER_ETT,
                              "sync_ett": sync_ett_of(base), "ft_hsdp_ett": ft_ett_of(base),
                              "ft_hsdp_ett_overlap": ft_hsdp_ett_overlap(base.mtbf_s, base.replicas,
                                                                         base.ft_stall_s, base.ft_down_s)}
    result["monte_carlo"] = {
        "failures": args.mc_failures, "seed": args.seed,
        "sync_ett": mc_sync(base.mtbf_s, base.sync_recovery_s, ckpt_interval_s=args.ckpt_interval_min * MIN,
                            failures=args.mc_failures, seed=args.seed),
        "ft_hsdp_ett": mc_ft_hsdp(base.mtbf_s, base.replicas, base.ft_stall_s, base.ft_down_s,
                                  failures=args.mc_failures, seed=args.seed)}

    sim_rows: list[dict[str, Any]] = []
    for n in _ints(args.sim_sizes):
        say(f"simulating crash -> new view with {n} replica leaders ({args.crashes} crashes)")
        sim_rows.append(measure_view_change(n, crashes=args.crashes, seed=args.seed, loss=args.loss, log=say))
    result["control_plane"] = sim_rows

    p2p_for: Callable[[int], P2pftInputs] | None = None
    if args.chaos:
        measured = load_chaos(args.chaos)
        result["chaos"] = {k: asdict(v) for k, v in measured.items()}
        if "p2pft" not in measured:
            raise SystemExit(f"{args.chaos}: no 'p2pft' system row")
        mine = measured["p2pft"]
        relaunch = args.relaunch_min * MIN
        notes = [f"{name} missing from the chaos run: taken as 0 s" for name, v in
                 (("stall_p50_s", mine.stall_p50_s), ("stall_max_s", mine.stall_max_s),
                  ("rejoin_p50_s", mine.rejoin_p50_s)) if math.isnan(v)]
        for note in notes:
            say(f"warning: p2pft {note}")
        result["p2pft_notes"] = notes

        def chaos_backed(r: int) -> P2pftInputs:
            return p2pft_inputs(mine, view_time_at(sim_rows, r), relaunch)

        p2p_for = chaos_backed

        worst = p2pft_inputs(mine, view_time_at(sim_rows, base.replicas, "view_p99_s"), relaunch, worst=True)
        result["p2pft_inputs"] = asdict(p2p_for(base.replicas))
        result["p2pft_ett"] = p2pft_ett(base, p2p_for(base.replicas))
        result["p2pft_ett_worst"] = p2pft_ett(base, worst)

    result["sweep"] = sweep(base, _ints(args.sweep_replicas), _floats(args.sweep_mtbf), p2p_for)

    if args.plot:
        plot(args.plot, base, p2p_for)
        result["plot"] = args.plot
    if args.json:  # before printing, so a closed stdout cannot lose the results
        Path(args.json).write_text(json.dumps(_finite(result), indent=2, allow_nan=False) + "\n")
    print_results(result, base, loss=args.loss)
    return 0


def print_results(result: dict[str, Any], base: FleetInputs, loss: float) -> None:
    """The headline table, both sweeps and the control-plane measurements."""
    paper = result["preset"] == "paper"
    mc = result["monte_carlo"]
    ft_label = "FT-HSDP (paper inputs)" if paper else "FT-HSDP"
    rows = [["synchronous", _pct(result["sync_ett"]), _pct(result["sync_ett"]), _pct(mc["sync_ett"])],
            [ft_label, _pct(result["ft_hsdp_ett"]), _pct(result["ft_hsdp_ett_overlap"]), _pct(mc["ft_hsdp_ett"])]]
    columns = ["system", "analytic", "+ overlap", "Monte Carlo"]
    if paper:
        columns.append("paper")
        rows[0].append(f"{PAPER_ETT['sync_ett']:.0%}")
        rows[1].append(f"{PAPER_ETT['ft_hsdp_ett']:.0%}")
    if "p2pft_ett" in result:
        pad = [""] * (len(columns) - 2)
        rows.append(["p2pft (predicted, p50)", _pct(result["p2pft_ett"])] + pad)
        rows.append(["p2pft (max stall, p99 view)", _pct(result["p2pft_ett_worst"])] + pad)
    print_table(f"ETT at MTBF {base.mtbf_s / MIN:g} min, {base.replicas} replicas", columns, rows)
    has_p2p = "p2pft_ett" in result
    cols = ["sync", "FT-HSDP"] + (["p2pft"] if has_p2p else [])

    def cells(r: dict[str, Any]) -> list[str]:
        return [_pct(r["sync_ett"]), _pct(r["ft_hsdp_ett"])] + ([_pct(r["p2pft_ett"])] if has_p2p else [])

    print_table(f"ETT vs replica count (MTBF {base.mtbf_s / MIN:g} min)", ["replicas"] + cols,
                [[str(r["replicas"])] + cells(r) for r in result["sweep"]["by_replicas"]])
    print_table(f"ETT vs MTBF ({base.replicas} replicas)", ["MTBF (min)"] + cols,
                [[f"{r['mtbf_min']:g}"] + cells(r) for r in result["sweep"]["by_mtbf"]])
    sim_rows = result["control_plane"]
    if sim_rows:
        print_table(f"crash -> committed view without the crashed node (loss {loss:g})",
                    ["replica leaders", "crashes", "p50 (s)", "p99 (s)", "join (virtual s)", "wall (s)"],
                    [[str(r["replicas"]), str(r["crashes"]), f"{r['view_p50_s']:.3f}", f"{r['view_p99_s']:.3f}",
                      f"{r['join_virtual_s']:.1f}", f"{r['wall_s']:.1f}"] for r in sim_rows])


def _finite(x: Any) -> Any:
    """NaN (a number a chaos run did not produce) becomes null: strict JSON has no NaN."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


if __name__ == "__main__":
    sys.exit(main())
