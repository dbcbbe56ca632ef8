"""The values that cross the ranks of a replica during one step attempt.

Rank 0 turns the view into an ``Attempt`` and broadcasts it; every rank allreduces its shard and
all-gathers a ``Verdict``; all ranks then decide from the same list. ``Entry`` is one reduced
step as every contributor saw it: what is applied, logged for replay, or served to a peer that
fast-forwards.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
import torch

from ...core.view import JobTarget, Role, shard_addr
from ...transport.device import Event
from .errors import StepTimeout, Stopped


class Plan(enum.Enum):
    ALLREDUCE = "allreduce"
    WAIT = "wait"          # not on the data plane of the current view: look again
    STOP = "stop"          # request_stop(): every rank raises Stopped
    TIMEOUT = "timeout"    # no view to commit in within the step timeout


@dataclass(frozen=True)
class Attempt:
    kind: Plan
    epoch: int = 0
    data_epoch: int = 0
    rank: int = 0                                 # this replica's rank in the communicators
    addrs: tuple[tuple[str, ...], ...] = ()      # every data member's shard addresses, rank order
    contribute: bool = False
    demote: bool = False                          # our gradients must not count (re-slotted, left out)
    role: Role | None = None                      # this replica's role in the attempt's view
    rejoin: bool = False                          # left out after being a participant: catch up
    node: str = ""                                # rank 0's node id
    donor: tuple[str, tuple[str, ...]] | None = None            # catch-up source: node, shard addresses
    nodes: tuple[str, ...] = ()                   # every data member's node id, rank order
    slot_ranks: tuple[tuple[int, int], ...] = ()  # participants: slot, data rank (the ring's order)
    behind: bool = False                          # a synced joiner whose donor holds a later step
    #: data rank -> step of members done at the job's end past our step (they reduce no more):
    #: fetch the steps we missed from them instead of reducing
    done_ahead: tuple[tuple[int, int], ...] = ()
    finished: int | None = None                   # STOP: the job finished at this step
    #: the step a paused (or just returned) member holds: keep the log of steps from it on
    hold_from: int | None = None
    target: JobTarget | None = None               # ... declared as this

    def peers(self, shard: int) -> list[str]:
        return [shard_addr(a, shard) for a in self.addrs]


@dataclass(frozen=True)
class Verdict:
    """One rank's outcome of an attempt, small enough to all-gather every time."""

    ok: bool
    comm: bool = False             # a communicator failed (vs. e.g. not on the data plane yet)
    aborted: bool = False          # aborted by us (newer data epoch, stop): no peer to blame
    peer: str | None = None        # data address of the peer that failed
    error: str = ""
    steps: tuple[tuple[int, int], ...] = ()   # slot -> step, read from the reduced buffer
    held: tuple[tuple[int, int], ...] = ()    # data rank -> step of members holding the state
    count: int = 0
    short: tuple[tuple[int, int], ...] = ()   # slot -> samples it left untrained (partial contributions)
    ready: int | None = None       # catching up and at the head of the replay log at this step
    unusable: bool = False         # the data plane cannot work for this job (no retry can succeed)


@dataclass
class Entry:
    step: int
    flat: torch.Tensor             # reduced (summed) buffer, as every contributor saw it
    count: int
    mask: list[bool]
    extra: dict[str, object] = field(default_factory=dict)
    #: device tensors: an event recorded once `flat` was written (``written_event``), so a donor
    #: serving it to a peer that fast-forwards does not wait behind this rank's next collective
    ready: Event | None = None
    #: with clipping, the L2 norm of the mean gradient over the replica's shards: measured once,
    #: every rank in lockstep, when the entry is made (``StepEngine.measure``), so that a replay
    #: on a background thread applies the same clip coefficient without a collective
    norm: float | None = None
    #: slot -> samples of its assignment a contributor left untrained (a DiLoCo replica back
    #: mid-span): the cursor keeps them for later, and the mean counts only the work done
    short: dict[int, int] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()

    def divisor(self, batch_per_slot: int) -> float:
        """What the sum is divided by: contributors, less the untrained fraction of each partial
        one (the contributor count exactly when every slot trained all of its samples)."""
        if not self.short:
            return float(self.count)
        return self.count - sum(self.short.values()) / batch_per_slot


@dataclass
class StepResult:
    """What one ``commit()`` did (docs/runtime.md lists the fields)."""

    step: int                 # committed step count after this call
    committed: bool           # this call applied an optimizer update
    contributors: int         # replicas whose gradients were in the mean (0 if none applied)
    retries: int              # failed allreduce attempts before the outcome
    role: str                 # this replica's role when the outcome was reached
    fast_forwarded: int = 0   # steps applied from a peer's log (missed commits)
    trained: list[tuple[int, int]] | None = None  # sample ranges of ours in a committed mean
    trained_step: int | None = None  # the step whose mean holds `trained` (its step count before the update)
    slot: int | None = None   # the slot whose samples `trained` are (with `trained`)
    data_rank: int | None = None  # our rank in the communicator that reduced this step (None: no allreduce)
    data_world: int | None = None  # that communicator's size (the ring's summation order, for a replay)
    # The ring that reduced the committed step (of size data_world): each contributing slot's
    # data rank. The summation order follows from it, so a replay can add in the same order.
    slot_ranks: dict[int, int] | None = None


__all__ = ["Attempt", "Entry", "Plan", "StepResult", "StepTimeout", "Stopped", "Verdict"]
