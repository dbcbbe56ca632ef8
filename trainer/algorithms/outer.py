"""The pure parts of DiLoCo: the outer optimizer, the fragment schedule, the pseudo-gradient, the merge.

DiLoCo (arXiv 2311.08105) trains with an inner optimizer locally and, every H inner steps,
averages the *pseudo-gradient* (global weights minus local weights) across replicas and takes
an outer optimizer step on the global weights (SGD, lr 0.7, Nesterov momentum 0.9 in the
paper). Streaming DiLoCo (arXiv 2501.18512) splits the parameters into N fragments synced at
staggered inner steps, lets each fragment's allreduce run for tau inner steps while training
goes on, and merges the new global fragment into the local one with a factor alpha.

Here one *sync* is one committed step of the step engine: sync s carries fragment s mod N, and
between two syncs every contributing replica runs ``span = H / N`` inner steps. Nothing here
touches sockets, threads or the clock.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

OUTER_LR = 0.7
OUTER_MOMENTUM = 0.9


def outer_sgd(params: Sequence[torch.nn.Parameter], lr: float = OUTER_LR,
              momentum: float = OUTER_MOMENTUM) -> torch.optim.Optimizer:
    """The paper's outer optimizer: SGD with Nesterov momentum on the averaged pseudo-gradient."""
    return torch.optim.SGD(list(params), lr=lr, momentum=momentum, nesterov=True)


@dataclass(frozen=True)
class FragmentSchedule:
    """When each fragment is sent and applied, as a function of the sync count and the inner step.

    A sync (one engine step) covers ``span`` inner steps. With ``overlap`` = tau, the
    pseudo-gradient of the sync's fragment is taken after ``span - tau`` of them, reduced in
    the background during the last tau, and applied (merged) at the end of the span. tau = 0
    is plain DiLoCo: take, reduce and apply at the end of the span.
    """

    sync_every: int        # H: inner steps between two syncs of the same fragment
    fragments: int = 1     # N
    overlap: int = 0       # tau, in inner steps
    alpha: float = 0.0     # merge: local <- alpha * local + (1 - alpha) * global

    def __post_init__(self) -> None:
        for name in ("sync_every", "fragments"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if self.sync_every % self.fragments:
            raise ValueError(f"sync_every={self.sync_every} must be a multiple of fragments={self.fragments}: "
                             "fragments are synced at evenly staggered inner steps")
        if isinstance(self.overlap, bool) or not isinstance(self.overlap, int) or not 0 <= self.overlap < self.span:
            raise ValueError(f"overlap must be an int in [0, {self.span}) (the inner steps between two syncs), "
                             f"got {self.overlap!r}")
        if not isinstance(self.alpha, (int, float)) or isinstance(self.alpha, bool) or not 0.0 <= self.alpha < 1.0:
            raise ValueError(f"alpha must be a number in [0, 1), got {self.alpha!r}")

    @property
    def span(self) -> int:
        """Inner steps between two consecutive syncs (of different fragments when N > 1)."""
        return self.sync_every // self.fragments

    @property
    def send_at(self) -> int:
        """How many inner steps of a span run before its pseudo-gradient is taken."""
        return self.span - self.overlap

    def fragment(self, sync: int) -> int:
        """The fragment sync number `sync` carries (fragment 0 first, then 1, ... round robin)."""
        if sync < 0:
            raise ValueError(f"sync must be non-negative, got {sync}")
        return sync % self.fragments

    def inner_steps(self, syncs: int) -> int:
        """Inner steps a replica that contributed to every sync has run after `syncs` syncs."""
        return syncs * self.span

    def sync_points(self, fragment: int, horizon: int) -> list[int]:
        """The inner steps (1-based counts) below `horizon` at which `fragment` is applied."""
        if not 0 <= fragment < self.fragments:
            raise ValueError(f"fragment must be in [0, {self.fragments}), got {fragment}")
        return [(s + 1) * self.span for s in range(fragment, horizon // self.span, self.fragments)]


def split_fragments(params: Sequence[torch.nn.Parameter], n: int) -> list[list[int]]:
    """Indices of `params` in `n` contiguous groups of about equal size (in elements).

    Contiguous in module order, as the paper's fragments are consecutive layers. Every group
    holds at least one parameter, so n may not exceed the number of parameters."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"fragments must be a positive int, got {n!r}")
    if n > len(params):
        raise ValueError(f"{n} fragments for {len(params)} parameters: each fragment needs one")
    total = sum(p.numel() for p in params)
    groups: list[list[int]] = [[] for _ in range(n)]
    done = 0
    g = 0
    for i, p in enumerate(params):
        left = len(params) - i          # parameters still to place, this one included
        if groups[g] and g < n - 1 and (done >= total * (g + 1) / n or left == n - 1 - g):
            g += 1
        groups[g].append(i)
        done += p.numel()
    return groups


@torch.no_grad()
def pseudo_gradient(global_params: Sequence[torch.Tensor], local_params: Sequence[torch.Tensor],
                    out: Sequence[torch.Tensor]) -> None:
    """out = global - local, per parameter (the direction the outer optimizer descends)."""
    for g, lp, o in zip(global_params, local_params, out, strict=True):
        torch.sub(g, lp.to(g.dtype), out=o)


@torch.no_grad()
def merge(local_params: Sequence[torch.Tensor], global_params: Sequence[torch.Tensor], alpha: float) -> None:
    """local <- alpha * local + (1 - alpha) * global; alpha = 0 restarts local from global exactly."""
    for lp, g in zip(local_params, global_params, strict=True):
        if alpha == 0.0:
            lp.copy_(g)
        else:
            lp.mul_(alpha).add_(g.to(lp.dtype), alpha=1.0 - alpha)


__all__ = ["FragmentSchedule", "OUTER_LR", "OUTER_MOMENTUM", "merge", "outer_sgd", "pseudo_gradient",
           "split_fragments"]
