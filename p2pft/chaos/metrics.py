"""What a chaos run measured, computed from the replicas' JSON-lines stats and the harness events."""
from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Any

from .breakdown import commit_series, contributor_seconds, phase_windows, step_time_by_phase
from .cluster import Cluster
from .records import read_stats

__all__ = ["digests_by_step", "read_stats", "summarize"]  # read_stats is re-exported for the benchmarks

STALL_WINDOW = 5.0   # seconds after a failure in which a survivor's longest commit gap is its stall


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    k = min(len(xs) - 1, max(0, int(round(q * (len(xs) - 1)))))
    return xs[k]


def digests_by_step(recs: dict[tuple[int, int], list[dict[str, Any]]],
                    restarts_all: bool) -> dict[tuple[int, int], set[str]]:
    """The state digests recorded at each step, by (job start, step), from the records of each
    (replica, incarnation).

    A replica that rejoins a running cluster must hold the survivors' weights at every step, so
    for p2pft all incarnations are compared at one step. A job restarted as a whole discards
    the steps past its checkpoint: only the ranks of one start of the job are compared (a
    re-trained step may differ in its last bits from the discarded one: DDP's reduction order
    follows its gradient buckets, which it lays out again after the first step of every start)."""
    digests: dict[tuple[int, int], set[str]] = defaultdict(set)
    for (_replica, incarnation), rs in recs.items():
        start = incarnation if restarts_all else 0  # a whole-job restart starts every rank anew
        for r in rs:
            if "digest" in r and "step" in r and r.get("kind") is None:
                digests[(start, int(r["step"]))].add(r["digest"])
    return digests


def summarize(cluster: Cluster, t_end: float) -> dict[str, Any]:
    """The row of one system: progress, stalls, rejoins, crashes, divergence."""
    procs = sorted(cluster.finished, key=lambda p: (p.replica, p.incarnation))
    recs: dict[tuple[int, int], list[dict[str, Any]]] = {(p.replica, p.incarnation): read_stats(p.stats)
                                                        for p in procs}
    kills = [e for e in cluster.events if e["kind"] in ("kill", "pause")]
    crashes = [e for e in cluster.events if e["kind"] == "crash"]
    last_step: dict[tuple[int, int], int] = {}
    commit_times: dict[tuple[int, int], list[float]] = {}
    step_gaps: list[float] = []
    contributors: dict[int, int] = {}
    losses: list[tuple[int, float]] = []
    for key, rs in recs.items():
        ts = []
        for r in rs:
            if "step" in r and r.get("kind") in (None, "start") and r["t"] <= t_end:
                last_step[key] = int(r["step"])  # a start record holds the step it resumed at
            if "step" in r and r.get("kind") is None:
                if r.get("c"):
                    ts.append(float(r["t"]))
                    if r["t"] <= t_end:
                        contributors[int(r["step"])] = int(r.get("n", 0))
                if "loss" in r:
                    losses.append((int(r["step"]), float(r["loss"])))
        commit_times[key] = ts
        step_gaps += [b - a for a, b in zip(ts, ts[1:])]
    step_p50 = statistics.median(step_gaps) if step_gaps else 0.0
    # The final committed step is what the replicas still running at the end hold: a system that
    # fell back to step 0 is charged for it, whatever peak it reached before.
    gone = {(p.replica, p.incarnation) for p in procs
            if any(e["kind"] in ("kill", "stop", "crash") and e["replica"] == p.replica
                   and p.started <= float(e["t"]) < t_end for e in cluster.events)}
    final_step = max((s for k, s in last_step.items() if k not in gone), default=0)
    if cluster.restarts_all:
        # A job restarted as a whole resumes from its last disk checkpoint: that step is kept.
        final_step = max([final_step] + [int(r["step"]) for rs in recs.values() for r in rs
                                         if _checkpointed(r, cluster) and float(r["t"]) <= t_end])
    ended_before = {(p.replica, p.incarnation): t for p in procs
                    for t in [next((float(e["t"]) for e in cluster.events if e["kind"] in ("kill", "stop", "crash")
                                    and e["replica"] == p.replica and float(e["t"]) >= p.started), None)]
                    if t is not None}
    stalls, raw_gaps = [], []
    all_commits = sorted(t for ts in commit_times.values() for t in ts)
    for k in kills:
        tk = float(k["t"])
        worst = 0.0
        if cluster.restarts_all:
            # Nobody survives a failure: the stall lasts until the restarted job commits again.
            worst = next((t for t in all_commits if t > tk), t_end) - tk
            raw_gaps.append(worst)
            stalls.append(max(0.0, worst - step_p50))
            continue
        for (rep, inc), ts in commit_times.items():
            if rep == k["replica"] or not ts or ts[0] > tk:
                continue  # the victim itself, or a replica not yet training at the failure
            if (rep, inc) in ended_before and ended_before[(rep, inc)] <= tk:
                continue  # this incarnation was gone before the failure
            # A survivor that never commits again stalls until the end of the run.
            after = [t for t in ts if t > tk]
            ends = ts + ([] if after else [t_end])
            gaps = [b - a for a, b in zip(ends, ends[1:]) if b > tk and a < tk + STALL_WINDOW]
            if gaps:
                worst = max(worst, max(gaps))
        if worst:
            raw_gaps.append(worst)
            stalls.append(max(0.0, worst - step_p50))  # time lost beyond one normal step
    rejoins, rejoins_excl = [], []
    for p in procs:
        if p.incarnation == 0:
            continue
        rs = recs[(p.replica, p.incarnation)]
        start = next((r for r in rs if r.get("kind") == "start"), None)
        first = next((r for r in rs if r.get("kind") is None and r.get("c") and r.get("role") == "participant"
                      and r.get("n", 0) >= 1), None)
        if start and first:
            rejoins.append(float(first["t"]) - p.started)
            rejoins_excl.append(float(first["t"]) - float(start["t_imported"]))
    digests = digests_by_step(recs, cluster.restarts_all)
    divergent = sum(1 for d in digests.values() if len(d) > 1)
    return {
        "system": cluster.system,
        "final_step": final_step,
        # Samples in the steps the run kept: steps lost to a rollback are not progress.
        "samples": sum(n for step, n in contributors.items() if step <= final_step) * cluster.cfg.batch,
        "kills": len(kills),
        "survivor_crashes": len(crashes),
        "stall_p50_s": _round(statistics.median(stalls)) if stalls else None,
        "stall_max_s": _round(max(stalls)) if stalls else None,
        "gap_max_s": _round(max(raw_gaps)) if raw_gaps else None,
        "rejoin_p50_s": _round(statistics.median(rejoins)) if rejoins else None,
        "rejoin_max_s": _round(max(rejoins)) if rejoins else None,
        "rejoin_excl_imports_p50_s": _round(statistics.median(rejoins_excl)) if rejoins_excl else None,
        "step_time_p50_s": _round(statistics.median(step_gaps)) if step_gaps else None,
        "divergent_steps": divergent,
        "digest_steps_checked": sum(1 for d in digests.values() if d),
        "loss": sorted(losses)[-1][1] if losses else None,
        **_breakdown(cluster, recs, t_end, step_p50, [float(k["t"]) for k in kills]),
        "_losses": sorted(losses),
        "_commits": {f"r{r}.{i}": ts for (r, i), ts in commit_times.items()},
        "_events": cluster.events,
        "_steps": _step_series(recs, t_end),
    }


def _checkpointed(r: dict[str, Any], cluster: Cluster) -> bool:
    """A committed step written to disk: marked by the DDP worker, every N-th step for sync."""
    if r.get("kind") is not None or not r.get("c") or "step" not in r:
        return False
    every = cluster.cfg.checkpoint_every
    return bool(r.get("ckpt")) or (cluster.system == "sync" and every > 0 and int(r["step"]) % every == 0)


def _breakdown(cluster: Cluster, recs: dict[tuple[int, int], list[dict[str, Any]]], t_end: float,
               step_p50: float, failures: list[float]) -> dict[str, Any]:
    series = commit_series(recs, cluster.t0, t_end)
    return {
        "contributor_seconds": contributor_seconds(series, cluster.t0, t_end, step_p50, cluster.cfg.replicas),
        "step_time_by_phase": step_time_by_phase(series, phase_windows(recs, step_p50), failures, step_p50),
        "cpu_s": cluster.cpu_by_kind(),
        "_contributors": [[c.t, c.n] for c in series],
    }


def _step_series(recs: dict[tuple[int, int], list[dict[str, Any]]], t_end: float) -> dict[str, list[list[float]]]:
    """Committed steps over time, one series per process incarnation ("r1.2")."""
    out: dict[str, list[list[float]]] = defaultdict(list)
    for (rep, inc), rs in recs.items():
        for r in rs:
            if r.get("kind") is None and "step" in r and r.get("c") and float(r["t"]) <= t_end:
                out[f"r{rep}.{inc}"].append([float(r["t"]), int(r["step"])])
    return {k: sorted(v) for k, v in out.items()}


def _round(x: float) -> float:
    return round(float(x), 3)
