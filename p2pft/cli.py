"""The ``p2pft`` command line.

Every option that names the cluster can also come from a ``P2PFT_*`` environment variable
(``P2PFT_LISTEN``, ``P2PFT_ADVERTISE``, ``P2PFT_SEEDS``, ``P2PFT_REPLICA_ID``,
``P2PFT_SECRET_FILE``, ``P2PFT_SECRET``); a command-line argument always wins over the environment.
Errors a user can cause (bad address, port taken, unreadable secret, nobody listening) end
with one line on stderr and a non-zero exit status, never a traceback.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import time
from typing import Any, Sequence

from .core.config import PROFILES
from .deploy.launch import add_launch_args
from .net import aio
from .net.wire import WireError, load_secret
from .ops.log import log_level, setup_logging

log = logging.getLogger("p2pft.cli")


class CliError(Exception):
    """A user-facing error: printed as one line, exit status 2."""


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(f"P2PFT_{name}", default)


def parse_seeds(text: str | None) -> list[str]:
    from .transport.addr import parse_hostport
    seeds = [s.strip() for s in (text or "").split(",") if s.strip()]
    for s in seeds:
        try:
            parse_hostport(s, "--seeds entry")
        except ValueError as exc:
            raise CliError(f"bad {exc}") from None
    return seeds


def _secret(args: argparse.Namespace) -> bytes | None:
    try:
        return load_secret(args.secret_file or _env("SECRET_FILE"))
    except ValueError as exc:
        raise CliError(str(exc)) from None


# ---------------------------------------------------------------------- peer
def cmd_peer(args: argparse.Namespace) -> int:
    from .core.meta import NodeSpec
    from .net.driver import ConnLimits, NodeServer
    from .transport.addr import parse_hostport
    listen = args.listen or _env("LISTEN")
    if not listen:
        raise CliError("--listen HOST:PORT is required (or set P2PFT_LISTEN)")
    try:
        parse_hostport(listen, "--listen")
    except ValueError as exc:
        raise CliError(f"bad {exc}") from None
    advertise = args.advertise or _env("ADVERTISE")
    if advertise:
        try:
            parse_hostport(advertise, "--advertise")
        except ValueError as exc:
            raise CliError(f"bad {exc}") from None
    seeds = parse_seeds(args.seeds if args.seeds is not None else _env("SEEDS"))
    replica_id = args.replica_id or _env("REPLICA_ID")
    listen, advertise, seeds, replica_id, metrics_port = _placement(args, listen, advertise, seeds, replica_id)
    metrics_port = _metrics_port(metrics_port, listen)
    secret = _secret(args)
    profile = PROFILES[args.profile]
    for name in ("max_inbound", "idle_timeout", "drain_timeout"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            raise CliError(f"--{name.replace('_', '-')} must be positive")
    limits = ConnLimits(**{k: getattr(args, k) for k in ("max_inbound", "idle_timeout", "drain_timeout")
                           if getattr(args, k) is not None})

    data_dir = args.data_dir or _env("DATA_DIR")

    async def main() -> int:
        from .net.store import DataDirError
        server = NodeServer(listen=listen, spec=NodeSpec(replica_id=replica_id or ""), seeds=seeds,
                            secret=secret, profile=profile, advertise=advertise, limits=limits, data_dir=data_dir)
        try:
            await server.start()
        except OSError as exc:
            raise CliError(f"cannot listen on {listen}: {exc.strerror or exc}") from None
        except (DataDirError, ValueError) as exc:
            raise CliError(str(exc)) from None
        from .ops.log import set_context
        set_context(node=server.node.id if server.node else "-")
        metrics = None
        if metrics_port is not None:
            from .ops.metrics import serve_node_metrics
            try:
                metrics = serve_node_metrics(server, metrics_port)
            except OSError as exc:
                await server.stop(leave=False)
                raise CliError(f"cannot serve metrics on {metrics_port}: {exc.strerror or exc}") from None
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        if args.ready_file:
            with open(args.ready_file, "w") as fh:
                fh.write(server.addr + "\n")
        await stop.wait()
        log.info("leaving the cluster")
        await server.stop(leave=True)
        if metrics is not None:
            metrics.close()
        return 0

    return aio.run(main())


def _placement(args: argparse.Namespace, listen: str, advertise: str | None, seeds: list[str],
               replica_id: str | None) -> tuple[str, str | None, list[str], str | None, str | None]:
    """Seeds, identity and ports from the scheduler (--seeds-from); what the user gave wins."""
    from .deploy.launch import LaunchError, cluster_args_from, offset_port
    try:
        ca = cluster_args_from(args, listen=listen, advertise=advertise, seeds=seeds, replica_id=replica_id, role="w")
    except (LaunchError, ValueError) as exc:
        raise CliError(str(exc)) from None
    metrics = args.metrics_port if args.metrics_port is not None else _env("METRICS_PORT")
    return ca.listen, ca.advertise, ca.seeds, ca.replica_id, offset_port(ca, metrics)


def _metrics_port(value: str | None, listen: str) -> str | None:
    """--metrics-port (or P2PFT_METRICS_PORT), checked before anything starts."""
    if not value:
        return None
    from .ops.metrics import parse_metrics_addr
    from .transport.addr import parse_hostport
    try:
        parse_metrics_addr(value, parse_hostport(listen).host)
    except ValueError as exc:
        raise CliError(f"bad --metrics-port: {exc}") from None
    return value


# ---------------------------------------------------------------------- members
def cmd_members(args: argparse.Namespace) -> int:
    from .net.admin import admin_error, admin_request
    from .transport.addr import parse_hostport
    try:
        parse_hostport(args.peer, "--peer")
    except ValueError as exc:
        raise CliError(f"bad {exc}") from None
    secret = _secret(args)
    try:
        report = aio.run(admin_request(args.peer, "admin.members", secret=secret, timeout=args.timeout))
    except (OSError, asyncio.TimeoutError, WireError) as exc:
        raise CliError(admin_error(exc, args.peer, args.timeout) or str(exc)) from None
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
        return 0
    print(format_members(report))
    return 0


def format_members(report: dict[str, Any]) -> str:
    when = report.get("committed_at")
    age = f"{time.time() - when:.1f} s ago" if when else "never"
    lines = [f"epoch {report.get('epoch')}  leader {report.get('leader')}  committed {age}  (as seen by "
             f"{report.get('node')})"]
    rows = [("node", "replica", "addr", "role", "state", "step", "voter")]
    for m in report.get("members", []):
        rows.append((m["node"], str(m["replica_id"]), m["addr"], m["role"], m["state"], str(m["step"]),
                     "yes" if m.get("voter") else ""))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    lost = report.get("quorum_lost") or []
    if lost:
        lines.append(f"MAJORITY OF VOTERS LOST: {quorum_lost_text(lost)} unreachable; no view can be committed "
                     "until enough of them come back (restarted with their --data-dir)")
    return "\n".join(lines)


def quorum_lost_text(lost: list[dict[str, Any]]) -> str:
    """'r2 (r2.1a2b3c4d, 127.0.0.1:7102), ...' for the members report's quorum_lost list."""
    return ", ".join(f"{v.get('replica_id')} ({v.get('voter')}{', ' + v['addr'] if v.get('addr') else ''})"
                     for v in lost)


# ---------------------------------------------------------------------- top
def cmd_top(args: argparse.Namespace) -> int:
    from .ops.top import run_top
    return run_top(args, _secret(args), CliError)


# ---------------------------------------------------------------------- parser
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="p2pft", description="Fault-tolerant data-parallel training without a "
                                "coordinator. Arguments win over P2PFT_* environment variables.")
    p.add_argument("--log-level", type=log_level, default=None,
                   help="DEBUG, INFO, WARNING, ERROR (default: $P2PFT_LOG_LEVEL or INFO)")
    sub = p.add_subparsers(dest="cmd", required=True)

    peer = sub.add_parser("peer", help="run a witness peer (a member and possible voter, no trainer)")
    peer.add_argument("--listen", help="HOST:PORT to listen on (env P2PFT_LISTEN)")
    peer.add_argument("--advertise", default=None, help="HOST:PORT that peers use to reach this one, if not "
                      "--listen (NAT, proxy; env P2PFT_ADVERTISE)")
    peer.add_argument("--seeds", default=None, help="comma-separated HOST:PORT of existing peers (env P2PFT_SEEDS)")
    peer.add_argument("--secret-file", help="file holding the cluster secret (env P2PFT_SECRET_FILE or "
                      "P2PFT_SECRET)")
    peer.add_argument("--replica-id", default=None, help="stable name of this peer (default: its address)")
    peer.add_argument("--data-dir", default=None,
                      help="directory that keeps this peer's Raft voter identity, term, vote and log, so that a "
                           "restart returns as the same voter (env P2PFT_DATA_DIR; default: none, a new identity "
                           "on every start)")
    peer.add_argument("--profile", choices=sorted(PROFILES), default="default", help="timing profile")
    peer.add_argument("--ready-file", help=argparse.SUPPRESS)
    add_launch_args(peer)
    peer.add_argument("--metrics-port", default=None, help="serve Prometheus metrics on PORT or HOST:PORT (a bare "
                      "port binds the --listen host; env P2PFT_METRICS_PORT; default: off)")
    peer.add_argument("--max-inbound", type=int, default=None,
                      help="inbound connections kept open; past it the longest-idle is closed (default 2048)")
    peer.add_argument("--idle-timeout", type=float, default=None,
                      help="seconds before an inbound connection that sends nothing is closed (default 60)")
    peer.add_argument("--drain-timeout", type=float, default=None,
                      help="seconds a connection may leave its answers unread before it is closed (default 2)")
    peer.set_defaults(fn=cmd_peer)

    mem = sub.add_parser("members", help="print the committed view as one peer sees it")
    mem.add_argument("--peer", required=True, help="HOST:PORT of any peer")
    mem.add_argument("--json", action="store_true", help="print JSON")
    mem.add_argument("--secret-file", help="file holding the cluster secret")
    mem.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer")
    mem.set_defaults(fn=cmd_members)

    from .ops.top import register as register_top
    register_top(sub, cmd_top)

    _add_optional_commands(sub)
    # `p2pft peer --log-level INFO ...` as well as `p2pft --log-level INFO peer ...`: after the
    # subcommand, the option overrides the one before it (SUPPRESS: absent, it leaves that be).
    for cmd in sub.choices.values():
        cmd.add_argument("--log-level", type=log_level, default=argparse.SUPPRESS,
                         help="DEBUG, INFO, WARNING, ERROR (default: $P2PFT_LOG_LEVEL or INFO)")
    return p


def _add_optional_commands(sub: Any) -> None:
    """Commands that live in their own modules register here."""
    try:
        from .chaos.cli import register as register_chaos
    except ImportError:
        return
    register_chaos(sub)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    setup_logging(args.log_level)
    try:
        return int(args.fn(args) or 0)
    except CliError as exc:
        print(f"p2pft {args.cmd}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    # Run through the package module so that exception classes are the package's own.
    from p2pft.cli import main as _main
    sys.exit(_main())
