"""The pure and thread-level pieces behind pauses: the idle back-off, the log limiter, a
committed step's signature, and the donor's hand-off that serves snapshots whatever the
training loop does."""
from __future__ import annotations

import logging
import threading
import time

import pytest

from p2pft.core.step import IDLE_BACKOFF_MAX_S, IDLE_PAUSE_S, idle_backoff
from p2pft.trainer.recovery.donor import SnapshotRequests
from p2pft.trainer.kernel.recent import RecentSteps, step_signature
from p2pft.trainer.kernel.retry import LogLimiter
from p2pft.transport.stream import StateSnapshot


def test_idle_backoff_grows_to_a_bound_that_caps_rounds_per_second() -> None:
    waits = [idle_backoff(n) for n in range(1, 40)]
    assert waits[0] == IDLE_PAUSE_S
    assert waits == sorted(waits) and waits[-1] == IDLE_BACKOFF_MAX_S
    # A replica that can make no progress for a minute makes at most ~2 rounds a second.
    t, rounds = 0.0, 0
    while t < 60.0:
        rounds += 1
        t += idle_backoff(rounds)
    assert rounds < 2 * 60 + 10, rounds


def test_log_limiter_holds_back_repeats_and_counts_them(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    say = LogLimiter(every=10.0, clock=lambda: now[0])
    log = logging.getLogger("test.limiter")
    with caplog.at_level(logging.INFO, logger="test.limiter"):
        for i in range(100):
            now[0] = i * 0.1  # 100 lines over 10 s
            say(log, logging.INFO, "k", "line %d", i)
        now[0] = 10.5
        say(log, logging.INFO, "k", "line %d", 999)
        say(log, logging.INFO, "other", "another kind")
    msgs = [r.getMessage() for r in caplog.records]
    assert msgs[0] == "line 0"
    assert msgs[1].startswith("line 999 (99 more like this")
    assert msgs[2] == "another kind" and len(msgs) == 3


def test_step_signature_tells_contributor_sets_apart() -> None:
    a = step_signature(7, 3, [True, True, True, False])
    assert a == step_signature(7, 3, [True, True, True])          # trailing empty slots do not matter
    assert a != step_signature(7, 2, [True, False, True, False])  # redone without slot 1
    assert a != step_signature(8, 3, [True, True, True])
    rs = RecentSteps(2)
    assert rs.signature(7) is None
    rs.forget_signatures()


def _snap(tag: str) -> StateSnapshot:
    return StateSnapshot(meta={"tag": tag}, tensors={})


def _ask(req: SnapshotRequests, r: dict) -> StateSnapshot | None:
    """As a transport thread would (it lowers its own priority: not this test's thread)."""
    box: list[StateSnapshot | None] = []
    th = threading.Thread(target=lambda: box.append(req.request(r)))
    th.start()
    th.join(10.0)
    assert box, "the request did not return"
    return box[0]


def test_donor_serves_at_once_while_idle_and_queues_while_busy() -> None:
    req = SnapshotRequests(wait_s=5.0)
    req.idle(lambda r: True, lambda: _snap("idle"))
    t0 = time.monotonic()
    got = _ask(req, {"min_step": 0})
    assert got is not None and got.meta["tag"] == "idle" and time.monotonic() - t0 < 1.0

    req.busy()  # a step began: the request waits for the training thread
    box: list[StateSnapshot | None] = []
    th = threading.Thread(target=lambda: box.append(req.request({"min_step": 0})))
    th.start()
    time.sleep(0.2)
    assert not box, "a busy donor copied its state from a transport thread"
    req.idle(lambda r: True, lambda: _snap("boundary"))  # the step ended: the queued request is answered
    th.join(2.0)
    assert box and box[0] is not None and box[0].meta["tag"] == "boundary"


def test_donor_busy_waits_for_a_copy_in_progress() -> None:
    """The lock the training thread takes to begin a step: never while a copy is half done."""
    req = SnapshotRequests(wait_s=5.0)
    copying = threading.Event()
    order: list[str] = []

    def slow_take() -> StateSnapshot:
        copying.set()
        time.sleep(0.3)
        order.append("copied")
        return _snap("x")
    req.idle(lambda r: True, slow_take)
    th = threading.Thread(target=lambda: req.request({}))
    th.start()
    assert copying.wait(2.0)
    req.busy()
    order.append("busy")
    th.join(2.0)
    assert order == ["copied", "busy"]


def test_donor_refusal_is_none_not_a_wait() -> None:
    req = SnapshotRequests(wait_s=5.0)
    req.idle(lambda r: int(r.get("min_step", 0)) <= 3, lambda: _snap("x"))
    t0 = time.monotonic()
    assert _ask(req, {"min_step": 9}) is None
    assert time.monotonic() - t0 < 1.0


def test_top_shows_a_paused_replica_with_its_step() -> None:
    from p2pft.ops.top import build_frame, render_plain

    def member(node: str, role: str, step: int) -> dict:
        return {"node": node, "replica_id": node.split(".")[0], "addr": "127.0.0.1:7000", "data_addr": "",
                "role": role, "slot": None, "shards": 1, "since": 1, "state": "alive", "step": step, "voter": False}
    report = {"now": 10.0, "node": "w.1", "epoch": 5, "leader": "w.1",
              "events": [{"t": 9.0, "kind": "role", "text": "e5: b participant -> paused"}],
              "members": [member("w.1", "witness", 0), member("b.1", "paused", 40), member("a.1", "participant", 52)]}
    f = build_frame("127.0.0.1:7000", report, None)
    assert [r.role for r in f.members] == ["participant", "paused", "witness"]
    text = render_plain(f)
    row = next(ln for ln in text.splitlines() if ln.startswith("b "))
    assert row.split()[1:4] == ["paused", "alive", "40"]
    assert "b participant -> paused" in text


def test_back_from_a_pause_compares_its_last_step_with_a_peer_over_the_data_port() -> None:
    """``last_step_agreed`` asks the peers' data servers (real sockets) for their signature
    of the step: the first that knows it decides; nobody knowing it is no divergence."""
    from types import SimpleNamespace

    from p2pft.trainer.job.pause import last_step_agreed
    from p2pft.transport import DataServer
    from p2pft.core.view import Member, Role, View

    mine = step_signature(41, 3, [True, True, True])
    servers = [DataServer(), DataServer()]
    try:
        def member(node: str, role: Role, addr: str) -> Member:
            return Member(node=node, replica_id=node.split(".")[0], addr="127.0.0.1:1", data_addrs=(addr,),
                          role=role, slot=None)
        view = View(epoch=3, members=(member("a.1", Role.PAUSED, "127.0.0.1:9"),
                                      member("b.1", Role.PARTICIPANT, servers[0].addr),
                                      member("c.1", Role.PARTICIPANT, servers[1].addr)))
        rt = SimpleNamespace(view=view, node_id="a.1")
        sigs: dict[str, str | None] = {servers[0].addr: None, servers[1].addr: mine}
        for s in servers:
            s.serve_state(lambda req, a=s.addr: StateSnapshot(meta={"sig": sigs[a]}, tensors={})
                          if sigs[a] is not None and req.get("step") == 41 else None)
        assert last_step_agreed(rt, mine, 41, None) is True          # b does not know it, c agrees
        sigs[servers[1].addr] = step_signature(41, 2, [True, False, True])  # redone without us
        assert last_step_agreed(rt, mine, 41, None) is False
        sigs[servers[1].addr] = None
        assert last_step_agreed(rt, mine, 41, None) is True          # nobody redid it
        assert last_step_agreed(rt, None, 41, None) is True          # our state came from a snapshot
    finally:
        for s in servers:
            s.close()


def test_recent_steps_hold_the_log_for_a_paused_member_within_the_byte_cap() -> None:
    import torch

    from p2pft.trainer.kernel.attempt import Entry

    def entry(s: int) -> Entry:
        return Entry(s, torch.zeros(25), 2, [True, True])   # 100 bytes each

    rs = RecentSteps(2, cap_bytes=500)
    for s in range(5):
        rs.append(entry(s))
    assert rs.held == (2, 200) and rs.serve(3, 5) is not None and rs.serve(2, 5) is None
    rs.hold(4)                       # a member paused holding step 4: keep 4 on
    for s in range(5, 8):
        rs.append(entry(s))
    assert rs.serve(4, 8) is not None and rs.held == (4, 400)
    rs.append(entry(8))
    assert rs.serve(4, 9) is not None and rs.held == (5, 500)     # at the cap, still whole
    rs.append(entry(9))              # past the cap: the hold lapses, back to the last two
    assert rs.serve(4, 10) is None and rs.held == (2, 200) and rs.serve(8, 10) is not None
    rs.hold(3)                       # older than the oldest kept: no use, nothing held
    for s in range(10, 13):
        rs.append(entry(s))
    assert rs.held == (2, 200)
    rs.hold(13)
    for s in range(13, 16):
        rs.append(entry(s))
    assert rs.held == (3, 300)
    rs.hold(None)                    # it came back: the log shrinks at once
    assert rs.held == (2, 200) and rs.serve(14, 16) is not None
