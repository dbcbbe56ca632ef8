"""The view plan of one step attempt (p2pft/core/viewplan.py), table-driven: each row is the
trainer's memory of its earlier looks, the view it reads, its own facts, and the decision the
engine and the simulator's trainers both take."""
from __future__ import annotations

import random
from typing import Any

import pytest

from p2pft.core.meta import MemberMeta, Status
from p2pft.core.view import Member, Role, View
from p2pft.core.viewplan import (NoteKind, PlanMemory, Reduce, Wait, WaitFor, end_check_steps, must_check_end,
                                 plan_view)


def _m(node: str, role: Role, slot: int | None = None, since: int = 0, shards: int = 1) -> Member:
    return Member(node=node, replica_id=node, addr=f"{node}:1",
                  data_addrs=tuple(f"{node}:{2 + i}" for i in range(shards)), role=role, slot=slot, since=since)


def _view(*members: Member, epoch: int = 9) -> View:
    return View(epoch=epoch, members=members, data_epoch=epoch - 1)


P1 = _m("me", Role.PARTICIPANT, 1, since=2)
P1_NEW = _m("me", Role.PARTICIPANT, 1, since=5)       # dropped and taken back since view 5
P2 = _m("me", Role.PARTICIPANT, 2, since=2)           # re-slotted
J = _m("me", Role.JOINER, since=2)
Z = _m("me", Role.PAUSED, since=2)
A = _m("a", Role.PARTICIPANT, 0)
B_Z = _m("b", Role.PAUSED)
C_Z = _m("c", Role.PAUSED)
B_J = _m("b", Role.JOINER)
W = _m("w", Role.WITNESS)

FRESH = PlanMemory()
WAS = PlanMemory(was_participant=True, member_since=2)            # a participant since view 2 at the last look
PENDING = PlanMemory(rejoin_pending=True)                           # left out at an earlier look
LEFT = PlanMemory(rejoin_pending=True, was_participant=False)
RET_B4 = PlanMemory(returning=(("b", 4),))


def meta(step: int, status: Status) -> MemberMeta:
    return MemberMeta(status=status, step=step)


# (what, memory, view, slot, synced, step, member steps, member metas, decision, memory after, notes)
# The decision: a Wait, or the Reduce fields that row is about.
TABLE: list[tuple[str, PlanMemory, View | None, int | None, bool, int, dict[str, int], dict[str, MemberMeta],
                  Wait | dict[str, Any], PlanMemory, tuple[NoteKind, ...]]] = [
    # --- waits
    ("no view yet", FRESH, None, None, True, 0, {}, {}, Wait(WaitFor.ROLE), FRESH, ()),
    ("not listed yet", FRESH, _view(A, W), None, True, 0, {}, {}, Wait(WaitFor.ROLE), FRESH, ()),
    ("a witness", FRESH, _view(A, _m("me", Role.WITNESS)), None, True, 0, {}, {}, Wait(WaitFor.ROLE), FRESH, ()),
    ("paused, never a participant", FRESH, _view(A, Z), None, True, 0, {}, {}, Wait(WaitFor.ROLE), FRESH, ()),
    ("members with another shard count", FRESH, _view(A, _m("me", Role.PARTICIPANT, 1, shards=2)), 1, True, 0,
     {}, {}, Wait(WaitFor.EPOCH, 9, ("me",)), PlanMemory(True, 0), ()),
    ("... a rejoin stays pending meanwhile", PENDING, _view(A, _m("me", Role.JOINER, shards=2)), None, True, 0,
     {}, {}, Wait(WaitFor.EPOCH, 9, ("me",)), PENDING, ()),
    # --- left out: rejoin
    ("first look as a participant", FRESH, _view(A, P1), 1, True, 3, {}, {},
     {"rejoin": False, "contribute": True, "demote": False, "role": Role.PARTICIPANT}, WAS, ()),
    ("a participant again, the same since", WAS, _view(A, P1), 1, True, 3, {}, {},
     {"rejoin": False, "contribute": True, "demote": False}, WAS, ()),
    ("absent after being a participant", WAS, _view(A, W), None, True, 3, {}, {}, Wait(WaitFor.ROLE), LEFT, ()),
    ("... no view at all is not being left out", WAS, None, None, True, 3, {}, {}, Wait(WaitFor.ROLE), WAS, ()),
    ("paused after being a participant (no after_pause)", WAS, _view(A, Z), None, True, 3, {}, {},
     Wait(WaitFor.ROLE), LEFT, ()),
    ("... then a joiner: catch up", LEFT, _view(A, J), None, True, 3, {"a": 3}, {},
     {"rejoin": True, "contribute": False, "demote": False, "donor": ("a", ("a:2",)), "behind": False}, FRESH, ()),
    ("a joiner after being a participant", WAS, _view(A, J), 1, True, 3, {}, {},
     {"rejoin": True, "contribute": False, "demote": True, "role": Role.JOINER}, FRESH, ()),
    ("dropped and taken back unseen: its since changed", WAS, _view(A, P1_NEW), 1, True, 3, {}, {},
     {"rejoin": True, "contribute": False, "demote": True},
     PlanMemory(was_participant=True, member_since=5), (NoteKind.TAKEN_BACK,)),
    ("a pending rejoin is taken once", PlanMemory(True, 2, True), _view(A, P1), 1, True, 3, {}, {},
     {"rejoin": True, "contribute": False, "demote": True}, WAS, ()),
    # --- sole holder
    ("left out, nobody else holds the state: a joiner stays ready", LEFT, _view(J, W), None, True, 7, {}, {},
     {"rejoin": False, "donor": None, "behind": False}, PENDING, (NoteKind.SOLE_HOLDER,)),
    ("... promoted alone: trains on, the rejoin dropped", PENDING, _view(P1, W), 1, True, 7, {}, {},
     {"rejoin": False, "contribute": True, "demote": False}, WAS, ()),
    ("... not synced: a catch-up, whoever serves it", LEFT, _view(J, W), None, False, 7, {}, {},
     {"rejoin": True, "donor": None}, FRESH, ()),
    ("... a paused member holds the state: catch up from it", LEFT, _view(J, B_Z), None, True, 7, {"b": 7}, {},
     {"rejoin": True, "donor": ("b", ("b:2",)), "behind": False}, FRESH, ()),
    # --- demote
    ("re-slotted while computing", WAS, _view(A, P2), 1, True, 3, {}, {},
     {"rejoin": False, "contribute": False, "demote": True}, WAS, ()),
    ("no slot: nothing to drop", WAS, _view(A, P1), None, True, 3, {}, {},
     {"contribute": False, "demote": False}, WAS, ()),
    ("began with a slot, now a joiner it asked to be", FRESH, _view(A, J), 1, True, 3, {}, {},
     {"rejoin": False, "contribute": False, "demote": True}, FRESH, ()),
    ("a participant not synced does not count", FRESH, _view(A, P1), 1, False, 3, {}, {},
     {"contribute": False, "demote": True}, WAS, ()),
    # --- behind
    ("a synced joiner, the donor ahead", FRESH, _view(A, J), None, True, 3, {"a": 5}, {},
     {"behind": True, "donor": ("a", ("a:2",))}, FRESH, ()),
    ("... at the donor's step", FRESH, _view(A, J), None, True, 5, {"a": 5}, {}, {"behind": False}, FRESH, ()),
    ("... not synced: catching up anyway", FRESH, _view(A, J), None, False, 3, {"a": 5}, {}, {"behind": False},
     FRESH, ()),
    ("a participant is never behind", WAS, _view(A, P1), 1, True, 3, {"a": 5}, {}, {"behind": False}, WAS, ()),
    ("a joiner behind a paused donor", FRESH, _view(J, B_Z), None, True, 3, {"b": 6}, {},
     {"behind": True, "donor": ("b", ("b:2",))}, FRESH, ()),
    # --- the donor
    ("a participant before any paused member", FRESH, _view(A, J, C_Z), None, True, 3, {"a": 3, "c": 9}, {},
     {"donor": ("a", ("a:2",)), "behind": False}, FRESH, ()),
    ("the lowest slot among participants", FRESH, _view(_m("x", Role.PARTICIPANT, 3), A, J), None, True, 3, {}, {},
     {"donor": ("a", ("a:2",))}, FRESH, ()),
    ("no participant: the furthest paused member", FRESH, _view(J, B_Z, C_Z), None, False, 0, {"b": 7, "c": 4}, {},
     {"donor": ("b", ("b:2",))}, FRESH, ()),
    ("... ties: the highest node id", FRESH, _view(J, B_Z, C_Z), None, False, 0, {"b": 4, "c": 4}, {},
     {"donor": ("c", ("c:2",))}, FRESH, ()),
    ("nobody: no donor", FRESH, _view(J, W), None, False, 0, {}, {}, {"donor": None, "behind": False}, FRESH, ()),
    # --- hold_from: the log kept for a member back from a pause
    ("a member pauses: hold from its step", WAS, _view(A, P1, B_Z), 1, True, 6, {}, {"b": meta(4, Status.PAUSED)},
     {"hold_from": 4}, PlanMemory(True, 2, returning=(("b", 4),)), ()),
    ("... 'ready' but still listed paused", WAS, _view(A, P1, B_Z), 1, True, 6, {}, {"b": meta(4, Status.READY)},
     {"hold_from": 4}, PlanMemory(True, 2, returning=(("b", 4),)), ()),
    ("... no step yet (it paused while catching up)", WAS, _view(A, P1, B_Z), 1, True, 6, {},
     {"b": meta(-1, Status.PAUSED)}, {"hold_from": None}, WAS, ()),
    ("... 'fresh' is no held state", WAS, _view(A, P1, B_Z), 1, True, 6, {}, {"b": meta(4, Status.FRESH)},
     {"hold_from": None}, WAS, ()),
    ("back as a joiner at its step: kept", RET_B4, _view(A, P1, B_J), 1, True, 6, {}, {"b": meta(4, Status.READY)},
     {"hold_from": 4}, PlanMemory(True, 2, returning=(("b", 4),)), ()),
    # Its PAUSED status is the step its pause holds: a step remembered from a READY status may
    # be the gossip from before the pause, older than the log (then nothing would be held).
    ("paused, at a later step than remembered: its pause's step", RET_B4, _view(A, P1, B_Z), 1, True, 6, {},
     {"b": meta(5, Status.PAUSED)}, {"hold_from": 5}, PlanMemory(True, 2, returning=(("b", 5),)), ()),
    ("past its step: dropped", RET_B4, _view(A, P1, B_J), 1, True, 6, {}, {"b": meta(5, Status.READY)},
     {"hold_from": None}, WAS, ()),
    ("catching up: dropped", RET_B4, _view(A, P1, B_J), 1, True, 6, {}, {"b": meta(4, Status.JOINING)},
     {"hold_from": None}, WAS, ()),
    ("left the views: dropped", RET_B4, _view(A, P1), 1, True, 6, {}, {"b": meta(4, Status.READY)},
     {"hold_from": None}, WAS, ()),
    ("nothing known of it any more: dropped", RET_B4, _view(A, P1, B_J), 1, True, 6, {}, {}, {"hold_from": None},
     WAS, ()),
    ("two members paused: the oldest step", WAS, _view(A, P1, B_Z, C_Z), 1, True, 9, {},
     {"b": meta(6, Status.PAUSED), "c": meta(3, Status.PAUSED)},
     {"hold_from": 3}, PlanMemory(True, 2, returning=(("b", 6), ("c", 3))), ()),
    ("our own pause is not held for", FRESH, _view(A, J, B_Z), None, True, 6, {},
     {"b": meta(4, Status.PAUSED), "me": meta(2, Status.PAUSED)}, {"hold_from": 4},
     PlanMemory(returning=(("b", 4),)), ()),
]


@pytest.mark.parametrize("what,memory,view,slot,synced,step,steps,metas,want,after,notes", TABLE,
                         ids=[r[0] for r in TABLE])
def test_plan_view(what: str, memory: PlanMemory, view: View | None, slot: int | None, synced: bool, step: int,
                   steps: dict[str, int], metas: dict[str, MemberMeta], want: Wait | dict[str, Any],
                   after: PlanMemory, notes: tuple[NoteKind, ...]) -> None:
    plan = plan_view(memory, view, "me", slot=slot, synced=synced, step=step, world=1,
                     member_step=lambda n: steps.get(n, 0), member_meta=metas.get)
    if isinstance(want, Wait):
        assert plan.decision == want
    else:
        assert isinstance(plan.decision, Reduce), plan.decision
        got = {k: getattr(plan.decision, k) for k in want}
        assert got == want
        assert plan.decision.demote == (slot is not None and not plan.decision.contribute)
    assert plan.memory == after
    assert tuple(n.kind for n in plan.notes) == notes


def test_the_communicator_fields_come_from_the_view() -> None:
    x = _m("x", Role.PARTICIPANT, 0)
    view = _view(x, _m("a", Role.PARTICIPANT, 2), J, W, B_Z)
    plan = plan_view(FRESH, view, "me", slot=None, synced=False, step=0, world=1, member_step=lambda n: 0,
                     member_meta=lambda n: None)
    d = plan.decision
    assert isinstance(d, Reduce)
    assert (d.epoch, d.data_epoch, d.node, d.role) == (9, 8, "me", Role.JOINER)
    assert d.nodes == ("a", "me", "x") and d.rank == 1              # data members, by node id
    assert d.addrs == (("a:2",), ("me:2",), ("x:2",))
    assert d.slot_ranks == ((0, 2), (2, 0))                          # participants: slot, data rank


def test_taken_back_note_names_the_old_since() -> None:
    plan = plan_view(WAS, _view(A, P1_NEW, epoch=12), "me", slot=1, synced=True, step=3, world=1,
                     member_step=lambda n: 0, member_meta=lambda n: None)
    assert [(n.kind, n.since, n.epoch) for n in plan.notes] == [(NoteKind.TAKEN_BACK, 2, 12)]


def test_after_pause_forgets_the_views_it_missed_not_the_returning_members() -> None:
    m = PlanMemory(was_participant=True, member_since=3, rejoin_pending=True, returning=(("b", 4),))
    assert m.after_pause() == PlanMemory(returning=(("b", 4),))
    # back from the pause as a joiner: no rejoin (the pause checked its last step itself)
    plan = plan_view(m.after_pause(), _view(A, J), "me", slot=None, synced=True, step=3, world=1,
                     member_step=lambda n: 3, member_meta=lambda n: None)
    assert isinstance(plan.decision, Reduce) and not plan.decision.rejoin


@pytest.mark.parametrize("wait,view,want", [
    (Wait(WaitFor.ROLE), _view(A, W), False),
    (Wait(WaitFor.ROLE), _view(A, J), True),
    (Wait(WaitFor.ROLE), _view(A, P1), True),
    (Wait(WaitFor.ROLE), _view(A, Z), False),
    (Wait(WaitFor.EPOCH, 9), _view(A, P1, epoch=9), False),
    (Wait(WaitFor.EPOCH, 9), _view(A, P1, epoch=10), True),
])
def test_what_a_wait_waits_for(wait: Wait, view: View, want: bool) -> None:
    assert wait.satisfied(view, "me") is want


# ---------------------------------------------------------------------- the engine's code it replaces
class _OldEngine:
    """``StepEngine._view_plan``, ``_hold_from`` and ``_paused_donor`` as they were in the engine
    (trainer/kernel/engine.py at 97fd32d), their runtime calls made plain inputs."""

    def __init__(self) -> None:
        self.was_participant, self.member_since, self.rejoin_pending = False, None, False
        self.returning: dict[str, int] = {}

    def plan(self, view: View | None, node: str, slot: int | None, synced: bool, step: int,
             steps: dict[str, int], metas: dict[str, MemberMeta]) -> Any:
        me = view.member(node) if view is not None else None
        if me is not None and me.role is Role.PARTICIPANT:
            if self.was_participant and self.member_since not in (None, me.since):
                self.rejoin_pending = True
            self.was_participant = True
            self.member_since = me.since
        elif self.was_participant and view is not None:
            self.was_participant = False
            self.rejoin_pending = True
            self.member_since = None
        if view is None or me is None or me.role not in (Role.PARTICIPANT, Role.JOINER):
            return "wait"
        members = view.data_members
        if [m.node for m in members if len(m.data_addrs) != 1]:
            return "wait"
        rejoin, self.rejoin_pending = self.rejoin_pending, False
        cands = [m for m in view.paused if m.node != me.node]
        donor = view.donor(exclude=me.node) or max(cands, key=lambda m: (steps.get(m.node, 0), m.node), default=None)
        if rejoin and donor is None and synced:
            if me.role is Role.JOINER:
                self.rejoin_pending = True
            rejoin = False
        still_mine = slot is not None and synced and not rejoin and me.role is Role.PARTICIPANT and me.slot == slot
        behind = synced and me.role is Role.JOINER and donor is not None and steps.get(donor.node, 0) > step
        for m in view.paused:
            if m.node == node:
                continue
            meta = metas.get(m.node)
            # One change since the move: a PAUSED status replaces a remembered step (viewplan.hold_from).
            if meta is not None and meta.step >= 0 and meta.status is Status.PAUSED:
                self.returning[m.node] = meta.step
            elif meta is not None and meta.step >= 0 and meta.status is Status.READY:
                self.returning.setdefault(m.node, meta.step)
        for n, s in list(self.returning.items()):
            meta = metas.get(n)
            if (view.member(n) is None or meta is None or meta.status is Status.JOINING
                    or (meta.status is not Status.PAUSED and meta.step > s)):
                del self.returning[n]
        return (still_mine, slot is not None and not still_mine, rejoin,
                donor.node if donor is not None else None, behind, min(self.returning.values(), default=None))


def test_the_same_decisions_as_the_engine_before_over_random_looks() -> None:
    """Sequences of looks over random views: every decision and the memory after each look are
    the engine's, as it decided before the view plan moved to the core."""
    rng = random.Random(39)
    roles = [Role.PARTICIPANT, Role.JOINER, Role.PAUSED, Role.WITNESS, None]
    statuses = [Status.PAUSED, Status.READY, Status.JOINING, Status.FRESH, Status.DONE]
    for _ in range(400):
        old, memory = _OldEngine(), PlanMemory()
        for epoch in range(1, 12):
            members = []
            for node in ("me", "a", "b", "c"):
                role = rng.choice(roles)
                if role is not None:
                    members.append(_m(node, role, rng.choice([0, 1, 2]) if role is Role.PARTICIPANT else None,
                                      since=rng.choice([1, 2, 5])))
            view = None if rng.random() < 0.05 else _view(*members, epoch=epoch)
            steps = {n: rng.randint(0, 6) for n in ("a", "b", "c")}
            metas = {n: meta(rng.randint(-1, 6), rng.choice(statuses)) for n in ("a", "b", "c") if rng.random() < 0.8}
            slot, synced, step = rng.choice([None, 0, 1, 2]), rng.random() < 0.8, rng.randint(0, 6)
            want = old.plan(view, "me", slot, synced, step, steps, metas)
            plan = plan_view(memory, view, "me", slot=slot, synced=synced, step=step, world=1,
                             member_step=lambda n: steps.get(n, 0), member_meta=metas.get)
            memory = plan.memory
            d = plan.decision
            got = "wait" if isinstance(d, Wait) else (d.contribute, d.demote, d.rejoin,
                                                      d.donor[0] if d.donor else None, d.behind, d.hold_from)
            assert got == want
            assert (memory.was_participant, memory.member_since, memory.rejoin_pending, dict(memory.returning)) == \
                (old.was_participant, old.member_since, old.rejoin_pending, old.returning)


# ---------------------------------------------------------------------- the end barrier's look
def _fin(*members: Member, finished: int | None = None, left: tuple[str, ...] = ()) -> View:
    return View(epoch=12, members=members, data_epoch=11, finished=finished, left=left)


WAS_AT_14 = PlanMemory(was_participant=True, member_since=2, reduced=14)   # reduced step 14 itself, since 2

END_TABLE: list[tuple[str, PlanMemory, View | None, bool]] = [
    ("still a participant since the same view", WAS_AT_14, _fin(A, P1), False),
    ("... the job finished with us", WAS_AT_14, _fin(A, P1, finished=16, left=("x",)), False),
    ("dropped: absent", WAS_AT_14, _fin(A, W), True),
    ("taken back as a joiner", WAS_AT_14, _fin(A, J), True),
    ("taken back as a participant under a new since", WAS_AT_14, _fin(A, P1_NEW), True),
    ("left out at an earlier look (a wait)", PlanMemory(rejoin_pending=True, reduced=14), _fin(A, P1_NEW), True),
    ("dropped, a paused member holds the state", WAS_AT_14, _fin(B_Z, W), True),
    ("dropped and nobody else holds a state: ours (sole holder)", WAS_AT_14, _fin(W, left=("a",)), False),
    ("taken back alone under a new since (sole holder)", WAS_AT_14, _fin(P1_NEW, W), False),
    ("finished, the finishers left the view (named as left)", WAS_AT_14, _fin(W, finished=16, left=("me", "a")),
     True),
    ("finished, another joiner on the data plane", WAS_AT_14, _fin(J, B_J, W, finished=16), True),
    ("finished, a joiner alone, nobody else ever left (sole holder)", WAS_AT_14, _fin(J, W, finished=16, left=("me",)),
     False),
    ("finished with us alone, taken back (sole holder)", WAS_AT_14, _fin(P1_NEW, W, finished=16), False),
    ("never a participant (a joiner caught up)", FRESH, _fin(A, J), False),
    ("back from a pause: it checked its step", WAS_AT_14.after_pause(), _fin(A, J), False),
    ("no view", WAS_AT_14, None, False),
    ("no view, left out at an earlier look", PENDING, None, True),
]


@pytest.mark.parametrize("what,memory,view,want", END_TABLE, ids=[r[0] for r in END_TABLE])
def test_must_check_end(what: str, memory: PlanMemory, view: View | None, want: bool) -> None:
    assert must_check_end(memory, view, "me") is want


@pytest.mark.parametrize("reduced,step,want", [
    (14, 15, (14,)),          # our last step was our own reduce
    (14, 16, (14, 15)),       # ... and step 15 came from a peer's log (a fast-forward at the end)
    (None, 16, (15,)),        # never reduced ourselves: the last step, as after a pause
    (None, 0, ()),
    (15, 15, (14,)),          # a stale mark past our step (a snapshot of an older one since): the last step
])
def test_end_check_steps(reduced: int | None, step: int, want: tuple[int, ...]) -> None:
    assert end_check_steps(PlanMemory(reduced=reduced), step) == want


def test_after_reduce_marks_the_step_and_keeps_the_rest() -> None:
    m = WAS.after_reduce(7)
    assert m == PlanMemory(was_participant=True, member_since=2, reduced=7)
    assert m.after_pause() == PlanMemory(reduced=7)
