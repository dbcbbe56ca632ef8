"""The pure step core: the decision after a reduced buffer, and the replay log, as tables."""
from __future__ import annotations

from dataclasses import dataclass

import pytest

from p2pft.core.step import (Action, Decision, Reduced, ReplayLog, decide, view_wait_after_failure,
                             SUSPICION_MULTIPLIER, VIEW_WAIT_SUSPICIONS)

F = Action.FAST_FORWARD

# (slot -> step of each contributor, local step, synced) -> decision
DECIDE_CASES = [
    ("nobody contributed", {}, 5, True, Decision(Action.IDLE)),
    ("nobody contributed, catching up", {}, 5, False, Decision(Action.IDLE)),
    ("all at our step", {0: 5, 1: 5}, 5, True, Decision(Action.COMMIT, step=5)),
    ("one contributor at our step", {3: 7}, 7, True, Decision(Action.COMMIT, step=7)),
    ("all at s, we are behind", {0: 5, 1: 5}, 3, True, Decision(F, step=5, target=5, commit_after=True)),
    ("all at s, we are ahead", {0: 5, 1: 5}, 6, True, Decision(Action.RETRY, step=5)),
    ("catching up logs", {0: 5, 1: 5}, 2, False, Decision(Action.LOG, step=5)),
    ("catching up logs even at our step", {0: 5}, 5, False, Decision(Action.LOG, step=5)),
    ("split steps, we are behind the head", {0: 5, 1: 6}, 5, True, Decision(F, step=6, target=6)),
    ("split steps, we are at the head", {0: 5, 1: 6}, 6, True, Decision(Action.RETRY, step=6)),
    ("split steps, catching up", {0: 5, 1: 6}, 0, False, Decision(Action.RETRY, step=6)),
    ("split steps, far behind", {0: 2, 1: 9}, 1, True, Decision(F, step=9, target=9)),
]

# (contributors' steps, held steps by data rank of every member holding the state, local step,
# synced) -> decision: a member ahead that contributes nothing (it committed a step the others'
# allreduce failed, then a hot spare, demoted for a round, or at the end barrier)
HELD_CASES = [
    ("all at s, a silent member ahead: no commit, we fast-forward", {0: 5, 1: 5}, {0: 5, 1: 5, 2: 6}, 5, True,
     Decision(F, step=6, target=6)),
    ("all at s, we are the silent member ahead", {0: 5, 1: 5}, {0: 5, 1: 5, 2: 6}, 6, True,
     Decision(Action.RETRY, step=6)),
    ("all at s, a silent member ahead, catching up", {0: 5}, {0: 5, 1: 6}, 0, False, Decision(Action.RETRY, step=6)),
    ("all at s, silent members at s or behind: commit", {0: 5, 1: 5}, {0: 5, 1: 5, 2: 5, 3: 4}, 5, True,
     Decision(Action.COMMIT, step=5)),
    ("all at s, we are a silent member behind s", {0: 5}, {0: 5, 1: 4}, 4, True, Decision(F, step=5, target=5,
                                                                                       commit_after=True)),
    ("nobody contributed, a member further than us", {}, {0: 9, 1: 7}, 7, True, Decision(F, step=9, target=9)),
    ("nobody contributed, all holding our step", {}, {0: 7, 1: 7}, 7, True, Decision(Action.IDLE)),
    ("nobody contributed, catching up", {}, {0: 9}, 3, False, Decision(Action.IDLE)),
]


@pytest.mark.parametrize("name,steps,local,synced,want", DECIDE_CASES, ids=[c[0] for c in DECIDE_CASES])
def test_decide(name: str, steps: dict[int, int], local: int, synced: bool, want: Decision) -> None:
    assert decide(Reduced(steps, len(steps)), local, synced) == want


@pytest.mark.parametrize("name,steps,held,local,synced,want", HELD_CASES, ids=[c[0] for c in HELD_CASES])
def test_decide_with_members_holding_the_state(name: str, steps: dict[int, int], held: dict[int, int], local: int,
                                               synced: bool, want: Decision) -> None:
    assert decide(Reduced(steps, len(steps), held), local, synced) == want


def test_no_replica_commits_a_step_a_member_holding_the_state_already_passed() -> None:
    """The invariant the held steps buy: whatever the local steps, nobody commits step s in a
    round where some member that holds the committed state is past s (it applied other
    gradients for s; committing s again would make the replicas diverge silently)."""
    for s in range(3):
        for ahead in range(s + 1, s + 3):
            header = Reduced({0: s, 1: s}, 2, {0: s, 1: s, 2: ahead})
            for local in range(0, s + 4):
                for synced in (True, False):
                    d = decide(header, local, synced)
                    assert d.action is not Action.COMMIT and not d.commit_after, (s, ahead, local, synced, d)


def test_every_rank_of_every_replica_decides_alike_on_one_header() -> None:
    """Replicas at the same local step and sync state take the same decision from one header;
    only the local step and sync state (replicated per replica) may differ the outcome."""
    header = Reduced({0: 4, 2: 4, 5: 4}, 3)
    outcomes = {decide(header, 4, True) for _ in range(5)}
    assert outcomes == {Decision(Action.COMMIT, step=4)}


@dataclass
class E:
    step: int
    nbytes: int = 16


def steps(log: ReplayLog[E]) -> list[int]:
    out = []
    while log:
        out.append(log.pop_first().step)
    return out


# (appends: (step, keep_from)), cap in entries of 16 bytes -> steps kept
LOG_CASES = [
    ("contiguous", [(3, None), (4, None), (5, None)], 100, [3, 4, 5]),
    ("a step reduced again replaces the older round", [(3, None), (4, None), (5, None), (5, None)], 100, [3, 4, 5]),
    ("an older step reduced again drops what followed", [(3, None), (4, None), (5, None), (4, None)], 100, [3, 4]),
    ("a gap clears the log", [(3, None), (4, None), (7, None)], 100, [7]),
    ("past the cap the oldest go", [(s, None) for s in range(6)], 3, [3, 4, 5]),
    ("never what a held snapshot needs", [(s, 1) for s in range(6)], 3, [1, 2, 3, 4, 5]),
    ("the last entry stays even over the cap", [(0, None)], 0.5, [0]),
]


@pytest.mark.parametrize("name,appends,cap,want", LOG_CASES, ids=[c[0] for c in LOG_CASES])
def test_replay_log(name: str, appends: list[tuple[int, int | None]], cap: float, want: list[int]) -> None:
    log: ReplayLog[E] = ReplayLog(int(cap * 16))
    for s, keep in appends:
        log.append(E(s), keep_from=keep)
    assert log.nbytes == 16 * len(want)
    assert steps(log) == want
    assert log.nbytes == 0


def test_replay_log_snapshot_reach() -> None:
    log: ReplayLog[E] = ReplayLog(1 << 20)
    for s in (4, 5, 6):
        log.append(E(s))
    assert log.predates(3) and not log.reaches(3)        # step 3 was never logged
    assert all(log.reaches(s) for s in (4, 5, 6, 7))     # 7: the snapshot is at the log's head
    assert not log.reaches(8)                            # ahead of the log: wait for it
    log.drop_before(6)
    assert (log.first, log.last, log.nbytes) == (6, 6, 16)


def test_replay_log_rejects_a_non_positive_cap() -> None:
    with pytest.raises(ValueError, match="positive"):
        ReplayLog(0)


def test_view_wait_after_failure_is_named_multiples_of_the_suspicion_timeout() -> None:
    assert view_wait_after_failure(0.5) == pytest.approx(VIEW_WAIT_SUSPICIONS * SUSPICION_MULTIPLIER * 0.5)
    assert view_wait_after_failure(0.5) == pytest.approx(6 * 0.5 * 4)  # the value both trainers used
