"""The sending half of one ring lane: a persistent thread that owns the outgoing socket.

Frames are written in order with blocking sendmsg() straight from the tensor's memory. With
`inline` the producer (the lane's receiving thread) first tries to write a frame itself without
blocking, which saves a thread wake-up per chunk; the thread still guarantees that sending never
waits for receiving, which is what keeps a ring from deadlocking.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import time
from typing import Any, Callable

from .errors import CommError, CommTimeout, PeerFailed
from .failure import FailHooks
from .wire import RemoteError, io_slice, read_reverse_error, send_all_timed, send_nowait, set_io_slice

__all__ = ["DrainMark", "ERROR_FRAME_GRACE_S", "LaneSender", "SENDER_GRACE_S", "STOP", "WAKE"]

logger = logging.getLogger(__name__)

# close(): how long to let a sender finish the frame in flight before shutting its socket.
SENDER_GRACE_S = 0.05
# A failing sender's patience for writing the error frame behind the frame in flight.
ERROR_FRAME_GRACE_S = 1.0

#: queue items besides frames: STOP ends a lane thread, WAKE makes a sender look at the failure state
STOP = object()
WAKE = object()


class DrainMark:
    """Queued behind an op's frames: `reached` turns true once the thread has written them all.

    Only the sender sets `reached`; `ev` is the drainer's waiter event, which failures and other
    lanes finishing also set, so it only says "look again", never "done"."""

    __slots__ = ("ev", "reached")

    def __init__(self, ev: threading.Event) -> None:
        self.ev = ev
        self.reached = False

    def reach(self) -> None:
        self.reached = True
        self.ev.set()


class LaneSender:
    """Owns one outgoing socket; writes queued frames in order on its own thread.

    The queue holds at most the frames of one operation (bounded by the op's plan) plus a few
    control items; payloads are memoryviews of the caller's tensor, never copies. Every write to
    the socket (by this thread or inline by the producer) happens under `wlock`, and a frame the
    producer started inline is always completed before an error frame, so the receiver can
    always parse the stream.
    """

    def __init__(self, name: str, sock: socket.socket, *, inline: bool, right: int, right_addr: str,
                 hooks: FailHooks, close_sock: Callable[[socket.socket], None]) -> None:
        self.sock = sock
        self.inline = inline
        self.right = right
        self.right_addr = right_addr
        self.hooks = hooks
        self.state = hooks.state
        self._close_sock = close_sock
        # Data jobs handed to the thread and finished by it; each counter has a single writer
        # (the lane's receive thread / the sender thread).
        self.submitted = 0
        self.completed = 0
        self.progress = 0.0  # monotonic time of the last byte written (inline or by the thread)
        self.wlock = threading.Lock()
        self.blame_lock = threading.Lock()
        self.reverse_read = False
        self.reverse: RemoteError | None = None
        self.q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.exited = threading.Event()
        self.timeout = -1.0  # op timeout, set by the producer before each operation (none yet)
        self.thread = threading.Thread(target=self._run, daemon=True, name=name)

    def start(self) -> None:
        self.thread.start()

    def _run(self) -> None:
        state = self.state
        fail = self.hooks.fail
        sock = self.sock
        q = self.q
        try:
            while True:
                job = q.get()
                if state.failed is not None:
                    self._finish_with_error(job)
                    return
                if job is STOP:
                    return
                if type(job) is tuple:
                    hdr, payload, queued, _rest = job
                    # No-progress clock: from the later of "this frame was ready" and "the
                    # last byte moved", so a late wake-up of this thread does not stretch it.
                    with self.wlock:
                        self.progress = send_all_timed(sock, (hdr, payload), self.timeout,
                                                       max(queued, self.progress))
                    self.completed += 1
                elif type(job) is DrainMark:
                    job.reach()
        except TimeoutError:
            fail(CommTimeout(f"rank {self.right} accepted no data for {self.timeout:.3g} s",
                             peer_rank=self.right, peer_addr=self.right_addr))
        except OSError as e:
            if state.failed is None:
                fail(self._blame(e))
        except BaseException as e:  # noqa: BLE001 - never die silently: fail the communicator
            logger.exception("sender thread crashed")
            fail(CommError(f"sender thread crashed: {e!r}"))
        finally:
            if state.failed is not None:
                self._close_sock(sock)  # after the error frame and FIN: the data in flight still arrives
            self.exited.set()
            state.wake_waiters()

    def set_timeout(self, tmo: float) -> None:
        """Called by the lane's receive thread at op start, while no frame of this lane is queued.
        The socket's send slice is set on the first call whatever `tmo` is: until then the
        socket blocks without a limit."""
        if tmo != self.timeout:
            set_io_slice(self.sock, io_slice(tmo), recv=False)
            self.timeout = tmo

    def submit(self, hdr: bytes, payload: memoryview | None) -> None:
        """Queue a frame; with `inline`, first try to write it from the calling (receive) thread
        without blocking, which saves a thread wake-up per chunk when the socket has room."""
        state = self.state
        if self.inline and self.submitted == self.completed and self.wlock.acquire(blocking=False):
            try:
                if state.failed is not None:
                    raise state.failed
                try:
                    rest = send_nowait(self.sock, (hdr, payload))
                except OSError as e:
                    if state.failed is None:
                        self.hooks.fail(self._blame(e))
                    raise state.failed from None  # type: ignore[misc]
                now = time.monotonic()
                if not rest:
                    self.progress = now
                    return
                # Partly written: the thread must finish this frame, even after a failure.
                job: tuple[Any, ...]
                if len(rest) == 1:
                    job = (b"", rest[0], now, True)
                else:
                    job = (rest[0], rest[1], now, True)
                self.submitted += 1
                self.q.put(job)
                return
            finally:
                self.wlock.release()
        if state.failed is not None:
            raise state.failed
        self.submitted += 1
        self.q.put((hdr, payload, time.monotonic(), False))

    def drain(self, tmo: float) -> None:
        """Wait until everything queued for this op is written (the caller may reuse the tensor
        as soon as the op returns)."""
        state = self.state
        if self.submitted == self.completed:
            if state.failed is not None:
                raise state.failed
            return  # everything was written inline or the sender already finished
        with state.waiter() as ev:
            # The waiter event is also set when another lane finishes: only the mark, which the
            # thread reaches after this op's last frame, says the tensor is no longer being read.
            mark = DrainMark(ev)
            self.q.put(mark)
            deadline = time.monotonic() + tmo + SENDER_GRACE_S
            while not mark.reached:
                if state.failed is not None:
                    raise state.failed
                if self.exited.is_set():
                    raise state.failed or self.hooks.fail(CommError("sender stopped"))
                left = deadline - time.monotonic()
                if left <= 0:
                    raise self.hooks.fail(CommTimeout(
                        f"rank {self.right} did not take our data within {tmo:.3g} s",
                        peer_rank=self.right, peer_addr=self.right_addr))
                ev.wait(left)
                ev.clear()  # before `reached` is looked at again: a mark reached meanwhile is not missed
            if state.failed is not None:
                raise state.failed

    def wake(self) -> None:
        """Make the thread look at the failure state (it then finishes its frame and exits)."""
        self.q.put(WAKE)

    def stop(self) -> None:
        """End the thread after what is queued."""
        self.q.put(STOP)

    def hand_over(self, hdr: bytes, payload: memoryview | None) -> None:
        """Queue the rest of a frame another writer (the C loop) left half-written: this thread
        completes it, also after a failure, so the receiver can still parse the stream."""
        self.submitted += 1
        self.q.put((hdr, payload, time.monotonic(), True))

    def write_failed(self, timed_out: bool, errno_: int, tmo: float) -> CommError:
        """Another writer's send on this lane failed (the C loop's): the error to raise, blamed
        as when this thread fails (the right neighbour's error frame, if it left one), with the
        socket closed after it."""
        err = (CommTimeout(f"rank {self.right} accepted no data for {tmo:.3g} s",
                           peer_rank=self.right, peer_addr=self.right_addr)
               if timed_out else self._blame(OSError(errno_, os.strerror(errno_))))
        self._close_sock(self.sock)
        return err

    def silent(self, after: float) -> CommError:
        """The right neighbour's host acknowledged nothing for `after` seconds although the
        kernel retransmitted (wire.unacknowledged): it is gone without a reset, or cut off.
        The socket is closed after it."""
        err = PeerFailed(f"rank {self.right}'s host acknowledged nothing for {after:.3g} s (gone without a reset?)",
                         peer_rank=self.right, peer_addr=self.right_addr)
        self._close_sock(self.sock)
        return err

    def _finish_with_error(self, job: Any) -> None:
        """Complete a frame the producer left half-written, then append the error frame."""
        frame = self.state.error_frame
        grace = min(self.timeout, ERROR_FRAME_GRACE_S) if self.timeout > 0 else ERROR_FRAME_GRACE_S
        with self.wlock:
            rest = job if type(job) is tuple and job[3] else None
            while rest is None:
                try:
                    j = self.q.get_nowait()
                except queue.Empty:
                    break
                if type(j) is tuple and j[3]:
                    rest = j
            try:
                set_io_slice(self.sock, io_slice(grace), recv=False)
                if rest is not None:
                    send_all_timed(self.sock, (rest[0], rest[1]), grace)
                if frame is not None:
                    send_all_timed(self.sock, (frame,), grace)
                self.sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass  # the right neighbour is gone or stuck: it will see EOF or time out

    def _blame(self, exc: OSError) -> CommError:
        """The right neighbour went away: use the error frame it left behind, if any. Both the
        thread and an inline write may fail on the same socket; the frame is read only once."""
        with self.blame_lock:
            if not self.reverse_read:
                self.reverse = read_reverse_error(self.sock)
                self.reverse_read = True
            remote = self.reverse
        if remote is not None:
            return self.hooks.from_remote(remote, self.right)
        return PeerFailed(f"send to rank {self.right} failed: {exc.strerror or exc!r}",
                          peer_rank=self.right, peer_addr=self.right_addr)
