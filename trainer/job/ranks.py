"""How the ranks of a replica act as one in the job's life: rank 0 (the only one that reads the
views) decides, and every rank takes its decision through the replica's group, so they raise
the same error, load the same step and leave the end barrier together. Forming, the same start
and the end barrier all decide this way; this module is the one place that says how.
"""
from __future__ import annotations

import logging
from typing import Callable, TypeVar, cast

from ...transport.backend import DataPlaneError
from ..kernel.errors import JobError
from ..kernel.ports import RecoveryParts, ReplicaState, RuntimePort

#: the job's life logs under one name, whichever of its modules says it (as before the split)
log = logging.getLogger("p2pft.trainer.job.life")

POLL_S = 0.1                # one look at the view while waiting for the group or the end

T = TypeVar("T")


class Ranks:
    """Rank 0 decides, every rank of the replica gets the same value; an error decided is
    raised on every rank."""

    def __init__(self, port: ReplicaState) -> None:
        self.port = port

    @property
    def rt(self) -> RuntimePort:
        rt = self.port.rt
        assert rt is not None, "rank 0 decides the job's life"
        return rt

    def decided(self, decide: Callable[[], T]) -> T:
        """`decide()`'s value on rank 0, handed to every rank; a job error it raised is raised
        on every rank."""
        got: object = self.port.group.broadcast(_capture(decide) if self.port.rt is not None else None)
        if isinstance(got, BaseException):
            raise got
        return cast(T, got)   # rank 0's value, as the group hands it (see ``ReplicaGroup.broadcast``)


def raise_if_unusable(port: RecoveryParts) -> None:
    """Rank 0: the data plane can never work for this job (one of its communicators was
    refused for good, say explicit NCCL with two replicas on one device): say so, stop."""
    broken = port.comms.unusable()
    if broken is not None:
        err = DataPlaneError(f"the data plane cannot work for this job: {type(broken).__name__}: {broken}")
        log.error("%s", err)
        raise err


def _capture(fn: Callable[[], T]) -> T | JobError | DataPlaneError:
    """The value of `fn`, or the job error it raised (to be raised on every rank)."""
    try:
        return fn()
    except (JobError, DataPlaneError) as exc:
        return exc


__all__ = ["POLL_S", "Ranks", "log", "raise_if_unusable"]
