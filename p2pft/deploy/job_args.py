"""Command-line options of the job's life, shared by the example replicas (FaultTolerant,
HSDP and DiLoCo): the same flags for the same keywords (docs/runtime.md, "A job's life")."""
from __future__ import annotations

import argparse
from typing import Any


def add_job_args(p: argparse.ArgumentParser) -> None:
    """Checkpoints, the same start, and what a replica does when the job's state is gone or
    the job already finished (``--steps`` and ``--min-replicas`` are in ``add_replica_args``)."""
    p.add_argument("--checkpoint-dir", default=None,
                   help="this replica's checkpoint directory (torch.distributed.checkpoint; every rank of an FSDP "
                        "replica writes its shard there): resumed from at start, written every --checkpoint-every")
    p.add_argument("--checkpoint-every", type=int, default=0, help="write a checkpoint every N committed steps")
    p.add_argument("--allow-restart-from-scratch", action="store_true",
                   help="when no peer and no checkpoint holds the job's furthest step, train again from this "
                        "replica's state instead of refusing to start")
    p.add_argument("--resume-grace", type=float, default=15.0,
                   help="with no replica training and the job further than this replica's state, wait this "
                        "long (s) for one that holds it before refusing (or, allowed, restarting)")
    p.add_argument("--on-finished", choices=["exit", "wait"], default="exit",
                   help="a replica that starts after the job finished exits 0 (exit) or waits for a further "
                        "target (wait)")
    p.add_argument("--initial-state", choices=["broadcast", "check", "off"], default="broadcast",
                   help="at step 0 the participants take the leader's state (broadcast), or compare digests "
                        "and fail on a difference (check)")


def job_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The algorithms' job keywords from the parsed flags."""
    return {"total_steps": args.steps or None, "min_replicas": args.min_replicas,
            "checkpoint_dir": args.checkpoint_dir, "checkpoint_every": args.checkpoint_every,
            "allow_restart_from_scratch": args.allow_restart_from_scratch, "resume_grace": args.resume_grace,
            "on_finished": args.on_finished, "initial_state": args.initial_state}


__all__ = ["add_job_args", "job_kwargs"]
