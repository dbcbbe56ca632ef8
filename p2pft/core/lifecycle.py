"""The job's life as one trainer decides it: whether it may enter the group, how its state at
step 0 is agreed, whether it leads a committed step, and what each look at the end barrier
means. Pure functions of a view and the trainer's own facts: no clock, no I/O.

``p2pft/core/jobplan.py`` is the leader's half (what the next view says of the job); this is the
trainer's half. The trainer (``trainer/job/life.py``) and the simulator's trainers
(``p2pft/sim/trainers.py``) call the same functions, so the simulator's job-level invariants check
the decisions production makes.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, Sequence

from .view import JobTarget, Role, View


class Admit(enum.Enum):
    """One look at the view by a trainer that wants to train (at its start, and before each step)."""

    WAIT = "wait"                  # no view takes this trainer yet
    IN = "in"                      # in the group: train (a participant) or catch up (a joiner)
    FINISHED = "finished"          # the job finished: nothing to train (JobFinished)
    FURTHER = "further"            # the job finished, and this trainer waits for a further target
    CONFIG_ERROR = "config_error"  # this trainer declares another end than the group's (JobConfigError)
    OFFER = "offer"                # nobody trains, the job got further than our step > 0: wait for the
    #                                leader to resume from the best step held (ours, or another's)
    GRACE = "grace"                # nobody trains, the job got further, we hold step 0: wait for a holder
    REFUSE = "refuse"              # ... the grace is over, no holder came back: MissingStateError
    SCRATCH = "scratch"            # ... the grace is over and a restart from scratch is allowed


@dataclass(frozen=True, slots=True)
class Declared:
    """What this trainer declared of the job (``JobOptions``)."""

    target: JobTarget | None = None
    allow_scratch: bool = False
    wait_when_finished: bool = False    # on_finished="wait"


def further(mine: JobTarget | None, theirs: JobTarget | None) -> bool:
    """Does `mine` extend the group's finished target (same kind, more)?"""
    return mine is not None and theirs is not None and mine.kind is theirs.kind and mine.n > theirs.n


def admit(view: View | None, me: str, step: int, declared: Declared, grace_over: bool,
          finishing: bool = False) -> Admit:
    """May this trainer (node id `me`, holding committed step `step`) train in `view`?

    The order is the start's: a finished job first (a committed view that says so is enough,
    whoever it lists: the replicas that finished may have left with the quorum), then the
    declared end, then the job's progress: with no participant and nobody paused, a trainer
    below the high-water step must not train on from its older state without the leader
    resuming from it (``JobPlanner``), and one at step 0 holds nothing of the job."""
    if view is None:
        return Admit.WAIT
    if view.finished is not None and not finishing:
        if further(declared.target, view.target) or declared.wait_when_finished:
            return Admit.FURTHER
        return Admit.FINISHED
    if declared.target is not None and view.target is not None and declared.target != view.target \
            and view.finished is None:
        return Admit.CONFIG_ERROR
    role = view.role_of(me)
    if role not in (Role.PARTICIPANT, Role.JOINER):
        return Admit.WAIT
    if not view.participants and not view.paused and view.high_water > step:
        if step > 0:
            return Admit.OFFER
        if not grace_over:
            return Admit.GRACE
        return Admit.SCRATCH if declared.allow_scratch else Admit.REFUSE
    return Admit.IN


class Fetch(enum.Enum):
    """How a trainer's state at step 0 is agreed (rank 0's word to the ranks)."""

    HOLD = "hold"           # this replica is the lead: keep a copy of the state for the others
    FROM = "from"           # pull (or compare with) the lead replica's, shard by shard
    CATCH_UP = "catch_up"   # the group started without this replica: a snapshot, not step 0
    NONE = "none"           # nothing to agree on


def initial_fetch(view: View | None, me: str, step: int, peer_step: Callable[[str], int],
                  agree: bool = True) -> Fetch:
    """At step 0 with every participant at step 0: the lead holds its state for the others to
    pull (`agree`; with initial_state="off", nothing). A trainer at step 0 that the group did
    not start with (a joiner, or participants already past step 0) catches up from a snapshot:
    its state at step 0 is its own, not the job's (replicas need not seed alike), so the steps
    since, replayed onto it, would give other weights than the group's."""
    if step != 0 or view is None:
        return Fetch.NONE
    others = [m for m in view.participants if m.node != me]
    if view.role_of(me) is not Role.PARTICIPANT or any(peer_step(m.node) != 0 for m in others):
        if others or any(m.node != me for m in view.paused):   # someone holds the job's state
            return Fetch.CATCH_UP
        return Fetch.NONE
    if not agree:
        return Fetch.NONE
    lead = view.lead()
    if lead is None:
        return Fetch.NONE
    return Fetch.HOLD if lead.node == me else Fetch.FROM


def leads_step(mask: Sequence[bool], slot: int | None) -> bool:
    """Does the replica at data slot `slot` lead the committed step whose contributor mask is
    `mask`? The lowest contributing slot does: every replica that committed the step read the
    same mask, so exactly one of them leads it, whatever views each read meanwhile."""
    return slot is not None and 0 <= slot < len(mask) and bool(mask[slot]) and list(mask).index(True) == slot


class EndWord(enum.Enum):
    """One look at the end barrier (rank 0's word to the ranks)."""

    FINISHED = "finished"   # the view says the job finished at our step: return it
    BEHIND = "behind"       # the job finished at another step than ours: our weights are not the job's
    WAIT = "wait"
    ROUND = "round"         # an idle reduce round for the joiners still catching up
    STOP = "stop"
    TIMEOUT = "timeout"
    CHECK = "check"         # left out since our last commit: compare our last steps with a finished peer's
    DONE = "done"           # ... they agree: our step is the job's, say done (``end_checked``)
    REJOIN = "rejoin"       # ... the others redid one without us: catch up from a snapshot before done


class SigCheck(enum.Enum):
    """What a finished peer's signatures of our last steps say (``signatures_agree``)."""

    SAME = "same"           # every step both know has the same contributors: our state is theirs
    REDONE = "redone"       # one differs: the others redid it without us
    UNKNOWN = "unknown"     # the peer knows none of them (or could not be asked)


def signatures_agree(pairs: Sequence[tuple[str | None, str | None]]) -> SigCheck:
    """(ours, the peer's) signature of each step checked (``viewplan.end_check_steps``). A step
    we hold no signature of is not ours to check (our state came from a snapshot since): with
    none of ours, there is nothing of ours the others could have redone."""
    ours = [(m, t) for m, t in pairs if m is not None]
    if not ours:
        return SigCheck.SAME
    both = [(m, t) for m, t in ours if t is not None]
    if any(m != t for m, t in both):
        return SigCheck.REDONE
    return SigCheck.SAME if both else SigCheck.UNKNOWN


def end_word(view: View | None, step: int, synced: bool, stopping: bool, timed_out: bool,
             all_done: bool, unchecked: bool = False, peer_done: bool = False) -> EndWord:
    """At the end barrier: the job's end is ours only when we hold its final committed state
    (synced, at the finished step); a trainer that did not get there (a joiner still catching
    up, a pause that came back too late) is told so, never handed the end as its own.

    `unchecked`: we were left out of the views since our last commit (``viewplan.must_check_end``)
    and have not yet compared our last steps with a finished peer's: our step may be one the
    others redid without us, so the end is not ours before that check (``CHECK``, once the job
    finished or a peer says done at our step: `peer_done`; ``end_checked`` reads its outcome)."""
    if view is not None and view.finished is not None:
        if not synced or step != view.finished:
            return EndWord.BEHIND
        return EndWord.CHECK if unchecked else EndWord.FINISHED
    if stopping:
        return EndWord.STOP
    if timed_out:
        return EndWord.TIMEOUT
    if unchecked and synced and peer_done:
        return EndWord.CHECK
    if view is not None and view.joiners and all_done:
        return EndWord.ROUND    # a round moves the whole buffer to the joiners
    return EndWord.WAIT


def end_checked(result: SigCheck, finished: bool) -> EndWord:
    """The word after a ``CHECK``: the same signatures make the end ours (``FINISHED``, or
    ``DONE`` to say so while the job is not finished). A step the others redid means a catch-up
    (``REJOIN``) while the job goes on, and after its end leaving without the job's weights
    (``BEHIND``), as when no finished peer could say (a peer may answer at the next look)."""
    if result is SigCheck.SAME:
        return EndWord.FINISHED if finished else EndWord.DONE
    if finished:
        return EndWord.BEHIND
    return EndWord.REJOIN if result is SigCheck.REDONE else EndWord.WAIT


__all__ = ["Admit", "Declared", "EndWord", "Fetch", "SigCheck", "admit", "end_checked", "end_word", "further",
           "initial_fetch", "leads_step", "signatures_agree"]
