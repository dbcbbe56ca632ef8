"""The donor side of catch-up, shared by ``FaultTolerant`` and ``HSDP``.

A joiner's snapshot request arrives on a transport thread, but the state is a committed one only
while the training loop leaves it alone. The loop mutates it between ``begin()`` (forward
passes update buffers) and the end of ``commit()`` (the optimizer step); outside that window
(evaluating, checkpointing, in a pause, at a barrier, sleeping) it holds the state of its last
committed step. So:

- while the loop is outside that window (``idle``), the transport thread copies the state
  itself, under a lock the training thread takes only to enter the window (``busy``): a joiner
  never waits for the donor's loop to come back to ``commit()``;
- inside it, the request is queued and the training thread answers it at the next step
  boundary (right after a commit, or when it leaves the window), as a copy.

Either way the copy is streamed by the transport thread at a lower CPU priority.
"""
from __future__ import annotations

import os
import queue
import threading
from typing import Any, Callable

from ...transport.stream import StateSnapshot
from ..kernel.ports import DonorPort
from ..kernel.requests import RequestKind, StateRequest

CATCHUP_NICE = 10  # weight ~1/10 of a normal thread: catch-up still progresses on a busy host
# The donor's stream runs at the lowest priority (weight 15 against a training thread's 1024,
# ~1.5% of a busy core): it runs mostly while the training threads wait (allreduce, accelerator
# time), so the survivors' steps barely notice it; at nice 10 it took a tenth of the survivors'
# core for the whole stream (+12-20% steps at 50M parameters, the joiner on its own core).
DONOR_NICE = 19


def lower_thread_priority(nice: int = CATCHUP_NICE) -> None:
    """Lower the calling thread's CPU priority (Linux: nice is per thread), so that background
    catch-up work takes mostly idle CPU rather than the training threads' (at nice 10 a busy
    core gives it about a tenth), yet still finishes on an oversubscribed host."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except (AttributeError, OSError):
        pass


class SnapshotRequests:
    """Bounded hand-off of snapshot requests from transport threads to the training thread,
    or a copy on the transport thread itself while the training loop is outside a step."""

    def __init__(self, cap: int = 16, wait_s: float = 60.0) -> None:
        self._q: "queue.Queue[tuple[StateRequest, queue.Queue[StateSnapshot | None]]]" = queue.Queue(cap)
        self.wait_s = wait_s
        self._lock = threading.Lock()
        self._idle = False
        self._can_serve: Callable[[StateRequest], bool] | None = None
        self._take: Callable[[], StateSnapshot] | None = None

    def request(self, req: StateRequest) -> StateSnapshot | None:
        """Transport thread: a copy now when the loop is idle, else wait (bounded) for the
        training thread's answer; None = refused."""
        box: "queue.Queue[StateSnapshot | None]" = queue.Queue(1)
        with self._lock:
            if self._idle and self._take is not None and self._can_serve is not None:
                snap = self._take() if self._can_serve(req) else None
                lower_thread_priority(DONOR_NICE)
                return snap
            try:
                self._q.put_nowait((req, box))
            except queue.Full:
                return None
        lower_thread_priority(DONOR_NICE)  # this stream's thread: serving a joiner must not slow our steps
        try:
            return box.get(timeout=self.wait_s)
        except queue.Empty:
            return None

    def busy(self) -> None:
        """Training thread: about to mutate the state (a step begins). Waits for a copy in
        progress on a transport thread, if any."""
        with self._lock:
            self._idle = False

    def idle(self, can_serve: Callable[[StateRequest], bool], take: Callable[[], StateSnapshot]) -> None:
        """Training thread: the state is a committed one and the loop leaves it alone until the
        next ``busy``; answers what is queued, and lets transport threads copy from now on."""
        with self._lock:
            self._can_serve, self._take = can_serve, take
            self._idle = True
            self._drain(can_serve, take)

    def serve(self, can_serve: Callable[[StateRequest], bool], take: Callable[[], StateSnapshot]) -> None:
        """Training thread, at a step boundary: answer every queued request without blocking."""
        with self._lock:
            self._drain(can_serve, take)

    def _drain(self, can_serve: Callable[[StateRequest], bool], take: Callable[[], StateSnapshot]) -> None:
        while True:
            try:
                req, box = self._q.get_nowait()
            except queue.Empty:
                return
            box.put(take() if can_serve(req) else None)


class Donor:
    """What one rank of a replica serves its peers on its data server (a transport thread):
    snapshots to joiners, mean gradients to peers that fast-forward, and signatures of committed
    steps to a replica back from a pause (``pause.py``)."""

    def __init__(self, engine: DonorPort) -> None:
        self.e = engine
        self.requests = SnapshotRequests()
        self._kinds: dict[RequestKind, Callable[[StateRequest], StateSnapshot | None]] = {}

    def register(self, kind: RequestKind, provider: Callable[[StateRequest], StateSnapshot | None]) -> None:
        """Serve requests of another kind too (the job's initial state at group formation)."""
        self._kinds[kind] = provider

    def provide(self, wire: dict[str, Any]) -> StateSnapshot | None:
        """Transport thread: the answer to a peer's request (None: refused, or malformed)."""
        e = self.e
        try:
            req = StateRequest.from_wire(wire)
        except (KeyError, TypeError, ValueError):
            return None
        if req.shard != e.shard:
            return None
        if req.kind is RequestKind.GRADS:
            return e.recent.serve(req.lo, req.hi)
        if req.kind is RequestKind.SNAPSHOT:
            return self.requests.request(req)
        if req.kind is RequestKind.SIG:
            sig = e.recent.signature(req.step)
            return StateSnapshot(meta={"sig": sig}, tensors={}) if sig is not None else None
        extra = self._kinds.get(req.kind)
        return extra(req) if extra is not None else None

    def _take(self) -> StateSnapshot:
        meta, tensors = self.e.capture_state()
        return StateSnapshot(meta=meta, tensors=tensors)

    def _can_serve(self, req: StateRequest) -> bool:
        return bool(self.e.synced) and self.e.step >= req.min_step

    def busy(self) -> None:
        """Training thread: the loop is about to mutate the state."""
        self.requests.busy()

    def idle(self) -> None:
        """Training thread: the state is a committed one until the next ``busy``."""
        if self.e.state_io.copy_between_steps:
            self.requests.idle(self._can_serve, self._take)
        else:  # answered here, at this step boundary, and at the next ones
            self.requests.serve(self._can_serve, self._take)

    def serve_queued(self) -> None:
        """Training thread, right after a commit: answer the requests queued during the step."""
        self.requests.serve(self._can_serve, self._take)


__all__ = ["CATCHUP_NICE", "DONOR_NICE", "Donor", "SnapshotRequests", "lower_thread_priority"]
