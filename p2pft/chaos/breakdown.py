"""Where a system's time went: how many replicas contributed, and step time by phase.

Both are computed from the replicas' own stats records (one JSON line per step, with the number
of contributors ``n``, the role, and the catch-up events of a restarted replica), so every
system is measured the same way.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

Recs = dict[tuple[int, int], list[dict[str, Any]]]

PHASES = ("normal", "catching_up", "joiner_present", "just_promoted")
JUST_PROMOTED_STEPS = 10   # steps after a promotion that count as "just promoted"
STALL_FACTOR = 3.0         # a gap longer than this many normal steps is a stall, not a step


@dataclass(frozen=True)
class Commit:
    t: float
    step: int
    n: int


def commit_series(recs: Recs, t0: float, t_end: float) -> list[Commit]:
    """One entry per step the system committed, in time order (the first replica to record it)."""
    raw = sorted((float(r["t"]), int(r["step"]), int(r.get("n", 0))) for rs in recs.values() for r in rs
                 if r.get("kind") is None and "step" in r and r.get("c") and t0 <= float(r["t"]) <= t_end)
    out: list[Commit] = []
    for t, step, n in raw:
        if out and step == out[-1].step:
            continue  # the same step recorded by another replica
        out.append(Commit(t, step, n))
    return out


def contributor_seconds(series: list[Commit], t0: float, t_end: float, step_p50: float,
                        replicas: int) -> dict[str, float]:
    """Seconds spent training with k contributors; "0" is time with no step committed (stalls,
    restarts). The gap before a commit belongs to that commit's contributor count."""
    out = {str(k): 0.0 for k in range(replicas, -1, -1)}
    prev = t0
    limit = STALL_FACTOR * step_p50 if step_p50 > 0 else float("inf")
    for c in series:
        gap = c.t - prev
        if gap > limit:
            out["0"] += gap - step_p50
            gap = step_p50
        key = str(min(max(c.n, 0), replicas))
        out[key] = out.get(key, 0.0) + gap
        prev = c.t
    out["0"] += max(0.0, t_end - prev)
    return {k: round(v, 2) for k, v in out.items()}


def phase_windows(recs: Recs, step_p50: float) -> list[tuple[float, float, str]]:
    """Time windows of each phase of a restarted replica's return, from its own records:
    catching up (catch-up start to done), joiner present (done to promotion), just promoted."""
    out = []
    for (_, inc), rs in recs.items():
        if inc == 0:
            continue
        ev = {r.get("event"): float(r["t"]) for r in rs if r.get("kind") == "event"}
        joined = next((float(r["t"]) for r in rs if r.get("kind") is None and r.get("role") == "joiner"), None)
        promoted = next((float(r["t"]) for r in rs if r.get("kind") is None and r.get("c")
                         and r.get("role") == "participant"), None)
        start = ev.get("catchup_start", joined)
        done = ev.get("catchup_done")
        if start is not None:
            out.append((start, done or promoted or float("inf"), "catching_up"))
        if done is not None:
            out.append((done, promoted or float("inf"), "joiner_present"))
        if promoted is not None:
            out.append((promoted, promoted + JUST_PROMOTED_STEPS * step_p50, "just_promoted"))
    return out


def _phase_at(t: float, windows: list[tuple[float, float, str]]) -> str:
    hits = {name for a, b, name in windows if a <= t < b}
    return next((p for p in PHASES[1:] if p in hits), "normal")


def step_time_by_phase(series: list[Commit], windows: list[tuple[float, float, str]],
                       failures: list[float], step_p50: float) -> dict[str, dict[str, float | int | None]]:
    """Median step time and step count per phase; gaps that hold a failure are stalls, left out."""
    gaps: dict[str, list[float]] = {p: [] for p in PHASES}
    limit = STALL_FACTOR * step_p50 if step_p50 > 0 else float("inf")
    for a, b in zip(series, series[1:]):
        if any(a.t <= f < b.t for f in failures) or b.t - a.t > limit:
            continue
        gaps[_phase_at(b.t, windows)].append(b.t - a.t)
    return {p: {"steps": len(g), "step_p50_s": round(statistics.median(g), 3) if g else None}
            for p, g in gaps.items()}
