"""Gossip's piggyback queue: which membership updates ride on the next message.

One pending update per node (a newer one replaces it). Urgent news (failures, refutations,
metadata changes) goes before the ``alive`` of newly learned members, so the backlog of a mass
join never delays a suspicion or its refutation; within each, the least-transmitted first and,
among those, the newest first (as memberlist does). Each update is sent a bounded number of
times. Bucketed by transmit count, so taking ``k`` updates is O(k) even with 1,000 queued.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

from ..messages import Update


@dataclass(slots=True)
class _Pending:
    upd: Update
    count: int      # times transmitted
    prio: int       # 0 urgent, 1 join


class BroadcastQueue:
    def __init__(self) -> None:
        self._pending: dict[str, _Pending] = {}
        # [priority][transmits] -> nodes, oldest first (priority 0: urgent, 1: joins). OrderedDict,
        # not dict: a dict used as a FIFO keeps dead slots at its front, and iterating it costs
        # O(everything ever removed).
        self._bq: tuple[list[OrderedDict[str, None]], list[OrderedDict[str, None]]] = ([], [])

        self._limit_for, self._limit = -1, 0

    def __len__(self) -> int:
        return len(self._pending)

    def limit(self, n_live: int, mult: int) -> int:
        """Transmits per update: ``mult * ceil(log10(N + 1))`` (cached per cluster size)."""
        if n_live != self._limit_for:
            self._limit_for = n_live
            self._limit = mult * max(1, math.ceil(math.log10(n_live + 1)))
        return self._limit

    def push(self, upd: Update, urgent: bool = True) -> None:
        node = upd.node
        old = self._pending.get(node)
        if old is not None:
            self._bq[old.prio][old.count].pop(node, None)
        prio = 0 if urgent else 1
        self._pending[node] = _Pending(upd, 0, prio)
        buckets = self._bq[prio]
        if not buckets:
            buckets.append(OrderedDict())
        buckets[0][node] = None

    def take(self, want: int, limit: int) -> list[Update]:
        """Up to ``want`` updates for one message; each is dropped after ``limit`` transmits."""
        if not self._pending:
            return []
        taken: list[str] = []
        for buckets in self._bq:
            for bucket in buckets:
                for node in reversed(bucket):
                    taken.append(node)
                    if len(taken) >= want:
                        break
                if len(taken) >= want:
                    break
            if len(taken) >= want:
                break
        out: list[Update] = []
        for node in taken:
            entry = self._pending[node]
            buckets = self._bq[entry.prio]
            del buckets[entry.count][node]
            out.append(entry.upd)
            count = entry.count + 1
            if count >= limit:
                del self._pending[node]
                continue
            entry.count = count
            while len(buckets) <= count:
                buckets.append(OrderedDict())
            buckets[count][node] = None
        return out


__all__ = ["BroadcastQueue"]
