"""Run the systems side by side under one failure schedule and collect their rows.

All systems run at the same time on the same machine (each its own cluster on its own ports),
so a shared, noisy machine slows them alike and the ratios stay meaningful.
"""
from __future__ import annotations

import logging
import signal
import statistics
import time
from pathlib import Path
from typing import Any, Callable

from .cluster import ChaosConfig, Cluster, Proc, Schedule
from .interrupt import Interrupt
from .metrics import summarize
from .records import read_stats

log = logging.getLogger(__name__)

SYSTEMS = ("p2pft", "ddp", "failure_free")


class CannotTrain(RuntimeError):
    """A system whose every replica exited before training (a configuration that cannot work:
    e.g. ``--data-plane nccl`` without CUDA): nothing to measure, and the replica says why."""


def replica_error(p: Proc) -> str:
    """The line of a replica's log that says why it exited: its last ERROR or CRITICAL line,
    else its last line that is not part of a traceback."""
    try:
        lines = [ln.rstrip() for ln in p.stats.with_suffix(".log").read_text(errors="replace").splitlines()]
    except OSError:
        return "(no log)"
    lines = [ln for ln in lines if ln.strip()]
    severe = [ln for ln in lines if " ERROR " in ln or " CRITICAL " in ln]
    if severe:
        return severe[-1]
    plain = [ln for ln in lines if not ln.startswith((" ", "\t", "Traceback"))]
    return plain[-1] if plain else "(empty log)"


def first_crash(c: Cluster) -> str | None:
    """'replica rN exited with status S: <its line>' for the first replica of `c` that exited
    without being killed, or None."""
    crashed = sorted((p for p in c.finished if p.returncode is not None and not p.killed_by_us
                      and p.kind in ("replica", "joiner")), key=lambda p: p.started)
    if not crashed:
        return None
    p = crashed[0]
    return (f"replica r{p.replica} exited with status {p.returncode}: {replica_error(p)} "
            f"(log: {p.stats.with_suffix('.log')})")


def run_chaos(cfg: ChaosConfig, workdir: Path, systems: tuple[str, ...] = SYSTEMS,
              on_tick: Callable[[dict[str, Cluster], float], None] | None = None,
              interrupt: Interrupt | None = None) -> dict[str, Any]:
    """Start every system, apply the schedule, stop them all after cfg.duration; return the report.

    With ``interrupt`` (see ``interrupt.py``) a signal ends the run early: every cluster is
    stopped, and the report covers the time until the signal (``interrupted`` names it). A
    signal before training began raises ``Interrupted`` once everything is stopped.
    """
    cfg.validate()
    interrupt = interrupt or Interrupt()
    clusters: dict[str, Cluster] = {}
    extra: dict[str, Any] = {}
    t0 = t_end = 0.0
    try:
        for s in systems:
            clusters[s] = _make_cluster(s, cfg, workdir / s)
            clusters[s].start()
            interrupt.check()
        # Measure from when every replica of every system is up and training: process startup
        # (Python and torch imports on a loaded machine) is not training time.
        _wait_started(clusters, timeout=180.0, interrupt=interrupt)
        t0 = time.time()
        for c in clusters.values():
            c.t0 = t0
        schedule = Schedule(cfg)
        pending_restarts: list[tuple[float, str, int]] = []
        pending_resumes: list[tuple[float, str, int]] = []
        next_fault = 0
        while not interrupt.requested:
            now = time.time()
            el = now - t0
            if el >= cfg.duration:
                break
            if next_fault < len(schedule.times) and el >= schedule.times[next_fault]:
                next_fault += 1
                _inject(cfg, clusters, schedule, now, pending_restarts, pending_resumes)
            for item in list(pending_restarts):
                if now >= item[0]:
                    pending_restarts.remove(item)
                    c = clusters[item[1]]
                    if c.restarts_all:
                        c.start()  # the go file exists: they train as soon as all are back
                    elif item[2] not in c.procs:
                        c.spawn(item[2])
            for item in list(pending_resumes):
                if now >= item[0]:
                    pending_resumes.remove(item)
                    c = clusters[item[1]]
                    c.signal(item[2], signal.SIGCONT, "resume")
                    if item[2] in c.procs:
                        c.procs[item[2]].paused = False
            for c in clusters.values():
                c.reap()
            if on_tick is not None:
                on_tick(clusters, el)
            time.sleep(0.05)
    finally:
        t_end = time.time()
        _stop_all(clusters)
    if interrupt.requested:
        extra["interrupted"] = interrupt.name
    rows = {name: summarize(c, t_end) for name, c in clusters.items()}
    base = rows.get("failure_free", {}).get("final_step") or 0
    base_samples = rows.get("failure_free", {}).get("samples") or 0
    for r in rows.values():
        r["ett"] = round(r["final_step"] / base, 3) if base else None
        r["baseline_final_step"] = base
        # Steps with fewer contributors train fewer samples: report that ratio as well.
        r["sample_ett"] = round(r["samples"] / base_samples, 3) if base_samples else None
    if "ddp" in rows and "failure_free" in rows:
        extra["overhead_vs_ddp"] = _overhead(rows["failure_free"], rows["ddp"])
    for c in clusters.values():
        c.cleanup()
    extra["t0"] = t0
    extra["t_end"] = t_end
    # A system that committed no step and lost replicas it did not kill could not train at all.
    dead = {r["system"]: first_crash(clusters[r["system"]]) for r in rows.values()
            if not r.get("final_step") and r.get("survivor_crashes")}
    if dead and not interrupt.requested:
        extra["cannot_train"] = {k: v for k, v in dead.items() if v}
    return {"config": cfg.__dict__, "systems": list(rows.values()), **extra}


def _overhead(p2pft: dict[str, Any], ddp: dict[str, Any]) -> float | None:
    """p2pft's step time over plain DDP's, minus one: what the runtime costs when nothing fails.

    Both are median gaps between committed steps before the first failure, when both run
    failure-free on the same cores at the same time (later, restarts load the machine unevenly).
    """
    until = min((float(e["t"]) for e in ddp.get("_events", []) if e["kind"] in ("kill", "pause")),
                default=float("inf"))

    def median_gap(row: dict[str, Any]) -> float | None:
        ts = [float(t) for t, _ in row.get("_contributors", []) if t <= until]
        gaps = [b - a for a, b in zip(ts, ts[1:])]
        return statistics.median(gaps) if gaps else None

    a, b = median_gap(p2pft), median_gap(ddp)
    return round(a / b - 1.0, 3) if a and b else None


def _make_cluster(system: str, cfg: ChaosConfig, workdir: Path) -> Cluster:
    if system == "torchft":
        from .torchft_system import TorchftCluster
        return TorchftCluster(system, cfg, workdir)
    if system == "ddp":
        from .ddp_system import DdpCluster
        return DdpCluster(system, cfg, workdir)
    return Cluster(system, cfg, workdir)


def _stop_all(clusters: dict[str, Cluster]) -> None:
    """Stop every cluster, even when stopping one of them fails."""
    errors = []
    for c in clusters.values():
        try:
            c.stop()
        except Exception as exc:  # keep stopping the others; the process groups are killed anyway
            log.error("stopping %s failed: %s", c.system, exc)
            errors.append(exc)
    if errors:
        raise errors[0]


def _wait_started(clusters: dict[str, Cluster], timeout: float, interrupt: Interrupt) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        interrupt.check()
        for c in clusters.values():
            if not c.procs and c.finished:   # every replica exited before training began
                raise CannotTrain(f"{c.system} cannot train: {first_crash(c) or 'every replica exited'}")
        ready = all(any(r.get("kind") == "start" for r in read_stats(p.stats))
                    for c in clusters.values() for p in c.procs.values())
        if ready:
            for c in clusters.values():
                c.go()
            return
        for c in clusters.values():
            c.reap()
        time.sleep(0.1)
    raise RuntimeError(f"replicas did not start training within {timeout:g} s")


def _map_targets(targets: list[int], size: int) -> list[int]:
    """The victims' indices in a cluster of `size` replicas: the same indices where they exist
    (a p2pft cluster with hot spares has more replicas than the others), else distinct others."""
    out: list[int] = []
    for i in targets:
        j = i if i < size else i % size
        while j in out and len(out) < size:
            j = (j + 1) % size
        out.append(j)
    return out


def _inject(cfg: ChaosConfig, clusters: dict[str, Cluster], schedule: Schedule, now: float,
            pending_restarts: list[tuple[float, str, int]], pending_resumes: list[tuple[float, str, int]]) -> None:
    """One failure, the same replica indices for every system that has failures."""
    faulty = [n for n in clusters if n != "failure_free"]
    if not faulty:
        return
    ref = clusters["p2pft"] if "p2pft" in clusters else clusters[faulty[0]]
    leader = ref.leader() if cfg.fault == "leader" else None
    # Victims are replicas that are training in the reference system (a failure of a process
    # that is still importing torch tests nothing); every system loses the same index.
    targets = schedule.targets(sorted(ref.training()), sorted(ref.live()), leader)
    if not targets:
        log.info("failure at %.1f s skipped: no replica may fail", now)
        for name in faulty:
            clusters[name].events.append({"t": now, "kind": "skipped", "replica": -1})
        return
    for name in faulty:
        c = clusters[name]
        own = _map_targets(targets, c.cfg.replicas + getattr(c, "spares", 0))
        if c.restarts_all:
            # Any failure stops the synchronous job: every replica restarts from the checkpoint.
            if cfg.fault == "host":
                for i in own:
                    c.host_down(i)
            c.kill_job(own)
            pending_restarts.append((now + cfg.restart_after, name, -1))
            continue
        for i in own:
            if cfg.fault == "pause":
                c.signal(i, signal.SIGSTOP, "pause")
                if i in c.procs:
                    c.procs[i].paused = True
                pending_resumes.append((now + cfg.pause_for, name, i))
            elif i in c.live():
                if cfg.fault == "host":
                    c.lose_host(i)
                else:
                    c.signal(i, signal.SIGKILL, "kill")
                pending_restarts.append((now + cfg.restart_after, name, i))
