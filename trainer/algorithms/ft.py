"""``FaultTolerant``: the step protocol around an ordinary loop, for a replica of one rank.

A training loop calls ``begin()`` (which samples to train on, empty when this replica does not
contribute), runs forward/backward, then ``commit()``. ``commit`` allreduces the step buffer on
the current view's communicator and, on any data-plane error, waits for the next view and
retries with the saved local gradients: no recomputation, no restart. It is the step kernel
(``engine.py``) with one rank, the whole state, and the job's life; see docs/architecture.md.
"""
from __future__ import annotations

import logging

import torch

from ...runtime import Runtime
from ..kernel.algorithm import MeanGradient
from ..kernel.attempt import StepResult
from ..kernel.errors import (InitialStateMismatch, JobConfigError, JobError, JobFinished, MissingStateError,
                             StepTimeout, Stopped)
from ..kernel.options import Options
from ..state.layouts import WHOLE_STATE
from .front import Front
from .shape import Shape

log = logging.getLogger(__name__)




class FaultTolerant(Front):
    """Wraps a model and optimizer of one replica (``p2pft.trainer.FaultTolerant``): the mean of
    the replicas' gradients each step, over a one-rank kernel and the whole state.

    ``options`` is an ``Options`` (``p2pft.trainer.Options``), keywords override its fields; the
    same positional order and options for every algorithm. The job's life around the loop is the
    kernel's (``start()``, ``done``, ``finish()``, ``is_leader``, ``pause()``)."""

    def __init__(self, runtime: Runtime, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 options: Options | None = None, **overrides: object) -> None:
        opts = Options.of(options, **overrides)   # checked first: one error before anything is served
        self.kernel = Shape.one_rank(runtime).kernel(model, optimizer, MeanGradient.of(model, opts.max_slots), opts)

    def begin(self, stop: bool = False) -> list[int]:
        """Collective. This step's sample indices ([] while this replica contributes nothing)."""
        return self.kernel.begin(stop)

    def commit(self) -> StepResult:
        """Collective. Allreduce the step's gradients, retry across views, apply (``StepResult``)."""
        return self.kernel.commit()


__all__ = ["FaultTolerant", "InitialStateMismatch", "JobConfigError", "JobError", "JobFinished", "MissingStateError",
           "StepResult", "StepTimeout", "Stopped", "WHOLE_STATE"]
