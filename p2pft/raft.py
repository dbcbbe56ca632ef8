"""Sans-IO Raft among a small voter set; the log entries are membership views.

The replicated state machine is just "the latest view", so a snapshot is the latest committed
view and log compaction is trivial. A view's epoch is its log index: at most one view can ever
be committed per epoch, and epochs only grow.

Configuration changes follow Raft's single-server rule: the voter set is the ``voters`` field
of the newest entry in a node's log (committed or not), and the node layer never proposes a
view that adds or removes more than one voter, nor a new view before the last one committed.

Pre-vote and check-quorum keep a partitioned or removed voter from disrupting the leader. A
voter also ignores vote requests while it hears from a leader (leader stickiness).

Node identities are per process incarnation, so no state needs to survive a restart: a restarted
process is a new node that has never voted, and the old identity is removed from the voter set
through an ordinary single-server change. A term's vote is therefore never cast twice by the
same identity, which is the property Raft's stable storage exists to guarantee.
"""
from __future__ import annotations

import random
from typing import Any, Callable

from .config import Profile

FOLLOWER, PRECANDIDATE, CANDIDATE, LEADER = "follower", "precandidate", "candidate", "leader"
MAX_ENTRIES = 16


class Raft:
    def __init__(self, me: str, profile: Profile, rng: random.Random, now: float) -> None:
        self.abstain = False  # do not campaign (the node's own trainer loop is stalled); still votes
        self.me = me
        self.p = profile
        self.rng = rng
        self.term = 0
        self.voted_for: str | None = None
        self.role = FOLLOWER
        self.leader: str | None = None
        self.snap_index = 0
        self.snap_term = 0
        self.snap_view: dict[str, Any] | None = None
        self.log: list[tuple[int, dict[str, Any]]] = []   # entries snap_index+1 ...
        self.commit = 0
        self.applied = 0
        self.outbox: list[tuple[str, dict[str, Any]]] = []  # (node id, message)
        self.committed: list[dict[str, Any]] = []            # views, in order, not yet drained
        self.events: list[tuple[str, Any]] = []             # ("leader", term) when we win
        self.learners: set[str] = set()                     # leader replicates to these, they never vote
        # Optional: the content of a new leader's first entry, from the last view (pure function).
        self.first_entry: Callable[[dict[str, Any]], dict[str, Any]] | None = None
        self._votes: set[str] = set()
        self._next: dict[str, int] = {}
        self._match: dict[str, int] = {}
        self._contact: dict[str, float] = {}
        self._acked: dict[str, float] = {}                # voter -> time of its last append response
        self._last_leader_contact = -1e9
        self._next_hb = float("inf")
        self._reset_election(now)

    # ------------------------------------------------------------------ log helpers
    @property
    def last_index(self) -> int:
        return self.snap_index + len(self.log)

    def term_at(self, index: int) -> int | None:
        if index == self.snap_index:
            return self.snap_term
        if self.snap_index < index <= self.last_index:
            return self.log[index - self.snap_index - 1][0]
        return None

    def entry(self, index: int) -> dict[str, Any] | None:
        if index == self.snap_index:
            return self.snap_view
        if self.snap_index < index <= self.last_index:
            return self.log[index - self.snap_index - 1][1]
        return None

    def last_view(self) -> dict[str, Any] | None:
        return self.entry(self.last_index)

    def voters(self) -> list[str]:
        view = self.last_view()
        return list(view.get("voters", ())) if view else []

    def is_voter(self) -> bool:
        return self.me in self.voters()

    def _quorum(self) -> int:
        return len(self.voters()) // 2 + 1

    # ------------------------------------------------------------------ API for the node layer
    def bootstrap(self, view: dict[str, Any], now: float) -> None:
        """Start a new cluster with ourselves as the only voter (epoch 1, term 1)."""
        self.term = 1
        self.voted_for = self.me
        view = dict(view, epoch=1, term=1)
        self.log = [(1, view)]
        self._become_leader(now, noop=False)
        self._advance_commit(now)

    def learn(self, view: dict[str, Any]) -> bool:
        """A committed view from outside Raft (non-voters learn views this way)."""
        epoch = int(view["epoch"])
        if epoch <= self.commit:
            return False
        t = self.term_at(epoch)
        if t is not None and t == view.get("term"):
            self.commit = epoch
        else:
            self._install(epoch, int(view.get("term", 0)), view)
        self._apply()
        return True

    def propose(self, view: dict[str, Any], now: float) -> int | None:
        """Append a view as leader; returns its epoch, or None if we cannot propose now."""
        if self.role != LEADER or self.commit < self.last_index:
            return None
        epoch = self.last_index + 1
        self.log.append((self.term, dict(view, epoch=epoch, term=self.term)))
        self._match[self.me] = self.last_index
        self._broadcast_append(now)
        self._advance_commit(now)
        return epoch

    def pending(self) -> bool:
        return self.commit < self.last_index

    def leader_failed(self, node: str, now: float) -> None:
        """Membership says our leader is dead: stop waiting out the election timeout.

        Both our own timer and our leader stickiness (which makes us refuse pre-votes) are
        cleared, so a new leader can be elected within a heartbeat or so instead of after
        ``election_min``. Only timing changes; a wrong report costs one needless election.
        """
        if self.role == LEADER or node != self.leader:
            return
        self._last_leader_contact = -1e9
        self.leader = None
        # Stagger the survivors by their rank in the voter list, so they do not all campaign at
        # once and split the vote (which would cost a full election timeout).
        others = sorted(v for v in self.voters() if v != node)
        rank = others.index(self.me) if self.me in others else len(others)
        delay = self.p.heartbeat * (0.5 * rank + self.rng.uniform(0, 0.25))
        self._election_deadline = min(self._election_deadline, now + delay)

    def acked_after(self, node: str, t: float) -> bool:
        """Leader: has this voter (or learner) answered an append at or after time t? We always have."""
        return node == self.me or self._acked.get(node, -1e9) >= t

    def acked_within(self, node: str, now: float, window: float) -> bool:
        return self.acked_after(node, now - window)

    # ------------------------------------------------------------------ time
    def next_deadline(self) -> float:
        return self._next_hb if self.role == LEADER else self._election_deadline

    def tick(self, now: float) -> None:
        if self.role == LEADER:
            if now >= self._next_hb:
                self._broadcast_append(now)
            self._check_quorum(now)
        elif now >= self._election_deadline:
            if self.is_voter() and not self.abstain:
                self._start_prevote(now)
            else:
                self._reset_election(now)

    # ------------------------------------------------------------------ messages
    def handle(self, src: str, msg: dict[str, Any], now: float) -> None:
        t = msg["t"]
        term = int(msg["term"])
        if t in ("r.pv", "r.pvr"):
            (self._on_prevote if t == "r.pv" else self._on_prevote_resp)(src, msg, now)
            return
        if t == "r.rv" and self._sticky(now) and term > self.term:
            return  # we hear from a live leader: ignore a disruptive candidate
        if term > self.term:
            self._step_down(term, now, leader=src if t in ("r.ae", "r.snap") else None)
        if t == "r.rv":
            self._on_vote(src, msg, now)
        elif t == "r.rvr":
            self._on_vote_resp(src, msg, now)
        elif t == "r.ae":
            self._on_append(src, msg, now)
        elif t == "r.aer":
            self._on_append_resp(src, msg, now)
        elif t == "r.snap":
            self._on_snapshot(src, msg, now)

    # ------------------------------------------------------------------ elections
    def _reset_election(self, now: float) -> None:
        self._election_deadline = now + self.rng.uniform(self.p.election_min, self.p.election_max)

    def _sticky(self, now: float) -> bool:
        return self.role == LEADER or now - self._last_leader_contact < self.p.election_min

    def _log_ok(self, msg: dict[str, Any]) -> bool:
        lt, li = int(msg["llt"]), int(msg["lli"])
        my_lt = self.term_at(self.last_index) or 0
        return lt > my_lt or (lt == my_lt and li >= self.last_index)

    def _start_prevote(self, now: float) -> None:
        self.role = PRECANDIDATE
        self._votes = {self.me}
        self._reset_election(now)
        if len(self._votes) >= self._quorum():
            self._start_election(now)
            return
        for v in self.voters():
            if v != self.me:
                self.outbox.append((v, {"t": "r.pv", "term": self.term + 1, "lli": self.last_index,
                                        "llt": self.term_at(self.last_index) or 0}))

    def _on_prevote(self, src: str, msg: dict[str, Any], now: float) -> None:
        term = int(msg["term"])
        grant = term > self.term and self._log_ok(msg) and not self._sticky(now)
        self.outbox.append((src, {"t": "r.pvr", "term": term if grant else self.term, "ok": grant}))

    def _on_prevote_resp(self, src: str, msg: dict[str, Any], now: float) -> None:
        if not msg.get("ok"):
            if int(msg["term"]) > self.term:
                self._step_down(int(msg["term"]), now)
            return
        if self.role != PRECANDIDATE or int(msg["term"]) != self.term + 1:
            return
        self._votes.add(src)
        if len(self._votes & set(self.voters())) >= self._quorum():
            self._start_election(now)

    def _start_election(self, now: float) -> None:
        self.role = CANDIDATE
        self.term += 1
        self.voted_for = self.me
        self.leader = None
        self._votes = {self.me}
        self._reset_election(now)
        if len(self._votes) >= self._quorum():
            self._become_leader(now)
            return
        for v in self.voters():
            if v != self.me:
                self.outbox.append((v, {"t": "r.rv", "term": self.term, "lli": self.last_index,
                                        "llt": self.term_at(self.last_index) or 0}))

    def _on_vote(self, src: str, msg: dict[str, Any], now: float) -> None:
        term = int(msg["term"])
        grant = (term == self.term and self.voted_for in (None, src) and self._log_ok(msg))
        if grant:
            self.voted_for = src
            self._reset_election(now)
        self.outbox.append((src, {"t": "r.rvr", "term": self.term, "ok": grant}))

    def _on_vote_resp(self, src: str, msg: dict[str, Any], now: float) -> None:
        if self.role != CANDIDATE or int(msg["term"]) != self.term or not msg.get("ok"):
            return
        self._votes.add(src)
        if len(self._votes & set(self.voters())) >= self._quorum():
            self._become_leader(now)

    def _become_leader(self, now: float, noop: bool = True) -> None:
        self.role = LEADER
        self.leader = self.me
        self._next = {v: self.last_index + 1 for v in self.voters()}
        self._match = {v: 0 for v in self.voters()}
        self._match[self.me] = self.last_index
        self._contact = {v: now for v in self.voters()}
        self.events.append(("leader", self.term))
        base = self.last_view()
        if noop and base is not None:
            # A fresh entry of our own term lets us commit everything before it (Raft 5.4.2).
            # Its content may be the node layer's up-to-date view (saving a round on a leader
            # change), but never with other voters: a new leader commits an entry of its own
            # term before any configuration change.
            first = self.first_entry(base) if self.first_entry is not None else base
            epoch = self.last_index + 1
            self.log.append((self.term, dict(first, epoch=epoch, term=self.term, voters=list(base.get("voters", ())))))
            self._match[self.me] = self.last_index
        self._broadcast_append(now)
        self._advance_commit(now)

    def step_down(self, now: float) -> None:
        """Give up leadership (the followers elect another leader after their timeout)."""
        if self.role == LEADER:
            self._step_down(self.term, now)

    def _step_down(self, term: int, now: float, leader: str | None = None) -> None:
        if term > self.term:
            self.term = term
            self.voted_for = None
        if self.role != FOLLOWER:
            self.role = FOLLOWER
            self._next_hb = float("inf")
        self.leader = leader
        self._reset_election(now)

    def _check_quorum(self, now: float) -> None:
        voters = self.voters()
        if self.me not in voters:
            if self.commit >= self.last_index:
                self._step_down(self.term, now)  # removed from the voter set and it is committed
            return
        recent = sum(1 for v in voters if v == self.me or now - self._contact.get(v, -1e9) <= self.p.election_max)
        if recent < self._quorum():
            self._step_down(self.term, now)

    # ------------------------------------------------------------------ replication
    def _broadcast_append(self, now: float) -> None:
        self._next_hb = now + self.p.heartbeat
        voters = self.voters()
        for v in voters:
            if v != self.me:
                self._send_append(v)
        for v in sorted(self.learners):
            if v != self.me and v not in voters:
                self._send_append(v)

    def _send_append(self, v: str) -> None:
        nxt = self._next.setdefault(v, self.last_index + 1)
        self._match.setdefault(v, 0)
        if nxt <= self.snap_index:
            self.outbox.append((v, {"t": "r.snap", "term": self.term, "index": self.snap_index,
                                    "sterm": self.snap_term, "view": self.snap_view}))
            return
        prev = nxt - 1
        entries = self.log[prev - self.snap_index: prev - self.snap_index + MAX_ENTRIES]
        self.outbox.append((v, {"t": "r.ae", "term": self.term, "prev": prev,
                                "pterm": self.term_at(prev) or 0,
                                "ents": [[t, e] for t, e in entries], "commit": self.commit}))

    def _on_append(self, src: str, msg: dict[str, Any], now: float) -> None:
        if int(msg["term"]) < self.term:
            self.outbox.append((src, {"t": "r.aer", "term": self.term, "ok": False, "hint": self.last_index}))
            return
        self.role = FOLLOWER
        self.leader = src
        self._last_leader_contact = now
        self._reset_election(now)
        prev, pterm = int(msg["prev"]), int(msg["pterm"])
        ents = [(int(t), e) for t, e in msg["ents"]]
        if prev < self.snap_index:
            skip = self.snap_index - prev
            ents, prev, pterm = ents[skip:], self.snap_index, self.snap_term
            if skip > len(msg["ents"]):
                self.outbox.append((src, {"t": "r.aer", "term": self.term, "ok": True, "match": self.snap_index}))
                return
        if prev > self.last_index or self.term_at(prev) != pterm:
            hint = min(self.last_index, prev - 1)
            self.outbox.append((src, {"t": "r.aer", "term": self.term, "ok": False, "hint": max(hint, self.commit)}))
            return
        idx = prev
        for t, e in ents:
            idx += 1
            have = self.term_at(idx)
            if have is None:
                self.log.append((t, e))
            elif have != t:
                assert idx > self.commit, "leader tried to overwrite a committed entry"
                del self.log[idx - self.snap_index - 1:]
                self.log.append((t, e))
        new_commit = min(int(msg["commit"]), idx)
        if new_commit > self.commit:
            self.commit = new_commit
            self._apply()
        self.outbox.append((src, {"t": "r.aer", "term": self.term, "ok": True, "match": idx}))

    def _on_append_resp(self, src: str, msg: dict[str, Any], now: float) -> None:
        if self.role != LEADER or int(msg["term"]) != self.term:
            return
        self._contact[src] = now
        self._acked[src] = now
        if msg.get("ok"):
            m = int(msg["match"])
            if m > self._match.get(src, 0):
                self._match[src] = m
            self._next[src] = max(self._next.get(src, 1), m + 1)
            self._advance_commit(now)
            if self._next[src] <= self.last_index:
                self._send_append(src)
        else:
            self._next[src] = max(1, min(self._next.get(src, 1) - 1, int(msg.get("hint", 0)) + 1))
            self._send_append(src)

    def _on_snapshot(self, src: str, msg: dict[str, Any], now: float) -> None:
        if int(msg["term"]) < self.term:
            return
        self.role = FOLLOWER
        self.leader = src
        self._last_leader_contact = now
        self._reset_election(now)
        index = int(msg["index"])
        if index > self.commit:
            self._install(index, int(msg["sterm"]), msg["view"])
            self._apply()
        self.outbox.append((src, {"t": "r.aer", "term": self.term, "ok": True, "match": max(index, self.commit)}))

    def _install(self, index: int, term: int, view: dict[str, Any]) -> None:
        if self.term_at(index) == term and index <= self.last_index:
            self.log = self.log[index - self.snap_index:]
        else:
            self.log = []
        self.snap_index, self.snap_term, self.snap_view = index, term, view
        self.commit = max(self.commit, index)

    def _advance_commit(self, now: float) -> None:
        voters = self.voters()
        q = self._quorum()
        for n in range(self.last_index, self.commit, -1):
            if self.term_at(n) != self.term:
                break
            if sum(1 for v in voters if (self.last_index if v == self.me else self._match.get(v, 0)) >= n) >= q:
                self.commit = n
                self._apply()
                self._broadcast_append(now)
                break

    def _apply(self) -> None:
        if self.applied < self.snap_index:
            if self.snap_view is not None:
                self.committed.append(self.snap_view)
            self.applied = self.snap_index
        while self.applied < self.commit:
            self.applied += 1
            e = self.entry(self.applied)
            if e is not None:
                self.committed.append(e)
        if self.commit - self.snap_index > self.p.compact_after:
            keep_from = self.commit
            view, term = self.entry(keep_from), self.term_at(keep_from)
            self.log = self.log[keep_from - self.snap_index:]
            self.snap_index, self.snap_term, self.snap_view = keep_from, term or self.snap_term, view
