"""The receiving half of one ring lane: the per-chunk loops of allreduce and broadcast.

The calling thread runs lane 0, a persistent `LaneWorker` thread each further lane. A receiver
owns its incoming socket: it receives with recv_into() straight into the tensor (copy phases) or
into one chunk-sized scratch buffer (reduce phase, then adds it in place), checks every frame
header against the op's schedule, and hands the frame that the received chunk unlocks to the
lane's sender.
"""

from __future__ import annotations

import errno
import os
import queue
import socket
import threading
import time
from types import ModuleType
from typing import Any, Callable

from .buffers import FlatBuffer
from .errors import CommError, CommTimeout, PeerFailed, ProtocolMismatch
from .failure import FailHooks, frame_mismatch
from .native import NATIVE_DTYPES, Status, native_loop, packed_plan
from .ring import LanePlan
from .sender import STOP, LaneSender
from .wire import (
    F_EMPTY, FRAME_LEN, FRAME_MAGIC, FRAME_PREFIX, FRAME_SUFFIX, MAX_ERROR_PAYLOAD, OP_ERROR, OP_KEEPALIVE,
    PREFIX_LEN, io_slice, parse_error_payload, recv_exact_timed, right_link_stopped, set_io_slice,
    unacknowledged,
)

__all__ = ["LaneReceiver", "LaneWorker"]


class LaneReceiver:
    """Receive side of one lane of a connected communicator (one thread at a time)."""

    def __init__(self, sock: socket.socket, sender: LaneSender, *, epoch: int, shard: int, rank: int,
                 world: int, left: int, left_addr: str, chunk_bytes: int, timeout: float,
                 hooks: FailHooks, ack_timeout: float | None = None) -> None:
        self.sock = sock
        self.sender = sender
        self.epoch = epoch
        self.shard = shard
        self.rank = rank
        self.world = world
        self.left = left
        self.left_addr = left_addr
        self.chunk_bytes = chunk_bytes
        self.timeout = timeout  # the communicator's default: bounds reading a neighbour's error frame
        self.ack_timeout = ack_timeout  # RingOptions.ack_timeout: a silent right host fails the op
        self.fail = hooks.fail
        self.hooks = hooks
        self._scratch = bytearray(0)
        self._hdr = bytearray(FRAME_LEN)
        self._recv_tmo = -1.0
        self._keepalive = FRAME_PREFIX.pack(FRAME_MAGIC, OP_KEEPALIVE, 0, epoch, shard, rank, 0, 0, 0) \
            + FRAME_SUFFIX.pack(0, 0, 0, 0, 0)

    # ------------------------------------------------------------------ operations
    def allreduce(self, plan: LanePlan, buf: FlatBuffer, prefix_out: bytes, prefix_in: bytes,
                  contrib: bool, tmo: float) -> int:
        loop = native_loop()
        if loop is not None and buf.dtype_code in NATIVE_DTYPES:
            return self._allreduce_native(loop, plan, buf, prefix_out, prefix_in, contrib, tmo)
        sock = self.sock
        snd = self.sender
        self._start(tmo)
        mv = buf.mv
        pack = FRAME_SUFFIX.pack
        sends = plan.sends
        put = snd.submit
        c0 = 1 if contrib else 0
        for i in range(plan.first_sends):
            f = sends[i]
            if contrib:
                put(prefix_out + pack(f.step, f.chunk, 0, 1, f.nbytes), mv[f.off:f.off + f.nbytes])
            else:
                put(prefix_out + pack(f.step, f.chunk, F_EMPTY, 0, 0), None)
        if len(self._scratch) < self.chunk_bytes:
            self._scratch = bytearray(self.chunk_bytes)
        scratch = memoryview(self._scratch)
        hv = memoryview(self._hdr)
        idle = self._idle_hook(tmo)
        total = -1
        for f, reduce, nxt in plan.recvs:
            suffix = self._recv_header(sock, hv, prefix_in, tmo, idle)
            self._check_suffix(suffix, f.step, f.chunk, f.nbytes)
            flags = suffix[2]
            count = suffix[3]
            n = f.nbytes
            empty = flags & F_EMPTY
            if reduce:
                if empty:
                    out_empty = not contrib
                elif contrib:
                    if n:
                        self._recv_payload(sock, scratch[:n], tmo, idle)
                        buf.add_from(f.off, scratch[:n])
                    out_empty = False
                else:
                    self._recv_payload(sock, mv[f.off:f.off + n], tmo, idle)
                    out_empty = False
                count += c0
                if nxt < 0 or sends[nxt].step == self.world - 1:
                    # Last reduce step: this region is final. No contribution at all -> zeros.
                    if out_empty and n:
                        buf.zero(f.off, n)
                    if total < 0:
                        total = count
            else:
                if empty:
                    if n:
                        buf.zero(f.off, n)
                    out_empty = True
                else:
                    if n:
                        self._recv_payload(sock, mv[f.off:f.off + n], tmo, idle)
                    out_empty = False
                if total >= 0 and count != total:
                    raise self.fail(ProtocolMismatch(
                        f"rank {self.left} reports {count} contributors, this rank counted {total}",
                        peer_rank=self.left, peer_addr=self.left_addr))
                if total < 0:
                    total = count
            if nxt >= 0:
                g = sends[nxt]
                if out_empty:
                    put(prefix_out + pack(g.step, g.chunk, F_EMPTY, count, 0), None)
                else:
                    put(prefix_out + pack(g.step, g.chunk, 0, count, g.nbytes), mv[g.off:g.off + g.nbytes])
        snd.drain(tmo)
        return total

    def _allreduce_native(self, loop: ModuleType, plan: LanePlan, buf: FlatBuffer, prefix_out: bytes,
                          prefix_in: bytes, contrib: bool, tmo: float) -> int:
        """The same schedule in C (native.py): sends and receives on this thread, no GIL held."""
        self._start(tmo)
        snd = self.sender
        sends, recvs = packed_plan(plan)
        if len(self._scratch) < loop.SCRATCH_BYTES:
            self._scratch = bytearray(loop.SCRATCH_BYTES)
        # Holding the lane's write lock keeps the sender thread from writing an error frame into
        # the middle of a frame this loop is writing; a half-written one is handed to it below.
        with snd.wlock:
            args: tuple[object, ...] = (
                self.sock.fileno(), snd.sock.fileno(), buf.mv, self._scratch, sends, plan.first_sends, recvs,
                prefix_out, prefix_in, self._keepalive, contrib, buf.dtype_code, self.world, tmo, io_slice(tmo),
                self.hooks.state)
            if getattr(loop, "WATCHES_RIGHT", 0):  # a build that also watches the right connection
                args += (self.ack_timeout or 0.0,)
            st, total, err, detail, hdr, pending = loop.allreduce_lane(*args)
            if st == Status.OK:
                return total
            if st in (Status.SEND_ERROR, Status.SEND_TIMEOUT):
                raise self.fail(snd.write_failed(st == Status.SEND_TIMEOUT, err, tmo))
            if st == Status.RIGHT_SILENT:
                raise self.fail(snd.silent(self.ack_timeout or 0.0))
            if pending is not None:
                rest, off, n = pending
                snd.hand_over(rest, buf.mv[off:off + n] if n else None)
        if st == Status.INTERRUPTED:
            raise hdr  # e.g. KeyboardInterrupt: the communicator fails as with the Python loop
        if st == Status.FAILED:
            raise self.fail(CommError("failed while this lane ran"))  # returns the failure recorded first
        if st == Status.NO_THREAD:
            raise self.fail(CommError(f"the ring loop could not start its sender thread: {os.strerror(err)}"))
        if st == Status.RECV_TIMEOUT:
            raise self.fail(CommTimeout(f"no data from rank {self.left} for {tmo:.3g} s",
                                        peer_rank=self.left, peer_addr=self.left_addr))
        if st in (Status.EOF, Status.RECV_ERROR):
            raise self._reader_lost(EOFError() if st == Status.EOF else OSError(err, os.strerror(err)))
        if st == Status.BAD_PREFIX:
            self._bad_prefix(self.sock, memoryview(bytearray(hdr)), prefix_in)  # raises unless a keepalive
        elif st == Status.BAD_SUFFIX:
            f = plan.recvs[detail[0]][0]
            self._check_suffix(FRAME_SUFFIX.unpack_from(hdr, PREFIX_LEN), f.step, f.chunk, f.nbytes)  # raises
        elif st == Status.COUNT_MISMATCH:
            raise self.fail(ProtocolMismatch(
                f"rank {self.left} reports {detail[0]} contributors, this rank counted {detail[1]}",
                peer_rank=self.left, peer_addr=self.left_addr))
        raise self.fail(CommError(f"ring loop stopped with status {st}"))

    def broadcast(self, plan: LanePlan, buf: FlatBuffer, prefix_out: bytes, prefix_in: bytes,
                  root: int, tmo: float) -> None:
        sock = self.sock
        snd = self.sender
        self._start(tmo)
        mv = buf.mv
        pack = FRAME_SUFFIX.pack
        put = snd.submit
        for i in range(plan.first_sends):
            f = plan.sends[i]
            put(prefix_out + pack(f.step, f.chunk, 0, root, f.nbytes), mv[f.off:f.off + f.nbytes])
        hv = memoryview(self._hdr)
        idle = self._idle_hook(tmo)
        for f, _reduce, nxt in plan.recvs:
            suffix = self._recv_header(sock, hv, prefix_in, tmo, idle)
            self._check_suffix(suffix, f.step, f.chunk, f.nbytes)
            if f.nbytes:
                self._recv_payload(sock, mv[f.off:f.off + f.nbytes], tmo, idle)
            if nxt >= 0:
                put(prefix_out + pack(f.step, f.chunk, 0, root, f.nbytes), mv[f.off:f.off + f.nbytes])
        snd.drain(tmo)

    # ------------------------------------------------------------------ receiving
    def _start(self, tmo: float) -> None:
        if self._recv_tmo != tmo:
            set_io_slice(self.sock, io_slice(tmo), send=False)
            self._recv_tmo = tmo
        self.sender.set_timeout(tmo)

    def _recv_header(self, sock: socket.socket, hv: memoryview, prefix_in: bytes, tmo: float,
                     idle: Any) -> tuple:
        while True:
            try:
                recv_exact_timed(sock, hv, tmo, idle)
            except TimeoutError:
                raise self.fail(CommTimeout(f"no data from rank {self.left} for {tmo:.3g} s",
                                            peer_rank=self.left, peer_addr=self.left_addr)) from None
            except (EOFError, OSError) as e:
                raise self._reader_lost(e) from None
            if hv[:PREFIX_LEN] == prefix_in or not self._bad_prefix(sock, hv, prefix_in):
                return FRAME_SUFFIX.unpack_from(hv, PREFIX_LEN)
            # A keepalive: the left neighbour is alive and itself starved; keep waiting.

    def _idle_hook(self, tmo: float) -> Callable[[float], None]:
        """While this thread starves on its left neighbour, tell the right neighbour every
        timeout/4 that we are alive (a keepalive frame when nothing else is queued), so that
        only the rank next to a stalled peer times out on it and the others hear its verdict
        instead of blaming their own, innocent, left neighbour. A right neighbour that stopped
        (its error frame or EOF came back) fails this rank at once, blaming whom it blamed; one
        whose host acknowledged nothing for `ack_timeout` (wire.unacknowledged) is blamed itself."""
        snd = self.sender
        every = tmo / 4
        frame = self._keepalive
        state = [every]

        t0 = time.monotonic()
        ack = self.ack_timeout

        def idle(waited: float) -> None:
            # As the C loop: the right neighbour stopped (its error frame, EOF) or its host is silent.
            if right_link_stopped(snd.sock):
                e = snd.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) if snd.sock.fileno() >= 0 else 0
                raise self.fail(snd.write_failed(False, e or errno.EPIPE, tmo))
            if ack and time.monotonic() - t0 >= ack and unacknowledged(snd.sock, ack):
                raise self.fail(snd.silent(ack))
            if waited >= state[0]:
                state[0] = waited + every
                if snd.submitted == snd.completed:
                    snd.submit(frame, None)

        return idle

    def _recv_payload(self, sock: socket.socket, view: memoryview, tmo: float, idle: Any = None) -> None:
        try:
            recv_exact_timed(sock, view, tmo, idle)
        except TimeoutError:
            raise self.fail(CommTimeout(f"no data from rank {self.left} for {tmo:.3g} s",
                                        peer_rank=self.left, peer_addr=self.left_addr)) from None
        except (EOFError, OSError) as e:
            raise self._reader_lost(e) from None

    def _reader_lost(self, e: BaseException) -> CommError:
        failed = self.hooks.state.failed
        if failed is not None:
            return failed
        why = "closed the connection" if isinstance(e, EOFError) else f"connection failed ({e!r})"
        return self.fail(PeerFailed(f"rank {self.left} {why}", peer_rank=self.left, peer_addr=self.left_addr))

    def _bad_prefix(self, sock: socket.socket, hv: memoryview, expected: bytes) -> bool:
        """Slow path: True for a keepalive; raises for an error frame from the left or a frame
        of another op/epoch/tag."""
        got = FRAME_PREFIX.unpack_from(hv)
        exp = FRAME_PREFIX.unpack(expected)
        if got[0] == FRAME_MAGIC and got[1] == OP_KEEPALIVE and got[3:6] == exp[3:6] \
                and FRAME_SUFFIX.unpack_from(hv, PREFIX_LEN)[4] == 0:
            return True
        if got[0] == FRAME_MAGIC and got[1] == OP_ERROR:
            plen = FRAME_SUFFIX.unpack_from(hv, PREFIX_LEN)[4]
            if plen > MAX_ERROR_PAYLOAD:
                raise self.fail(ProtocolMismatch("oversized error frame", peer_rank=self.left,
                                                 peer_addr=self.left_addr))
            payload = bytearray(plen)
            self._recv_payload(sock, memoryview(payload), self.timeout)
            raise self.fail(self.hooks.from_remote(parse_error_payload(bytes(payload)), self.left))
        raise self.fail(frame_mismatch(hv, expected, left=self.left, rank=self.rank, left_addr=self.left_addr))

    def _check_suffix(self, suffix: tuple, step: int, chunk: int, nbytes: int) -> None:
        st, ch, flags, _count, plen = suffix
        if st != step or ch != chunk or (plen != (0 if flags & F_EMPTY else nbytes)):
            raise self.fail(ProtocolMismatch(
                f"frame from rank {self.left} is step {st} chunk {ch} len {plen}, expected step {step} "
                f"chunk {chunk} len {nbytes} (chunk size or lane count differ?)",
                peer_rank=self.left, peer_addr=self.left_addr))


class LaneWorker:
    """Runs the receive side of lane >= 1 for each operation on a persistent thread."""

    def __init__(self, name: str, lane: int, on_done: Callable[[], None]) -> None:
        self.lane = lane
        self._on_done = on_done
        self.q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.done = threading.Event()
        self.result: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True, name=name)
        self.thread.start()

    def submit(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        """Run `fn(*args)` on this lane's thread; `done` is set when it returns or raises."""
        self.q.put((fn, args))

    def stop(self) -> None:
        self.q.put(STOP)

    def _run(self) -> None:
        while True:
            job = self.q.get()
            if job is STOP:
                return
            fn, args = job
            try:
                fn(*args)
                self.result = None
            except BaseException as e:  # noqa: BLE001 - handed to the calling thread
                self.result = e
            finally:
                self.done.set()
                self._on_done()
