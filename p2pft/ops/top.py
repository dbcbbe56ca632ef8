"""``p2pft top``: a live view of the whole cluster from any one peer.

It polls the peer's ``admin.top`` answer (the committed view, every member's step as gossip
carries it, the Raft term, leader changes, joiners and recent cluster events) on the control
port and shows members with role, state, step and step rate, the view and its age, catch-ups in
progress and recent events. A terminal gets a ``rich`` live screen; anything else (a pipe, a
file, ``--plain``) gets plain text frames. Ctrl-C ends it. A peer that cannot be reached at the
start is one line on stderr and exit status 2.
"""
from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

EVENTS_SHOWN = 8


@dataclass(frozen=True)
class MemberRow:
    replica_id: str
    node: str
    role: str
    state: str
    step: int
    rate: float | None           # committed steps per second since the previous poll
    voter: bool
    addr: str


@dataclass(frozen=True)
class Frame:
    """One screen's worth, built from an admin.top answer and the previous one."""

    peer: str
    seen_by: str
    epoch: int
    data_epoch: int
    leader: str
    view_age: float | None
    term: int
    leader_changes: int
    members: list[MemberRow]
    catchups: list[tuple[str, float, int, int]]   # replica id, seconds as a joiner, its step, head step
    events: list[tuple[float, str]]               # (wall time, text), oldest first
    rejected: dict[str, int] = field(default_factory=dict)
    unreachable: list[str] = field(default_factory=list)   # "r2 10.0.0.5:7300 (named by r0)"
    quorum_lost: list[str] = field(default_factory=list)   # voters unreachable with a majority lost: "r2 (r2.1a2b3c4d)"
    error: str | None = None                      # the last poll failed (the frame shows the one before)


def build_frame(peer: str, report: dict[str, Any], prev: dict[str, Any] | None) -> Frame:
    now = float(report.get("now") or time.time())
    prev_steps: dict[str, int] = {}
    dt = 0.0
    if prev is not None:
        dt = now - float(prev.get("now") or now)
        prev_steps = {m["node"]: int(m["step"]) for m in prev.get("members", [])}
    rows = []
    for m in report.get("members", []):
        rate = None
        if dt > 0 and m["node"] in prev_steps:
            rate = max(0.0, (int(m["step"]) - prev_steps[m["node"]]) / dt)
        rows.append(MemberRow(str(m["replica_id"]), m["node"], m["role"], m["state"], int(m["step"]), rate,
                              bool(m.get("voter")), m["addr"]))
    rows.sort(key=lambda r: ({"participant": 0, "joiner": 1, "paused": 2, "witness": 3}.get(r.role, 4), r.replica_id))
    head = max((r.step for r in rows if r.role == "participant"), default=0)
    since = report.get("joiner_since", {})
    catchups = [(r.replica_id, max(0.0, now - float(since.get(r.node, now))), r.step, head)
                for r in rows if r.role == "joiner"]
    committed = report.get("committed_at")
    leader = str(report.get("leader") or "-")
    return Frame(peer=peer, seen_by=str(report.get("node", "?")), epoch=int(report.get("epoch", 0)),
                 data_epoch=int(report.get("data_epoch", report.get("epoch", 0))),
                 leader=_short(leader), view_age=(now - float(committed)) if committed else None,
                 term=int(report.get("term", 0)), leader_changes=int(report.get("leader_changes", 0)),
                 members=rows, catchups=catchups,
                 events=[(float(e["t"]), str(e["text"])) for e in report.get("events", [])][-EVENTS_SHOWN:],
                 rejected={k: int(v) for k, v in report.get("rejected", {}).items() if v},
                 unreachable=[f"{u.get('replica_id')} {u.get('data_addr')} "
                              f"(named by {', '.join(u.get('named_by', []))})"
                              for u in report.get("unreachable", [])],
                 quorum_lost=[f"{v.get('replica_id')} ({v.get('voter')})" for v in report.get("quorum_lost", [])])


def _short(node: str) -> str:
    return node.rsplit(".", 1)[0] if "." in node else node


def _age(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.1f} s"


def _rate(rate: float | None) -> str:
    return "-" if rate is None else f"{rate:.1f}"


def _header(f: Frame) -> str:
    return (f"p2pft top  {f.peer} ({_short(f.seen_by)})  epoch {f.epoch} (data {f.data_epoch})  leader {f.leader}  "
            f"term {f.term}  view age {_age(f.view_age)}  leader changes {f.leader_changes}")


COLUMNS = ("replica", "role", "state", "step", "steps/s", "voter", "addr")


def _cells(r: MemberRow) -> tuple[str, ...]:
    trains = r.role != "witness"   # a witness has no step
    return (r.replica_id, r.role, r.state, str(r.step) if trains else "-", _rate(r.rate) if trains else "-",
            "yes" if r.voter else "", r.addr)


def _quorum_text(f: Frame) -> str:
    return (f"! majority of voters lost: {', '.join(f.quorum_lost)} unreachable; nothing can be committed until "
            "enough of them come back")


def _catchup_text(c: tuple[str, float, int, int]) -> str:
    rid, secs, step, head = c
    return f"{rid}: joiner for {secs:.1f} s, step {step} (participants at {head})"


def render_plain(f: Frame) -> str:
    """The frame as plain text (pipes, files, README captures)."""
    lines = [_header(f)]
    if f.error:
        lines.append(f"! {f.error}")
    if f.quorum_lost:
        lines.append(_quorum_text(f))
    rows = [COLUMNS] + [_cells(r) for r in f.members]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    lines.append("catch-ups: " + ("; ".join(_catchup_text(c) for c in f.catchups) if f.catchups else "none"))
    if f.unreachable:
        lines.append("data port unreachable, left out: " + "; ".join(f.unreachable))
    if f.rejected:
        lines.append("rejected: " + ", ".join(f"{k}={v}" for k, v in sorted(f.rejected.items())))
    lines.append("recent events:")
    lines += [f"  {time.strftime('%H:%M:%S', time.localtime(t))}  {text}" for t, text in f.events] or ["  none"]
    return "\n".join(lines)


def render_rich(f: Frame) -> Any:
    """The frame as a rich renderable (the live terminal screen)."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    table = Table(title=_header(f), title_justify="left", expand=False)
    for c in COLUMNS:
        table.add_column(c, justify="right" if c in ("step", "steps/s") else "left")
    colors = {"participant": "green", "joiner": "yellow", "paused": "magenta", "witness": "cyan"}
    for r in f.members:
        cells = list(_cells(r))
        style = "red" if r.state != "alive" else colors.get(r.role, "")
        table.add_row(*cells, style=style)
    parts: list[Any] = []
    if f.error:
        parts.append(Text(f"! {f.error}", style="bold red"))
    if f.quorum_lost:
        parts.append(Text(_quorum_text(f), style="bold red"))
    parts.append(table)
    parts.append(Text("catch-ups: " + ("; ".join(_catchup_text(c) for c in f.catchups) if f.catchups else "none"),
                      style="yellow" if f.catchups else ""))
    if f.unreachable:
        parts.append(Text("data port unreachable, left out: " + "; ".join(f.unreachable), style="bold red"))
    if f.rejected:
        parts.append(Text("rejected: " + ", ".join(f"{k}={v}" for k, v in sorted(f.rejected.items())), style="red"))
    parts.append(Text("recent events:", style="bold"))
    for t, text in f.events:
        parts.append(Text(f"  {time.strftime('%H:%M:%S', time.localtime(t))}  {text}"))
    return Group(*parts)


class Poller:
    """One admin.top request per poll; keeps the previous answer for the step rates."""

    def __init__(self, peer: str, secret: bytes | None, timeout: float,
                 request: Callable[..., Any]) -> None:
        self.peer, self.secret, self.timeout = peer, secret, timeout
        self._request = request
        self.prev: dict[str, Any] | None = None
        self.last: Frame | None = None

    def fetch(self) -> dict[str, Any]:
        """Raises the request's OSError/TimeoutError/WireError, or ValueError for a peer that
        does not know admin.top."""
        from ..net import aio
        report = aio.run(self._request(self.peer, "admin.top", secret=self.secret, timeout=self.timeout))
        if "error" in report:
            raise ValueError(str(report["error"]))
        return report

    def poll(self) -> Frame:
        from ..net.wire import WireError
        try:
            report = self.fetch()
        except (OSError, asyncio.TimeoutError, TimeoutError, ValueError, WireError) as exc:
            if self.last is None:
                raise
            why = f"{self.peer} did not answer ({type(exc).__name__}: {exc}); showing the last answer"
            self.last = _with_error(self.last, why)
            return self.last
        frame = build_frame(self.peer, report, self.prev)
        self.prev = report
        self.last = frame
        return frame


def _with_error(f: Frame, error: str) -> Frame:
    from dataclasses import replace
    return replace(f, error=error)


def run_top(args: argparse.Namespace, secret: bytes | None, fail: Callable[[str], Exception]) -> int:
    from ..net.admin import admin_error, admin_request
    from ..transport.addr import parse_hostport
    from ..net.wire import WireError
    try:
        parse_hostport(args.peer, "--peer")
    except ValueError as exc:
        raise fail(f"bad {exc}") from None
    if args.interval <= 0:
        raise fail("--interval must be positive")
    if args.count < 0:
        raise fail("--count must be 0 (until Ctrl-C) or more")
    poller = Poller(args.peer, secret, args.timeout, admin_request)
    try:
        poller.prev = poller.fetch()   # the first answer: the baseline of the step rates
    except (OSError, asyncio.TimeoutError, WireError) as exc:
        raise fail(admin_error(exc, args.peer, args.timeout) or str(exc)) from None
    except ValueError as exc:
        raise fail(f"{args.peer} cannot answer top ({exc}): is it an older p2pft?") from None
    plain = args.plain or not sys.stdout.isatty()
    frames = 0
    # Ctrl-C ends it, always: a flag set by our own handler and checked between frames (each
    # poll runs its own asyncio loop, which is left alone). With the inherited disposition, a
    # SIGINT that the launching shell ignored (`cmd &` in a script) was ignored here too.
    stop = threading.Event()
    installed = _main_thread()
    saved = signal.signal(signal.SIGINT, lambda *_: stop.set()) if installed else None
    try:
        if plain:
            while (not args.count or frames < args.count) and not stop.wait(args.interval):
                frame = poller.poll()
                print(("\n" if frames else "") + render_plain(frame), flush=True)
                frames += 1
            return 0
        from rich.live import Live
        if stop.wait(min(args.interval, 0.5)):
            return 0
        with Live(render_rich(poller.poll()), refresh_per_second=4, screen=False) as live:
            while (not args.count or frames < args.count) and not stop.wait(args.interval):
                live.update(render_rich(poller.poll()))
                frames += 1
        return 0
    except (KeyboardInterrupt, BrokenPipeError):   # Ctrl-C, or the reader of a pipe went away
        return 0
    except (OSError, WireError, ValueError, asyncio.TimeoutError) as exc:   # unreachable only before any frame
        raise fail(f"cannot reach {args.peer}: {exc}") from None
    finally:
        if installed:
            signal.signal(signal.SIGINT, saved if saved is not None else signal.SIG_DFL)


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def register(sub: Any, cmd: Callable[[argparse.Namespace], int]) -> None:
    top = sub.add_parser("top", help="a live view of the cluster from one peer (Ctrl-C ends it)")
    top.add_argument("--peer", required=True, help="HOST:PORT of any peer (its control port)")
    top.add_argument("--interval", type=float, default=1.0, help="seconds between two polls (default 1)")
    top.add_argument("--count", type=int, default=0, help="stop after this many frames (default: until Ctrl-C)")
    top.add_argument("--plain", action="store_true", help="plain text frames even on a terminal")
    top.add_argument("--secret-file", help="file holding the cluster secret (env P2PFT_SECRET_FILE or P2PFT_SECRET)")
    top.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for each answer")
    top.set_defaults(fn=cmd)


__all__ = ["Frame", "MemberRow", "Poller", "build_frame", "register", "render_plain", "render_rich", "run_top"]
