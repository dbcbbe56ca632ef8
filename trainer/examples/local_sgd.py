"""A fourth algorithm by composition: local SGD (docs/architecture.md, "Adding an algorithm").

Every replica takes ``sync_every`` optimizer steps on its own, then the replicas average their
weights. As a composition: the kernel's ``MeanGradient`` algorithm over a buffer of the weights
(the replica's weights are its contribution; the kernel reduces their mean), an "optimizer" that
sets the weights to that mean, and the kernel's ``Spans`` (a round every ``sync_every`` local
steps, a beat at each). Everything else comes with the kernel: retries with the saved
contribution when a peer dies mid-sync, exactly-once data, catch-up, pauses, the job's life.
A runnable replica is ``local_sgd_replica.py``::

    python -m p2pft.trainer.examples.local_sgd_replica --replica-id a --listen 127.0.0.1:7300 --seeds 127.0.0.1:7301
"""
from __future__ import annotations

from typing import Any

import torch

from p2pft.runtime import Runtime
from p2pft.trainer import Front, Options
from p2pft.trainer.kernel.algorithm import MeanGradient
from p2pft.trainer.kernel.attempt import StepResult
from p2pft.trainer.algorithms.shape import Shape
from p2pft.trainer.kernel.span import Spans


class AverageWeights(torch.optim.Optimizer):
    """The sync's update: the weights become the reduced mean the kernel unpacked into ``grad``."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, {"lr": 1.0})   # the kernel scales "lr" by its lr policy; unused here

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]  # torch's overloads; no closure
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.copy_(p.grad)


class LocalSGD(Front):
    """``begin()`` gives one local step's samples ([] while not contributing); ``commit()``
    takes the local optimizer step and, every ``sync_every`` of them, averages the weights."""

    def __init__(self, runtime: Runtime, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 options: Options | None = None, *, sync_every: int, **overrides: object) -> None:
        opts = Options.of(options, **overrides)   # total_steps counts local steps: a multiple of sync_every
        self.local_opt = optimizer
        mean = MeanGradient.of(model, opts.max_slots, sparse=True)   # of the weights, packed as gradients
        self.weights = mean.buf
        self.kernel = Shape.one_rank(runtime).kernel(model, AverageWeights(model.parameters()), mean, opts,
                                                     span=sync_every)
        self.spans = Spans(self.kernel, sync_every, self.weights)

    def begin(self, stop: bool = False) -> list[int]:
        return self.spans.begin(stop)

    def zero_grad(self) -> None:
        self.local_opt.zero_grad(set_to_none=True)

    def commit(self) -> StepResult | None:
        """None after a local step; the kernel's result at a sync."""
        if self.spans.samples:
            self.local_opt.step()
            if not self.spans.stepped():
                return None
            for p in self.weights.params:   # this replica's weights are its contribution
                p.grad = p.detach().clone()
        return self.spans.round()


__all__ = ["AverageWeights", "LocalSGD"]
