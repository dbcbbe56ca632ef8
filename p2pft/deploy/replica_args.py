"""Command-line options shared by the example replica scripts (single-process and HSDP).

Kept in the control-plane package, which does not import torch, so that a launcher process
parses its arguments without the seconds of a torch import. Arguments win over the
``P2PFT_*`` environment variables, which are only defaults.
"""
from __future__ import annotations

import argparse
import os

from .launch import LaunchError, add_launch_args, cluster_args_from, data_addrs, offset_port
from ..ops.log import log_level
from ..transport.addr import parse_hostport


def add_replica_args(p: argparse.ArgumentParser, *, replicas: int, digest_every: int) -> None:
    """Identity, addresses, secret, model, optimisation and run-length options."""
    p.add_argument("--replica-id", default=os.environ.get("P2PFT_REPLICA_ID"), help="env P2PFT_REPLICA_ID")
    p.add_argument("--listen", default=os.environ.get("P2PFT_LISTEN", "127.0.0.1:0"), help="env P2PFT_LISTEN")
    p.add_argument("--seeds", default=os.environ.get("P2PFT_SEEDS", ""), help="env P2PFT_SEEDS")
    p.add_argument("--secret-file", default=os.environ.get("P2PFT_SECRET_FILE"))
    p.add_argument("--data-dir", default=os.environ.get("P2PFT_DATA_DIR") or None,
                   help="directory that keeps this replica's Raft voter identity, term, vote and log: restarted "
                        "with the same one, it returns as the same voter, so a majority of voters killed at once "
                        "heals (env P2PFT_DATA_DIR; default: none)")
    p.add_argument("--model", default="tiny", choices=["tiny", "small"])
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--lr-policy", default="sqrt", choices=["none", "linear", "sqrt"])
    p.add_argument("--replicas", type=int, default=replicas, help="nominal number of replicas (learning-rate policy)")
    p.add_argument("--step-delay", type=float, default=0.0, help="emulated accelerator seconds per step")
    p.add_argument("--steps", type=int, default=0, help="stop after this many committed steps (0: no limit)")
    p.add_argument("--duration", type=float, default=0.0, help="stop after this many seconds (0: no limit)")
    p.add_argument("--digest-every", type=int, default=digest_every)
    p.add_argument("--min-replicas", type=int, default=1, help="wait for this many participants before step 0")
    p.add_argument("--go-file", default=None, help="wait until this file exists before training (a harness "
                   "starts every replica first, then says go)")
    p.add_argument("--seed", type=int, default=0, help="model init seed (the same on every replica)")
    p.add_argument("--log-level", type=log_level, default=os.environ.get("P2PFT_LOG_LEVEL", "WARNING"))
    p.add_argument("--max-participants", type=int, default=os.environ.get("P2PFT_MAX_PARTICIPANTS") or None,
                   help="the job's planned participants: replicas beyond it wait as hot spares "
                        "(env P2PFT_MAX_PARTICIPANTS)")
    p.add_argument("--progress", choices=["auto", "on", "off"], default="auto",
                   help="a progress line every few seconds and a summary at the end, on stderr "
                        "(auto: when stderr is a terminal)")
    p.add_argument("--metrics-port", default=os.environ.get("P2PFT_METRICS_PORT") or None,
                   help="serve Prometheus metrics on PORT or HOST:PORT (a bare port binds the --listen host; "
                        "env P2PFT_METRICS_PORT; default: off)")
    add_launch_args(p)


def require_replica_id(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Fill seeds, replica id and addresses from the scheduler (--seeds-from; what the user
    gave wins), check the metrics address, then require a replica id."""
    try:
        ca = cluster_args_from(args, listen=args.listen, advertise=getattr(args, "advertise", None),
                               seeds=[s for s in args.seeds.split(",") if s], replica_id=args.replica_id, role="r")
        args.metrics_port = offset_port(ca, args.metrics_port)
        if args.metrics_port:
            from ..ops.metrics import parse_metrics_addr
            parse_metrics_addr(args.metrics_port, parse_hostport(ca.listen, "--listen").host)
        if hasattr(args, "data_listen"):
            args.data_listen, args.advertise_data = data_addrs(ca, args.data_listen, args.advertise_data)
    except (LaunchError, ValueError) as exc:
        p.error(str(exc))
    args.listen, args.seeds, args.replica_id = ca.listen, ",".join(ca.seeds), ca.replica_id
    if hasattr(args, "advertise"):
        args.advertise = ca.advertise
    if not args.replica_id:
        p.error("--replica-id is required (or set P2PFT_REPLICA_ID)")
    if args.data_dir:
        # Every example script's Runtime reads $P2PFT_DATA_DIR when not given data_dir (an HSDP
        # replica's on its rank 0): set from the flag here, it is honoured by all of them.
        args.data_dir = os.path.abspath(args.data_dir)
        os.environ["P2PFT_DATA_DIR"] = args.data_dir
    if args.max_participants is not None and args.max_participants < 1:
        p.error(f"--max-participants must be at least 1, got {args.max_participants}")
