"""``Ready``: everything one step of a node's state machine produced, handed over in one value.

After any input (a message, a tick, a call from the trainer) the caller takes
``node.ready()`` and acts on it: write the hard state if there is one (a node with a data
directory), then send the messages, publish the views, note new leader terms.
Taking it clears it (etcd-raft's ``Ready``/``Advance`` in one call). Callers only read it: a
step that produced nothing hands out one shared empty value.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .durable import HardState
from .messages import Message
from .view import View


@dataclass(slots=True)
class Ready:
    messages: list[tuple[str, Message]] = field(default_factory=list)   # (address, message), in order
    views: list[View] = field(default_factory=list)                     # newly committed, epochs growing
    leader_terms: list[int] = field(default_factory=list)               # terms in which we became leader
    # A durable voter's Raft state changed: write it (atomically, synced) before sending any of
    # ``messages`` or publishing ``views`` (etcd's rule; p2pft/core/durable.py).
    hard_state: HardState | None = None

    def __bool__(self) -> bool:
        return bool(self.messages or self.views or self.leader_terms or self.hard_state is not None)


__all__ = ["Ready"]
