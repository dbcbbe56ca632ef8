"""The short log of recently committed steps that a replica serves to peers fast-forwarding.

A peer that died mid-allreduce may leave a step committed at some replicas only; those that
missed it fetch its reduced buffer from a replica that has it (``FAST_FORWARD``) instead of
pulling a whole snapshot. Each rank keeps and serves its own shard's buffers.
"""
from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import OrderedDict, deque

import torch

from ...core.view import shard_addr
from ...transport import CommError
from ...transport.device import written_event
from ...transport.stream import StateSnapshot, fetch_state
from .attempt import Attempt, Entry
from .ports import FastForwardPort
from .requests import StateRequest

log = logging.getLogger(__name__)

FAST_FORWARD_TIMEOUT_S = 10.0
SIG_KEEP = 4096   # committed steps whose signature a replica remembers (a few bytes each)


def step_signature(step: int, count: int, mask: list[bool]) -> str:
    """Which replicas' gradients a committed step averaged: two replicas that applied the same
    step with the same contributors applied the same mean (the saved gradients of a retry are
    the same), so equal signatures mean equal states after it."""
    bits = "".join("1" if b else "0" for b in mask).rstrip("0")
    return hashlib.blake2b(f"{step}|{count}|{bits}".encode(), digest_size=12).hexdigest()


class RecentSteps:
    """The last `keep` committed steps, and more while a peer that paused needs them: from the
    step a paused (or just returned) member holds on (``hold``), up to `cap_bytes` in all. Past
    the cap the oldest go, the hold then lapses (that member pulls a snapshot instead), and the
    log shrinks back to `keep`."""

    def __init__(self, keep: int, cap_bytes: int = 0) -> None:
        self.keep = max(1, keep)
        self.cap_bytes = cap_bytes
        self._entries: deque[Entry] = deque()
        self._bytes = 0
        self._hold: int | None = None
        self._sigs: OrderedDict[int, str] = OrderedDict()
        self._lock = threading.Lock()

    def append(self, e: Entry) -> None:
        sig = step_signature(e.step, e.count, e.mask)
        with self._lock:
            self._entries.append(e)
            self._bytes += e.nbytes
            self._trim()
            self._sigs[e.step] = sig
            self._sigs.move_to_end(e.step)
            while len(self._sigs) > SIG_KEEP:
                self._sigs.popitem(last=False)

    def hold(self, step: int | None) -> None:
        """Keep the steps from `step` on (None: only the last `keep`): a member paused at
        `step` fast-forwards through them when it comes back. A step older than the oldest kept
        is no use to hold: that member needs a snapshot anyway."""
        with self._lock:
            if step is not None and self._entries and step < self._entries[0].step:
                step = None
            self._hold = step
            self._trim()

    def _trim(self) -> None:
        """Under the lock: drop the oldest entries beyond `keep` that no hold needs, and any
        beyond the byte cap (a hold that loses its first step lapses)."""
        while len(self._entries) > self.keep:
            first = self._entries[0]
            held = self._hold is not None and first.step >= self._hold and self._bytes <= self.cap_bytes
            if held:
                break
            self._entries.popleft()
            self._bytes -= first.nbytes
            if self._hold is not None and first.step >= self._hold:
                self._hold = None   # over the cap: the paused member catches up from a snapshot

    @property
    def held(self) -> tuple[int, int]:
        """(entries, bytes) kept now."""
        with self._lock:
            return len(self._entries), self._bytes

    def forget_signatures(self) -> None:
        """A snapshot replaced the state: the steps signed so far may not be its history."""
        with self._lock:
            self._sigs.clear()

    def adopt_signature(self, step: int, sig: str) -> None:
        """The signature of the last step of a state loaded from elsewhere (a checkpoint, a
        donor's snapshot): its history, so a later check against the others' can use it."""
        with self._lock:
            self._sigs[step] = sig
            self._sigs.move_to_end(step)

    def signature(self, step: int) -> str | None:
        """The signature of committed step `step` applied here (None: not one of ours)."""
        with self._lock:
            return self._sigs.get(step)

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
                                   "masks": [[int(b) for b in e.mask] for e in entries],
                                   "shorts": [sorted(e.short.items()) for e in entries]},
                             tensors={f"g{e.step}": e.flat for e in entries},
                             ready=entries[-1].ready)   # one stream wrote them all, in step order


def fetch_recent(lo: int, hi: int, att: Attempt, held: dict[int, int], shard: int, secret: bytes | None,
                 device: torch.device, source_host: str | None = None) -> tuple[str, list[Entry]] | None:
    """Steps lo..hi-1 of this shard from a data member that committed them (its held step in the
    reduced header, by data rank, is at least hi: a participant or a hot spare); None when no
    such peer has them all."""
    for rank, (node, addrs) in enumerate(zip(att.nodes, att.addrs)):
        if held.get(rank, -1) < hi or node == att.node:
            continue
        try:
            snap = fetch_state(shard_addr(addrs, shard, node),
                               StateRequest.grads(lo, hi, shard).to_wire(),
                               secret=secret, timeout=FAST_FORWARD_TIMEOUT_S, source_host=source_host)
        except CommError as exc:
            log.info("fast-forward from %s failed: %s", node, exc)
            continue
        got = snap.meta.get("steps", [])
        if not got or got[0] != lo or len(got) != hi - lo:
            continue
        # The log arrives in host memory; apply() reads it on the step buffer's device.
        flats = [snap.tensors[f"g{s}"].to(device) for s in got]
        ready = written_event(flats[-1])
        shorts = snap.meta.get("shorts") or [[] for _ in got]
        return node, [Entry(int(s), flats[i], int(snap.meta["counts"][i]),
                            [bool(x) for x in snap.meta["masks"][i]], ready=ready,
                            short={int(a): int(b) for a, b in shorts[i]}) for i, s in enumerate(got)]
    return None





def fast_forward(e: FastForwardPort, target: int, att: Attempt, held: dict[int, int],
                 slot: int | None) -> tuple[int, Entry | None]:
    """Collective, for the step engine `e`: fetch and apply the mean gradients of the steps it
    missed from a peer that has them (each rank its shard); if any rank cannot, the replica
    catches up instead. Returns the steps applied and the one that holds our gradients, if any
    (it committed elsewhere with our contribution before we could apply it)."""
    want_from = e.step
    got = (fetch_recent(want_from, target, att, held, e.shard, e.secret, e.buf_device, e.ds.host)
           if e.synced else None)
    if not all(e.group.agree(got is not None)) or got is None:
        log.info("at step %d, behind the others (step %d) and not in a peer's short log: catching up "
                 "from a snapshot", want_from, target)
        e.catchup.start("behind")
        return 0, None
    donor, entries = got
    ours = None
    for entry in entries:
        if entry.step == e.began_step and slot is not None and entry.mask[slot]:
            ours = entry
        e.measure(entry)
        e.apply(entry)
    e.events.append({"t": time.time(), "kind": "fast_forward", "from": want_from, "to": e.step})
    log.info("fast-forwarded %d step(s) to %d from %s", len(entries), e.step, donor)
    e.committed()
    return len(entries), ours


__all__ = ["FAST_FORWARD_TIMEOUT_S", "RecentSteps", "fast_forward", "fetch_recent", "step_signature"]
