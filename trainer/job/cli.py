"""Command-line options of the job's life, shared by the example replicas (FaultTolerant,
HSDP, DiLoCo, local SGD): one flag per field of ``p2pft.trainer.Options`` it sets, its default
read from there, so a flag and its keyword cannot drift (docs/runtime.md, "A job's life")."""
from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from ..kernel.options import InitialState, OnFinished, Options

_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Options)}

#: the Options fields these flags set (``--steps`` and ``--min-replicas`` are in ``add_replica_args``)
JOB_FIELDS = ("checkpoint_dir", "checkpoint_every", "allow_restart_from_scratch", "resume_grace", "on_finished",
              "initial_state")


def add_job_args(p: argparse.ArgumentParser) -> None:
    """Checkpoints, the same start, and what a replica does when the job's state is gone or
    the job already finished."""
    d = _DEFAULTS
    p.add_argument("--checkpoint-dir", default=d["checkpoint_dir"],
                   help="this replica's checkpoint directory (torch.distributed.checkpoint; every rank of an FSDP "
                        "replica writes its shard there): resumed from at start, written every --checkpoint-every")
    p.add_argument("--checkpoint-every", type=int, default=d["checkpoint_every"],
                   help="write a checkpoint every N committed steps")
    p.add_argument("--allow-restart-from-scratch", action="store_true", default=d["allow_restart_from_scratch"],
                   help="when no peer and no checkpoint holds the job's furthest step, train again from this "
                        "replica's state instead of refusing to start")
    p.add_argument("--resume-grace", type=float, default=d["resume_grace"],
                   help="with no replica training and the job further than this replica's state, wait this "
                        "long (s) for one that holds it before refusing (or, allowed, restarting)")
    p.add_argument("--on-finished", choices=[o.value for o in OnFinished], default=d["on_finished"],
                   help="a replica that starts after the job finished exits 0 (exit) or waits for a further "
                        "target (wait)")
    p.add_argument("--initial-state", choices=[o.value for o in InitialState], default=d["initial_state"],
                   help="at step 0 the participants take the leader's state (broadcast), or compare digests "
                        "and fail on a difference (check)")


def job_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The ``Options`` keywords of the parsed flags (``--steps 0``: no declared end)."""
    kw = {name: getattr(args, name) for name in JOB_FIELDS}
    return {"total_steps": args.steps or None, "min_replicas": args.min_replicas, **kw}


__all__ = ["JOB_FIELDS", "add_job_args", "job_kwargs"]
