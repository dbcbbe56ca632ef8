"""Raft core (views as log entries), driven directly on a tiny virtual network."""
from __future__ import annotations

import heapq
import itertools
import math
import random
from typing import Any

import msgpack
import pytest

from p2pft.core import codec
from p2pft.core.config import DEFAULT, Profile
from p2pft.core.messages import AppendResp, Vote
from p2pft.core.raft import CANDIDATE, FOLLOWER, LEADER, Raft
from p2pft.core.view import Member, Role, View

P = DEFAULT


def V(tag: str | None, voters: list[str], epoch: int = 0) -> View:
    """A view whose one member's id is ``tag`` (a label the tests follow through the log)."""
    members = () if tag is None else (Member(node=tag, replica_id=tag, addr="", data_addrs=(), role=Role.WITNESS,
                                             slot=None),)
    return View(epoch=epoch, members=members, voters=tuple(voters))


def tag(v: View | None) -> str | None:
    return v.members[0].node if v is not None and v.members else None


class Cluster:
    """Raft instances keyed by id; 1 ms message delay through msgpack; drops, partitions, crashes."""

    def __init__(self, ids: list[str], *, seed: int = 0, profile: Profile = P, loss: float = 0.0) -> None:
        self.rng = random.Random(seed)
        self.p = profile
        self.now = 0.0
        self.loss = loss
        self.r: dict[str, Raft] = {i: Raft(i, profile, random.Random(self.rng.getrandbits(32)), 0.0) for i in ids}
        self.down: set[str] = set()
        self.blocked: set[tuple[str, str]] = set()
        self.committed: dict[str, list[tuple[int, View]]] = {i: [] for i in ids}   # (term, view)
        self.leaders: dict[int, str] = {}
        self._q: list[tuple[float, int, str, str, bytes]] = []
        self._seq = itertools.count()

    def add(self, i: str) -> Raft:
        self.r[i] = Raft(i, self.p, random.Random(self.rng.getrandbits(32)), self.now)
        self.committed[i] = []
        return self.r[i]

    def drain(self, i: str) -> None:
        r = self.r[i]
        for dst, msg in r.outbox:
            if (i, dst) in self.blocked or self.rng.random() < self.loss:
                continue
            heapq.heappush(self._q, (self.now + 0.001, next(self._seq), i, dst, msgpack.packb(codec.to_wire(msg))))
        r.outbox.clear()
        for term in r.events:
            other = self.leaders.setdefault(term, i)
            assert other == i, f"two leaders in term {term}: {other} and {i}"
        r.events.clear()
        self.committed[i].extend(r.committed)
        r.committed.clear()

    def run(self, until: float) -> None:
        while True:
            live = [i for i in self.r if i not in self.down]
            t_timer = min((self.r[i].next_deadline() for i in live), default=math.inf)
            t_msg = self._q[0][0] if self._q else math.inf
            t = min(t_timer, t_msg)
            if t > until:
                self.now = until
                return
            self.now = max(self.now, t)
            if t_msg <= t_timer:
                _, _, src, dst, data = heapq.heappop(self._q)
                if dst in self.r and dst not in self.down:
                    self.r[dst].handle(src, codec.from_wire(msgpack.unpackb(data)), self.now)
                    self.drain(dst)
            else:
                for i in live:
                    if self.r[i].next_deadline() <= self.now:
                        self.r[i].tick(self.now)
                        self.drain(i)

    def leader(self) -> Raft | None:
        best = None
        for i, r in self.r.items():
            if i not in self.down and r.role == LEADER and (best is None or r.term > best.term):
                best = r
        return best

    def propose(self, voters: list[str], tag: str) -> int:
        ld = self.leader()
        assert ld is not None
        epoch = ld.propose(V(tag, voters), self.now)
        assert epoch is not None
        self.drain(ld.me)
        return epoch

    def isolate(self, i: str) -> None:
        for j in self.r:
            if j != i:
                self.blocked.update({(i, j), (j, i)})

    def check_agreement(self) -> None:
        """Committed views: one per epoch everywhere, in increasing epochs at every node."""
        by_epoch: dict[int, Any] = {}
        for i, views in self.committed.items():
            epochs = [v.epoch for _, v in views]
            assert epochs == sorted(set(epochs)), f"{i} committed out of order: {epochs}"
            for term, v in views:
                key = (v.members, v.voters, term)
                assert by_epoch.setdefault(v.epoch, key) == key, f"two views for epoch {v.epoch}"


def three_voters(seed: int = 0, **kw: Any) -> Cluster:
    c = Cluster(["a", "b", "c"], seed=seed, **kw)
    c.r["a"].bootstrap(V("boot", ["a"]), 0.0)
    c.drain("a")
    c.propose(["a", "b"], "add-b")
    c.run(0.2)
    c.propose(["a", "b", "c"], "add-c")
    c.run(0.4)
    return c


def test_bootstrap_commits_epoch_one_at_once() -> None:
    c = Cluster(["a"])
    c.r["a"].bootstrap(V("x", ["a"]), 0.0)
    c.drain("a")
    assert c.r["a"].role == LEADER and c.r["a"].term == 1
    assert [(v.epoch, t) for t, v in c.committed["a"]] == [(1, 1)]


def test_single_server_changes_grow_the_voter_set_and_commit_everywhere() -> None:
    c = three_voters()
    epoch = c.propose(["a", "b", "c"], "payload")
    c.run(0.6)
    for i in "abc":
        assert c.r[i].commit == epoch
        assert tag(c.committed[i][-1][1]) == "payload"
        assert c.r[i].voters() == ["a", "b", "c"]
    assert [v.epoch for _, v in c.committed["a"]] == list(range(1, epoch + 1))   # epoch = log index
    c.check_agreement()


def test_propose_refused_when_not_leader_or_a_view_is_pending() -> None:
    c = three_voters()
    assert c.r["b"].propose(V(None, ["a", "b", "c"]), c.now) is None
    ld = c.r["a"]
    assert ld.propose(V("1", ["a", "b", "c"]), c.now) is not None
    assert ld.pending()
    assert ld.propose(V("2", ["a", "b", "c"]), c.now) is None   # one at a time
    c.drain("a")
    c.run(c.now + 0.1)
    assert not ld.pending()


def test_leader_crash_elects_a_new_leader_and_keeps_committed_views() -> None:
    c = three_voters(seed=1)
    epoch = c.propose(["a", "b", "c"], "before-crash")
    c.run(c.now + 0.1)
    c.down.add("a")
    t0 = c.now
    c.run(t0 + 2.0)
    ld = c.leader()
    assert ld is not None and ld.me in "bc" and ld.term > 1
    t_elected = min(t for t, who in ((c.now, i) for i in "bc") if c.r[who].role == LEADER)
    assert t_elected - t0 <= 2.0
    # The new leader's first entry (its term's no-op copy) commits, and nothing committed is lost.
    assert ld.commit > epoch
    assert any(tag(v) == "before-crash" for _, v in c.committed[ld.me])
    c.check_agreement()


def test_isolated_leader_steps_down_by_check_quorum() -> None:
    c = three_voters(seed=2)
    c.isolate("a")
    t0 = c.now
    c.run(t0 + P.election_max + 0.2)
    assert c.r["a"].role == FOLLOWER
    ld = c.leader()
    assert ld is not None and ld.me in "bc"
    c.blocked.clear()
    c.run(c.now + 1.0)
    assert c.r["a"].leader == ld.me and c.r["a"].term == ld.term
    c.check_agreement()


def test_prevote_keeps_a_returning_voter_from_disrupting_the_leader() -> None:
    c = three_voters(seed=3)
    term = c.r["a"].term
    c.isolate("c")
    c.run(c.now + 5.0)        # c times out again and again, but pre-votes never raise its term
    assert c.r["c"].term == term
    c.blocked.clear()
    c.run(c.now + 1.0)
    assert c.r["a"].role == LEADER and c.r["a"].term == term
    assert all(r.term == term for r in c.r.values())


def test_uncommitted_entries_of_a_deposed_leader_are_overwritten() -> None:
    c = three_voters(seed=4)
    c.isolate("a")
    lost = c.r["a"].propose(V("lost", ["a", "b", "c"]), c.now)
    assert lost is not None
    c.drain("a")
    c.run(c.now + 1.5)
    ld = c.leader()
    assert ld is not None and ld.me != "a"
    kept = c.propose(["a", "b", "c"], "kept")
    c.run(c.now + 0.2)
    c.blocked.clear()
    c.run(c.now + 1.0)
    assert tag(c.r["a"].entry(kept)) == "kept"
    assert not any(tag(v) == "lost" for _, v in c.committed["a"] + c.committed[ld.me])
    c.check_agreement()


def test_lagging_follower_catches_up_from_a_snapshot() -> None:
    prof = Profile(compact_after=4)
    c = Cluster(["a", "b", "c"], seed=5, profile=prof)
    c.r["a"].bootstrap(V("boot", ["a"]), 0.0)
    c.drain("a")
    c.propose(["a", "b"], "b")
    c.run(0.2)
    c.propose(["a", "b", "c"], "c")
    c.run(0.4)
    c.down.add("c")
    for k in range(12):
        c.propose(["a", "b", "c"], f"v{k}")
        c.run(c.now + 0.05)
    assert c.r["a"].snap_index > c.r["c"].last_index       # c's next entry was compacted away
    c.down.discard("c")
    c.run(c.now + 0.5)
    assert c.r["c"].commit == c.r["a"].commit
    assert tag(c.committed["c"][-1][1]) == "v11"
    c.check_agreement()


def test_non_voters_learn_committed_views_in_order_only() -> None:
    r = Raft("x", P, random.Random(0), 0.0)
    assert r.learn(V("m", ["a"], epoch=3), 1)
    assert not r.learn(V("old", ["a"], epoch=2), 1)
    assert r.learn(V("new", ["a"], epoch=5), 2)
    assert [v.epoch for _, v in r.committed] == [3, 5]
    assert not r.is_voter()
    r.tick(10.0)                       # a non-voter never campaigns
    assert r.role == FOLLOWER and r.outbox == []


def test_leader_failed_report_shortens_the_election() -> None:
    def elect_after_crash(report: bool) -> float:
        c = three_voters(seed=6)
        c.run(c.now + 0.3)
        c.down.add("a")
        t0 = c.now
        if report:
            for i in "bc":
                c.r[i].leader_failed("a", t0)
        while c.leader() is None or c.leader().me == "a":
            c.run(c.now + 0.005)
            assert c.now - t0 < 3.0
        return c.now - t0

    slow, fast = elect_after_crash(False), elect_after_crash(True)
    assert slow >= P.election_min * 0.9
    assert fast < P.election_min / 2


def test_leader_failed_about_someone_else_changes_nothing() -> None:
    c = three_voters(seed=7)
    c.run(c.now + 0.2)
    before = c.r["b"].next_deadline()
    c.r["b"].leader_failed("c", c.now)
    assert c.r["b"].next_deadline() == before and c.r["b"].leader == "a"


@pytest.mark.parametrize("seed", range(30))
def test_random_faults_one_leader_per_term_and_one_view_per_epoch(seed: int) -> None:
    rng = random.Random(seed)
    c = three_voters(seed=seed)
    c.add("d")
    c.add("e")
    c.loss = 0.05
    for _ in range(2):
        ld = c.leader()
        if ld and not ld.pending():
            voters = ld.voters() + [x for x in "de" if x not in ld.voters()][:1]
            ld.propose(V("grow", voters), c.now)
            c.drain(ld.me)
        c.run(c.now + 0.5)
    for step in range(40):
        what = rng.random()
        ids = list(c.r)
        if what < 0.15:
            c.isolate(rng.choice(ids))
        elif what < 0.3:
            c.blocked.clear()
        elif what < 0.4:
            c.blocked.add(tuple(rng.sample(ids, 2)))  # type: ignore[arg-type]
        ld = c.leader()
        if ld and not ld.pending():
            ld.propose(V(f"s{seed}-{step}", ld.voters()), c.now)
            c.drain(ld.me)
        c.run(c.now + rng.uniform(0.01, 0.4))
    c.blocked.clear()
    c.loss = 0.0
    c.run(c.now + 3.0)
    c.check_agreement()
    ld = c.leader()
    assert ld is not None
    assert all(c.r[i].commit == ld.commit for i in ld.voters())
    assert sum(1 for r in c.r.values() if r.role in (LEADER, CANDIDATE) and r.term == ld.term) == 1


def test_a_vote_is_granted_once_per_term() -> None:
    r = Raft("a", P, random.Random(0), 0.0)
    r.learn(V(None, ["a", "b", "c"], epoch=1), 1)
    r.handle("b", Vote(term=5, last_index=1, last_term=1), 10.0)
    r.handle("c", Vote(term=5, last_index=1, last_term=1), 10.0)
    r.handle("b", Vote(term=5, last_index=1, last_term=1), 10.0)   # a retry from b is fine
    answers = [(dst, m.ok) for dst, m in r.outbox]
    assert answers == [("b", True), ("c", False), ("b", True)]
    assert r.voted_for == "b"


def test_a_vote_needs_an_up_to_date_log() -> None:
    r = Raft("a", P, random.Random(0), 0.0)
    r.learn(V(None, ["a", "b"], epoch=4), 2)
    r.handle("b", Vote(term=3, last_index=9, last_term=1), 10.0)    # longer log, older term
    assert r.outbox[-1][1].ok is False


def test_entries_of_an_older_term_commit_only_through_one_of_the_current_term() -> None:
    """Raft's figure 8: counting replicas of an old-term entry is not enough to commit it."""
    r = Raft("a", P, random.Random(0), 0.0)
    r.log = [(1, V(None, ["a", "b", "c"], epoch=1)), (2, V("x", ["a", "b", "c"], epoch=2))]
    r.commit = r.applied = 1
    r.term = 3
    r._become_leader(0.0)                      # appends its own no-op at index 3
    assert r.last_index == 3 and r.term_at(3) == 3
    r.handle("b", AppendResp(term=3, ok=True, match=2), 0.01)
    assert r.commit == 1                       # entry 2 is on a majority but is from term 2
    r.handle("b", AppendResp(term=3, ok=True, match=3), 0.02)
    assert r.commit == 3
