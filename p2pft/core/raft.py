"""Sans-IO Raft among a small voter set; the log entries are membership views.

The replicated state machine is just "the latest view", so a snapshot is the latest committed
view and log compaction is trivial. A view's epoch is its log index: at most one view can ever
be committed per epoch, and epochs only grow.

Configuration changes follow Raft's single-server rule: the voter set is the ``voters`` field
of the newest entry in a node's log (committed or not), and the node layer never proposes a
view that adds or removes more than one voter, nor a new view before the last one committed.

Pre-vote and check-quorum keep a partitioned or removed voter from disrupting the leader. A
voter also ignores vote requests while it hears from a leader (leader stickiness).

A voter's identity (``me``) is its node id, per process incarnation, unless the node keeps a
data directory: then it is a durable identity restored with its term, vote and log
(``HardState``, ``restore``), and ``hard_state()`` is what the driver must write before it sends
anything after a step that changed it (``hard_key`` says when). Either way a term's vote is
never cast twice by the same identity, nor an acknowledged entry forgotten: the two properties
Raft's stable storage exists to guarantee. A node without a data directory is a new identity
on every start that has never voted; its old identity leaves the voter set through an ordinary
single-server change, or, with a majority of the voters gone at once, only when enough durable
voters come back (docs/control-plane.md, "Durable voters").
"""
from __future__ import annotations

import enum
import random
from dataclasses import replace
from typing import Callable

from .config import Profile
from .durable import HardState
from .messages import Append, AppendResp, PreVote, PreVoteResp, RaftMsg, Snapshot, Vote, VoteResp
from .view import View

class RaftRole(str, enum.Enum):
    """This voter's role in its current term (``str`` values: logs and reports read the word)."""

    FOLLOWER = "follower"
    PRECANDIDATE = "precandidate"
    CANDIDATE = "candidate"
    LEADER = "leader"

    def __str__(self) -> str:
        return self.value


FOLLOWER, PRECANDIDATE, CANDIDATE = RaftRole.FOLLOWER, RaftRole.PRECANDIDATE, RaftRole.CANDIDATE
LEADER = RaftRole.LEADER
MAX_ENTRIES = 16


class Raft:
    """One voter's (or learner's) Raft state. Outputs are drained by the owner: ``outbox``
    (``(node id, message)``), ``events`` (terms in which we became leader) and ``committed``
    (``(term, view)`` in epoch order).

    ``first_entry`` (optional, a pure function of the last view) gives the content of a new
    leader's first entry; ``None`` repeats the last view."""

    def __init__(self, me: str, profile: Profile, rng: random.Random, now: float, *,
                 first_entry: Callable[[View], View] | None = None, restore: HardState | None = None) -> None:
        self._abstain = False  # do not campaign (the node's own trainer loop is stalled); still votes
        self._election_deadline = 0.0   # set by _reset_election below, before any tick reads it
        self.me = me
        self.p = profile
        self.rng = rng
        self.term = 0
        self.voted_for: str | None = None
        self.role: RaftRole = FOLLOWER
        self.leader: str | None = None
        self.snap_index = 0
        self.snap_term = 0
        self.snap_view: View | None = None
        self.log: list[tuple[int, View]] = []             # (term, view): entries snap_index+1 ...
        self.commit = 0
        self.applied = 0
        self.outbox: list[tuple[str, RaftMsg]] = []         # (node id, message)
        self.committed: list[tuple[int, View]] = []         # (term, view), in order, not yet drained
        self.events: list[int] = []                         # terms in which we became leader
        self._learners: set[str] = set()                    # leader replicates to these, they never vote
        self._first_entry = first_entry
        self._votes: set[str] = set()
        self._next: dict[str, int] = {}
        self._match: dict[str, int] = {}
        self._contact: dict[str, float] = {}
        self._acked: dict[str, float] = {}                # voter -> time of its last append response
        self._last_leader_contact = -1e9
        self._next_hb = float("inf")
        self._reset_election(now)
        if restore is not None:
            self._restore(restore)

    # ------------------------------------------------------------------ durable state
    def _restore(self, hs: HardState) -> None:
        """Come back as the voter `hs` describes: its term and vote, its log compacted at what it
        knew to be committed (already applied: the node does not hand those views out again)."""
        if hs.voter != self.me:
            raise ValueError(f"durable state of voter {hs.voter} restored into {self.me}")
        self.term, self.voted_for = hs.term, hs.vote
        self.snap_index, self.snap_term, self.snap_view = hs.snap_index, hs.snap_term, hs.snap_view
        self.log = list(hs.entries)
        self.commit = self.applied = hs.snap_index

    def hard_key(self) -> tuple[int, str | None, int, int, int, int]:
        """Changes whenever ``hard_state()`` would: term, vote, commit and the last entry (by the
        log matching property, equal last (index, term) means an equal log)."""
        return (self.term, self.voted_for, self.commit, self.snap_index, self.last_index, self.last_term())

    def hard_state(self, replica_id: str) -> HardState:
        """What must be on disk before any message of this step leaves: term, vote, and the log
        compacted at the commit index (a few entries: one proposal is in flight at a time)."""
        c = self.commit
        return HardState(voter=self.me, replica_id=replica_id, term=self.term, vote=self.voted_for,
                         snap_index=c, snap_term=self.term_at(c) or 0, snap_view=self.entry(c),
                         entries=tuple(self.log[c - self.snap_index:]))

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

    def entry(self, index: int) -> View | None:
        if index == self.snap_index:
            return self.snap_view
        if self.snap_index < index <= self.last_index:
            return self.log[index - self.snap_index - 1][1]
        return None

    def last_view(self) -> View | None:
        return self.entry(self.last_index)

    def last_term(self) -> int:
        """Term of the last entry (0 when the log is empty)."""
        return self.term_at(self.last_index) or 0

    def voters(self) -> list[str]:
        view = self.last_view()
        return list(view.voters) if view else []

    def is_voter(self) -> bool:
        return self.me in self.voters()

    def _quorum(self) -> int:
        return len(self.voters()) // 2 + 1

    # ------------------------------------------------------------------ API for the node layer
    @property
    def abstain(self) -> bool:
        return self._abstain

    def set_abstain(self, abstain: bool) -> None:
        """Do not campaign (our own training loop is stalled); we still vote."""
        self._abstain = bool(abstain)

    @property
    def learners(self) -> frozenset[str]:
        return frozenset(self._learners)

    def set_learners(self, nodes: set[str] | frozenset[str] | tuple[str, ...] = ()) -> None:
        """Nodes the leader replicates to without counting their votes (voters-to-be)."""
        self._learners = set(nodes)

    def bootstrap(self, view: View, now: float) -> None:
        """Start a new cluster with ourselves as the only voter (epoch 1, term 1)."""
        self.term = 1
        self.voted_for = self.me
        self.log = [(1, replace(view, epoch=1))]
        self._become_leader(now, noop=False)
        self._advance_commit(now)

    def learn(self, view: View, term: int) -> bool:
        """A committed view (of Raft term ``term``) from outside Raft (non-voters learn views this way)."""
        epoch = view.epoch
        if epoch <= self.commit:
            return False
        t = self.term_at(epoch)
        if t is not None and t == term:
            self.commit = epoch
        else:
            self._install(epoch, term, view)
        self._apply()
        return True

    def propose(self, view: View, now: float) -> int | None:
        """Append a view as leader; returns its epoch, or None if we cannot propose now."""
        if self.role != LEADER or self.commit < self.last_index:
            return None
        epoch = self.last_index + 1
        self.log.append((self.term, view if view.epoch == epoch else replace(view, epoch=epoch)))
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
            if self.is_voter() and not self._abstain:
                self._start_prevote(now)
            else:
                self._reset_election(now)

    # ------------------------------------------------------------------ messages
    def handle(self, src: str, msg: RaftMsg, now: float) -> None:
        term = msg.term
        if isinstance(msg, PreVote):
            self._on_prevote(src, msg, now)
            return
        if isinstance(msg, PreVoteResp):
            self._on_prevote_resp(src, msg, now)
            return
        if isinstance(msg, Vote) and self._sticky(now) and term > self.term:
            return  # we hear from a live leader: ignore a disruptive candidate
        if term > self.term:
            self._step_down(term, now, leader=src if isinstance(msg, (Append, Snapshot)) else None)
        if isinstance(msg, Vote):
            self._on_vote(src, msg, now)
        elif isinstance(msg, VoteResp):
            self._on_vote_resp(src, msg, now)
        elif isinstance(msg, Append):
            self._on_append(src, msg, now)
        elif isinstance(msg, AppendResp):
            self._on_append_resp(src, msg, now)
        elif isinstance(msg, Snapshot):
            self._on_snapshot(src, msg, now)

    # ------------------------------------------------------------------ elections
    def _reset_election(self, now: float) -> None:
        self._election_deadline = now + self.rng.uniform(self.p.election_min, self.p.election_max)

    def _sticky(self, now: float) -> bool:
        return self.role == LEADER or now - self._last_leader_contact < self.p.election_min

    def _log_ok(self, msg: PreVote | Vote) -> bool:
        lt, li = msg.last_term, msg.last_index
        my_lt = self.last_term()
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
                self.outbox.append((v, PreVote(term=self.term + 1, last_index=self.last_index,
                                               last_term=self.last_term())))

    def _on_prevote(self, src: str, msg: PreVote, now: float) -> None:
        term = msg.term
        grant = term > self.term and self._log_ok(msg) and not self._sticky(now)
        self.outbox.append((src, PreVoteResp(term=term if grant else self.term, ok=grant)))

    def _on_prevote_resp(self, src: str, msg: PreVoteResp, now: float) -> None:
        if not msg.ok:
            if msg.term > self.term:
                self._step_down(msg.term, now)
            return
        if self.role != PRECANDIDATE or msg.term != self.term + 1:
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
                self.outbox.append((v, Vote(term=self.term, last_index=self.last_index, last_term=self.last_term())))

    def _on_vote(self, src: str, msg: Vote, now: float) -> None:
        term = msg.term
        grant = (term == self.term and self.voted_for in (None, src) and self._log_ok(msg))
        if grant:
            self.voted_for = src
            self._reset_election(now)
        self.outbox.append((src, VoteResp(term=self.term, ok=grant)))

    def _on_vote_resp(self, src: str, msg: VoteResp, now: float) -> None:
        if self.role != CANDIDATE or msg.term != self.term or not msg.ok:
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
        self.events.append(self.term)
        base = self.last_view()
        if noop and base is not None:
            # A fresh entry of our own term lets us commit everything before it (Raft 5.4.2).
            # Its content may be the node layer's up-to-date view (saving a round on a leader
            # change), but never with other voters: a new leader commits an entry of its own
            # term before any configuration change.
            first = self._first_entry(base) if self._first_entry is not None else base
            epoch = self.last_index + 1
            self.log.append((self.term, replace(first, epoch=epoch, voters=base.voters)))
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
        for v in sorted(self._learners):
            if v != self.me and v not in voters:
                self._send_append(v)

    def _send_append(self, v: str) -> None:
        nxt = self._next.setdefault(v, self.last_index + 1)
        self._match.setdefault(v, 0)
        if nxt <= self.snap_index and self.snap_view is not None:
            self.outbox.append((v, Snapshot(term=self.term, index=self.snap_index, snap_term=self.snap_term,
                                            view=self.snap_view)))
            return
        prev = nxt - 1
        entries = self.log[prev - self.snap_index: prev - self.snap_index + MAX_ENTRIES]
        self.outbox.append((v, Append(term=self.term, prev=prev, prev_term=self.term_at(prev) or 0,
                                      entries=list(entries), commit=self.commit)))

    def _on_append(self, src: str, msg: Append, now: float) -> None:
        if msg.term < self.term:
            self.outbox.append((src, AppendResp(term=self.term, ok=False, hint=self.last_index)))
            return
        self.role = FOLLOWER
        self.leader = src
        self._last_leader_contact = now
        self._reset_election(now)
        prev, pterm = msg.prev, msg.prev_term
        ents = msg.entries
        if prev < self.snap_index:
            skip = self.snap_index - prev
            ents, prev, pterm = ents[skip:], self.snap_index, self.snap_term
            if skip > len(msg.entries):
                self.outbox.append((src, AppendResp(term=self.term, ok=True, match=self.snap_index)))
                return
        if prev > self.last_index or self.term_at(prev) != pterm:
            hint = min(self.last_index, prev - 1)
            self.outbox.append((src, AppendResp(term=self.term, ok=False, hint=max(hint, self.commit))))
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
        new_commit = min(msg.commit, idx)
        if new_commit > self.commit:
            self.commit = new_commit
            self._apply()
        self.outbox.append((src, AppendResp(term=self.term, ok=True, match=idx)))

    def _on_append_resp(self, src: str, msg: AppendResp, now: float) -> None:
        if self.role != LEADER or msg.term != self.term:
            return
        self._contact[src] = now
        self._acked[src] = now
        if msg.ok:
            m = msg.match
            if m > self._match.get(src, 0):
                self._match[src] = m
            self._next[src] = max(self._next.get(src, 1), m + 1)
            self._advance_commit(now)
            if self._next[src] <= self.last_index:
                self._send_append(src)
        else:
            self._next[src] = max(1, min(self._next.get(src, 1) - 1, msg.hint + 1))
            self._send_append(src)

    def _on_snapshot(self, src: str, msg: Snapshot, now: float) -> None:
        if msg.term < self.term:
            return
        self.role = FOLLOWER
        self.leader = src
        self._last_leader_contact = now
        self._reset_election(now)
        index = msg.index
        if index > self.commit:
            self._install(index, msg.snap_term, msg.view)
            self._apply()
        self.outbox.append((src, AppendResp(term=self.term, ok=True, match=max(index, self.commit))))

    def _install(self, index: int, term: int, view: View) -> None:
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
                self.committed.append((self.snap_term, self.snap_view))
            self.applied = self.snap_index
        while self.applied < self.commit:
            self.applied += 1
            e = self.entry(self.applied)
            if e is not None:
                self.committed.append((self.term_at(self.applied) or 0, e))
        if self.commit - self.snap_index > self.p.compact_after:
            keep_from = self.commit
            view, term = self.entry(keep_from), self.term_at(keep_from)
            self.log = self.log[keep_from - self.snap_index:]
            self.snap_index, self.snap_term, self.snap_view = keep_from, term or self.snap_term, view
