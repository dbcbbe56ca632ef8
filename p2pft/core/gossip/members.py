"""Gossip's member table: who we know, in which state, and the suspicions we hold.

``MemberTable`` keeps the live members (alive or suspect) indexable, so that sampling k of them
and counting them is O(k) and O(1) at 1,000 members, and the dead/left ones as tombstones until
they expire. Every state change goes through ``set_state`` so the index stays exact.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Iterator

from ..messages import ALIVE, DEAD, LEFT, SUSPECT, MemberState, Row
from ..meta import MemberMeta

_LIVE = (ALIVE, SUSPECT)


@dataclass
class GossipMember:
    node: str
    addr: str
    inc: int
    state: MemberState
    meta: MemberMeta
    since: float                      # time of the last state change
    epoch: int = 0                    # last committed epoch this member told us about
    step: int = 0                     # last committed step this member told us about
    heard: bool = False               # it spoke to us directly (its epoch/step are first-hand)
    beat: int = -1                    # last training-loop beat it sent us directly (trainers)
    beat_at: float | None = None      # our clock when that beat last changed

    def row(self) -> Row:
        return Row(self.node, self.addr, self.inc, self.state, self.meta)


@dataclass
class Suspicion:
    inc: int
    start: float
    min_t: float
    max_t: float
    confirmers: set[str] = field(default_factory=set)   # independent suspecters, not the first one
    origin: str = ""                                      # who suspected first

    def deadline(self, k: int) -> float:
        """From max_t down to min_t as confirmations arrive (log-scaled, Lifeguard/memberlist).
        The first suspicion is not its own confirmation: a lone accuser leaves the full max_t
        for the suspect to refute."""
        c = len(self.confirmers)
        if k <= 0 or c <= 0:
            return self.start + self.max_t
        frac = math.log(c + 1) / math.log(k + 1)
        return self.start + max(self.min_t, self.max_t - (self.max_t - self.min_t) * frac)


class MemberTable:
    """Members by node id, with an index of the live ones and the set of tombstones."""

    def __init__(self, me: GossipMember) -> None:
        self.me = me.node
        self.by_id: dict[str, GossipMember] = {me.node: me}
        self.n_live = 1                                   # members ALIVE or SUSPECT (us included)
        self.live_ids: list[str] = [me.node]              # the same members, indexable for sampling
        self._live_pos: dict[str, int] = {me.node: 0}
        self.gone: set[str] = set()                       # members DEAD or LEFT (tombstones)

    def __contains__(self, node: object) -> bool:
        return node in self.by_id

    def __len__(self) -> int:
        return len(self.by_id)

    def __iter__(self) -> Iterator[GossipMember]:
        return iter(self.by_id.values())

    def get(self, node: str) -> GossipMember | None:
        return self.by_id.get(node)

    def is_live(self, node: str) -> bool:
        return node in self._live_pos

    def live(self) -> list[GossipMember]:
        return [m for m in self.by_id.values() if m.state in _LIVE]

    def add(self, m: GossipMember) -> None:
        """A member we did not know, alive."""
        self.by_id[m.node] = m
        self.n_live += 1
        self._live_add(m.node)

    def forget(self, node: str) -> None:
        """Drop a member entirely (as an expired tombstone is)."""
        m = self.by_id.pop(node, None)
        if m is None:
            return
        if m.state in _LIVE:
            self.n_live -= 1
            self._live_remove(node)
        self.gone.discard(node)

    def set_state(self, m: GossipMember, state: MemberState, now: float) -> None:
        """Every state change goes through here so the live count and tombstone set stay exact."""
        was_live = m.state in _LIVE
        is_live = state in _LIVE
        if was_live and not is_live:
            self.n_live -= 1
            self.gone.add(m.node)
            self._live_remove(m.node)
        elif is_live and not was_live:
            self.n_live += 1
            self.gone.discard(m.node)
            self._live_add(m.node)
        m.state, m.since = state, now

    def expire(self, now: float, keep: float) -> None:
        """Forget tombstones older than ``keep`` seconds."""
        for node in [n for n in self.gone if n != self.me and now - self.by_id[n].since > keep]:
            self.gone.discard(node)
            del self.by_id[node]

    def node_at(self, addr: str) -> str | None:
        """The newest live member known at an address."""
        best = None
        for m in self.by_id.values():
            if m.addr == addr and m.state in _LIVE:
                best = m.node
        return best

    def sample_alive(self, rng: random.Random, k: int, exclude: tuple[str, ...]) -> list[GossipMember]:
        """Up to k distinct ALIVE members not in exclude, uniformly at random, without an O(N) scan."""
        ids = self.live_ids
        by_id = self.by_id
        if len(ids) <= 4 * (k + len(exclude)):
            pool = [by_id[n] for n in ids if n not in exclude and by_id[n].state == ALIVE]
            return rng.sample(pool, min(k, len(pool)))
        out: list[GossipMember] = []
        seen = set(exclude)
        for _ in range(8 * k):
            n = ids[rng.randrange(len(ids))]
            if n in seen:
                continue
            seen.add(n)
            m = by_id[n]
            if m.state == ALIVE:
                out.append(m)
                if len(out) == k:
                    break
        return out

    def dead_ids(self) -> list[str]:
        return [n for n in self.gone if self.by_id[n].state == DEAD]

    def _live_add(self, node: str) -> None:
        if node not in self._live_pos:
            self._live_pos[node] = len(self.live_ids)
            self.live_ids.append(node)

    def _live_remove(self, node: str) -> None:
        i = self._live_pos.pop(node, None)
        if i is None:
            return
        last = self.live_ids.pop()
        if last != node:
            self.live_ids[i] = last
            self._live_pos[last] = i


__all__ = ["ALIVE", "SUSPECT", "DEAD", "LEFT", "GossipMember", "MemberTable", "Suspicion"]
