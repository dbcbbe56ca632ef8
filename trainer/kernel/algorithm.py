"""What an algorithm decides, as a small typed object the step kernel drives.

The kernel (``engine.py``) owns the bookkeeping every algorithm shares: beats, the step counter,
the attempt loop across views, the commit, replay and the recent log, the data cursor. An
algorithm says only what differs: which tensors a round reduces (``buffer``), how they travel
(``reduce``: plain, or through a codec), and how the reduced mean becomes the new state
(``apply``). When rounds happen (every step, or every ``span`` inner steps: ``span.py``) and the
replica's shape (one rank, R FSDP ranks: ``group.py`` and a ``StateIO``) are separate pieces, so
"DiLoCo over FSDP replicas" composes pieces that exist. docs/architecture.md, "Adding an algorithm".
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from ...transport.base import Communicator
from .stepbuf import StepBuffer


@dataclass(frozen=True)
class Round:
    """How this replica takes part in one attempt at a round's allreduce."""

    contribute: bool    # its buffer holds a contribution (gradients, a pseudo-gradient, weights)
    header: bool        # its header enters the sum: a contribution, or zeros with the step it holds
    world: int          # replicas on the communicator
    timeout: float      # one allreduce (the communicator timeout)


class Algorithm(Protocol):
    """The three decisions of an algorithm; everything else is the kernel's."""

    #: Rounds are seconds apart (a span of inner steps between them): a restarted replica takes its
    #: snapshot at once and holds the round it is at, and a round's ring may wait up to the
    #: communicator timeout for peers still in their span.
    sparse: bool

    def buffer(self, step: int) -> StepBuffer:
        """The tensors round `step` reduces (every buffer of an algorithm has one size: a replica
        catching up answers with zeros before it knows which one the others send)."""

    def reduce(self, comm: Communicator, buf: StepBuffer, r: Round) -> None:
        """Sum `buf` over the communicator (its flat tensor, header included)."""

    def apply(self, step: int, buf: StepBuffer, update: Callable[[], None]) -> None:
        """The update of round `step` from the mean, already unpacked into `buf`'s gradients:
        identical on every replica and in a replay. `update()` is the kernel's optimizer step
        with the round's contributor count and measured norm bound (``OptimizerStep``)."""


class MeanGradient:
    """The mean of the replicas' gradients, applied by the optimizer: ``FaultTolerant``,
    ``HSDP`` (each rank its shard) and local SGD (whose "gradient" is the weights)."""

    sparse = False

    def __init__(self, buf: StepBuffer, *, sparse: bool = False) -> None:
        self.buf = buf
        self.sparse = sparse

    @classmethod
    def of(cls, model: torch.nn.Module, max_slots: int, *, sparse: bool = False) -> MeanGradient:
        """The mean over `model`'s trainable parameters (their gradients become views of one buffer)."""
        return cls(StepBuffer([p for p in model.parameters() if p.requires_grad], max_slots=max_slots), sparse=sparse)

    def buffer(self, step: int) -> StepBuffer:
        return self.buf

    def reduce(self, comm: Communicator, buf: StepBuffer, r: Round) -> None:
        comm.allreduce(buf.flat, contribute=r.header, timeout=r.timeout)

    def apply(self, step: int, buf: StepBuffer, update: Callable[[], None]) -> None:
        update()


__all__ = ["Algorithm", "MeanGradient", "Round"]
