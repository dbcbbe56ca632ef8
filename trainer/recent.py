"""The short log of recently committed steps that a replica serves to peers fast-forwarding.

A peer that died mid-allreduce may leave a step committed at some replicas only; those that
missed it fetch its reduced buffer from a replica that has it (``FAST_FORWARD``) instead of
pulling a whole snapshot. Each rank keeps and serves its own shard's buffers.
"""
from __future__ import annotations

import logging
import threading
from collections import deque

import torch

from ..transport import CommError
from ..transport.stream import StateSnapshot, fetch_state
from .attempt import Attempt, Entry

log = logging.getLogger(__name__)

FAST_FORWARD_TIMEOUT_S = 10.0


class RecentSteps:
    def __init__(self, keep: int) -> None:
        self._entries: deque[Entry] = deque(maxlen=max(1, keep))
        self._lock = threading.Lock()

    def append(self, e: Entry) -> None:
        with self._lock:
            self._entries.append(e)

    @property
    def last_mask(self) -> list[bool] | None:
        with self._lock:
            return list(self._entries[-1].mask) if self._entries else None

    def serve(self, lo: int, hi: int) -> StateSnapshot | None:
        """Transport thread: the reduced buffers of steps lo..hi-1, or None if we lack one."""
        with self._lock:
            entries = [e for e in self._entries if lo <= e.step < hi]
        if not entries or entries[0].step != lo or len(entries) != hi - lo:
            return None
        return StateSnapshot(meta={"steps": [e.step for e in entries], "counts": [e.count for e in entries],
                                   "masks": [[int(b) for b in e.mask] for e in entries]},
                             tensors={f"g{e.step}": e.flat for e in entries})


def fetch_recent(lo: int, hi: int, att: Attempt, steps: dict[int, int], shard: int, secret: bytes | None,
                 device: torch.device) -> tuple[str, list[Entry]] | None:
    """Steps lo..hi-1 of this shard from a participant that committed them (its slot's step in
    the reduced header is at least hi); None when no such peer has them all."""
    for slot, node, addrs in att.sources:
        if steps.get(slot, -1) < hi or node == att.node:
            continue
        try:
            snap = fetch_state(addrs[min(shard, len(addrs) - 1)],
                               {"kind": "grads", "from": lo, "to": hi, "shard": shard},
                               secret=secret, timeout=FAST_FORWARD_TIMEOUT_S)
        except CommError as exc:
            log.info("fast-forward from %s failed: %s", node, exc)
            continue
        got = snap.meta.get("steps", [])
        if not got or got[0] != lo or len(got) != hi - lo:
            continue
        # The log arrives in host memory; apply() reads it on the step buffer's device.
        return node, [Entry(int(s), snap.tensors[f"g{s}"].to(device), int(snap.meta["counts"][i]),
                            [bool(x) for x in snap.meta["masks"][i]]) for i, s in enumerate(got)]
    return None


__all__ = ["FAST_FORWARD_TIMEOUT_S", "RecentSteps", "fetch_recent"]
