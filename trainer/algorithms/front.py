"""The object a training loop holds: the documented API, and nothing of the kernel's inside.

Every algorithm (``FaultTolerant``, ``HSDP``, ``DiLoCo``, local SGD) is a composition: an
``Algorithm`` (what a round reduces and how its mean is applied), a step kernel driving it, and
for span algorithms a ``Spans`` front. This class is what they share with the user: the loop's
calls (README, "The API"), each handed to the kernel. Integrations (``StepLoader``, the
examples' stats) reach the kernel's internals through ``kernel``, by name.
"""
from __future__ import annotations

from collections import deque
from contextlib import AbstractContextManager
from typing import cast

from ..kernel.engine import StepEngine
from ..kernel.ports import Event
from ...runtime import Runtime


class Front:
    """The documented loop API of every algorithm, over one step kernel (``self.kernel``)."""

    kernel: StepEngine

    # ------------------------------------------------------------------ the job's life
    def start(self) -> None:
        """Collective: join the group (the first ``begin()`` does it): ``min_replicas``, the same
        initial state everywhere, a finished or lost job refused."""
        self.kernel.start()

    @property
    def done(self) -> bool:
        """The job's target is reached here, or the job finished: call ``finish()``."""
        return self.kernel.done

    def finish(self, timeout: float | None = None) -> int:
        """Collective: the end barrier; the step the job finished at."""
        return self.kernel.finish(timeout)

    @property
    def is_leader(self) -> bool:
        """This replica does the side work of the step begun last (one participant per step)."""
        return self.kernel.is_leader

    @property
    def leader(self) -> str | None:
        """The replica id of the participant doing side work, as of the step begun last."""
        return self.kernel.leader

    def pause(self, why: str = "pause") -> AbstractContextManager[None]:
        """``with algo.pause("eval"):`` leave the data plane for long work between commits."""
        return self.kernel.pause(why)

    # ------------------------------------------------------------------ the loop
    def zero_grad(self) -> None:
        self.kernel.zero_grad()

    @property
    def step(self) -> int:
        """Committed rounds (steps; syncs for DiLoCo and local SGD)."""
        return self.kernel.step

    @property
    def synced(self) -> bool:
        """This replica holds the committed state (False while it catches up)."""
        return self.kernel.synced

    @property
    def rt(self) -> Runtime | None:
        """The control plane (rank 0; None on the other ranks of an FSDP replica)."""
        # The kernel holds it as the port it reads (``RuntimePort``); every algorithm's
        # constructor takes, and hands its kernel, the Runtime itself.
        return cast("Runtime | None", self.kernel.rt)

    @property
    def events(self) -> deque[Event]:
        """This replica's event log (retries, exclusions, catch-ups), newest last."""
        return self.kernel.events

    def digest(self) -> str:
        """Hash of this rank's state: equal at equal steps, across replicas."""
        return self.kernel.digest()

    def digests(self) -> list[str]:
        """Collective over the replica's ranks: every rank's shard digest (parameters and
        optimizer state), in rank order (one digest for a one-rank replica)."""
        return self.kernel.group.agree(self.digest())

    def full_digest(self) -> str:
        """Collective: the digest of the whole (unsharded) parameters, as a plain PyTorch
        process that loads this replica's checkpoint into an unsharded model computes it
        (``p2pft.trainer.state.whole.params_digest``)."""
        from ..state.whole import params_digest
        full = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p.detach())
                for n, p in self.kernel.model.named_parameters()}
        return params_digest(full)

    def request_stop(self) -> None:
        """Graceful shutdown, safe from a signal handler (the loop's next call raises Stopped)."""
        self.kernel.request_stop()

    def close(self) -> None:
        self.kernel.close()


__all__ = ["Front"]
