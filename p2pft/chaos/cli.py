"""``p2pft chaos``: argument parsing and the live view.

Usage errors end with one line on stderr and exit status 2, as every ``p2pft`` command's do;
the chaos command prints them itself, so that this package never imports ``p2pft.cli`` (which
imports this module to register the command).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from pathlib import Path
from typing import Any

from .cluster import ALGOS, DILOCO_SYSTEMS, FAULTS, ChaosConfig, Cluster


class UsageError(Exception):
    """A user-facing error of ``p2pft chaos``: printed as one line, exit status 2."""


def register(sub: Any) -> None:
    p = sub.add_parser("chaos", help="train a local cluster under a failure schedule and report",
                       description="Start local replicas (processes on loopback, CPU) training a small language "
                       "model, SIGKILL a random one every --kill-every seconds, restart it --restart-after seconds "
                       "later, and compare with a failure-free run and plain DDP restarted as a whole from its last "
                       "checkpoint, run at the same time (and torchft when it is installed). Ends with a table, JSON and a PNG timeline.")
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--duration", type=float, default=60.0, help="seconds of training per system")
    p.add_argument("--kill-every", type=float, default=10.0, help="seconds between failures")
    p.add_argument("--restart-after", type=float, default=2.0, help="seconds before a failed replica restarts")
    p.add_argument("--fault", choices=FAULTS, default="kill",
                   help="kill: SIGKILL a random replica; pause: SIGSTOP it for --pause-for; leader: kill the "
                   "Raft leader's replica; two: kill two replicas at once; host: the replica's host disappears "
                   "(its link goes down, no reset), then its processes die (needs --hosts netns)")
    p.add_argument("--hosts", choices=["loopback", "netns"], default="loopback",
                   help="loopback: every process on 127.0.0.1; netns: each replica of every system on a host of "
                   "its own (a Linux network namespace; needs root and iproute2), p2pft's witnesses and "
                   "torchft's lighthouse on hosts of their own")
    p.add_argument("--link-mbit", type=float, default=None,
                   help="with --hosts netns: limit each host's link to this many Mbit/s (tc tbf)")
    p.add_argument("--pause-for", type=float, default=3.0)
    p.add_argument("--step-delay", type=float, default=0.1, help="emulated accelerator seconds per step")
    p.add_argument("--model", choices=["tiny", "small"], default="tiny")
    p.add_argument("--workload", choices=["example", "gpt"], default=None,
                   help="example (default): the example replica; gpt (the default with --algo diloco): the GPT "
                   "recipe (trainer/examples/gpt.py), whose committed steps are then replayed in one plain PyTorch "
                   "process and compared (oracle columns)")
    p.add_argument("--algo", choices=ALGOS, default="ft",
                   help="ft: FaultTolerant, an allreduce every step; diloco: the GPT recipe with DiLoCo (inner AdamW, "
                   "an outer Nesterov SGD on the mean pseudo-gradient every --sync-every inner steps), for the "
                   "systems p2pft and failure_free (and torchft 0.2.0's DiLoCo on the same recipe when it is "
                   "installed); a step is then a sync, and the oracle replays p2pft's syncs")
    p.add_argument("--sync-every", type=int, default=5, help="with --algo diloco: inner steps between syncs (H)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--checkpoint-every", type=int, default=20,
                   help="ddp and sync baselines: steps between disk checkpoints")
    p.add_argument("--systems", default="auto",
                   help="comma list of p2pft,ddp,sync,failure_free,torchft (auto: p2pft,ddp,failure_free and "
                   "torchft when installed; sync: p2pft replicas restarted as a whole job, like ddp)")
    p.add_argument("--witnesses", type=int, default=2, help="witness peers per cluster (voters, never killed)")
    p.add_argument("--spares", type=int, default=0,
                   help="this many extra replicas wait as spares: p2pft's as hot spares (caught-up joiners) that "
                        "take a dead participant's place in the view that removes it, torchft's in its "
                        "FIXED_WITH_SPARES mode (min_replica_size = --replicas: spares allreduce zeros)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="results/chaos", help="folder for chaos.json, timeline.png and logs")
    p.add_argument("--no-live", action="store_true", help="no live progress display")
    p.add_argument("--data-plane", choices=["auto", "nccl", "tcp"], default=None,
                   help="p2pft replicas' data plane ($P2PFT_DATA_PLANE for every replica; default: theirs)")
    p.set_defaults(fn=cmd_chaos)


def cmd_chaos(args: argparse.Namespace) -> int:
    if getattr(args, "data_plane", None):
        os.environ["P2PFT_DATA_PLANE"] = args.data_plane   # the replicas inherit it
    try:
        return _chaos(args)
    except UsageError as exc:
        print(f"p2pft chaos: error: {exc}", file=sys.stderr)
        return 2


def _chaos(args: argparse.Namespace) -> int:
    """Run, then report. Ctrl-C, SIGTERM and SIGHUP stop the clusters and report what was
    measured until then (exit status 128 + the signal's number). A system that cannot train at
    all (every replica exited before training, or no step committed while replicas crashed)
    ends with the first replica's error line on stderr and exit status 1."""
    from .interrupt import Interrupt, Interrupted
    from .report import plot_timeline, print_table, write_json
    from .run import CannotTrain, run_chaos

    cfg = ChaosConfig(replicas=args.replicas, duration=args.duration, kill_every=args.kill_every,
                      restart_after=args.restart_after, fault=args.fault, pause_for=args.pause_for,
                      step_delay=args.step_delay, model=args.model, batch=args.batch,
                      checkpoint_every=args.checkpoint_every, seed=args.seed,
                      witnesses=args.witnesses, spares=args.spares,
                      workload=args.workload or ("gpt" if args.algo == "diloco" else "example"),
                      hosts=args.hosts, link_mbit=args.link_mbit, algo=args.algo, sync_every=args.sync_every)
    if cfg.hosts == "netns":
        from .hosts import unavailable
        why = unavailable()
        if why is not None:
            fallback = "kill" if cfg.fault == "host" else cfg.fault
            print(f"p2pft chaos: no network namespaces ({why}): running on loopback"
                  + (", --fault kill instead of host" if fallback != cfg.fault else ""), file=sys.stderr)
            cfg.hosts, cfg.link_mbit, cfg.fault = "loopback", None, fallback
    try:
        cfg.validate()
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    systems = _systems(args.systems, cfg.algo)
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"cannot create {out}: {exc.strerror or exc}") from None
    from rich.console import Console
    console = Console() if sys.stdout.isatty() else Console(width=150)
    console.print(f"[bold]p2pft chaos[/]: {', '.join(systems)} side by side for {cfg.duration:g} s "
                  f"({cfg.replicas} replicas each); logs in {out}/")
    interrupt = Interrupt()
    with interrupt.handling():
        live = None if args.no_live or not console.is_terminal else _Live(console)
        on_tick = live.update if live else _Plain(console).update
        try:
            report = run_chaos(cfg, out / "runs", tuple(systems), on_tick=on_tick, interrupt=interrupt)
        except Interrupted as exc:
            print(f"p2pft chaos: {exc}; every process stopped, no report", file=sys.stderr)
            return 128 + exc.signum
        except CannotTrain as exc:
            print(f"p2pft chaos: error: {exc}; every process stopped, no report", file=sys.stderr)
            return 1
        finally:
            if live:
                live.stop()
        if cfg.workload == "gpt":
            from .oracle import add_to_report
            console.print("replaying the committed steps in one plain PyTorch process (the oracle) ...")
            add_to_report(report, out / "runs")
        # Files first: after a SIGHUP the terminal may be gone and printing fail.
        write_json(report, out / "chaos.json")
        write_json(report, out / "chaos-full.json", full=True)
        plot_timeline(report, out / "timeline.png")
        try:
            if interrupt.requested:
                console.print(f"[bold]stopped by {interrupt.name}[/] after "
                              f"{report['t_end'] - report['t0']:.1f} s of training: the report covers that time")
            print_table(report, console)
            console.print(f"wrote {out / 'chaos.json'}, {out / 'timeline.png'}")
        except OSError:
            pass  # the terminal went away (SIGHUP); the files hold the report
    if interrupt.signum is not None:
        return 128 + interrupt.signum
    for system, why in (report.get("cannot_train") or {}).items():
        print(f"p2pft chaos: error: {system} committed no step: {why}", file=sys.stderr)
    return 1 if report.get("cannot_train") else 0


def _systems(text: str, algo: str = "ft") -> list[str]:
    known = ("p2pft", "ddp", "sync", "failure_free", "torchft")
    if algo == "diloco":
        out = list(DILOCO_SYSTEMS) if text == "auto" else [s.strip() for s in text.split(",") if s.strip()]
        if text == "auto" and importlib.util.find_spec("torchft") is None:
            out.remove("torchft")   # torchft's DiLoCo beside p2pft's when it is installed
        bad = [s for s in out if s not in DILOCO_SYSTEMS]
        if bad:
            raise UsageError(f"--algo diloco runs on {', '.join(DILOCO_SYSTEMS)} only, not {', '.join(bad)}")
        if "torchft" in out and importlib.util.find_spec("torchft") is None:
            raise UsageError("torchft is not installed (pip install 'p2pft[compare]')")
        return out if "failure_free" in out else [*out, "failure_free"]
    if text == "auto":
        out = ["p2pft", "ddp", "failure_free"]
        if importlib.util.find_spec("torchft") is not None:
            out.append("torchft")
        return out
    out = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in out if s not in known]
    if bad:
        raise UsageError(f"unknown system(s) {', '.join(bad)}; choose from {', '.join(known)}")
    if "torchft" in out and importlib.util.find_spec("torchft") is None:
        raise UsageError("torchft is not installed (pip install 'p2pft[compare]')")
    if "failure_free" not in out:
        out.append("failure_free")  # the denominator of ETT
    return out


def _progress(clusters: dict[str, Cluster]) -> list[tuple[str, str, int, str, int]]:
    rows = []
    for name, c in clusters.items():
        for i in range(getattr(c, "size", c.cfg.replicas)):
            p = c.procs.get(i)
            if p is None:
                rows.append((name, f"r{i}", -1, "down", 0))
                continue
            recs = _tail(p.stats)
            last = next((r for r in reversed(recs) if r.get("kind") is None and "step" in r), None)
            state = "paused" if p.paused else (last.get("role", "?") if last else "starting")
            rows.append((name, f"r{i}", int(last["step"]) if last else 0, state, int(last.get("e", 0)) if last else 0))
    return rows


def _tail(path: Path, nbytes: int = 4096) -> list[dict[str, Any]]:
    try:
        with open(path, "rb") as fh:
            fh.seek(0, 2)
            size = fh.tell()
            fh.seek(max(0, size - nbytes))
            data = fh.read().decode(errors="replace")
    except OSError:
        return []
    import json
    out = []
    for line in data.splitlines()[1:] if size > nbytes else data.splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


class _Live:
    def __init__(self, console: Any) -> None:
        from rich.live import Live
        self.live = Live(console=console, refresh_per_second=4, transient=False)
        self.live.start()
        self.last = 0.0

    def update(self, clusters: dict[str, Cluster], elapsed: float) -> None:
        if time.time() - self.last < 0.25:
            return
        self.last = time.time()
        from rich.table import Table
        t = Table(title=f"t = {elapsed:5.1f} s")
        for col in ("system", "replica", "step", "role", "epoch"):
            t.add_column(col)
        for name, rep, step, state, epoch in _progress(clusters):
            style = "red" if state in ("down", "paused") else ("yellow" if state == "joiner" else "")
            t.add_row(name, rep, str(step) if step >= 0 else "-", state, str(epoch), style=style)
        events = []
        for name, c in clusters.items():
            for e in c.events[-3:]:
                if e["kind"] not in ("start",):
                    who = f" r{e['replica']}" if e["replica"] >= 0 else ""
                    events.append((e["t"], f"{name}: {e['kind']}{who}"))
        events.sort()
        t.caption = " | ".join(x[1] for x in events[-4:])
        self.live.update(t)

    def stop(self) -> None:
        self.live.stop()


class _Plain:
    """Progress lines every 10 s when stdout is not a terminal (CI logs)."""

    def __init__(self, console: Any) -> None:
        self.console = console
        self.next = 10.0

    def update(self, clusters: dict[str, Cluster], elapsed: float) -> None:
        if elapsed < self.next:
            return
        self.next += 10.0
        parts = []
        for name in clusters:
            steps = [s for n, _, s, _, _ in _progress({name: clusters[name]}) if s >= 0]
            parts.append(f"{name} step {max(steps) if steps else 0}")
        self.console.print(f"t={elapsed:5.1f}s  " + "  ".join(parts))


