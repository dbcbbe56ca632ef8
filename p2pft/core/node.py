"""One replica leader's control plane as a sans-IO state machine: gossip + Raft + views.

``Node`` routes messages to the gossip and Raft cores, turns gossip's membership into proposed
views when it leads (``p2pft.core.reconcile``), hands committed views to non-voters, and bootstraps a
cluster when there is none. Inputs: ``handle(msg, now)``, ``tick(now)``, the evidence calls
(``report_failure``, ``report_unreachable``, ``touch``) and the trainer's calls (``set_status``,
``set_step``, ``loop_beat``, ``request_data_epoch``, ``leave``). Output: ``ready()``, one
``Ready`` value (messages to send, committed views, leader terms) per step, taken by the caller.

Messages are the dataclasses of ``p2pft.core.messages``; committed views are ``View`` values (Raft's
log entries); member metadata is a ``MemberMeta``. Wire forms exist only in ``p2pft.core.codec``.

Two identities: the node id (``replica_id.<random>``, one per process incarnation: gossip, views,
the data plane) and the Raft voter id. They are the same unless the node keeps a data directory
(``durable``): its first incarnation's node id is then its voter id for good, restored with its
term, vote and log (``restore``), so that a majority of voters killed at once comes back when
they restart (docs/control-plane.md, "Durable voters"). Views list voters by voter id and each
member's voter id (``Member.voter``); Raft messages are addressed and signed with voter ids.
"""
from __future__ import annotations

import bisect
import logging
import random
from collections import Counter
from dataclasses import replace

from .config import DEFAULT, Profile
from .durable import HardState
from .gossip.events import GossipEventKind
from .gossip.swim import Gossip
from .messages import (ALIVE, DEAD, LEFT, SUSPECT, Envelope, GossipMessage, Message, RaftMessage, RaftMsg, Unknown,
                       Update, Updates, ViewDelta, ViewFull, ViewRequest)
from .meta import Kind, MemberStatus, NodeSpec, Status
from .raft import LEADER, Raft
from .ready import Ready
from .reconcile import ViewPlanner, canonical, member_entry
from .view import JobTarget, Member, Role, View

log = logging.getLogger(__name__)

PARTICIPANT, JOINER, WITNESS = Role.PARTICIPANT, Role.JOINER, Role.WITNESS
TRAINER_KIND, WITNESS_KIND = Kind.TRAINER, Kind.WITNESS
BOOTSTRAP_GIVE_UP = 10     # bootstrap waits for the lowest seed at most this many bootstrap_waits
BEAT_EVERY_MAX = 1.0       # a trainer's loop beats reach the leader at least this often
TOUCH_EPOCH = 1 << 62      # a view request nobody can answer: only the connection attempt matters
RESTORED_DEFER = 3         # election timeouts a restored voter leaves a surviving voter to lead first
RESTORED_DEFER_MAX = 30.0  # s after its start a restored voter campaigns whatever its gossip shows
#: the committed views carry the job's progress (high water) at most this stale once it trains, so
#: that the voters' data directories and every witness hold it through the loss of every trainer
HIGH_WATER_REFRESH_S = 5.0


_NOTHING = Ready()   # handed out when a step produced nothing; callers only read a Ready


def _node_key(m: Member) -> str:
    return m.node


class Node:
    """One node (an incarnation of a replica leader, or a witness): gossip member, Raft voter or
    learner, and the leader's view maker when Raft elects it."""

    def __init__(self, spec: NodeSpec, *, addr: str, seeds: list[str] | tuple[str, ...] = (),
                 profile: Profile = DEFAULT, rng: random.Random, now: float, start_stamp: float | None = None,
                 durable: bool = False, restore: HardState | None = None) -> None:
        self.replica_id = spec.replica_id or addr
        self.addr = addr
        self.kind = spec.kind
        self.p = profile
        self.rng = rng
        self.id = f"{self.replica_id}.{rng.getrandbits(32):08x}"
        if restore is not None and restore.replica_id != self.replica_id:
            raise ValueError(f"the data directory holds the voter state of replica {restore.replica_id!r}, "
                             f"not of {self.replica_id!r}")
        # A durable node's voter id: its first incarnation's node id, then the one on its disk.
        self.voter_id = restore.voter if restore is not None else self.id
        self.durable = durable or restore is not None
        meta = replace(spec, replica_id=self.replica_id).meta(now if start_stamp is None else start_stamp)
        if self.voter_id != self.id:
            meta = replace(meta, voter=self.voter_id)
        step = spec.step
        self.gossip = Gossip(self.id, addr, meta, profile, rng, now, step=step)
        self.raft = Raft(self.voter_id, profile, rng, now, first_entry=self._first_view, restore=restore)
        self._hard_key: tuple[object, ...] | None = None   # what was last handed out to be written
        self._aliases: dict[str, str] = {}                # voter id -> the newest member holding it (gossip)
        self._quorum_lost_since: float | None = None
        self._restored_at: float | None = now if restore is not None and restore.has_log else None
        self._majority_since: float | None = None          # a restored voter first saw a majority of its voters
        self._restored_epoch = restore.snap_index if restore is not None else 0
        self.quorum_lost: tuple[str, ...] = ()            # the missing voters, once reported (ERROR)
        self.stats: Counter[str] = Counter()
        self.planner = ViewPlanner(self.id, profile, self.gossip, self.raft, self.stats, high_water=step)
        self._now = now
        self.view: View | None = None
        self.view_term = 0                     # Raft term of self.view's entry
        self.view_time: float | None = None
        self._beat = 0
        self._next_beat = now
        self.leader: str | None = None
        self.leader_addr: str | None = None
        self._ready = Ready()
        self.started = now
        self.seeds = [s for s in seeds if s != addr]
        self.step = step
        self._pending_since: float | None = None
        self._next_hello = now
        self._view_asked: dict[str, float] = {}
        self._bootstrapped = False
        self._next_bootstrap = now + profile.bootstrap_wait   # when to consider bootstrapping next
        self._role: Role | None = None         # our role in self.view (asked on every tick)
        self._dirty = True                     # leader: membership changed since the last reconcile
        self._high_water_at = -1e9             # leader: when it last proposed a view (carrying the high water)
        self._next_reconcile = now
        if restore is not None and restore.has_log:
            # A voter back from its disk: it never bootstraps (it belongs to a cluster), and it
            # knows the last committed view, which it does not hand out again (its trainer is a
            # new incarnation that is in no view yet).
            self._bootstrapped = True
            base = self.raft.entry(self.raft.commit)
            if base is not None:
                self.view, self.view_term = base, self.raft.term_at(self.raft.commit) or 0
                self.gossip.set_epoch(base.epoch)
            log.info("restored voter %s from disk: term %d, committed epoch %d, %d entries after it",
                     self.voter_id, self.raft.term, self.raft.commit, len(restore.entries), extra={"node": self.id})
        if not self.seeds and not self._bootstrapped:
            self._bootstrap(now)
        else:
            self.gossip.join(self.seeds, now)
        self._pump(now)

    # ------------------------------------------------------------------ output
    def ready(self) -> Ready:
        """Everything produced since the last call (messages, committed views, leader terms).
        The caller acts on it; the node starts a fresh one."""
        out = self._ready
        if not (out.messages or out.views or out.leader_terms or out.hard_state is not None):
            return _NOTHING   # the common case after a timer: no allocation
        self._ready = Ready()
        return out

    # ------------------------------------------------------------------ inputs
    def handle(self, msg: Message, now: float) -> None:
        """One decoded message (``p2pft.core.codec.from_wire``). Content that makes no sense raises
        KeyError/TypeError/ValueError: the driver counts it and drops the message (never the node)."""
        self._now = now
        if isinstance(msg, GossipMessage):
            self.gossip.handle(msg, now)
        elif isinstance(msg, RaftMessage):
            if msg.to != self.voter_id:
                self.stats["misaddressed"] += 1
                return
            self.raft.handle(msg.src, msg, now)
        elif isinstance(msg, ViewRequest):
            if self.view is not None and self.view.epoch > msg.epoch:
                self._send_view(msg.frm)
        elif isinstance(msg, ViewFull):
            self._on_view_msg(msg, now)
        elif isinstance(msg, ViewDelta):
            self._on_view_delta(msg, now)
        elif isinstance(msg, Unknown):
            self.stats["unknown_type"] += 1
        else:
            raise TypeError(f"not a control message: {type(msg).__name__}")
        self._pump(now)

    def tick(self, now: float) -> None:
        self._now = now
        self._check_own_loop(now)
        self.gossip.tick(now)
        self.raft.tick(now)
        self._check_quorum(now)
        if not self._bootstrapped and self.view is None and now >= self._next_bootstrap:
            self._next_bootstrap = now + self.p.probe_interval
            self._maybe_bootstrap(now)
        if self.view is not None and not self._in_view() and now >= self._next_hello:
            self._hello(now)
        self._pump(now)

    def next_deadline(self) -> float:
        t = min(self.gossip.next_deadline(), self.raft.next_deadline())
        if self.view is None and not self._bootstrapped:
            t = min(t, self._next_bootstrap)
        if self.view is not None and not self._in_view():
            t = min(t, self._next_hello)
        if self._pending_since is not None and self.is_leader() and not self.raft.pending():
            t = min(t, self._pending_since + self.p.batch_window)
        return t

    def report_failure(self, node: str, now: float, certain: bool = False) -> None:
        """The data plane (or a refused connection) says this node failed."""
        self.gossip.report_failure(node, now, certain)
        self._pump(now)

    def report_unreachable(self, addr: str, now: float, certain: bool) -> None:
        node = self.gossip.node_at(addr)
        if node:
            self.report_failure(node, now, certain)

    def touch(self, node: str, now: float) -> None:
        """Knock on a node's control port (after data-plane evidence against it): a refused
        connection there is certain evidence, which the driver reports back."""
        addr = self.gossip.addr_of(node)
        if addr:
            self._send(addr, ViewRequest(epoch=TOUCH_EPOCH))

    def set_status(self, status: str | Status, now: float, step: int | None = None) -> None:
        """Trainer: 'fresh' (just started), 'joining' (needs catch-up) or 'ready' (holds current state)."""
        changes: dict[str, object] = {"status": Status(status)}
        if step is not None:
            changes["step"] = int(step)
            self.set_step(step)
        self.gossip.update_meta(now, **changes)
        self._hello(now)
        self._pump(now)

    def request_data_epoch(self, failed_data_epoch: int, now: float) -> None:
        """Trainer: the communicator of `failed_data_epoch` broke with nobody to exclude; ask
        the leader for a fresh data epoch (it sees the request in our metadata)."""
        self.gossip.update_meta(now, data_epoch_request=int(failed_data_epoch))
        self._hello(now)

    def set_data_unreachable(self, nodes: tuple[str, ...], now: float) -> None:
        """Trainer: the members whose data address it has not reached for longer than the bound
        although gossip says they are alive; the leader leaves them out (see p2pft/core/reach.py)."""
        if tuple(nodes) != self.gossip.meta.data_unreachable:
            self.gossip.update_meta(now, data_unreachable=tuple(nodes))
            self._hello(now)
            self._pump(now)

    def declare_job(self, target: JobTarget | None, allow_scratch: bool, now: float) -> None:
        """Trainer: the job's end as it was configured, and whether it may restart the job below
        the cluster's high-water step (both ride in its metadata; the leader reads them)."""
        self.gossip.update_meta(now, target=target, allow_scratch=bool(allow_scratch))
        self._hello(now)
        self._pump(now)

    def _check_own_loop(self, now: float) -> None:
        """A leader cannot leave itself out of the view: when its own training loop has stalled
        past the timeout it declared, it steps down and stops campaigning, so that another
        leader leaves it out (see ViewPlanner._loop_stalled)."""
        me = self.gossip.members[self.id]
        lt = me.meta.loop_timeout
        stalled = bool(lt) and me.beat_at is not None and now - me.beat_at > (lt or 0.0)
        stalled = stalled and len(self.raft.voters()) > 1
        self.raft.set_abstain(stalled or self._defer_to_survivors(now))
        if stalled and self.is_leader():
            log.warning("own training loop has not run for %.1f s: stepping down as Raft leader",
                        now - (me.beat_at or now), extra={"node": self.id})
            self.raft.step_down(now)

    def _defer_to_survivors(self, now: float) -> bool:
        """A voter restored from disk lets a voter that lived through the loss lead first.

        The views carry the job's high water only as of the last committed one; the steps since
        then reached the survivors by gossip (a witness saw every trainer's step until it died),
        not the restarted processes, whose gossip starts empty. A survivor leading writes them
        into the next view; a restarted trainer leading could forget them (and let a replica
        resume below them without a word). So until a view is committed after its restore, a
        restored voter does not campaign while its gossip does not show a majority of its voters
        (it would only be guessing who survived), nor for ``RESTORED_DEFER`` election timeouts
        after it does if a survivor voter (one whose node id is its voter id: it never
        restarted) is alive among them, or one is not known to its gossip yet; then it does (a
        survivor whose log is behind cannot win: liveness before preference), and in any case
        ``RESTORED_DEFER_MAX`` s after its start. It votes all along."""
        if self._restored_at is None:
            return False
        if (self.view is not None and self.view.epoch > self._restored_epoch) \
                or now - self._restored_at > RESTORED_DEFER_MAX:
            self._restored_at = None   # a view carries the job's state again (or the backstop)
            return False
        voters = self.raft.voters()
        if (len(voters) - len(self.missing_voters())) * 2 <= len(voters):
            self._majority_since = None
            return len(voters) > 1
        if self._majority_since is None:
            self._majority_since = now
        if now - self._majority_since > RESTORED_DEFER * self.p.election_max:
            return False
        g = self.gossip.members
        # A survivor is alive, or a voter is not known here at all yet (it may be one).
        return any(v != self.voter_id and ((v in g and g[v].state == ALIVE and not g[v].meta.voter)
                                           or (v not in g and v not in self._aliases)) for v in voters)

    def loop_beat(self, now: float, timeout: float) -> None:
        """Trainer: its training loop ran. The process may gossip perfectly while its loop is
        wedged (a hung data loader, a deadlock), and every allreduce of the data plane then
        waits for it; so the loop's own progress is reported to the leader, which leaves a
        trainer out of the view when its beats stop for longer than the `timeout` it declared
        (``MemberMeta.loop_timeout``; a trainer that declares none is never left out for this)."""
        self._beat += 1
        if self.gossip.meta.loop_timeout != float(timeout):
            self.gossip.update_meta(now, loop_timeout=float(timeout))
        if now < self._next_beat:
            return
        self._next_beat = now + min(BEAT_EVERY_MAX, timeout / 4)
        self.gossip.record_beat(self._beat, now)
        if self.leader_addr and self.leader != self.id:
            # The step rides along: the leader's high-water mark (which says whether a resume
            # from disk loses progress) is then at most one beat period old.
            self._send(self.leader_addr, Updates(beat=self._beat, step=self.step))
        self._pump(now)

    def set_step(self, step: int) -> None:
        """Trainer: its committed step (two int assignments: safe from another thread)."""
        self.step = int(step)
        self.gossip.set_step(self.step)

    def leave(self, now: float) -> None:
        self.gossip.leave(now)
        if self.leader_addr and self.leader != self.id:
            self._send(self.leader_addr, Updates(updates=[Update(LEFT, self.id, self.gossip.inc)]))
        self._pump(now)

    # ------------------------------------------------------------------ voters
    def voter_of(self, node: str) -> str:
        """The voter id of member `node` (its node id unless it restored a durable identity)."""
        if node == self.id:
            return self.voter_id
        m = self.gossip.members.get(node)
        if m is not None and m.meta.voter:
            return m.meta.voter
        vm = self.view.member(node) if self.view is not None else None
        return vm.voter_id if vm is not None else node

    def _voter_member(self, voter: str) -> str | None:
        """The live member holding voter id `voter`, if gossip knows one."""
        if voter == self.voter_id:
            return self.id
        g = self.gossip.members
        alias = self._aliases.get(voter)
        if alias is not None and alias in g and g[alias].state in (ALIVE, SUSPECT):
            return alias
        m = g.get(voter)
        if m is not None and m.state in (ALIVE, SUSPECT) and not m.meta.voter:
            return voter
        return None

    def member_of_voter(self, voter: str) -> str:
        """The member that holds voter id `voter` (for logs and reports: falls back to the id)."""
        live = self._voter_member(voter)
        if live is not None:
            return live
        vm = self.view.member_of_voter(voter) if self.view is not None else None
        return vm.node if vm is not None else voter

    def _voter_addr(self, voter: str) -> str | None:
        """Where Raft messages for `voter` go: its live member's address, else the last one a view
        or gossip knew (a durable voter restarted on the same address is reached there)."""
        live = self._voter_member(voter)
        if live is not None:
            return self.gossip.addr_of(live)
        for view in (self.view, self.raft.last_view()):
            m = view.member_of_voter(voter) if view is not None else None
            if m is not None:
                return m.addr
        return self.gossip.addr_of(voter)

    def missing_voters(self) -> list[str]:
        """The voters (of the newest entry this node holds) that no member gossip holds alive
        now (a suspect counts as missing: its probes failed, direct and indirect)."""
        g = self.gossip.members
        out = []
        for v in self.raft.voters():
            m = self._voter_member(v)
            if m is None or (m != self.id and g[m].state != ALIVE):
                out.append(v)
        return out

    def _check_quorum(self, now: float) -> None:
        """A majority of the voters unreachable for ``quorum_loss_grace``: one ERROR naming them
        (not one per tick), kept in ``quorum_lost`` for ``p2pft members``/``top``; one line again
        when a majority is back. Nothing can be committed meanwhile (no view, no job state). When
        they all left gracefully, or the job has finished, it is a WARNING: nothing failed."""
        voters = self.raft.voters()
        missing = self.missing_voters() if voters else []
        lost = bool(voters) and len(voters) - len(missing) <= len(voters) // 2
        if not lost:
            self._quorum_lost_since = None
            if self.quorum_lost:
                log.warning("a majority of the voters is reachable again (was missing: %s)",
                            self._describe_voters(self.quorum_lost), extra={"node": self.id})
                self.quorum_lost = ()
            return
        if self._quorum_lost_since is None:
            self._quorum_lost_since = now
        if not self.quorum_lost and now - self._quorum_lost_since >= self.p.quorum_loss_grace:
            self.quorum_lost = tuple(missing)
            self.stats["quorum_lost"] += 1
            finished = self.view is not None and self.view.finished is not None
            if finished or all(self._voter_left(v) for v in missing):
                # A job's end, or a stop by SIGTERM: the voters went on purpose, not a failure.
                log.warning("%d of the %d voters have left (%s)%s: no view can be committed until enough of them "
                            "come back", len(missing), len(voters), self._describe_voters(missing),
                            " after the job finished" if finished else "", extra={"node": self.id})
                return
            log.error("%d of the %d voters are unreachable (%s) for %.1f s: a majority is lost, so no view can "
                      "be committed and the job cannot go on until enough of them come back. A replica restarted "
                      "with the same --data-dir returns as the same voter; a voter whose data directory is lost "
                      "never does", len(missing), len(voters), self._describe_voters(missing),
                      now - self._quorum_lost_since, extra={"node": self.id})
        elif self.quorum_lost and tuple(missing) != self.quorum_lost:
            self.quorum_lost = tuple(missing)   # still lost, others missing: reported, not logged again

    def _voter_left(self, voter: str) -> bool:
        """The member holding `voter` left gracefully (SIGTERM, the job's end)."""
        g = self.gossip.members
        m = g.get(self._aliases.get(voter, voter))
        return m is not None and m.state == LEFT

    def _describe_voters(self, voters: list[str] | tuple[str, ...]) -> str:
        out = []
        for v in voters:
            m = self.view.member_of_voter(v) if self.view is not None else None
            out.append(f"{m.replica_id} ({v})" if m is not None else v)
        return ", ".join(out)

    # ------------------------------------------------------------------ queries
    def is_leader(self) -> bool:
        return self.raft.role == LEADER

    def member_state(self, node: str) -> str:
        m = self.gossip.members.get(node)
        return m.state if m else DEAD

    def member_statuses(self) -> dict[str, MemberStatus]:
        """A copy of every member's step and metadata (this node's own step included), for the
        driver to publish to other threads (the live table is the loop's alone)."""
        return {m.node: MemberStatus(self.step if m.node == self.id else m.step, m.meta)
                for m in self.gossip.members.values()}

    def member_step(self, node: str) -> int:
        if node == self.id:
            return self.step
        m = self.gossip.members.get(node)
        return m.step if m else 0

    def my_role(self) -> Role | None:
        return self._role

    @property
    def high_water(self) -> int:
        """Highest committed step this node (as leader) has seen in the cluster."""
        return self.planner.high_water

    def _in_view(self) -> bool:
        return self._role is not None

    # ------------------------------------------------------------------ views
    def _bootstrap(self, now: float) -> None:
        self._bootstrapped = True
        role = WITNESS if self.kind is Kind.WITNESS else PARTICIPANT
        member = member_entry(self.id, self.addr, self.gossip.meta, role, 0 if role is PARTICIPANT else None, 1)
        self.raft.bootstrap(View(epoch=1, members=(member,), voters=(self.voter_id,), data_epoch=1), now)
        log.info("bootstrapped a new cluster as %s", self.id, extra={"node": self.id})

    def _maybe_bootstrap(self, now: float) -> None:
        """Start a cluster only with positive evidence that none exists.

        A node that merely hears nobody (its seeds are dead, or it is partitioned away) must not
        bootstrap: that would be a second cluster with its own epoch 1. So the one bootstrapper
        is the lowest address among itself, its seeds and every member it knows of, and only
        once every seed has answered it directly and none of them, nor anyone else it has heard
        from, holds a view. (A majority of the seeds is not enough: the seeds that answer may be
        restarted processes with no memory while the cluster lives on in the others.)

        Liveness fallback: after BOOTSTRAP_GIVE_UP bootstrap waits, a seed that never answered is
        taken to be gone, and a majority of the seed list that answered without a view suffices,
        the lowest of those bootstrapping. This trades safety for progress: a cluster that lives
        only in seeds unreachable for that long (a long partition) can then be duplicated.
        """
        live = self.gossip.live_members()
        if any(m.epoch > 0 for m in live if m.node != self.id):
            return  # a cluster exists: wait to be added
        names = set(self.seeds) | {self.addr}
        answered = {m.addr for m in live if m.heard and m.addr in names} | {self.addr}
        if now - self.started < BOOTSTRAP_GIVE_UP * self.p.bootstrap_wait:
            if answered != names or min(names | {m.addr for m in live}) != self.addr:
                return
        else:
            if len(answered) * 2 <= len(names):
                return
            if min(answered | {m.addr for m in live if m.heard}) != self.addr:
                return
        self._bootstrap(now)

    def _set_leader(self, leader: str | None, leader_addr: str | None) -> None:
        if leader:
            self.leader, self.leader_addr = leader, leader_addr or ""

    def _on_view_msg(self, msg: ViewFull, now: float) -> None:
        self._set_leader(msg.leader, msg.leader_addr)
        self.raft.learn(msg.view, msg.term)

    def _on_view_delta(self, msg: ViewDelta, now: float) -> None:
        """A committed view as a change to the one before it; without that base, ask for it whole."""
        cur = self.view
        if msg.epoch <= (cur.epoch if cur else 0):
            return
        self._set_leader(msg.leader, msg.leader_addr)
        if cur is None or cur.epoch != msg.base:
            self.stats["view_delta_miss"] += 1
            self._send(msg.frm, ViewRequest(epoch=cur.epoch if cur else 0))
            return
        changed = {m.node: m for m in msg.changed}
        remove = {n for n in msg.removed if cur.member(n) is not None}
        remove.update(n for n in changed if cur.member(n) is not None)
        # Only a removal or a changed entry needs a pass over the members; additions (the common
        # case while a cluster forms) are a list copy plus a binary insertion each.
        members = [m for m in cur.members if m.node not in remove] if remove else list(cur.members)
        for m in changed.values():
            bisect.insort(members, m, key=_node_key)
        view = View(epoch=msg.epoch, members=tuple(members), voters=msg.voters, data_epoch=msg.data_epoch,
                    high_water=msg.high_water, left=msg.left, target=msg.target, finished=msg.finished)
        self.raft.learn(view, msg.term)

    def _send_view(self, addr: str) -> None:
        assert self.view is not None
        self._send(addr, ViewFull(view=self.view, term=self.view_term, leader=self.leader,
                                  leader_addr=self.leader_addr))

    def _delta_msg(self, prev: View) -> ViewDelta:
        """The current view as a change to ``prev``: O(change) bytes per member instead of O(members)."""
        view = self.view
        assert view is not None
        changed = [m for m in view.members if prev.member(m.node) != m]
        removed = [m.node for m in prev.members if view.member(m.node) is None]
        return ViewDelta(base=prev.epoch, epoch=view.epoch, term=self.view_term, voters=view.voters,
                         data_epoch=view.data_epoch, high_water=view.high_water, left=view.left,
                         target=view.target, finished=view.finished, changed=changed,
                         removed=removed, leader=self.leader, leader_addr=self.leader_addr)

    def _hello(self, now: float) -> None:
        """Tell the leader about ourselves directly: joining should not wait for gossip."""
        self._next_hello = now + self.p.view_retry
        if self.leader_addr and self.leader != self.id:
            self._send(self.leader_addr, Updates(updates=[self.gossip.alive_update()]))

    def _send(self, addr: str, msg: Envelope) -> None:
        msg.frm = self.addr
        msg.src = self.id
        self._ready.messages.append((addr, msg))  # type: ignore[arg-type]

    def _send_raft(self, addr: str, voter: str, msg: RaftMsg) -> None:
        """Raft speaks voter ids: addressed to the voter, signed with ours."""
        msg.frm = self.addr
        msg.src = self.voter_id
        msg.to = voter
        self._ready.messages.append((addr, msg))

    def _addr_of(self, node: str) -> str | None:
        a = self.gossip.addr_of(node)
        if a:
            return a
        for view in (self.view, self.raft.last_view()):
            m = view.member(node) if view is not None else None
            if m is not None:
                return m.addr
        return None

    def _pump(self, now: float) -> None:
        """Move core outputs into our Ready value and react to what the cores decided."""
        g, raft, out = self.gossip, self.raft, self._ready
        out.messages.extend(g.outbox)
        g.outbox.clear()
        for ev in g.events:   # voter ids held by members (a durable voter's later incarnations)
            m = g.members.get(ev.node)
            if m is not None and m.meta.voter:
                old = self._aliases.get(m.meta.voter)
                om = g.members.get(old) if old is not None else None
                if om is None or om.state not in (ALIVE, SUSPECT) or (m.meta.start, m.node) >= (om.meta.start, om.node):
                    self._aliases[m.meta.voter] = m.node
        for voter, msg in raft.outbox:
            addr = self._voter_addr(voter)
            if addr:
                self._send_raft(addr, voter, msg)
        raft.outbox.clear()
        for term in raft.events:
            self._dirty = True
            out.leader_terms.append(term)
            log.info("became Raft leader for term %d", term, extra={"node": self.id})
        raft.events.clear()
        if raft.leader:
            self.leader = self.member_of_voter(raft.leader)
            self.leader_addr = self._voter_addr(raft.leader)
        for ev in g.events:
            if ev.kind is GossipEventKind.NEWER_VIEW:
                self._ask_view(ev.node, now)
            else:
                self._dirty = True
                if ev.kind is not GossipEventKind.UPDATE:  # suspect / dead / alive / left: when detection happened
                    log.debug("gossip: %s %s", ev.node, ev.kind, extra={"node": self.id})
                if ev.lost:
                    raft.leader_failed(self.voter_of(ev.node), now)
        g.events.clear()
        declared = g.take_declared()
        if declared and self.leader_addr and self.leader != self.id and not self.is_leader():
            # We found a member dead: tell the leader now rather than after gossip reaches it.
            self._send(self.leader_addr, Updates(updates=declared))
        prev = self.view
        for term, view in raft.committed:
            if self.view is not None and view.epoch <= self.view.epoch:
                continue
            self.view, self.view_term = view, term
            self.view_time = now
            self._role = view.role_of(self.id)
            self._dirty = True
            g.set_epoch(view.epoch)
            out.views.append(view)
        raft.committed.clear()
        if self.durable:
            key = raft.hard_key()
            if key != self._hard_key:
                self._hard_key = key
                out.hard_state = raft.hard_state(self.replica_id)
        if self.view is not prev and self.is_leader():
            self._push_view(prev)
        if self.is_leader() and not raft.pending():
            # Re-derive the desired view when something changed, while a batch or voter change
            # is in progress, and once per heartbeat (steps and our own status change silently).
            if (self._dirty or self._pending_since is not None or self.planner.voter_change is not None
                    or now >= self._next_reconcile):
                self._reconcile(now)
        elif not self.is_leader():
            self._pending_since = None
            self.planner.stop_leading()

    def _ask_view(self, node: str, now: float) -> None:
        last = self._view_asked.get(node, -1e9)
        if now - last < self.p.view_retry:
            return
        self._view_asked[node] = now
        if len(self._view_asked) > 256:
            self._view_asked = {k: v for k, v in self._view_asked.items() if now - v < self.p.view_retry}
        addr = self._addr_of(node)
        if addr:
            self._send(addr, ViewRequest(epoch=self.view.epoch if self.view else 0))

    def _push_view(self, prev: View | None) -> None:
        """Leader: hand the committed view to everyone Raft does not reach (and the removed)."""
        view = self.view
        assert view is not None
        voters = set(view.voters)
        targets = {m.node: m.addr for m in view.members if m.voter_id not in voters}
        for m in (prev.members if prev is not None else ()):
            if m.voter_id not in voters and m.node not in targets:
                targets[m.node] = m.addr
        # Members are sorted by node id in every view the leader makes, so a delta reproduces it
        # exactly at a member holding the same base view; the others ask for the whole view.
        # One message value serves every target (messages are not changed once sent).
        delta = self._delta_msg(prev) if prev is not None else None
        full = None
        for node, addr in targets.items():
            if node != self.id:
                if delta is not None:
                    self._send(addr, delta)
                else:
                    if full is None:
                        full = ViewFull(view=view, term=self.view_term, leader=self.leader,
                                        leader_addr=self.leader_addr)
                    self._send(addr, full)

    # ------------------------------------------------------------------ leader: proposing views
    def _reconcile(self, now: float) -> None:
        """Leader: propose the view gossip implies, at most once per batch window.

        The first change opens a window; changes arriving within it land in the same view. The
        desired view is derived only when the window closes (O(members), so not per message).
        """
        if self._pending_since is None:
            self._pending_since = now
        if now - self._pending_since < self.p.batch_window:
            return
        self._pending_since = None
        self._dirty = False
        self._next_reconcile = now + self.p.heartbeat
        cur = self.raft.last_view()
        if cur is None:
            return
        desired = self.planner.desired(cur, now, self.step)
        if canonical(desired) == canonical(cur) and not self._high_water_due(cur, desired, now):
            return
        epoch = self.raft.propose(desired, now)
        if epoch is not None:
            self._high_water_at = now
            self.stats["views_proposed"] += 1
            # the proposal may have committed at once (single voter): process it
            self._pump(now)

    def _high_water_due(self, cur: View, desired: View, now: float) -> bool:
        """The job got further than the committed view says: a view that only carries the new
        high water, at the job's first committed step and then every HIGH_WATER_REFRESH_S, so a
        cluster that loses every trainer (and restarts from the voters' disks) still knows the
        job's progress and refuses to train it again from step 0."""
        if desired.high_water <= cur.high_water:
            return False
        return cur.high_water == 0 or now - self._high_water_at >= HIGH_WATER_REFRESH_S

    def _first_view(self, base: View) -> View:
        """A new leader's first entry: the members gossip shows now (Raft keeps the voters)."""
        return self.planner.desired(base, self._now, self.step, keep_voters=True)


__all__ = ["Node", "PARTICIPANT", "JOINER", "WITNESS", "TRAINER_KIND", "WITNESS_KIND", "ALIVE", "SUSPECT",
           "DEAD", "LEFT"]
