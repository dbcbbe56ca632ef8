"""The trainer's job-life decisions (p2pft/core/lifecycle.py), table-driven: each row is a view
as a trainer sees it, its own facts, and the decision production and the simulator both make."""
from __future__ import annotations

import pytest

from p2pft.core.lifecycle import (Admit, Declared, EndWord, Fetch, SigCheck, admit, end_checked, end_word,
                                  initial_fetch, leads_step, signatures_agree)
from p2pft.core.view import JobTarget, Member, Role, TargetKind, View

T40 = JobTarget(TargetKind.STEPS, 40)
T80 = JobTarget(TargetKind.STEPS, 80)
S40 = JobTarget(TargetKind.SAMPLES, 40)


def _m(node: str, role: Role, slot: int | None = None) -> Member:
    return Member(node=node, replica_id=node, addr=f"{node}:1", data_addrs=(f"{node}:2",), role=role, slot=slot)


def _view(*members: Member, hw: int = 0, target: JobTarget | None = T40, finished: int | None = None) -> View:
    return View(epoch=3, members=members, high_water=hw, target=target, finished=finished)


ME_P = _m("me", Role.PARTICIPANT, 1)
ME_J = _m("me", Role.JOINER)
A_P = _m("a", Role.PARTICIPANT, 0)
A_Z = _m("a", Role.PAUSED)
W = _m("w", Role.WITNESS)

ADMIT_TABLE = [
    # (what, view, step, declared, grace over, decision)
    ("no view yet", None, 0, Declared(T40), False, Admit.WAIT),
    ("not listed yet", _view(A_P, W), 0, Declared(T40), False, Admit.WAIT),
    ("a participant", _view(ME_P, A_P), 0, Declared(T40), False, Admit.IN),
    ("a joiner behind participants", _view(ME_J, A_P, hw=30), 0, Declared(T40), False, Admit.IN),
    ("finished: a late restart", _view(W, finished=40), 0, Declared(T40), False, Admit.FINISHED),
    ("finished, a further target declared", _view(W, finished=40), 0, Declared(T80), False, Admit.FURTHER),
    ("finished, another kind is not further", _view(W, finished=40), 0, Declared(S40), False, Admit.FINISHED),
    ("finished, on_finished=wait", _view(W, finished=40), 0, Declared(T40, wait_when_finished=True), False,
     Admit.FURTHER),
    ("another end declared", _view(ME_P, A_P), 0, Declared(T80), False, Admit.CONFIG_ERROR),
    ("no target of its own", _view(ME_P, A_P), 0, Declared(None), False, Admit.IN),
    ("nobody trains, we hold an older step", _view(ME_J, W, hw=30), 20, Declared(T40), False, Admit.OFFER),
    ("nobody trains, step 0: the grace", _view(ME_J, W, hw=30), 0, Declared(T40), False, Admit.GRACE),
    ("... grace over: refuse", _view(ME_J, W, hw=30), 0, Declared(T40), True, Admit.REFUSE),
    ("... grace over, scratch allowed", _view(ME_J, W, hw=30), 0, Declared(T40, allow_scratch=True), True,
     Admit.SCRATCH),
    ("a paused member holds the job", _view(ME_J, A_Z, hw=30), 0, Declared(T40), True, Admit.IN),
    ("at the high water with nobody training", _view(ME_J, W, hw=30), 30, Declared(T40), False, Admit.IN),
]


@pytest.mark.parametrize("what,view,step,declared,grace_over,want", ADMIT_TABLE, ids=[r[0] for r in ADMIT_TABLE])
def test_admit(what: str, view: View | None, step: int, declared: Declared, grace_over: bool, want: Admit) -> None:
    assert admit(view, "me", step, declared, grace_over) is want


def test_admit_at_the_end_barrier_ignores_the_finished_flag() -> None:
    """finish() reads the end itself (end_word); a look before a step must not raise JobFinished then."""
    assert admit(_view(ME_P, A_P, finished=40), "me", 40, Declared(T40), False, finishing=True) is Admit.IN


FETCH_TABLE = [
    ("the lead holds", _view(_m("me", Role.PARTICIPANT, 0), _m("a", Role.PARTICIPANT, 1)), 0, {}, True, Fetch.HOLD),
    ("the others pull", _view(ME_P, A_P), 0, {}, True, Fetch.FROM),
    ("initial_state=off", _view(ME_P, A_P), 0, {}, False, Fetch.NONE),
    ("past step 0", _view(ME_P, A_P), 5, {}, True, Fetch.NONE),
    ("a joiner catches up", _view(ME_J, A_P), 0, {}, True, Fetch.CATCH_UP),
    ("the group went on", _view(ME_P, A_P), 0, {"a": 3}, True, Fetch.CATCH_UP),
    ("alone, nothing to agree", _view(_m("me", Role.PARTICIPANT, 0), W), 0, {}, True, Fetch.HOLD),
    ("a joiner alone", _view(ME_J, W), 0, {}, True, Fetch.NONE),
    ("a paused member holds the job", _view(ME_J, A_Z), 0, {}, True, Fetch.CATCH_UP),
]


@pytest.mark.parametrize("what,view,step,steps,agree,want", FETCH_TABLE, ids=[r[0] for r in FETCH_TABLE])
def test_initial_fetch(what: str, view: View, step: int, steps: dict[str, int], agree: bool, want: Fetch) -> None:
    assert initial_fetch(view, "me", step, lambda n: steps.get(n, 0), agree) is want


@pytest.mark.parametrize("mask,slot,want", [
    ([True, True, True], 0, True), ([True, True, True], 1, False), ([False, True, True], 1, True),
    ([False, True], 0, False), ([True], None, False), ([True], 3, False), ([], 0, False),
])
def test_leads_step_is_the_lowest_contributing_slot(mask: list[bool], slot: int | None, want: bool) -> None:
    assert leads_step(mask, slot) is want


def test_exactly_one_leader_per_mask() -> None:
    for bits in range(1, 1 << 5):
        mask = [bool(bits >> i & 1) for i in range(5)]
        assert sum(leads_step(mask, s) for s in range(5)) == 1


END_TABLE = [
    ("finished at our step", _view(ME_P, A_P, finished=40), 40, True, False, False, False, EndWord.FINISHED),
    ("finished at another step", _view(ME_J, A_P, finished=40), 38, True, False, False, False, EndWord.BEHIND),
    ("finished, we are not synced", _view(ME_J, A_P, finished=40), 40, False, False, False, False, EndWord.BEHIND),
    ("stop requested", _view(ME_P, A_P), 40, True, True, False, False, EndWord.STOP),
    ("out of time", _view(ME_P, A_P), 40, True, False, True, False, EndWord.TIMEOUT),
    ("joiners while all are done", _view(ME_P, A_P, _m("j", Role.JOINER)), 40, True, False, False, True,
     EndWord.ROUND),
    ("joiners, not all done", _view(ME_P, A_P, _m("j", Role.JOINER)), 40, True, False, False, False, EndWord.WAIT),
    ("waiting", _view(ME_P, A_P), 40, True, False, False, True, EndWord.WAIT),
]


@pytest.mark.parametrize("what,view,step,synced,stopping,timed_out,all_done,want", END_TABLE,
                         ids=[r[0] for r in END_TABLE])
def test_end_word(what: str, view: View, step: int, synced: bool, stopping: bool, timed_out: bool, all_done: bool,
                  want: EndWord) -> None:
    assert end_word(view, step, synced, stopping, timed_out, all_done) is want


# A replica left out of the views since its last commit (viewplan.must_check_end) is `unchecked`
# until a finished peer's signatures of its last steps agree: the end is not its own before.
UNCHECKED_TABLE = [
    # (what, view, step, synced, all done, unchecked, a peer done at our step, word)
    ("finished at our step, checked", _view(ME_J, A_P, finished=40), 40, True, False, False, True,
     EndWord.FINISHED),
    ("finished at our step, left out: check first", _view(A_P, finished=40), 40, True, False, True, False,
     EndWord.CHECK),
    ("... as a joiner taken back", _view(ME_J, A_P, finished=40), 40, True, False, True, True, EndWord.CHECK),
    ("finished at another step, left out: behind", _view(A_P, finished=40), 39, True, False, True, True,
     EndWord.BEHIND),
    ("finished, not synced (catching up): behind", _view(ME_J, A_P, finished=40), 40, False, False, True, True,
     EndWord.BEHIND),
    ("a peer done at our step: check now", _view(ME_J, A_P), 40, True, True, True, True, EndWord.CHECK),
    ("... before a round for the joiners", _view(ME_J, A_P), 40, True, True, True, True, EndWord.CHECK),
    ("no peer done yet: wait", _view(A_P), 40, True, False, True, False, EndWord.WAIT),
    ("a peer done, but we are catching up: round", _view(ME_J, A_P), 40, False, True, True, True, EndWord.ROUND),
    ("checked: rounds as before", _view(ME_J, A_P), 40, True, True, False, True, EndWord.ROUND),
]


@pytest.mark.parametrize("what,view,step,synced,all_done,unchecked,peer_done,want", UNCHECKED_TABLE,
                         ids=[r[0] for r in UNCHECKED_TABLE])
def test_end_word_of_a_replica_left_out(what: str, view: View, step: int, synced: bool, all_done: bool,
                                        unchecked: bool, peer_done: bool, want: EndWord) -> None:
    assert end_word(view, step, synced, False, False, all_done, unchecked=unchecked, peer_done=peer_done) is want


def test_stop_and_timeout_come_before_a_check() -> None:
    v = _view(ME_J, A_P)
    assert end_word(v, 40, True, True, False, True, unchecked=True, peer_done=True) is EndWord.STOP
    assert end_word(v, 40, True, False, True, True, unchecked=True, peer_done=True) is EndWord.TIMEOUT


@pytest.mark.parametrize("result,finished,want", [
    (SigCheck.SAME, True, EndWord.FINISHED),
    (SigCheck.SAME, False, EndWord.DONE),
    (SigCheck.REDONE, True, EndWord.BEHIND),       # too late to catch up: leave without the end
    (SigCheck.REDONE, False, EndWord.REJOIN),      # catch up from a snapshot, then say done
    (SigCheck.UNKNOWN, True, EndWord.BEHIND),      # nobody could say: the end is not ours to claim
    (SigCheck.UNKNOWN, False, EndWord.WAIT),       # ask again at the next look
])
def test_end_checked(result: SigCheck, finished: bool, want: EndWord) -> None:
    assert end_checked(result, finished) is want


@pytest.mark.parametrize("what,pairs,want", [
    ("nothing to compare", [], SigCheck.SAME),
    ("none of ours (a snapshot since)", [(None, "x"), (None, None)], SigCheck.SAME),
    ("the same", [("a", "a"), ("b", "b")], SigCheck.SAME),
    ("the same where both know", [("a", None), ("b", "b")], SigCheck.SAME),
    ("our own step redone", [("a", "A"), ("b", "b")], SigCheck.REDONE),
    ("the last one redone", [("a", "a"), ("b", "B")], SigCheck.REDONE),
    ("the peer knows none", [("a", None), ("b", None)], SigCheck.UNKNOWN),
])
def test_signatures_agree(what: str, pairs: list[tuple[str | None, str | None]], want: SigCheck) -> None:
    assert signatures_agree(pairs) is want
