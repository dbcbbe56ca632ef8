"""A replica catching up between sparse rounds waits off the ring, and starts training when it can.

Rounds of a span algorithm (DiLoCo) are seconds apart. A restarted replica used to wait inside
the next round's ring, answering it with zeros, and only then hand over and train the span
after: a restart cost the rest of the span in progress plus a whole span. Off the ring it
instead watches two things, every rank of the replica in lockstep:

- its catch-up: once every rank restored a snapshot of the current step and nothing was reduced
  since, that state is the head; the replica hands over now (``Catchup.take_head``), and the
  algorithm trains the rest of the span from it and contributes a partial span at the round;
- its data server: a peer's ring connection waiting there means the round has started (a TCP
  ring connects at its first operation); the replica then joins it at once, as before.

Only where the data server can see such a call (``ShardComms.sees_calls``: its own TCP rings);
the survivors wait for nobody, and a round that starts first is answered as before.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

from .attempt import Attempt
from .comms import ShardComms
from .group import ReplicaGroup
from .ports import CatchupControl, RuntimePort

POLL_S = 0.02   # how often the replica looks (a gloo all-gather of a few bytes over its ranks)


class OffRingPort(Protocol):
    """What the wait reads of the step kernel."""

    step: int
    group: ReplicaGroup
    comms: ShardComms
    catchup: CatchupControl
    rt: RuntimePort | None

    @property
    def synced(self) -> bool: ...

    @property
    def stopping(self) -> bool: ...


@dataclass(frozen=True)
class Look:
    """One rank's look: a peer's ring call waits for it; the step it could hand over at;
    rank 0's current data epoch (None on the other ranks)."""

    called: bool
    ready: int | None
    epoch: int | None


def wait_off_ring(k: OffRingPort, att: Attempt, deadline: float) -> bool | None:
    """Collective. Wait off the ring for attempt `att`. True: the replica handed over between
    rounds (synced at ``k.step``, nothing applied); False: a round started, and this attempt's
    data epoch is still the current one, so go to the ring with it; None: plan again (the view
    moved on, the deadline passed, or a stop was asked)."""
    while True:
        view = k.rt.view if k.rt is not None else None
        look = Look(k.comms.calling(att.data_epoch), k.catchup.ready_step(),
                    view.data_epoch if view is not None else None)
        looks = k.group.agree(look)
        epoch = looks[0].epoch
        if any(x.called for x in looks):
            return False if epoch == att.data_epoch else None
        if all(x.ready is not None and x.ready == k.step for x in looks):
            # Every rank takes the head alike: they agreed that each is at it, and nothing else
            # moves the catch-up's head while the training thread is here (it reduces nothing).
            if all(k.group.agree(k.catchup.take_head(k.step))):
                return True
            raise RuntimeError(f"the ranks of this replica disagree on handing over at step {k.step}: the "
                               "replica must restart")
        if epoch != att.data_epoch or time.monotonic() > deadline or k.stopping:
            return None
        time.sleep(POLL_S)


def ring_calling(k: OffRingPort, min_epoch: int) -> bool:
    """Collective: a peer of any rank of the replica has started a round of data epoch
    `min_epoch` or later (a replica training a partial span then stops and joins it)."""
    return any(k.group.agree(k.comms.calling(min_epoch)))


__all__ = ["Look", "OffRingPort", "POLL_S", "ring_calling", "wait_off_ring"]
