"""The composition root: the one place that builds a replica's step kernel with its parts.

The kernel (``kernel/``) is the ground: it drives an ``Algorithm`` and calls its parts through
ports, importing none of them. Catch-up and the donor (``recovery/``), pauses and the job's life
(``job/``) and checkpoints (``state/``) are built here, each given the kernel as its port, and the
algorithms (``algorithms/``) build their kernel through ``kernel()``. Nothing below imports this.
"""
from __future__ import annotations

import torch

from .job.life import JobLife
from .job.pause import Pauses
from .kernel.algorithm import Algorithm
from .kernel.engine import StepEngine
from .kernel.group import ReplicaGroup
from .kernel.options import CheckpointOptions, EngineOptions, JobOptions
from .kernel.ports import CommFactory, DataServerPort, RuntimePort
from .kernel.state_io import StateIO
from .recovery.catchup import Catchup
from .recovery.donor import Donor
from .state.checkpoints import Checkpoints


class ReplicaParts:
    """The parts of every replica, whatever its algorithm (``engine.Parts``)."""

    def catchup(self, kernel: StepEngine, replay_cap_bytes: int, eager: bool) -> Catchup:
        return Catchup(kernel, replay_cap_bytes, eager=eager)

    def donor(self, kernel: StepEngine) -> Donor:
        return Donor(kernel)

    def pause(self, kernel: StepEngine) -> Pauses:
        return Pauses(kernel)

    def life(self, kernel: StepEngine, options: JobOptions) -> JobLife:
        return JobLife(kernel, options)

    def checkpoints(self, kernel: StepEngine, options: CheckpointOptions) -> Checkpoints:
        return Checkpoints(kernel, options)


def kernel(model: torch.nn.Module, optimizer: torch.optim.Optimizer, algorithm: Algorithm, *,
           group: ReplicaGroup, runtime: RuntimePort | None, data_server: DataServerPort, state_io: StateIO,
           options: EngineOptions, comm_factory: CommFactory | None = None) -> StepEngine:
    """A step kernel driving `algorithm` over `model` and `optimizer`, with every part wired: it
    resumes from a checkpoint when one is found, then serves its state and follows views.
    `runtime` and `data_server` are the ports the kernel reads (the algorithms hand it the
    ``Runtime`` and ``DataServer``); `comm_factory` builds its communicators instead of
    ``data_server.communicator`` (a test's in-memory ones)."""
    return StepEngine(model, optimizer, algorithm, parts=ReplicaParts(), group=group, runtime=runtime,
                      data_server=data_server, state_io=state_io, options=options, comm_factory=comm_factory)


__all__ = ["ReplicaParts", "kernel"]
