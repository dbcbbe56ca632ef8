"""Members alive on the control plane but unreachable on the data plane: who is left out.

A member can answer every gossip probe while no peer can open its data port (it advertises an
address peers cannot reach, a firewall drops the port, a loopback address among remote peers).
Every ring that includes it fails to connect, the engine asks for a fresh data epoch, the view
keeps it, and the job livelocks. So trainers probe the data address of a peer whose connect
failed and, after a bound (``DATA_UNREACHABLE_S``, in p2pft/net/dataprobe.py), name it in their
gossip metadata (``MemberMeta.data_unreachable``); the leader leaves a named member out of the
view, as it leaves out a stalled loop, until nobody names it any more (the naming trainer keeps
probing and withdraws the name once a connect succeeds).

One trainer's word could blame an innocent peer when the trainer itself is the broken one (its
outgoing connections are dropped). Such a trainer names several peers that the others reach:
a trainer that names at least two members and at least half of the other trainers is left out
itself, and what it names is ignored. Pure: no clock, no IO.
"""
from __future__ import annotations

import logging
from typing import Iterable

from .gossip.members import GossipMember
from .meta import Kind

log = logging.getLogger(__name__)


def data_unreachable(me: str, members: Iterable[GossipMember], logged: set[str]) -> set[str]:
    """The trainers to leave out of the next view for data-plane unreachability (never `me`,
    the leader: it cannot leave itself out). `logged` remembers who was already logged, so the
    leader's warning is one line per member and episode."""
    trainers = {m.node: m for m in members if m.meta.kind is Kind.TRAINER}
    out: set[str] = set()
    blamed: set[str] = set()
    for node, m in trainers.items():
        named = {n for n in m.meta.data_unreachable if n in trainers and n != node}
        if not named:
            continue
        others = len(trainers) - 1
        if len(named) >= 2 and 2 * len(named) >= others:
            out.add(node)            # it cannot reach most peers: the fault is on its side
        else:
            blamed |= named
    out |= blamed
    out.discard(me)
    for node in out - logged:
        log.warning("%s is alive but its data port cannot be reached: leaving it out of the view until it can",
                    node, extra={"node": me})
    logged.intersection_update(out)
    logged.update(out)
    return out


__all__ = ["data_unreachable"]
