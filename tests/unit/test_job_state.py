"""The job's state where it is pure: its wire form (views, deltas, member metadata), and the
leader's decisions (p2pft/core/jobplan.py) on the target, the end barrier and a headless resume."""
from __future__ import annotations

from collections import Counter
from typing import Any

import msgpack
import pytest

from p2pft.core import codec
from p2pft.core.jobplan import FINISH_GRACE_S, RESUME_GRACE_S, JobPlanner, Trainer
from p2pft.core.messages import ViewDelta, ViewFull
from p2pft.core.meta import Kind, MemberMeta, Status
from p2pft.core.reconcile import canonical
from p2pft.core.view import JobTarget, Member, Role, TargetKind, View

STEPS8 = JobTarget(TargetKind.STEPS, 8)
HDR: dict[str, Any] = {"frm": "10.0.0.1:7000", "src": "r1.0a"}


def _member(node: str, role: Role, slot: int | None = None) -> Member:
    return Member(node=node, replica_id=node.split(".")[0], addr=f"{node}:1", data_addrs=(f"{node}:2",), role=role,
                  slot=slot)


def _view(*members: Member, target: JobTarget | None = None, finished: int | None = None, hw: int = 0) -> View:
    return View(epoch=3, members=members, voters=("w.0",), high_water=hw, target=target, finished=finished)


def _trainer(node: str, status: Status, step: int, target: JobTarget | None = None, allow: bool = False,
             start: float = 1.0) -> Trainer:
    return Trainer(node, start, status, step, target, allow)


def _wire(msg: Any) -> Any:
    return codec.from_wire(msgpack.unpackb(msgpack.packb(codec.to_wire(msg), use_bin_type=True), raw=False))


# ---------------------------------------------------------------------- wire
@pytest.mark.parametrize("target,finished", [(STEPS8, None), (JobTarget(TargetKind.SAMPLES, 4096), 7), (None, None)])
def test_views_and_deltas_carry_the_job_state(target: JobTarget | None, finished: int | None) -> None:
    view = _view(_member("r1.0a", Role.PARTICIPANT, 0), target=target, finished=finished, hw=12)
    back = _wire(ViewFull(**HDR, view=view, term=2))
    assert back.view == view and back.view.target == target and back.view.finished == finished
    delta = ViewDelta(**HDR, base=2, epoch=3, term=2, high_water=12, target=target, finished=finished,
                      leader="w.0", leader_addr="10.0.0.2:7000")
    assert _wire(delta) == delta
    # An old frame without the keys reads as a job with no target that has not finished.
    assert View.from_wire({"epoch": 3, "members": []}).target is None


def test_member_metadata_carries_the_declaration() -> None:
    meta = MemberMeta(replica_id="r1", kind=Kind.TRAINER, status=Status.DONE, step=8, target=STEPS8,
                      allow_scratch=True)
    w = msgpack.unpackb(msgpack.packb(meta.to_wire(), use_bin_type=True), raw=False)
    assert w["tg"] == ["steps", 8] and w["ar"] == 1 and w["s"] == "done"
    assert MemberMeta.from_wire(w) == meta
    assert "tg" not in MemberMeta(replica_id="r1").to_wire()


@pytest.mark.parametrize("bad", [["steps", 0], ["epochs", 3], ["steps"], 5])
def test_a_malformed_target_is_rejected(bad: Any) -> None:
    with pytest.raises((ValueError, TypeError)):
        JobTarget.from_wire(bad)


def test_a_job_state_change_alone_is_a_new_proposal() -> None:
    m = _member("r1.0a", Role.PARTICIPANT, 0)
    assert canonical(_view(m)) != canonical(_view(m, target=STEPS8))
    assert canonical(_view(m, target=STEPS8)) != canonical(_view(m, target=STEPS8, finished=8))


# ---------------------------------------------------------------------- the leader's decisions
def test_first_declaration_is_the_target_and_stays() -> None:
    jp = JobPlanner("w.0", Counter())
    cur = _view(_member("a.1", Role.PARTICIPANT, 0), _member("b.1", Role.PARTICIPANT, 1))
    older = _trainer("a.1", Status.READY, 0, STEPS8, start=1.0)
    newer = _trainer("b.1", Status.READY, 0, JobTarget(TargetKind.STEPS, 9), start=2.0)
    assert jp.next_state(cur, [newer, older], 0, False, 0.0).target == STEPS8
    running = _view(*cur.members, target=STEPS8)
    # A different declaration does not move a running job's target (that trainer reports the conflict).
    assert jp.next_state(running, [newer], 0, False, 0.0).target == STEPS8


def test_end_barrier_waits_for_every_participant_then_joiners_for_a_grace() -> None:
    jp = JobPlanner("w.0", Counter())
    cur = _view(_member("a.1", Role.PARTICIPANT, 0), _member("b.1", Role.PARTICIPANT, 1),
                _member("c.1", Role.JOINER), target=STEPS8)
    a_done, b_done = _trainer("a.1", Status.DONE, 8), _trainer("b.1", Status.DONE, 8)
    joiner = _trainer("c.1", Status.JOINING, 3)
    assert jp.next_state(cur, [a_done, _trainer("b.1", Status.READY, 7), joiner], 8, False, 0.0).finished is None
    assert jp.next_state(cur, [a_done, _trainer("b.1", Status.DONE, 9), joiner], 9, False, 1.0).finished is None
    assert jp.next_state(cur, [a_done, b_done, joiner], 8, False, 2.0).finished is None      # the joiner's grace
    assert jp.next_state(cur, [a_done, b_done, _trainer("c.1", Status.DONE, 8)], 8, False, 3.0).finished == 8
    jp2 = JobPlanner("w.0", Counter())
    assert jp2.next_state(cur, [a_done, b_done, joiner], 8, False, 10.0).finished is None
    assert jp2.next_state(cur, [a_done, b_done, joiner], 8, False, 10.0 + FINISH_GRACE_S).finished == 8


def test_headless_resume_only_at_high_water_unless_allowed() -> None:
    stats: Counter[str] = Counter()
    jp = JobPlanner("w.0", stats)
    cur = _view(_member("a.2", Role.JOINER), hw=20)
    fresh = _trainer("a.2", Status.FRESH, 0)
    for t in (0.0, RESUME_GRACE_S + 1, 100.0):
        st = jp.next_state(cur, [fresh], 20, True, t)
        assert st.resume_at is None and st.high_water == 20
    assert stats["resume_refused"] == 1                                  # logged once, not per reconcile
    from_disk = _trainer("b.2", Status.FRESH, 20)
    assert jp.next_state(cur, [fresh, from_disk], 20, True, 101.0).resume_at == 20
    older = JobPlanner("w.0", Counter())          # a checkpoint below the high water: after the grace
    assert older.next_state(cur, [fresh, _trainer("b.2", Status.FRESH, 12)], 20, True, 0.0).resume_at is None
    st = older.next_state(cur, [fresh, _trainer("b.2", Status.FRESH, 12)], 20, True, RESUME_GRACE_S)
    assert st.resume_at == 12 and st.high_water == 12
    allowed = _trainer("a.2", Status.FRESH, 0, allow=True)
    jp3 = JobPlanner("w.0", Counter())
    assert jp3.next_state(cur, [allowed], 20, True, 0.0).resume_at is None   # a replica at 20 may still come
    st = jp3.next_state(cur, [allowed], 20, True, RESUME_GRACE_S)
    assert st.resume_at == 0 and st.high_water == 0


def test_finished_job_never_resumes_and_extends_only_further() -> None:
    jp = JobPlanner("w.0", Counter())
    cur = _view(_member("a.3", Role.JOINER), target=STEPS8, finished=8, hw=8)
    st = jp.next_state(cur, [_trainer("a.3", Status.FRESH, 8, STEPS8, allow=True)], 8, True, 100.0)
    assert st.finished == 8 and st.resume_at is None
    st = jp.next_state(cur, [_trainer("a.3", Status.FRESH, 8, JobTarget(TargetKind.SAMPLES, 99))], 8, True, 100.0)
    assert st.finished == 8, "a target of another kind does not extend the job"
    st = jp.next_state(cur, [_trainer("a.3", Status.FRESH, 8, JobTarget(TargetKind.STEPS, 12))], 8, True, 100.0)
    assert st.finished is None and st.target == JobTarget(TargetKind.STEPS, 12) and st.resume_at == 8


def test_lead_is_the_lowest_slot_and_moves_to_a_survivor() -> None:
    a, b, c = _member("a.1", Role.PARTICIPANT, 1), _member("b.1", Role.PARTICIPANT, 0), _member("c.1", Role.JOINER)
    view = _view(a, b, c)
    assert view.lead() == b
    assert _view(a, c).lead() == a
    assert _view(c).lead() is None
