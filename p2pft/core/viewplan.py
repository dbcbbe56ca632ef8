"""The view plan of one step attempt: what a trainer does with the view it reads before each
allreduce. Wait for a view that gives it a data-plane role, or allreduce; and with it, whether it
was left out and must catch up from a snapshot (``rejoin``), whether its gradients still count,
whom it pulls a snapshot from, whether it is behind a paused donor, and from which step it keeps
its log for a member back from a pause (docs/runtime.md, "One step" and "Pauses").

These are the hardest decisions of a replica, so they are pure functions of the view, the
trainer's own facts and a small memory of its earlier looks: no clock, no I/O. The engine
(``trainer/kernel/engine.py``) and the simulator's trainers (``p2pft/sim/trainers.py``) call the same
function, so the simulator's invariants check the decisions production makes.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from typing import Callable

from .meta import MemberMeta, Status
from .view import Member, Role, View

#: the committed step a member last told gossip about (0 when unknown)
StepOf = Callable[[str], int]
#: what gossip last said about a member (None when unknown)
MetaOf = Callable[[str], "MemberMeta | None"]


@dataclass(frozen=True, slots=True)
class PlanMemory:
    """What one look leaves for the next: the view is sampled once per attempt, so a trainer
    learns it was left out from the difference between two looks."""

    was_participant: bool = False
    member_since: int | None = None        # our membership's `since` while a participant
    rejoin_pending: bool = False           # left out: the next allreduce starts a catch-up
    returning: tuple[tuple[str, int], ...] = ()   # members back from a pause -> the step they hold
    reduced: int | None = None             # the last step we applied from our own reduce (not a log, a snapshot)

    def after_pause(self) -> PlanMemory:
        """Back from a pause (which checked our last step): being off the data plane meanwhile
        is not being left out of a view. The end barrier says the same once a finished peer's
        signatures agreed with ours (``must_check_end``)."""
        return replace(self, was_participant=False, rejoin_pending=False, member_since=None)

    def after_reduce(self, step: int) -> PlanMemory:
        """We applied `step` (the reduced buffer of step `step`, as ``Entry.step`` counts) from our
        own allreduce: the one step a view change may leave committed here only. Steps taken from
        a peer's log after it (a fast-forward) are the peer's, applied onto it."""
        return replace(self, reduced=step)


class WaitFor(enum.Enum):
    ROLE = "role"      # a view that puts this node on the data plane (participant or joiner)
    EPOCH = "epoch"    # a newer view: data-plane members have another shard count than ours


@dataclass(frozen=True, slots=True)
class Wait:
    """No allreduce in this view: look again once `satisfied` (or a bounded wait) says so."""

    why: WaitFor
    epoch: int = -1                 # EPOCH: the view to get past
    bad: tuple[str, ...] = ()       # EPOCH: the members whose shard count differs

    def satisfied(self, view: View, node: str | None) -> bool:
        if self.why is WaitFor.ROLE:
            return view.role_of(node) in (Role.PARTICIPANT, Role.JOINER)
        return view.epoch > self.epoch


@dataclass(frozen=True, slots=True)
class Reduce:
    """Allreduce in this view: every field the engine's ``Attempt`` takes from the view."""

    epoch: int
    data_epoch: int
    rank: int                                    # our rank in the communicators
    addrs: tuple[tuple[str, ...], ...]           # every data member's shard addresses, rank order
    contribute: bool                             # our gradients count (still our slot)
    demote: bool                                 # we began with a slot, and our gradients must not count
    role: Role
    rejoin: bool                                 # left out after being a participant: catch up
    node: str
    donor: tuple[str, tuple[str, ...]] | None    # catch-up source: node, shard addresses
    behind: bool                                 # a synced joiner whose donor holds a later step
    nodes: tuple[str, ...]                       # every data member's node id, rank order
    hold_from: int | None                        # keep the log of committed steps from this one on
    slot_ranks: tuple[tuple[int, int], ...]      # participants: slot, data rank


class NoteKind(enum.Enum):
    TAKEN_BACK = "taken_back"     # dropped from the views and taken back since `since` (a WARNING)
    SOLE_HOLDER = "sole_holder"   # left out, and nobody else holds the committed state (a WARNING)


@dataclass(frozen=True, slots=True)
class Note:
    """Something the caller logs: the decision is taken already."""

    kind: NoteKind
    epoch: int                     # the view's epoch (-1: none)
    since: int | None = None       # TAKEN_BACK: the `since` we had while a participant


@dataclass(frozen=True, slots=True)
class ViewPlan:
    decision: Wait | Reduce
    memory: PlanMemory             # what the next look starts from
    notes: tuple[Note, ...] = ()


def track_membership(memory: PlanMemory, view: View | None, me: Member | None) -> tuple[PlanMemory, Note | None]:
    """Were we left out since the last look? Left out of a view after being a participant
    (absent, or a joiner it did not ask to be), this replica may hold a step the others redid
    without it (its allreduce can finish while theirs fail), so it catches up from a snapshot
    before contributing again. A replica busy elsewhere (a long backward) may miss the views
    that dropped it and took it back: its membership's `since` (the epoch it entered the
    views, kept across roles) tells it anyway."""
    if me is not None and me.role is Role.PARTICIPANT:
        note = None
        pending = memory.rejoin_pending
        if memory.was_participant and memory.member_since not in (None, me.since):
            note = Note(NoteKind.TAKEN_BACK, view.epoch if view is not None else -1, memory.member_since)
            pending = True
        return replace(memory, was_participant=True, member_since=me.since, rejoin_pending=pending), note
    if memory.was_participant and view is not None:
        return replace(memory, was_participant=False, rejoin_pending=True, member_since=None), None
    return memory, None


def must_check_end(memory: PlanMemory, view: View | None, node: str | None) -> bool:
    """At the end barrier, where no commit looks at the views any more: were we left out of
    them since the look of our last commit (what that look's ``track_membership`` would find
    now: absent, a joiner we did not ask to be, or taken back under a new `since`), while another
    replica may hold the job's state? Then our last own step may be one the others redid without
    us (the allreduce of step s can finish here while theirs fail), and a fast-forward from their
    log at the end applied their next steps onto it. Such a replica must not say done, nor take
    the end as its own, until a finished peer's signatures of those steps (``end_check_steps``)
    agree with ours or it caught up; when it cannot, it leaves behind the end.

    Left out with nobody else holding a state (``sole_holder``), ours is the job's. Another
    holder is another participant or paused member; once the job finished, also another member
    on the data plane or a trainer the view names as left: replicas that finish together leave
    together, and the views then drop them (gossip from them may not have reached us: the
    views come by the log, whoever was cut off)."""
    me = view.member(node) if view is not None else None
    if not track_membership(memory, view, me)[0].rejoin_pending:
        return False
    if view is None:
        return True
    if view.donor(exclude=node) is not None or any(m.node != node for m in view.paused):
        return True
    if view.finished is None:
        return False
    return any(m.node != node and m.role.on_data_plane for m in view.members) or any(n != node for n in view.left)


def end_check_steps(memory: PlanMemory, step: int) -> tuple[int, ...]:
    """The steps whose signatures (``Entry.step`` numbering) a replica left out before the end
    compares with a finished peer's: its last own reduce (the one that may be redone without
    it) and its last step (what ``last_step_agreed`` checks after a pause); steps between were
    taken from a peer's log. A replica whose signature of one is gone (its state came from a
    snapshot since) has nothing of its own there to check."""
    return tuple(sorted({s for s in (memory.reduced, step - 1) if s is not None and 0 <= s < step}))


def sole_holder(rejoin: bool, donor: Member | None, synced: bool) -> bool:
    """Left out, and nobody else holds the committed state (the others died, and we were left
    out, e.g. falsely under load): ours is the job's. A snapshot from nobody would be waited for
    until the step timeout, while the leader waits for a holder of the high-water step to
    resume from. So stay ready; catch up once someone else holds a state."""
    return rejoin and donor is None and synced


def gradients_count(slot: int | None, synced: bool, rejoin: bool, me: Member) -> bool:
    """Do the gradients of the step we began count? Only when we still hold the committed state
    and the slot we began with (not left out, not demoted or re-slotted while computing)."""
    return slot is not None and synced and not rejoin and me.role is Role.PARTICIPANT and me.slot == slot


def is_behind(me: Member, donor: Member | None, synced: bool, step: int, member_step: StepOf) -> bool:
    """A synced joiner whose donor holds a later step: when nobody contributes (the others
    paused), it takes the donor's state instead of waiting for the step timeout."""
    return synced and me.role is Role.JOINER and donor is not None and member_step(donor.node) > step


def paused_donor(view: View, me: str, member_step: StepOf) -> Member | None:
    """With no participant, a paused member holds the committed state: the furthest one (ties:
    the highest node id, the same choice everywhere)."""
    cands = [m for m in view.paused if m.node != me]
    return max(cands, key=lambda m: (member_step(m.node), m.node), default=None)


def hold_from(returning: tuple[tuple[str, int], ...], view: View, me: str,
              member_meta: MetaOf) -> tuple[tuple[tuple[str, int], ...], int | None]:
    """The oldest step a member that paused holds, from its pause until it is past that step
    (it fast-forwarded, as a joiner or a participant promoted at once), caught up otherwise, or
    left: this replica keeps its log of committed steps from there on, so that member
    fast-forwards instead of pulling a snapshot. Returns the bookkeeping and that step."""
    held = dict(returning)
    for m in view.paused:
        if m.node == me:
            continue
        meta = member_meta(m.node)
        if meta is not None and meta.step >= 0 and meta.status is Status.PAUSED:
            # Its PAUSED status says the step its pause holds: it replaces a step taken from a
            # READY status, which may be the gossip from before the pause (the view of a pause
            # comes first when the pausing member leads), older than this log: none held at all.
            held[m.node] = meta.step
        elif meta is not None and meta.step >= 0 and meta.status is Status.READY:
            held.setdefault(m.node, meta.step)   # back already: the step it held through its pause
    for node, step in list(held.items()):
        meta = member_meta(node)
        if (view.member(node) is None or meta is None or meta.status is Status.JOINING
                or (meta.status is not Status.PAUSED and meta.step > step)):
            del held[node]
    return tuple(held.items()), min(held.values(), default=None)


def plan_view(memory: PlanMemory, view: View | None, node: str | None, *, slot: int | None, synced: bool,
              step: int, world: int, member_step: StepOf, member_meta: MetaOf) -> ViewPlan:
    """One attempt's plan for the trainer `node` (the replica's rank 0), whose step began with
    data slot `slot` (None: it contributes nothing), holding the committed state of `step` when
    `synced`, with `world` shards per replica."""
    me = view.member(node) if view is not None else None
    memory, taken_back = track_membership(memory, view, me)
    notes: tuple[Note, ...] = (taken_back,) if taken_back is not None else ()
    if view is None or me is None or me.role not in (Role.PARTICIPANT, Role.JOINER):
        return ViewPlan(Wait(WaitFor.ROLE), memory, notes)
    members = view.data_members
    bad = tuple(m.node for m in members if len(m.data_addrs) != world)
    if bad:
        return ViewPlan(Wait(WaitFor.EPOCH, view.epoch, bad), memory, notes)
    rejoin, memory = memory.rejoin_pending, replace(memory, rejoin_pending=False)
    donor = view.donor(exclude=me.node) or paused_donor(view, me.node, member_step)
    if sole_holder(rejoin, donor, synced):
        if me.role is Role.JOINER:      # catch up once someone else holds a state
            memory = replace(memory, rejoin_pending=True)
            notes += (Note(NoteKind.SOLE_HOLDER, view.epoch),)
        rejoin = False
    still_mine = gradients_count(slot, synced, rejoin, me)
    behind = is_behind(me, donor, synced, step, member_step)
    returning, hold = hold_from(memory.returning, view, me.node, member_meta)
    memory = replace(memory, returning=returning)
    return ViewPlan(Reduce(epoch=view.epoch, data_epoch=view.data_epoch, rank=view.data_rank(me.node),
                           addrs=tuple(m.data_addrs for m in members), contribute=still_mine,
                           demote=slot is not None and not still_mine, role=me.role, rejoin=rejoin, node=me.node,
                           donor=(donor.node, donor.data_addrs) if donor is not None else None, behind=behind,
                           nodes=tuple(m.node for m in members), hold_from=hold,
                           slot_ranks=tuple((m.slot, view.data_rank(m.node)) for m in view.participants
                                            if m.slot is not None)),
                    memory, notes)


__all__ = ["MetaOf", "Note", "NoteKind", "PlanMemory", "Reduce", "StepOf", "ViewPlan", "Wait", "WaitFor",
           "end_check_steps", "gradients_count", "hold_from", "is_behind", "must_check_end", "paused_donor",
           "plan_view", "sole_holder", "track_membership"]
