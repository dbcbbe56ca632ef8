"""The step protocol as pure logic: no torch, no sockets, no clock.

Every trainer (one rank or an FSDP replica of many) runs the same loop per attempt: read the
view, allreduce the step buffer, read the reduced buffer's header, and then act on
``decide(...)``. Because every rank of every replica reads the same reduced header, all of them
take the same decision without another round trip. This module holds that decision, the one
replay log a catching-up replica keeps, and the recovery policy's named timeouts; the torch
adapters (``p2pft.trainer``) only pack buffers, run communicators and apply.

States of one replica (see docs/architecture.md)::

    SYNCED --(behind: missed a commit it cannot fetch, or left out of a view)--> CATCHING_UP
    CATCHING_UP: contributes zeros, logs each reduced step, pulls a snapshot in the background,
                 restores it and replays the log; at the head of the log every rank says ready
    CATCHING_UP --(all ranks ready, the next reduced step extends the log)--> SYNCED
    SYNCED as a joiner --(status 'ready' published)--> promoted to participant by the leader
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar


class Action(enum.Enum):
    """What a replica does with one reduced buffer."""

    COMMIT = "commit"              # apply the mean gradient: this step is committed
    FAST_FORWARD = "fast_forward"  # we are behind: fetch the missed steps, then (maybe) commit this one
    LOG = "log"                    # catching up: keep the reduced step for replay, apply nothing
    RETRY = "retry"                # contributors disagree or are behind: discard, reduce again
    IDLE = "idle"                  # nobody contributed: nothing to apply, hand back to the loop


@dataclass(frozen=True, slots=True)
class Reduced:
    """The header every rank reads from the same reduced buffer."""

    steps: dict[int, int]          # slot -> the step each contributor was at
    count: int                     # number of contributors (the divisor)
    #: data rank -> step of every member holding the committed state, contributing or not
    held: dict[int, int] = field(default_factory=dict)

    @property
    def furthest(self) -> int | None:
        """The furthest step any member holding the committed state is at."""
        return max([*self.steps.values(), *self.held.values()], default=None)

    @property
    def mask(self) -> tuple[int, ...]:
        return tuple(sorted(self.steps))


@dataclass(frozen=True, slots=True)
class Decision:
    action: Action
    step: int | None = None        # the step this reduced buffer is for (COMMIT, LOG, FAST_FORWARD)
    target: int | None = None      # FAST_FORWARD: the step the replica must reach
    commit_after: bool = False     # FAST_FORWARD: commit this reduced step once the target is reached


def decide(reduced: Reduced, local_step: int, synced: bool) -> Decision:
    """The decision after one allreduce, identical on every rank that reads the same header.

    - nobody contributed: IDLE, unless a member holding the committed state is further than
      this synced replica: then it FAST_FORWARDs to it (the cluster's state is not moving);
    - contributors at different steps, or all at s while a member that contributed nothing
      (a hot spare, one demoted for this round) is past s (an earlier
      step committed at some replicas only, because a peer died during that allreduce): the
      ones behind the furthest FAST_FORWARD to it, everybody else RETRIES (this round is
      discarded everywhere). Committing s again here would apply other gradients for s than
      the member ahead applied: the replicas would silently diverge;
    - all at s, this replica catching up: LOG s;
    - all at s, we are behind s: FAST_FORWARD to s, then commit s;
    - all at s == ours: COMMIT s.
    """
    top = reduced.furthest
    if not reduced.steps:
        if synced and top is not None and local_step < top:
            return Decision(Action.FAST_FORWARD, step=top, target=top, commit_after=False)
        return Decision(Action.IDLE)
    lo, hi = min(reduced.steps.values()), max(reduced.steps.values())
    assert top is not None
    if lo != hi or top > hi:
        if synced and local_step < top:
            return Decision(Action.FAST_FORWARD, step=top, target=top, commit_after=False)
        return Decision(Action.RETRY, step=top)
    s = hi
    if not synced:
        return Decision(Action.LOG, step=s)
    if local_step < s:
        return Decision(Action.FAST_FORWARD, step=s, target=s, commit_after=True)
    if local_step > s:
        # Only a replica that neither contributed nor said it holds the state (else `top`
        # would be past s): nothing of ours is in this round; wait for the next one.
        return Decision(Action.RETRY, step=s)
    return Decision(Action.COMMIT, step=s)


class Logged(Protocol):
    """What the replay log needs of an entry (the buffer itself stays opaque here)."""

    @property
    def step(self) -> int: ...

    @property
    def nbytes(self) -> int: ...


E = TypeVar("E", bound=Logged)


class ReplayLog(Generic[E]):
    """Reduced steps a catching-up replica keeps, to replay after restoring a snapshot.

    One append policy for every trainer: contiguous steps only (a gap clears the log: those
    entries can no longer be replayed in order); a step reduced again (nobody committed the
    earlier round) replaces the older one; past `cap_bytes` the oldest entries go, but never the
    last one, and never those at or after `keep_from` (the step of a snapshot already held,
    which needs them)."""

    def __init__(self, cap_bytes: int) -> None:
        if cap_bytes <= 0:
            raise ValueError(f"replay cap must be positive, got {cap_bytes}")
        self.cap_bytes = cap_bytes
        self._entries: list[E] = []
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __bool__(self) -> bool:
        return bool(self._entries)

    @property
    def first(self) -> int | None:
        return self._entries[0].step if self._entries else None

    @property
    def last(self) -> int | None:
        return self._entries[-1].step if self._entries else None

    @property
    def nbytes(self) -> int:
        return self._bytes

    def clear(self) -> None:
        self._entries.clear()
        self._bytes = 0

    def append(self, e: E, keep_from: int | None = None) -> None:
        while self._entries and self._entries[-1].step >= e.step:
            self._bytes -= self._entries.pop().nbytes
        if self._entries and e.step != self._entries[-1].step + 1:
            self.clear()
        self._entries.append(e)
        self._bytes += e.nbytes
        while (len(self._entries) > 1 and self._bytes > self.cap_bytes
               and (keep_from is None or self._entries[0].step < keep_from)):
            self._bytes -= self._entries.pop(0).nbytes

    def drop_before(self, step: int) -> None:
        while self._entries and self._entries[0].step < step:
            self._bytes -= self._entries.pop(0).nbytes

    def pop_first(self) -> E:
        e = self._entries.pop(0)
        self._bytes -= e.nbytes
        return e

    def reaches(self, snapshot_step: int) -> bool:
        """A snapshot of `snapshot_step` plus this log brings a replica to the log's head."""
        return bool(self._entries) and self._entries[0].step <= snapshot_step <= self._entries[-1].step + 1

    def predates(self, snapshot_step: int) -> bool:
        """The snapshot is older than the log's first entry: the steps between are lost."""
        return bool(self._entries) and snapshot_step < self._entries[0].step


# ---------------------------------------------------------------------- recovery policy
#: After a communicator failure, how long a replica waits for a view that excludes the failed
#: peer before it asks for a fresh data epoch instead. Gossip confirms a death within a
#: suspicion timeout, at most ``SUSPICION_MULTIPLIER`` times its minimum once confirmations are
#: slow; agreement and the view's broadcast add little. Six of those leaves room for a suspected
#: peer to refute (a long pause) before everyone rebuilds communicators.
SUSPICION_MULTIPLIER = 4
VIEW_WAIT_SUSPICIONS = 6
#: After asking for a fresh data epoch: the leader answers within one batch window and a
#: round trip; five seconds covers a leader election on the way.
FRESH_EPOCH_WAIT_S = 5.0
#: After an error that is not a communicator failure (e.g. not on the data plane of a view
#: that just changed): the next view usually arrives within a batch window.
NEXT_VIEW_WAIT_S = 0.2
#: Pauses before reducing again when the reduced header says "retry" (contributors disagree
#: on the step) or "idle" (nobody contributed): short, so as not to spin on a busy host.
RETRY_PAUSE_S = 0.005
IDLE_PAUSE_S = 0.01
#: Nobody contributes round after round (the others paused, or none there): the pause between
#: rounds doubles up to this, so a replica that cannot make progress makes a few calls per
#: second, not a hundred, until its step timeout.
IDLE_BACKOFF_MAX_S = 0.5


def idle_backoff(rounds: int) -> float:
    """Seconds to wait after the `rounds`-th idle round in a row (1, 2, ...)."""
    if rounds < 1:
        return IDLE_PAUSE_S
    return min(IDLE_BACKOFF_MAX_S, IDLE_PAUSE_S * 2.0 ** min(rounds - 1, 16))


def view_wait_after_failure(suspicion_min_s: float) -> float:
    """Seconds to wait for a view that removes a failed peer (see VIEW_WAIT_SUSPICIONS)."""
    return VIEW_WAIT_SUSPICIONS * SUSPICION_MULTIPLIER * suspicion_min_s


__all__ = ["Action", "Decision", "Reduced", "ReplayLog", "decide", "view_wait_after_failure",
           "FRESH_EPOCH_WAIT_S", "NEXT_VIEW_WAIT_S", "RETRY_PAUSE_S", "IDLE_PAUSE_S", "IDLE_BACKOFF_MAX_S",
           "idle_backoff"]
