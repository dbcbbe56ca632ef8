"""One replica leader's control plane as a sans-IO state machine: gossip + Raft + views.

``Node`` routes messages to the gossip and Raft cores, turns gossip's membership into proposed
views when it leads, hands committed views to non-voters, and bootstraps a cluster when there
is none. Inputs: ``handle(msg, now)``, ``tick(now)`` and the evidence calls; outputs:
``outbox`` (``(addr, msg)``) and ``events`` (``("view", view)``, ``("leader", term)``).

Member metadata carried by gossip (short keys keep the frames small):
``r`` replica id, ``d`` data address, ``k`` kind (``trainer`` or ``witness``), ``sh`` shard
count, ``s`` status (``joining`` = needs catch-up, ``ready`` = holds current state,
``leaving``), ``t0`` process start stamp, ``st`` committed step when the status was set.
"""
from __future__ import annotations

import bisect
import logging
import random
from collections import Counter
from typing import Any

from .config import DEFAULT, Profile
from .gossip import ALIVE, DEAD, LEFT, SUSPECT, Gossip
from .raft import LEADER, Raft

log = logging.getLogger(__name__)

PARTICIPANT, JOINER, WITNESS = "participant", "joiner", "witness"
BOOTSTRAP_GIVE_UP = 10     # bootstrap waits for the lowest seed at most this many bootstrap_waits
RESUME_GRACE_S = 5.0       # with no participant left, wait this long for one at the high-water step
PROMOTE_SLACK_STEPS = 8    # a 'ready' joiner this close to the head is current (see _desired)
LEFT_KEEP = 128            # trainers recently left out of a view, carried in the view ("left")
BEAT_EVERY_MAX = 1.0       # a trainer's loop beats reach the leader at least this often
TRAINER_KIND, WITNESS_KIND = "trainer", "witness"


class Node:
    def __init__(self, *, replica_id: str, addr: str, data_addr: str = "", kind: str = WITNESS_KIND,
                 shards: int = 1, seeds: list[str] | tuple[str, ...] = (), profile: Profile = DEFAULT,
                 rng: random.Random, now: float, start_stamp: float | None = None,
                 status: str | None = None, step: int = 0) -> None:
        self.replica_id = str(replica_id)
        self.addr = addr
        self.kind = kind
        self.p = profile
        self.rng = rng
        self.id = f"{self.replica_id}.{rng.getrandbits(32):08x}"
        if status is None:
            status = "ready" if kind == WITNESS_KIND else "joining"
        meta = {"r": self.replica_id, "d": data_addr, "k": kind, "sh": int(shards), "s": status,
                "t0": float(now if start_stamp is None else start_stamp), "st": int(step)}
        self.gossip = Gossip(self.id, addr, meta, profile, rng, now)
        self.gossip.local_step = step
        self.raft = Raft(self.id, profile, rng, now)
        self.raft.first_entry = self._first_view
        self._now = now
        self.view: dict[str, Any] | None = None
        self.view_time: float | None = None
        self._beat = 0
        self._next_beat = now
        self._stalled: set[str] = set()    # leader: trainers left out for a stalled loop (logged once)
        self._lt_seen: dict[str, float] = {}  # leader: when it first saw a trainer's declared loop timeout
        self.leader: str | None = None
        self.leader_addr: str | None = None
        self.outbox: list[tuple[str, dict[str, Any]]] = []
        self.events: list[tuple[str, Any]] = []
        self.stats: Counter[str] = Counter()
        self.started = now
        self.seeds = [s for s in seeds if s != addr]
        self.step = step
        self._pending_since: float | None = None
        self._next_hello = now
        self._view_asked: dict[str, float] = {}
        self._bootstrapped = False
        self.high_water = step
        self._headless_since: float | None = None
        self._next_bootstrap = now + profile.bootstrap_wait   # when to consider bootstrapping next
        self._voter_change: tuple[tuple[str, ...], float] | None = None  # (voter set, decided at)
        self._role: str | None = None          # our role in self.view (cached: asked on every tick)
        # (epoch, our role, member ids) worked out from a delta, so committing it is O(change)
        self._role_hint: tuple[int, str | None, set[str]] | None = None
        self._view_ids: set[str] = set()       # node ids in self.view
        self._dirty = True                     # leader: membership changed since the last reconcile
        self._next_reconcile = now
        if not self.seeds:
            self._bootstrap(now)
        else:
            self.gossip.join(self.seeds, now)
        self._pump(now)

    # ------------------------------------------------------------------ inputs
    def handle(self, msg: dict[str, Any], now: float) -> None:
        """One decoded message. Malformed content raises KeyError/TypeError/ValueError: the
        driver counts it and drops the message (never the node)."""
        self._now = now
        t = msg["t"]
        if t.startswith("g."):
            self.gossip.handle(msg, now)
        elif t.startswith("r."):
            if msg.get("to") != self.id:
                self.stats["misaddressed"] += 1
                return
            self.raft.handle(str(msg["src"]), msg, now)
        elif t == "v.get":
            if self.view is not None and self.view["epoch"] > int(msg.get("e", 0)):
                self._send_view(str(msg["from"]))
        elif t == "v.view":
            self._on_view_msg(msg, now)
        elif t == "v.delta":
            self._on_view_delta(msg, now)
        else:
            self.stats["unknown_type"] += 1
        self._pump(now)

    def tick(self, now: float) -> None:
        self._now = now
        self._check_own_loop(now)
        self.gossip.tick(now)
        self.raft.tick(now)
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

    def set_status(self, status: str, now: float, step: int | None = None) -> None:
        """Trainer: 'joining' (needs catch-up) or 'ready' (holds current state)."""
        fields: dict[str, Any] = {"s": status}
        if step is not None:
            fields["st"] = int(step)
            self.set_step(step)
        self.gossip.set_meta(now, **fields)
        self._hello(now)
        self._pump(now)

    def _check_own_loop(self, now: float) -> None:
        """A leader cannot leave itself out of the view: when its own training loop has stalled
        past the timeout it declared, it steps down and stops campaigning, so that another
        leader leaves it out (see _loop_stalled)."""
        me = self.gossip.members[self.id]
        lt = me.meta.get("lt")
        stalled = bool(lt) and me.beat_at is not None and now - me.beat_at > float(lt)
        self.raft.abstain = stalled and len(self.raft.voters()) > 1
        if self.raft.abstain and self.is_leader():
            log.warning("own training loop has not run for %.1f s: stepping down as Raft leader",
                        now - (me.beat_at or now), extra={"node": self.id})
            self.raft.step_down(now)

    def loop_beat(self, now: float, timeout: float) -> None:
        """Trainer: its training loop ran. The process may gossip perfectly while its loop is
        wedged (a hung data loader, a deadlock), and every allreduce of the data plane then
        waits for it; so the loop's own progress is reported to the leader, which leaves a
        trainer out of the view when its beats stop for longer than the `timeout` it declared
        (meta ``lt``; a trainer that declares none is never left out for this)."""
        self._beat += 1
        if self.gossip.members[self.id].meta.get("lt") != timeout:
            self.gossip.set_meta(now, lt=float(timeout))
        if now < self._next_beat:
            return
        self._next_beat = now + min(BEAT_EVERY_MAX, timeout / 4)
        me = self.gossip.members[self.id]
        me.beat, me.beat_at = self._beat, now
        if self.leader_addr and self.leader != self.id:
            # The step rides along: the leader's high-water mark (which says whether a resume
            # from disk loses progress) is then at most one beat period old.
            self.outbox.append((self.leader_addr, self._stamp({"t": "g.upd", "pb": [], "lb": self._beat,
                                                                "st": self.step})))
        self._pump(now)

    def set_step(self, step: int) -> None:
        self.step = int(step)
        self.gossip.local_step = self.step

    def leave(self, now: float) -> None:
        self.gossip.leave(now)
        if self.leader_addr and self.leader != self.id:
            self.outbox.append((self.leader_addr, self._stamp({"t": "g.upd", "pb": [
                {"k": LEFT, "n": self.id, "i": self.gossip.inc}]})))
        self._pump(now)

    # ------------------------------------------------------------------ queries
    def is_leader(self) -> bool:
        return self.raft.role == LEADER

    def member_state(self, node: str) -> str:
        m = self.gossip.members.get(node)
        return m.state if m else DEAD

    def member_step(self, node: str) -> int:
        if node == self.id:
            return self.step
        m = self.gossip.members.get(node)
        return m.step if m else 0

    def my_role(self) -> str | None:
        return self._role

    def _in_view(self) -> bool:
        return self.my_role() is not None

    # ------------------------------------------------------------------ views
    def _bootstrap(self, now: float) -> None:
        self._bootstrapped = True
        meta = self.gossip.meta
        role = WITNESS if self.kind == WITNESS_KIND else PARTICIPANT
        member = self._member_entry(self.id, self.addr, meta, role, 0 if role == PARTICIPANT else None, 1)
        self.raft.bootstrap({"members": [member], "voters": [self.id], "data_epoch": 1}, now)
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

    def _member_entry(self, node: str, addr: str, meta: dict[str, Any], role: str, slot: int | None,
                      since: int) -> dict[str, Any]:
        return {"node": node, "replica_id": str(meta.get("r", node)), "addr": addr,
                "data_addr": str(meta.get("d", "")), "role": role, "slot": slot,
                "shards": int(meta.get("sh", 1)), "since": since}

    def _on_view_msg(self, msg: dict[str, Any], now: float) -> None:
        view = msg["view"]
        if not isinstance(view, dict) or not isinstance(view.get("members"), list):
            raise ValueError("v.view without a view")
        if msg.get("leader"):
            self.leader, self.leader_addr = str(msg["leader"]), str(msg.get("laddr") or "")
        self.raft.learn(view)

    def _on_view_delta(self, msg: dict[str, Any], now: float) -> None:
        """A committed view as a change to the one before it; without that base, ask for it whole."""
        hdr, base = msg["hdr"], int(msg["base"])
        if not isinstance(hdr, dict) or int(hdr["epoch"]) <= (self.view["epoch"] if self.view else 0):
            return
        if msg.get("leader"):
            self.leader, self.leader_addr = str(msg["leader"]), str(msg.get("laddr") or "")
        if self.view is None or self.view["epoch"] != base:
            self.stats["view_delta_miss"] += 1
            e = self.view["epoch"] if self.view else 0
            self.outbox.append((str(msg["from"]), self._stamp({"t": "v.get", "e": e})))
            return
        changed = {m["node"]: m for m in msg["set"]}
        present = self._view_ids
        remove = {n for n in msg["del"] if n in present} | {n for n in changed if n in present}
        # Only a removal or a changed entry needs a pass over the members; additions (the common
        # case while a cluster forms) are a list copy plus a binary insertion each.
        members = [m for m in self.view["members"] if m["node"] not in remove] if remove else list(self.view["members"])
        for m in changed.values():
            bisect.insort(members, m, key=_node_key)
        ids = set(present)
        ids.difference_update(msg["del"])
        ids.update(changed)
        epoch = int(hdr["epoch"])
        role = changed[self.id]["role"] if self.id in changed else (None if self.id not in ids else self._role)
        self._role_hint = (epoch, role, ids)
        self.raft.learn(dict(hdr, members=members))

    def _send_view(self, addr: str) -> None:
        self.outbox.append((addr, self._stamp({"t": "v.view", "view": self.view, "leader": self.leader,
                                               "laddr": self.leader_addr})))

    def _delta_msg(self, prev: dict[str, Any]) -> dict[str, Any]:
        """The current view as a change to ``prev``: O(change) bytes per member instead of O(members)."""
        assert self.view is not None
        old = {m["node"]: m for m in prev["members"]}
        new_members = self.view["members"]
        changed = [m for m in new_members if old.get(m["node"]) != m]
        keep = {m["node"] for m in new_members}
        return {"t": "v.delta", "base": prev["epoch"], "hdr": {k: v for k, v in self.view.items() if k != "members"},
                "set": changed, "del": [n for n in old if n not in keep], "leader": self.leader,
                "laddr": self.leader_addr}

    def _hello(self, now: float) -> None:
        """Tell the leader about ourselves directly: joining should not wait for gossip."""
        self._next_hello = now + self.p.view_retry
        if self.leader_addr and self.leader != self.id:
            me = self.gossip.members[self.id]
            upd = {"k": ALIVE, "n": self.id, "i": self.gossip.inc, "a": self.addr, "m": me.meta}
            self.outbox.append((self.leader_addr, self._stamp({"t": "g.upd", "pb": [upd]})))

    def _stamp(self, msg: dict[str, Any]) -> dict[str, Any]:
        msg["from"] = self.addr
        msg["src"] = self.id
        return msg

    def _addr_of(self, node: str) -> str | None:
        a = self.gossip.addr_of(node)
        if a:
            return a
        for view in (self.view, self.raft.last_view()):
            for m in (view or {}).get("members", ()):
                if m["node"] == node:
                    return m["addr"]
        return None

    def _pump(self, now: float) -> None:
        """Move core outputs to our outbox/events and react to what the cores decided."""
        g = self.gossip
        self.outbox.extend(g.outbox)
        g.outbox.clear()
        for node, msg in self.raft.outbox:
            addr = self._addr_of(node)
            if addr:
                msg["to"] = node
                self.outbox.append((addr, self._stamp(msg)))
        self.raft.outbox.clear()
        for kind, term in self.raft.events:
            self._dirty = True
            self.events.append(("leader", term))
            log.info("became Raft leader for term %d", term, extra={"node": self.id})
        self.raft.events.clear()
        if self.raft.leader:
            self.leader = self.raft.leader
            self.leader_addr = self._addr_of(self.leader)
        for kind, node in g.events:
            if kind == "epoch":
                self._ask_view(node, now)
            else:
                self._dirty = True
                if kind in (DEAD, LEFT):
                    self.raft.leader_failed(node, now)
        g.events.clear()
        if g.declared:
            # We found a member dead: tell the leader now rather than after gossip reaches it.
            if self.leader_addr and self.leader != self.id and not self.is_leader():
                self.outbox.append((self.leader_addr, self._stamp({"t": "g.upd", "pb": list(g.declared)})))
            g.declared.clear()
        prev = self.view
        for view in self.raft.committed:
            if self.view is not None and view["epoch"] <= self.view["epoch"]:
                continue
            self.view = view
            self.view_time = now
            hint = self._role_hint
            if hint is not None and hint[0] == view["epoch"]:
                self._role, self._view_ids = hint[1], hint[2]
            else:
                self._view_ids = {m["node"] for m in view["members"]}
                self._role = next((m["role"] for m in view["members"] if m["node"] == self.id), None)
            self._dirty = True
            g.local_epoch = view["epoch"]
            self.events.append(("view", view))
        self.raft.committed.clear()
        if self.view is not prev and self.is_leader():
            self._push_view(prev)
        if self.is_leader() and not self.raft.pending():
            # Re-derive the desired view when something changed, while a batch or voter change
            # is in progress, and once per heartbeat (steps and our own status change silently).
            if (self._dirty or self._pending_since is not None or self._voter_change is not None
                    or now >= self._next_reconcile):
                self._reconcile(now)
        elif not self.is_leader():
            self._pending_since = None
            self._voter_change = None
            self.raft.learners.clear()

    def _ask_view(self, node: str, now: float) -> None:
        last = self._view_asked.get(node, -1e9)
        if now - last < self.p.view_retry:
            return
        self._view_asked[node] = now
        if len(self._view_asked) > 256:
            self._view_asked = {k: v for k, v in self._view_asked.items() if now - v < self.p.view_retry}
        addr = self._addr_of(node)
        if addr:
            e = self.view["epoch"] if self.view else 0
            self.outbox.append((addr, self._stamp({"t": "v.get", "e": e})))

    def _push_view(self, prev: dict[str, Any] | None) -> None:
        """Leader: hand the committed view to everyone Raft does not reach (and the removed)."""
        assert self.view is not None
        voters = set(self.view.get("voters", ()))
        targets = {m["node"]: m["addr"] for m in self.view["members"] if m["node"] not in voters}
        for m in (prev or {}).get("members", ()):
            if m["node"] not in voters and m["node"] not in targets:
                targets[m["node"]] = m["addr"]
        # Members are sorted by node id in every view the leader makes, so a delta reproduces it
        # exactly at a member holding the same base view; the others ask for the whole view.
        delta = self._delta_msg(prev) if prev is not None else None
        for node, addr in targets.items():
            if node != self.id:
                if delta is not None:
                    self.outbox.append((addr, self._stamp(dict(delta))))
                else:
                    self._send_view(addr)

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
        desired = self._desired(cur, now)
        if _canonical(desired) == _canonical(cur):
            return
        epoch = self.raft.propose(desired, now)
        if epoch is not None:
            self.stats["views_proposed"] += 1
            # the proposal may have committed at once (single voter): process it
            self._pump(now)

    def _first_view(self, base: dict[str, Any]) -> dict[str, Any]:
        """A new leader's first entry: the members gossip shows now (Raft keeps the voters)."""
        return self._desired(base, self._now, keep_voters=True)

    def _desired(self, cur: dict[str, Any], now: float, keep_voters: bool = False) -> dict[str, Any]:
        g = self.gossip
        cur_members = {m["node"]: m for m in cur["members"]}
        newest: dict[str, Any] = {}
        for m in g.live_members():
            if m.meta.get("s") == "leaving":
                continue
            r = str(m.meta.get("r", m.node))
            key = (float(m.meta.get("t0", 0.0)), m.node)
            if r not in newest or key > newest[r][0]:
                newest[r] = (key, m)
        part_steps = [self.member_step(n) for n, cm in cur_members.items() if cm["role"] == PARTICIPANT
                      and n in g.members and g.members[n].state in (ALIVE, SUSPECT)]
        head = max(part_steps) if part_steps else None
        # High water: the furthest committed step this cluster is known to have reached. Dead
        # members' last steps stay in gossip tombstones for a while, and the view carries it.
        observed = [m.step for m in g.members.values() if m.meta.get("k") == TRAINER_KIND]
        self.high_water = max([self.high_water, int(cur.get("hw", 0)), head or 0, self.step] + observed)
        resume_at = None
        if head is None:
            # Every participant is gone. Resume only from a replica at the high-water step, or,
            # after a grace period for one to come back, from the best state anyone has (a disk
            # checkpoint), loudly: never silently from an older step.
            ready = [int(m.meta.get("st", -1)) for _, m in newest.values()
                     if m.meta.get("k") == TRAINER_KIND and m.meta.get("s") == "ready"]
            if self._headless_since is None:
                self._headless_since = now
            best = max(ready, default=None)
            if best is not None and (best >= self.high_water or now - self._headless_since >= RESUME_GRACE_S):
                resume_at = best
                if best < self.high_water:
                    self.stats["resumed_below_high_water"] += 1
                    log.warning("no replica holds step %d any more: resuming from step %d", self.high_water, best,
                                extra={"node": self.id})
        else:
            self._headless_since = None
        epoch = self.raft.last_index + 1
        left_list = [str(n) for n in cur.get("left", ())]
        left = set(left_list)
        chosen: list[tuple[Any, str]] = []
        for _, m in newest.values():
            if self._loop_stalled(m.node, m.meta, now):
                continue
            prev = cur_members.get(m.node)
            status = m.meta.get("s")
            if m.meta.get("k") == WITNESS_KIND:
                role = WITNESS
            elif prev and prev["role"] == PARTICIPANT:
                role = JOINER if status == "joining" else PARTICIPANT
            elif prev and prev["role"] == JOINER:
                # A joiner that caught up says 'ready' at its step; the head moved on meanwhile,
                # but a joiner applies every mean gradient, so it is still current. A fresh
                # process that merely started 'ready' at an old step stays a joiner.
                st = int(m.meta.get("st", -1))
                current = st >= head - PROMOTE_SLACK_STEPS if head is not None else st == resume_at
                role = PARTICIPANT if status == "ready" and current else JOINER
            elif (status == "ready" and int(m.meta.get("st", -1)) == (head if head is not None else resume_at)
                  and (head is None or m.node not in left)):
                # A fresh replica at the cluster's step: nothing to catch up. Not one that was
                # left out of an earlier view: it may hold a step the others redid without it
                # (its allreduce finished, theirs failed), so it comes back through catch-up.
                role = PARTICIPANT
            else:
                role = JOINER
            chosen.append((m, role))
        used = {cur_members[m.node]["slot"] for m, role in chosen
                if role == PARTICIPANT and m.node in cur_members and cur_members[m.node]["slot"] is not None}
        members = []
        for m, role in sorted(chosen, key=lambda x: x[0].node):
            prev = cur_members.get(m.node)
            slot = prev["slot"] if prev and role == PARTICIPANT and prev["slot"] is not None else None
            if role == PARTICIPANT and slot is None:
                slot = next(i for i in range(1 << 16) if i not in used)
                used.add(slot)
            since = prev["since"] if prev else epoch
            members.append(self._member_entry(m.node, m.addr, m.meta, role, slot, since))
        voters = list(cur.get("voters", ())) if keep_voters else self._next_voters(cur, members, now)
        data = sorted(m["node"] for m in members if m["role"] != WITNESS)
        old = sorted(m["node"] for m in cur["members"] if m["role"] != WITNESS)
        data_epoch = cur.get("data_epoch", cur.get("epoch", 0)) if data == old else epoch
        # A trainer whose communicator failed with nobody to exclude (a peer paused for less
        # than the failure timeout) asks for a fresh data epoch by naming the one that failed.
        if any(int(m.meta.get("rb", 0)) >= data_epoch for _, m in newest.values() if m.node in data):
            data_epoch = epoch
        now_in = {m["node"] for m in members}
        dropped = sorted(m["node"] for m in cur["members"] if m["role"] != WITNESS and m["node"] not in now_in
                         and m["node"] not in left)
        left_list = (left_list + dropped)[-LEFT_KEEP:]
        return {"members": members, "voters": voters, "data_epoch": data_epoch, "hw": self.high_water,
                "left": left_list}

    def _loop_stalled(self, node: str, meta: dict[str, Any], now: float) -> bool:
        """Leader: a trainer whose training loop has not beaten for longer than it declared."""
        lt = meta.get("lt")
        gm = self.gossip.members.get(node)
        if not lt or node == self.id or gm is None:
            return False
        # No beat from it yet (a new leader, or a loop that wedged before its first beat got
        # here): count from when this leader first saw the declaration.
        since = gm.beat_at if gm.beat_at is not None else self._lt_seen.setdefault(node, now)
        stalled = now - since > float(lt)
        if stalled and node not in self._stalled:
            self._stalled.add(node)
            self.stats["loop_stalled"] += 1
            log.warning("the training loop of %s has not run for %.1f s (it declared %.1f s): leaving it out of "
                        "the view", node, now - since, float(lt), extra={"node": self.id})
        elif not stalled:
            self._stalled.discard(node)
        if len(self._stalled) > 4096 or len(self._lt_seen) > 4096:  # nodes long gone: forget them
            self._stalled.clear()
            self._lt_seen.clear()
        return stalled

    def _next_voters(self, cur: dict[str, Any], members: list[dict[str, Any]], now: float) -> list[str]:
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
        voters = list(cur.get("voters", ()))
        want = self._voter_target(voters, members, now)
        if want is None:
            self._voter_change = None
            self.raft.learners.clear()
            return voters
        key = tuple(want)
        if self._voter_change is None or self._voter_change[0] != key:
            self._voter_change = (key, now)
            self.raft.learners = set(want) - set(voters)
            return voters
        since = max(self._voter_change[1], now - 3 * self.p.heartbeat)
        if sum(1 for v in want if self.raft.acked_after(v, since)) * 2 > len(want):
            return want
        return voters

    def _voter_target(self, voters: list[str], members: list[dict[str, Any]], now: float) -> list[str] | None:
        """The next voter set we would like (one server away from ``voters``), or None."""
        g = self.gossip
        in_view = {m["node"] for m in members}
        window = 3 * self.p.heartbeat

        def fresh_majority(new: list[str]) -> bool:
            up = sum(1 for v in new if self.raft.acked_within(v, now, window)
                     or (v not in voters and v in g.members and g.members[v].state == ALIVE))
            return up * 2 > len(new)

        gone = [v for v in voters if v not in in_view]
        if gone:
            for v in gone:
                new = [x for x in voters if x != v]
                if fresh_majority(new):
                    return new
            return None
        eligible = sorted((m for m in members if g.members.get(m["node"]) is not None
                           and g.members[m["node"]].state == ALIVE), key=_voter_preference)
        # An odd number of voters, up to max_voters, sized by the whole view (a member that is
        # only suspected still counts, so a brief suspicion does not shrink and regrow the set).
        target = min(self.p.max_voters, max(1, len(members)))
        if target > 1 and target % 2 == 0:
            target -= 1
        if len(voters) < target:
            for m in eligible:
                if m["node"] not in voters:
                    new = voters + [m["node"]]
                    return new if fresh_majority(new) else None
        if len(voters) > target:
            # Shrink (e.g. 2 voters of 2 members -> 1): an even set tolerates no more failures
            # than the odd one below it, and losing either of 2 voters would stall for good.
            order = {m["node"]: _voter_preference(m) for m in members}
            newest = max((v for v in voters if v != self.id), key=lambda v: order.get(v, (1 << 62, v)),
                         default=None)
            if newest:
                new = [v for v in voters if v != newest]
                return new if fresh_majority(new) else None
        return None


def _voter_preference(m: dict[str, Any]) -> tuple[int, int, str]:
    """Witnesses first (they do not die with a trainer's faults), then the longest-lived."""
    return (0 if m["role"] == WITNESS else 1, int(m["since"]), m["node"])


def _node_key(m: dict[str, Any]) -> str:
    return m["node"]


def _canonical(view: dict[str, Any]) -> tuple[Any, ...]:
    members = tuple(sorted((m["node"], m["role"], m["slot"], m["addr"], m["data_addr"])
                           for m in view["members"]))
    return members, tuple(view.get("voters", ())), view.get("data_epoch")


__all__ = ["Node", "PARTICIPANT", "JOINER", "WITNESS", "TRAINER_KIND", "WITNESS_KIND", "ALIVE", "SUSPECT",
           "DEAD", "LEFT"]
