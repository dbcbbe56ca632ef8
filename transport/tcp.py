"""The tcp backend: a pipelined ring allreduce / chain broadcast over plain TCP sockets.

Threading model (measured faster than asyncio/uvloop and than a single-threaded poll loop, see
docs/transport.md): per lane, one persistent sender thread owns the outgoing socket
(`sender.LaneSender`); the calling thread (lane 0) or a persistent worker thread (lanes >= 1)
runs the lane's receive loop (`receiver.LaneReceiver`). Connections and their set-up live in
`links.RingLinks`; the sticky first error and whom to blame in `failure`.

Failure handling: the first error wins and is sticky. The failing rank writes an OP_ERROR frame
forward (after the frame in flight) and backward (on the reverse direction of the incoming
socket), then shuts its sockets so nobody blocks on it; neighbours therefore learn who really
failed instead of blaming the messenger, and the news travels around the ring in milliseconds.
"""

from __future__ import annotations

import logging
import select
import socket
import time
from typing import Any, Callable

from .base import Communicator
from .buffers import as_flat_buffer
from .errors import CommAborted, CommError, ProtocolMismatch
from .failure import FailHooks, FailState, error_from_remote
from .links import RingLinks
from .options import DEFAULT_CHUNK_BYTES, RingOptions
from .receiver import LaneReceiver, LaneWorker
from .ring import LanePlan, allreduce_plan, broadcast_plan
from .sender import SENDER_GRACE_S, LaneSender
from .sockutil import shutdown_quietly
from .wire import (
    FRAME_MAGIC, FRAME_PREFIX, OP_ALLREDUCE, OP_BROADCAST, ST_CLOSED, ST_MISMATCH, ST_OK, Hello, RemoteError,
    pack_error_frame,
)

__all__ = ["TcpCommunicator", "DEFAULT_CHUNK_BYTES"]

logger = logging.getLogger(__name__)

MIN_AUTO_CHUNK = 64 << 10


class TcpCommunicator(Communicator):
    """Ring communicator over TCP. Create it with DataServer.communicator().

    `on_dead(comm)` is called once the communicator has failed or closed, so the server refuses
    later connections for it (it may be called more than once).
    """

    def __init__(self, epoch: int, shard: int, rank: int, peers: list[str], *, timeout: float,
                 connect_timeout: float, options: RingOptions,
                 on_dead: Callable[["TcpCommunicator"], None],
                 on_op: Callable[[str, int, float], None] | None = None) -> None:
        self.epoch = epoch
        self.shard = shard
        self.rank = rank
        self.world = len(peers)
        self.peers = list(peers)
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.chunk_bytes = options.chunk_bytes
        self.lanes = options.lanes
        self.left = (rank - 1) % self.world
        self.right = (rank + 1) % self.world
        self._options = options
        self._on_dead = on_dead
        self._on_op = on_op  # a completed operation: (kind, bytes, seconds), for metrics
        self._fs = FailState()
        self._lock = self._fs.lock
        self._cond = self._fs.cond
        self._hooks = FailHooks(self._fs, self._fail, self._error_from_remote)
        self._links = RingLinks(epoch=epoch, shard=shard, rank=rank, peers=self.peers, options=options,
                                connect_timeout=connect_timeout, hooks=self._hooks)
        self._closed = False
        self._in_op = False
        self._op_seq = 0
        self._op_tag = 0
        self._senders: list[LaneSender] = []
        self._receivers: list[LaneReceiver] = []
        self._workers: list[LaneWorker] = []
        self._connected = False

    # ------------------------------------------------------------------ public API
    @property
    def failed(self) -> CommError | None:
        return self._fs.failed

    def allreduce(self, tensor: Any, *, contribute: bool = True, tag: int = 0,
                  timeout: float | None = None) -> int:
        buf = as_flat_buffer(tensor, reducible=True)
        tmo = self._timeout(timeout)
        tag = int(tag)
        if not -(1 << 63) <= tag < (1 << 63):
            raise ValueError(f"tag {tag} does not fit in 64 bits")
        self._begin_op(tag)
        try:
            if self.world == 1:
                if not contribute:
                    buf.zero(0, buf.nbytes)
                return 1 if contribute else 0
            t0 = time.monotonic()
            self._ensure_connected()
            plans = allreduce_plan(buf.nbytes, buf.itemsize, self.world, self.rank,
                                   self._op_chunk(buf.nbytes // self.world), self.lanes)
            prefix_out = FRAME_PREFIX.pack(FRAME_MAGIC, OP_ALLREDUCE, buf.dtype_code, self.epoch, self.shard,
                                           self.rank, self._op_seq, int(tag), buf.nbytes)
            prefix_in = FRAME_PREFIX.pack(FRAME_MAGIC, OP_ALLREDUCE, buf.dtype_code, self.epoch, self.shard,
                                          self.left, self._op_seq, int(tag), buf.nbytes)
            counts = self._run_lanes(LaneReceiver.allreduce, plans, buf, prefix_out, prefix_in, bool(contribute), tmo)
            if self._on_op is not None:
                self._on_op("allreduce", buf.nbytes, time.monotonic() - t0)
            return counts
        except CommError:
            raise self._finish_failed_op() from None
        except OSError as e:  # a socket closed under us by a concurrent failure, or a real I/O error
            self._fail(CommError(f"socket error: {e!r}"))
            raise self._finish_failed_op() from None
        except BaseException as e:
            self._fail(CommError(f"operation interrupted: {e!r}"))
            self._finish_failed_op()
            raise
        finally:
            self._end_op()

    def broadcast(self, tensor: Any, root: int, *, timeout: float | None = None) -> None:
        buf = as_flat_buffer(tensor, reducible=False)
        if not 0 <= root < self.world:
            raise ValueError(f"root {root} out of range for world {self.world}")
        tmo = self._timeout(timeout)
        self._begin_op(root)
        try:
            if self.world == 1:
                return
            self._ensure_connected()
            plans = broadcast_plan(buf.nbytes, self.world, self.rank, root, self._op_chunk(buf.nbytes), self.lanes)
            prefix_out = FRAME_PREFIX.pack(FRAME_MAGIC, OP_BROADCAST, buf.dtype_code, self.epoch, self.shard,
                                           self.rank, self._op_seq, root, buf.nbytes)
            prefix_in = FRAME_PREFIX.pack(FRAME_MAGIC, OP_BROADCAST, buf.dtype_code, self.epoch, self.shard,
                                          self.left, self._op_seq, root, buf.nbytes)
            self._run_lanes(LaneReceiver.broadcast, plans, buf, prefix_out, prefix_in, root, tmo)
        except CommError:
            raise self._finish_failed_op() from None
        except OSError as e:  # a socket closed under us by a concurrent failure, or a real I/O error
            self._fail(CommError(f"socket error: {e!r}"))
            raise self._finish_failed_op() from None
        except BaseException as e:
            self._fail(CommError(f"operation interrupted: {e!r}"))
            self._finish_failed_op()
            raise
        finally:
            self._end_op()

    def abort(self, reason: str) -> None:
        self._fail(CommAborted(f"aborted: {reason}"))

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._fail(CommAborted("communicator closed"))
        # An op running in another thread was woken by _fail; let it unwind before we close fds.
        deadline = time.monotonic() + 1.0
        with self._cond:
            while self._in_op and time.monotonic() < deadline:
                self._cond.wait(0.05)
        self._stop_threads()
        for s in self._links.lefts + self._links.rights:
            self._links.close_sock(s)
        self._on_dead(self)

    def __repr__(self) -> str:
        return (f"TcpCommunicator(epoch={self.epoch}, shard={self.shard}, rank={self.rank}, "
                f"world={self.world}, failed={self._fs.failed!r})")

    # ------------------------------------------------------------------ called by the DataServer
    def check_hello(self, h: Hello) -> int:
        """Validate an incoming ring connection for this communicator; returns the ack status."""
        if self._fs.failed is not None or self._closed:
            return ST_CLOSED
        if (h.dst != self.rank or h.src != self.left or h.world != self.world or h.lanes != self.lanes
                or h.chunk != self.chunk_bytes or h.lane >= self.lanes):
            self._fail(ProtocolMismatch(
                f"connection from rank {h.src} for (rank {h.dst}, world {h.world}, lanes {h.lanes}, "
                f"chunk {h.chunk}) but this communicator is (rank {self.rank}, world {self.world}, "
                f"left {self.left}, lanes {self.lanes}, chunk {self.chunk_bytes})",
                peer_rank=h.src if h.src < self.world else None))
            return ST_MISMATCH
        if self._links.left_taken(h.lane):
            return ST_MISMATCH
        return ST_OK

    def attach(self, h: Hello, sock: socket.socket) -> None:
        """Take ownership of an accepted, acknowledged connection from the left neighbour."""
        self._links.attach(h.lane, sock)

    # ------------------------------------------------------------------ op bookkeeping
    def _op_chunk(self, seg_bytes: int) -> int:
        """Chunk size for one op: small segments are cut into a few chunks so that consecutive
        ring steps overlap (latency); large ones use the configured size (per-frame overhead).
        Every rank derives the same value from the tensor size."""
        return max(min(self.chunk_bytes, MIN_AUTO_CHUNK), min(self.chunk_bytes, -(-seg_bytes // 4)))

    def _timeout(self, timeout: float | None) -> float:
        t = self.timeout if timeout is None else float(timeout)
        if not t > 0:
            raise ValueError(f"timeout must be > 0, got {timeout}")
        return t

    def peer_started(self) -> bool:
        """The left neighbour has sent the first bytes of an operation while none runs here:
        its lanes are readable (nothing reads them between operations; EOF reads so too, and
        the operation then fails at once)."""
        with self._lock:
            if self._in_op or self._fs.failed is not None:
                return False
            socks = [s for s in self._links.lefts if s is not None]
        if not socks:
            return False
        try:
            readable, _, _ = select.select(socks, [], [], 0)
        except (OSError, ValueError):   # closed meanwhile: an operation will say so
            return False
        return bool(readable)

    def _begin_op(self, tag: int) -> None:
        with self._lock:
            if self._fs.failed is not None:
                raise self._fs.failed.copy()
            if self._in_op:
                raise RuntimeError("another operation is already running on this communicator")
            self._in_op = True
            self._op_seq += 1
            self._op_tag = tag

    def _end_op(self) -> None:
        with self._cond:
            self._in_op = False
            self._cond.notify_all()

    def _ensure_connected(self) -> None:
        if self._connected:
            return
        t0 = time.monotonic()
        links = self._links
        links.connect(t0 + self.connect_timeout)
        name = f"e{self.epoch}s{self.shard}r{self.rank}"
        for lane in range(self.lanes):
            snd = LaneSender(f"p2pft-send-{name}l{lane}", links.rights[lane],  # type: ignore[arg-type]
                             inline=self._options.inline_send, right=self.right,
                             right_addr=self.peers[self.right], hooks=self._hooks, close_sock=links.close_sock)
            self._senders.append(snd)
            snd.start()
            self._receivers.append(LaneReceiver(
                links.lefts[lane], snd, epoch=self.epoch, shard=self.shard, rank=self.rank,  # type: ignore[arg-type]
                world=self.world, left=self.left, left_addr=self.peers[self.left], chunk_bytes=self.chunk_bytes,
                timeout=self.timeout, hooks=self._hooks, ack_timeout=self._options.ack_timeout))
        for lane in range(1, self.lanes):
            self._workers.append(LaneWorker(f"p2pft-recv-{name}l{lane}", lane, self._fs.wake_waiters))
        self._connected = True
        logger.debug("communicator epoch=%d shard=%d rank=%d connected in %.2f ms",
                     self.epoch, self.shard, self.rank, (time.monotonic() - t0) * 1e3)

    def _run_lanes(self, fn: Callable[..., Any], plans: list[LanePlan], *args: Any) -> Any:
        """Run `fn(receiver, plan, *args)` on every lane (lane 0 on this thread); lane 0's result."""
        fs = self._fs
        rx = self._receivers
        with fs.waiter() as waiter:
            for w in self._workers:
                w.done.clear()
                w.submit(fn, (rx[w.lane], plans[w.lane], *args))
            result = fn(rx[0], plans[0], *args)
            for w in self._workers:
                while not w.done.is_set():
                    if fs.failed is not None:
                        raise fs.failed
                    waiter.wait()
                    waiter.clear()
                if w.result is not None:
                    raise w.result
            return result

    # ------------------------------------------------------------------ failure
    def _fail(self, err: CommError) -> CommError:
        """Record the first error, tell both neighbours, wake every thread blocked on this comm."""
        origin = err.origin if err.origin is not None else self.rank
        frame = pack_error_frame(self.epoch, self.shard, self.rank, err, origin, err.tags or None)
        fs = self._fs
        with self._cond:
            if fs.failed is not None:
                return fs.failed
            fs.error_frame = frame
            fs.failed = err
            in_op = self._in_op
            self._cond.notify_all()
        if isinstance(err, CommAborted):
            logger.info("communicator epoch=%d shard=%d rank=%d: %s", self.epoch, self.shard, self.rank, err)
        else:
            logger.warning("communicator epoch=%d shard=%d rank=%d failed: %s", self.epoch, self.shard, self.rank, err)
        links = self._links
        lefts = [s for s in links.lefts if s is not None]
        for s in lefts:  # all frames first: a reader woken below closes every left socket
            try:
                s.send(frame, socket.MSG_DONTWAIT)  # backward: the reverse direction is always empty
            except OSError as e:
                logger.debug("rank %d: backward error frame to rank %d not sent: %r", self.rank, self.left, e)
        for s in lefts:
            if in_op:
                shutdown_quietly(s)     # wakes our reader; it closes the fd when it unwinds
            else:
                links.close_sock(s)     # nobody reads it: close now so the left's sender sees a reset
        fs.io_done.set()
        for snd in self._senders:
            snd.wake()
        if not in_op:
            for w in self._workers:
                w.stop()
            if not self._senders:
                self._farewell_rights(frame)
        fs.wake_waiters()
        # A failed communicator is dead: new connections for it are refused as "closed", and its
        # threads and sockets go away by themselves even if the owner never calls close().
        self._on_dead(self)
        return err

    def _farewell_rights(self, frame: bytes) -> None:
        """Failed while connecting: tell the right neighbour directly, no sender thread will."""
        for s in self._links.rights:
            if s is not None:
                try:
                    s.send(frame, socket.MSG_DONTWAIT)
                except OSError:
                    pass
                self._links.close_sock(s)

    def _finish_failed_op(self) -> CommError:
        """Unwind after an error: readers are out of recv, so close incoming sockets (the left
        neighbour's blocked sender gets a reset and reads our error frame). Senders are not
        waited for: each finishes the frame in flight (so the right neighbour can still parse
        the stream), appends the error frame and exits by itself, bounded by the op timeout.
        After a failed op the tensor's content is undefined."""
        fs = self._fs
        err = fs.failed
        assert err is not None
        err = err.copy()  # each raise gets its own traceback; `failed` keeps the original
        for w in self._workers:
            w.done.wait(1.0)
            w.stop()
        fs.io_done.wait(1.0)  # _fail (maybe on another thread) is done with the left sockets
        for s in self._links.lefts:
            self._links.close_sock(s)
        for snd in self._senders:
            snd.wake()
        if not self._senders and fs.error_frame is not None:
            self._farewell_rights(fs.error_frame)
        return err

    def _error_from_remote(self, r: RemoteError, via: int) -> CommError:
        return error_from_remote(r, via, rank=self.rank, my_tag=self._op_tag, peers=self.peers)

    # ------------------------------------------------------------------ teardown
    def _stop_threads(self) -> None:
        for snd in self._senders:
            snd.stop()
        for w in self._workers:
            w.stop()
        deadline = time.monotonic() + SENDER_GRACE_S
        for snd in self._senders:
            snd.exited.wait(max(0.0, deadline - time.monotonic()))
            if not snd.exited.is_set():
                shutdown_quietly(snd.sock)
        for snd in self._senders:
            snd.thread.join(2.0)
        for w in self._workers:
            w.thread.join(2.0)
        threads = [snd.thread for snd in self._senders] + [w.thread for w in self._workers]
        alive = [t.name for t in threads if t.is_alive()]
        if alive:
            logger.error("threads did not stop: %s", alive)
