"""The leader's view reconciliation: the view gossip implies, and the next voter set.

``ViewPlanner.desired`` derives, from the current view and what gossip shows now, the view the
leader should propose: the newest live incarnation of each replica, each member's role and
slot, the data epoch, the high-water step, the trainers left out; and, one server at a time, the
voters. Pure bookkeeping over the node's gossip and Raft state: it sends nothing itself.
"""
from __future__ import annotations

import logging
from collections import Counter
from typing import Any

from .config import Profile
from .gossip.swim import Gossip, GossipMember
from .jobplan import HOLDS_STATE, RESUME_GRACE_S, JobPlanner, Trainer
from .messages import ALIVE, SUSPECT
from .meta import Kind, Status
from .raft import Raft
from .reach import data_unreachable
from .view import Member, Role, View

log = logging.getLogger(__name__)

PROMOTE_SLACK_STEPS = 8    # a 'ready' joiner this close to the head is current (see desired)
LEFT_KEEP = 128            # trainers recently left out of a view, carried in the view ("left")


def member_entry(node: str, addr: str, meta: Any, role: Role, slot: int | None, since: int) -> Member:
    """A view's entry for a node, from its gossip metadata."""
    return Member(node=node, replica_id=meta.replica_id or node, addr=addr, data_addrs=meta.data_addrs,
                  role=role, slot=slot, shards=meta.shards, since=since, voter=meta.voter)


def canonical(view: View) -> tuple[Any, ...]:
    """What makes two views the same proposal (epoch and high water aside)."""
    members = tuple(sorted((m.node, m.role, m.slot, m.addr, m.data_addrs) for m in view.members))
    return members, tuple(view.voters), view.data_epoch, view.target, view.finished


def voter_preference(m: Member) -> tuple[int, int, str]:
    """Witnesses first (they do not die with a trainer's faults), then the longest-lived."""
    return (0 if m.role is Role.WITNESS else 1, int(m.since), m.node)


def held_step(m: GossipMember) -> int:
    """The step of the state a trainer holds. Its status carries the step it was said at; a
    'ready' trainer has committed steps since (every commit is gossiped, not every status), so
    its step is the later of the two. A paused one says -1 when it holds no committed state."""
    return max(m.meta.step, m.step) if m.meta.status is Status.READY else m.meta.step


def _start(g: Gossip, m: Member) -> tuple[float, str]:
    gm = g.members.get(m.node)
    return (gm.meta.start if gm is not None else 0.0, m.node)


class ViewPlanner:
    """Leader-side state for deriving views: loop-stall bookkeeping, the headless grace period,
    the voter change in progress and the high-water step."""

    def __init__(self, me: str, profile: Profile, gossip: Gossip, raft: Raft, stats: Counter[str],
                 high_water: int = 0) -> None:
        self.me = me
        self.p = profile
        self.gossip = gossip
        self.raft = raft
        self.stats = stats
        self.high_water = high_water
        self.voter_change: tuple[tuple[str, ...], float] | None = None  # (voter set, decided at)
        self._stalled: set[str] = set()        # trainers left out for a stalled loop (logged once)
        self._unreachable: set[str] = set()    # trainers left out for an unreachable data port (logged)
        self._lt_seen: dict[str, float] = {}   # when it first saw a trainer's declared loop timeout
        self.job = JobPlanner(me, stats)

    def stop_leading(self) -> None:
        """No longer leader: drop the voter change in progress."""
        self.voter_change = None
        self.raft.set_learners()

    def desired(self, cur: View, now: float, step: int, keep_voters: bool = False) -> View:
        g = self.gossip
        newest: dict[str, tuple[tuple[float, str], GossipMember]] = {}
        for m in g.live_members():
            if m.meta.status is Status.LEAVING:
                continue
            r = m.meta.replica_id or m.node
            key = (m.meta.start, m.node)
            if r not in newest or key > newest[r][0]:
                newest[r] = (key, m)
        # A participant's step: the later of what gossip carries and what its status says (one
        # that pauses says the step it committed last, which its gossip may not carry yet).
        part_steps = [step if n.node == self.me else max(g.members[n.node].step, g.members[n.node].meta.step)
                      for n in cur.members
                      if n.role is Role.PARTICIPANT and n.node in g.members
                      and g.members[n.node].state in (ALIVE, SUSPECT)]
        head = max(part_steps) if part_steps else None
        # Participants that stay on the data plane at the head (alive, not suspected, not
        # pausing): a joiner promoted a few steps behind fast-forwards in its first step with
        # them. With none, it would be the data plane alone, behind the committed steps of a
        # paused or dying member: it would commit those steps again with other weights.
        carried = head is not None and any(
            (step if n.node == self.me else g.members[n.node].step) >= head for n in cur.members
            if n.role is Role.PARTICIPANT and n.node in g.members and g.members[n.node].state is ALIVE
            and g.members[n.node].meta.status is not Status.PAUSED)
        # High water: the furthest committed step this cluster is known to have reached. A
        # member that just died counts by its last gossiped step until a view removes it; the
        # view then carries the mark (members gone before an allowed restart no longer count).
        observed = [m.step for m in g.members.values() if m.meta.kind is Kind.TRAINER
                    and (m.state in (ALIVE, SUSPECT) or cur.member(m.node) is not None)]
        hw = max([self.high_water, cur.high_water, head or 0, step] + observed)
        trainers = [Trainer(m.node, m.meta.start, m.meta.status, held_step(m), m.meta.target, m.meta.allow_scratch,
                            stalled=self._loop_stalled(m, now))
                    for _, m in newest.values() if m.meta.kind is Kind.TRAINER]
        job = self.job.next_state(cur, trainers, hw, head is None, now)
        self.high_water = job.high_water
        resume_at = job.resume_at
        epoch = self.raft.last_index + 1
        left_list = list(cur.left)
        left = set(left_list)
        target = head if head is not None else resume_at   # the step a trainer must hold to train now
        chosen: list[tuple[GossipMember, Role]] = []
        unreachable = data_unreachable(self.me, [m for _, m in newest.values()], self._unreachable)
        for _, m in newest.values():
            if self._loop_stalled(m, now) or m.node in unreachable:
                continue
            prev = cur.member(m.node)
            status = m.meta.status
            # Holds a state at the cluster's step, and was not left out of an earlier view (it
            # may hold a step the others redid without it: it comes back through catch-up).
            at_target = status in HOLDS_STATE and m.meta.step == target and (head is None or m.node not in left)
            if m.meta.kind is Kind.WITNESS:
                role = Role.WITNESS
            elif status is Status.PAUSED:
                # Stepped out (evaluation, a checkpoint): off the data plane, so the others commit
                # without it and nobody waits for its data; it contributes nothing meanwhile.
                role = Role.PAUSED
            elif prev and prev.role is Role.PAUSED:
                # Back from a pause: it checked before saying 'ready' that its last step is the
                # others' (docs/runtime.md, "Pauses"); at the head it takes part at once, behind
                # it fast-forwards or catches up as a joiner.
                role = Role.PARTICIPANT if at_target else Role.JOINER
            elif prev and prev.role is Role.PARTICIPANT:
                role = Role.JOINER if status is Status.JOINING else Role.PARTICIPANT
            elif prev and prev.role is Role.JOINER:
                # A joiner that caught up says 'ready' at its step; the head moved on meanwhile,
                # but a joiner applies every mean gradient, so it is still current. Its step: the
                # one it said 'ready' at, or the one gossip carries now (a hot spare said 'ready'
                # long ago and has applied every step since). A process that merely started
                # ('fresh') at an old step stays a joiner, however close that step is: it has
                # not applied the steps in between.
                # The leader's own step is the live one it is called with: its own gossip
                # record may be old (a leader back from a pause would never promote itself).
                st = max(m.meta.step, step if m.node == self.me else m.step)
                if status is Status.READY:
                    slack = PROMOTE_SLACK_STEPS if carried else 0
                    current = st >= head - slack if head is not None else st == target
                else:
                    current = at_target
                role = Role.PARTICIPANT if current else Role.JOINER
            elif at_target:
                # A fresh replica at the cluster's step: nothing to catch up.
                role = Role.PARTICIPANT
            else:
                role = Role.JOINER
            chosen.append((m, role))
        chosen = self._cap_participants(chosen, cur, newest, epoch)
        used: set[int] = set()
        for m, role in chosen:
            prev = cur.member(m.node)
            if role is Role.PARTICIPANT and prev is not None and prev.slot is not None:
                used.add(prev.slot)
        members = []
        for m, role in sorted(chosen, key=lambda x: x[0].node):
            prev = cur.member(m.node)
            slot = prev.slot if prev and role is Role.PARTICIPANT and prev.slot is not None else None
            if role is Role.PARTICIPANT and slot is None:
                slot = next(i for i in range(1 << 16) if i not in used)
                used.add(slot)
            since = prev.since if prev else epoch
            members.append(member_entry(m.node, m.addr, m.meta, role, slot, since))
        voters = tuple(cur.voters) if keep_voters else tuple(self._next_voters(cur, members, now))
        data = sorted(m.node for m in members if m.role.on_data_plane)
        old = sorted(m.node for m in cur.members if m.role.on_data_plane)
        data_epoch = cur.data_epoch if data == old else epoch
        # A trainer whose communicator failed with nobody to exclude (a peer paused for less
        # than the failure timeout) asks for a fresh data epoch by naming the one that failed.
        if any((m.meta.data_epoch_request or 0) >= data_epoch for _, m in newest.values() if m.node in data):
            data_epoch = epoch
        now_in = {m.node for m in members}
        dropped = sorted(m.node for m in cur.members if m.role is not Role.WITNESS and m.node not in now_in
                         and m.node not in left)
        left_list = (left_list + dropped)[-LEFT_KEEP:]
        return View(epoch=epoch, members=tuple(members), voters=voters, data_epoch=data_epoch,
                    high_water=self.high_water, left=tuple(left_list), target=job.target, finished=job.finished)

    @staticmethod
    def _cap_participants(chosen: list[tuple[GossipMember, Role]], cur: View,
                          newest: dict[str, tuple[tuple[float, str], GossipMember]],
                          epoch: int) -> list[tuple[GossipMember, Role]]:
        """Hot spares: with a planned participant count declared (``max_participants``), trainers
        beyond it stay joiners. A joiner that keeps applying every reduced step is current, so
        when a participant leaves, the view that removes it promotes a spare at once: a failure
        costs one view change, not a process start. Participants are never demoted for the cap;
        promotions go to the longest-waiting joiner first."""
        caps = [m.meta.max_participants for _, m in newest.values()
                if m.meta.kind is Kind.TRAINER and m.meta.max_participants]
        if not caps:
            return chosen
        cap = max(caps)

        def was_participant(m: GossipMember) -> bool:
            prev = cur.member(m.node)
            return prev is not None and prev.role is Role.PARTICIPANT

        room = cap - sum(1 for m, role in chosen if role is Role.PARTICIPANT and was_participant(m))
        out: list[tuple[GossipMember, Role]] = []
        for m, role in sorted(chosen, key=lambda x: (getattr(cur.member(x[0].node), "since", epoch), x[0].node)):
            if role is Role.PARTICIPANT and not was_participant(m):
                if room > 0:
                    room -= 1
                else:
                    role = Role.JOINER
            out.append((m, role))
        return out

    def _loop_stalled(self, gm: GossipMember, now: float) -> bool:
        """A trainer whose training loop has not beaten for longer than it declared."""
        lt = gm.meta.loop_timeout
        node = gm.node
        if not lt or node == self.me or gm.meta.status is Status.PAUSED:
            # A paused trainer is off the data plane: a long evaluation holds nobody up.
            self._lt_seen.pop(node, None)
            return False
        # No beat from it yet (a new leader, or a loop that wedged before its first beat got
        # here): count from when this leader first saw the declaration.
        since = gm.beat_at if gm.beat_at is not None else self._lt_seen.setdefault(node, now)
        stalled = now - since > lt
        if stalled and node not in self._stalled:
            self._stalled.add(node)
            self.stats["loop_stalled"] += 1
            log.warning("the training loop of %s has not run for %.1f s (it declared %.1f s): leaving it out of "
                        "the view", node, now - since, lt, extra={"node": self.me})
        elif not stalled:
            self._stalled.discard(node)
        if len(self._stalled) > 4096 or len(self._lt_seen) > 4096:  # nodes long gone: forget them
            self._stalled.clear()
            self._lt_seen.clear()
        return stalled

    def _next_voters(self, cur: View, members: list[Member], now: float) -> list[str]:
        """At most one voter added or removed per view (Raft's single-server change).

        Raft switches to a voter set as soon as it is in the log, committed or not. A set
        without a live majority (say, one that drops a voter that is only partitioned away
        while another has just crashed, or adds a voter that has just crashed) could never
        commit nor be replaced, even after the partition heals. So a change is made in two
        steps: pick a set whose majority answered our appends within a few heartbeats, then
        propose it only once a majority of it has answered again *after* that decision (the
        added voter is replicated to as a learner meanwhile). Until then the view keeps the
        old voters, so member changes are not delayed.
        """
        voters = list(cur.voters)
        want = self._voter_target(voters, members, now)
        if want is None:
            self.voter_change = None
            self.raft.set_learners()
            return voters
        key = tuple(want)
        if self.voter_change is None or self.voter_change[0] != key:
            self.voter_change = (key, now)
            self.raft.set_learners(set(want) - set(voters))
            return voters
        since = max(self.voter_change[1], now - 3 * self.p.heartbeat)
        if sum(1 for v in want if self.raft.acked_after(v, since)) * 2 > len(want):
            return want
        return voters

    def _voter_target(self, voters: list[str], members: list[Member], now: float) -> list[str] | None:
        """The next voter set we would like (one server away from ``voters``), or None.

        Voters are named by voter id (``Member.voter_id``): a durable voter's later incarnation
        holds its old voter id, so a voter counts as present while any member holds it."""
        g = self.gossip
        by_voter: dict[str, Member] = {}
        for m in members:   # the newest incarnation holding a voter id (a restart may overlap its old one)
            old = by_voter.get(m.voter_id)
            if old is None or _start(g, m) >= _start(g, old):
                by_voter[m.voter_id] = m
        in_view = set(by_voter)
        window = 3 * self.p.heartbeat

        def alive(v: str) -> bool:
            m = by_voter.get(v)
            gm = g.members.get(m.node) if m is not None else None
            return gm is not None and gm.state == ALIVE

        def fresh_majority(new: list[str]) -> bool:
            up = sum(1 for v in new if self.raft.acked_within(v, now, window) or (v not in voters and alive(v)))
            return up * 2 > len(new)

        gone = [v for v in voters if v not in in_view]
        if gone:
            for v in gone:
                new = [x for x in voters if x != v]
                if fresh_majority(new):
                    return new
            return None
        eligible = sorted((m for m in by_voter.values() if g.members.get(m.node) is not None
                           and g.members[m.node].state == ALIVE), key=voter_preference)
        # An odd number of voters, up to max_voters, sized by the whole view (a member that is
        # only suspected still counts, so a brief suspicion does not shrink and regrow the set).
        target = min(self.p.max_voters, max(1, len(members)))
        if target > 1 and target % 2 == 0:
            target -= 1
        if len(voters) < target:
            for m in eligible:
                if m.voter_id not in voters:
                    new = voters + [m.voter_id]
                    return new if fresh_majority(new) else None
        if len(voters) > target:
            # Shrink (e.g. 2 voters of 2 members -> 1): an even set tolerates no more failures
            # than the odd one below it, and losing either of 2 voters would stall for good.
            order = {v: voter_preference(m) for v, m in by_voter.items()}
            newest = max((v for v in voters if v != self.raft.me), key=lambda v: order.get(v, (1 << 62, 0, v)),
                         default=None)
            if newest:
                new = [v for v in voters if v != newest]
                return new if fresh_majority(new) else None
        return None


__all__ = ["LEFT_KEEP", "PROMOTE_SLACK_STEPS", "RESUME_GRACE_S", "ViewPlanner", "canonical", "member_entry",
           "voter_preference"]
