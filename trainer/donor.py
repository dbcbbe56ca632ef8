"""The donor side of catch-up, shared by ``FaultTolerant`` and ``HSDP``.

A joiner's snapshot request arrives on a transport thread, but the state is consistent only at
a step boundary of the training thread. So the transport thread queues the request and waits;
the training thread answers queued requests right after a commit (a copy of the state, no
waiting on anybody), and the transport thread streams that copy at a lower CPU priority.
"""
from __future__ import annotations

import os
import queue
import threading
from typing import Any, Callable

from ..transport.stream import StateSnapshot

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
    """Bounded hand-off of snapshot requests from transport threads to the training thread."""

    def __init__(self, cap: int = 16, wait_s: float = 60.0) -> None:
        self._q: "queue.Queue[tuple[dict[str, Any], queue.Queue[StateSnapshot | None]]]" = queue.Queue(cap)
        self.wait_s = wait_s

    def request(self, req: dict[str, Any]) -> StateSnapshot | None:
        """Transport thread: wait (bounded) for the training thread's answer; None = refused."""
        lower_thread_priority(DONOR_NICE)  # this stream's thread: serving a joiner must not slow our steps
        box: "queue.Queue[StateSnapshot | None]" = queue.Queue(1)
        try:
            self._q.put_nowait((req, box))
        except queue.Full:
            return None
        try:
            return box.get(timeout=self.wait_s)
        except queue.Empty:
            return None

    def serve(self, can_serve: Callable[[dict[str, Any]], bool], take: Callable[[], StateSnapshot]) -> None:
        """Training thread, at a step boundary: answer every queued request without blocking."""
        while True:
            try:
                req, box = self._q.get_nowait()
            except queue.Empty:
                return
            box.put(take() if can_serve(req) else None)
