"""The tcp backend: a pipelined ring allreduce / chain broadcast over plain TCP sockets.

Threading model (measured faster than asyncio/uvloop and than a single-threaded poll loop, see
docs/transport.md): per lane, one persistent sender thread owns the outgoing socket and writes
queued frames with blocking sendmsg() straight from the tensor's memory; the calling thread
(lane 0) or a persistent worker thread (lanes >= 1) owns the incoming socket, receives with
recv_into() into the tensor (copy phases) or into one chunk-sized scratch buffer (reduce phase,
then numpy adds it in place), and queues the frame that the received chunk unlocks.

Failure handling: the first error wins and is sticky. The failing rank writes an OP_ERROR frame
forward (after the frame in flight) and backward (on the reverse direction of the incoming
socket), then shuts its sockets so nobody blocks on it; neighbours therefore learn who really
failed instead of blaming the messenger, and the news travels around the ring in milliseconds.
"""

from __future__ import annotations

import logging
import queue
import select
import socket
import threading
import time
from typing import TYPE_CHECKING, Any

from .base import Communicator
from .buffers import FlatBuffer, as_flat_buffer
from .errors import CommAborted, CommError, CommTimeout, PeerFailed, ProtocolMismatch
from .ring import LanePlan, allreduce_plan, broadcast_plan
from .wire import (
    FRAME_LEN, FRAME_MAGIC, FRAME_PREFIX, FRAME_SUFFIX, ACK_LEN, KIND_RING, MAX_ERROR_PAYLOAD,
    OP_ALLREDUCE, OP_BROADCAST, OP_ERROR, OP_KEEPALIVE, PREFIX_LEN, F_EMPTY, ST_OK, ST_PENDING, ST_CLOSED, ST_MISMATCH,
    ST_BUSY, STATUS_TEXT, Hello, RemoteError, find_error_frame, pack_error_frame, pack_hello,
    parse_ack, parse_error_payload, recv_exact, recv_exact_timed, send_all_timed, send_nowait, set_io_slice, io_slice,
    source_address, split_addr, tune_socket,
)

if TYPE_CHECKING:
    from .server import DataServer

__all__ = ["TcpCommunicator", "DEFAULT_CHUNK_BYTES"]

logger = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 1 << 20
MIN_AUTO_CHUNK = 64 << 10
# close(): how long to let a sender finish the frame in flight before shutting its socket.
SENDER_GRACE_S = 0.05
# A failing sender's patience for writing the error frame behind the frame in flight.
ERROR_FRAME_GRACE_S = 1.0
_REVERSE_READ_CAP = FRAME_LEN + MAX_ERROR_PAYLOAD

_STOP = object()
_WAKE = object()


class _Sender:
    """Owns one outgoing socket; writes queued frames in order on its own thread.

    The queue holds at most the frames of one operation (bounded by the op's plan) plus a few
    control items; payloads are memoryviews of the caller's tensor, never copies. Every write to
    the socket (by this thread or inline by the producer) happens under `wlock`, and a frame the
    producer started inline is always completed before an error frame, so the receiver can
    always parse the stream.
    """

    def __init__(self, comm: "TcpCommunicator", lane: int, sock: socket.socket, inline: bool) -> None:
        self.comm = comm
        self.lane = lane
        self.sock = sock
        self.inline = inline
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
        self.timeout = 1.0  # op timeout, set by the producer between operations
        self.thread = threading.Thread(
            target=self._run, daemon=True,
            name=f"p2pft-send-e{comm.epoch}s{comm.shard}r{comm.rank}l{lane}")

    def start(self) -> None:
        self.thread.start()

    def _run(self) -> None:
        comm = self.comm
        sock = self.sock
        q = self.q
        try:
            while True:
                job = q.get()
                if comm._failed is not None:
                    self._finish_with_error(job)
                    return
                if job is _STOP:
                    return
                if type(job) is tuple:
                    hdr, payload, queued, _rest = job
                    # No-progress clock: from the later of "this frame was ready" and "the
                    # last byte moved", so a late wake-up of this thread does not stretch it.
                    with self.wlock:
                        self.progress = send_all_timed(sock, (hdr, payload), self.timeout,
                                                       max(queued, self.progress))
                    self.completed += 1
                elif isinstance(job, threading.Event):
                    job.set()
        except TimeoutError:
            comm._fail(CommTimeout(
                f"rank {comm.right} accepted no data for {self.timeout:.3g} s", peer_rank=comm.right,
                peer_addr=comm.peers[comm.right]))
        except OSError as e:
            if comm._failed is None:
                comm._fail(self._blame(e))
        except BaseException as e:  # noqa: BLE001 - never die silently: fail the communicator
            logger.exception("sender thread crashed")
            comm._fail(CommError(f"sender thread crashed: {e!r}"))
        finally:
            if comm._failed is not None:
                comm._close_sock(sock)  # after the error frame and FIN: the data in flight still arrives
            self.exited.set()
            comm._wake_waiters()

    def set_timeout(self, tmo: float) -> None:
        """Called by the lane's receive thread at op start, while no frame of this lane is queued."""
        if tmo != self.timeout:
            set_io_slice(self.sock, io_slice(tmo), recv=False)
            self.timeout = tmo

    def submit(self, hdr: bytes, payload: memoryview | None) -> None:
        """Queue a frame; with `inline`, first try to write it from the calling (receive) thread
        without blocking, which saves a thread wake-up per chunk when the socket has room."""
        comm = self.comm
        if self.inline and self.submitted == self.completed and self.wlock.acquire(blocking=False):
            try:
                if comm._failed is not None:
                    raise comm._failed
                try:
                    rest = send_nowait(self.sock, (hdr, payload))
                except OSError as e:
                    if comm._failed is None:
                        comm._fail(self._blame(e))
                    raise comm._failed from None  # type: ignore[misc]
                now = time.monotonic()
                if not rest:
                    self.progress = now
                    return
                # Partly written: the thread must finish this frame, even after a failure.
                if len(rest) == 1:
                    job = (b"", rest[0], now, True)
                else:
                    job = (rest[0], rest[1], now, True)
                self.submitted += 1
                self.q.put(job)
                return
            finally:
                self.wlock.release()
        if comm._failed is not None:
            raise comm._failed
        self.submitted += 1
        self.q.put((hdr, payload, time.monotonic(), False))

    def _finish_with_error(self, job: Any) -> None:
        """Complete a frame the producer left half-written, then append the error frame."""
        frame = self.comm._error_frame
        grace = min(self.timeout, ERROR_FRAME_GRACE_S)
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
        comm = self.comm
        with self.blame_lock:
            if not self.reverse_read:
                self.reverse = read_reverse_error(self.sock)
                self.reverse_read = True
            remote = self.reverse
        if remote is not None:
            return comm._error_from_remote(remote, comm.right)
        return PeerFailed(f"send to rank {comm.right} failed: {exc.strerror or exc!r}",
                          peer_rank=comm.right, peer_addr=comm.peers[comm.right])


def read_reverse_error(sock: socket.socket) -> RemoteError | None:
    """Read what a peer wrote back on a connection we only send on (its farewell error frame)."""
    data = b""
    try:
        while len(data) < _REVERSE_READ_CAP:
            part = sock.recv(_REVERSE_READ_CAP - len(data), socket.MSG_DONTWAIT)
            if not part:
                break
            data += part
    except OSError:
        pass
    return find_error_frame(data)


class _LaneWorker:
    """Runs the receive side of lane >= 1 for each operation on a persistent thread."""

    def __init__(self, comm: "TcpCommunicator", lane: int) -> None:
        self.comm = comm
        self.lane = lane
        self.q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.done = threading.Event()
        self.result: BaseException | None = None
        self.thread = threading.Thread(
            target=self._run, daemon=True,
            name=f"p2pft-recv-e{comm.epoch}s{comm.shard}r{comm.rank}l{lane}")
        self.thread.start()

    def _run(self) -> None:
        while True:
            job = self.q.get()
            if job is _STOP:
                return
            fn, args = job
            try:
                fn(*args)
                self.result = None
            except BaseException as e:  # noqa: BLE001 - handed to the calling thread
                self.result = e
            finally:
                self.done.set()
                self.comm._wake_waiters()


class TcpCommunicator(Communicator):
    """Ring communicator over TCP. Create it with DataServer.communicator()."""

    def __init__(self, server: "DataServer", epoch: int, shard: int, rank: int, peers: list[str], *,
                 timeout: float, connect_timeout: float, chunk_bytes: int, lanes: int,
                 sock_bufsize: int | None, secret: bytes | None, inline_send: bool = True) -> None:
        self.epoch = epoch
        self.shard = shard
        self.rank = rank
        self.world = len(peers)
        self.peers = list(peers)
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.chunk_bytes = chunk_bytes
        self.lanes = lanes
        self.left = (rank - 1) % self.world
        self.right = (rank + 1) % self.world
        self._server = server
        self._secret = secret
        self._bufsize = sock_bufsize
        self._inline = inline_send
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._failed: CommError | None = None
        self._error_frame: bytes | None = None
        self._fail_io_done = threading.Event()
        self._closed = False
        self._in_op = False
        self._op_seq = 0
        self._op_tag = 0
        self._lefts: list[socket.socket | None] = [None] * lanes
        self._rights: list[socket.socket | None] = [None] * lanes
        self._closed_socks: set[int] = set()
        self._senders: list[_Sender] = []
        self._workers: list[_LaneWorker] = []
        self._connected = False
        self._waiters: set[threading.Event] = set()
        self._scratch: list[bytearray] = [bytearray(0) for _ in range(lanes)]
        self._hdr = [bytearray(FRAME_LEN) for _ in range(lanes)]
        self._recv_tmo = [-1.0] * lanes

    # ------------------------------------------------------------------ public API
    @property
    def failed(self) -> CommError | None:
        return self._failed

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
            counts = self._run_lanes(self._allreduce_lane, plans, buf, prefix_out, prefix_in, bool(contribute), tmo)
            self._server.note_op("allreduce", buf.nbytes, time.monotonic() - t0)
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
            self._run_lanes(self._broadcast_lane, plans, buf, prefix_out, prefix_in, root, tmo)
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
        for s in self._lefts + self._rights:
            self._close_sock(s)
        self._server._unregister(self)

    def __repr__(self) -> str:
        return (f"TcpCommunicator(epoch={self.epoch}, shard={self.shard}, rank={self.rank}, "
                f"world={self.world}, failed={self._failed!r})")

    def _op_chunk(self, seg_bytes: int) -> int:
        """Chunk size for one op: small segments are cut into a few chunks so that consecutive
        ring steps overlap (latency); large ones use the configured size (per-frame overhead).
        Every rank derives the same value from the tensor size."""
        return max(min(self.chunk_bytes, MIN_AUTO_CHUNK), min(self.chunk_bytes, -(-seg_bytes // 4)))

    # ------------------------------------------------------------------ op bookkeeping
    def _timeout(self, timeout: float | None) -> float:
        t = self.timeout if timeout is None else float(timeout)
        if not t > 0:
            raise ValueError(f"timeout must be > 0, got {timeout}")
        return t

    def _begin_op(self, tag: int) -> None:
        with self._lock:
            if self._failed is not None:
                raise _copy(self._failed)
            if self._in_op:
                raise RuntimeError("another operation is already running on this communicator")
            self._in_op = True
            self._op_seq += 1
            self._op_tag = tag

    def _end_op(self) -> None:
        with self._cond:
            self._in_op = False
            self._cond.notify_all()

    def _finish_failed_op(self) -> CommError:
        """Unwind after an error: readers are out of recv, so close incoming sockets (the left
        neighbour's blocked sender gets a reset and reads our error frame). Senders are not
        waited for: each finishes the frame in flight (so the right neighbour can still parse
        the stream), appends the error frame and exits by itself, bounded by the op timeout.
        After a failed op the tensor's content is undefined."""
        err = self._failed
        assert err is not None
        err = _copy(err)  # each raise gets its own traceback; `failed` keeps the original
        for w in self._workers:
            w.done.wait(1.0)
            w.q.put(_STOP)
        self._fail_io_done.wait(1.0)  # _fail (maybe on another thread) is done with the left sockets
        for s in self._lefts:
            self._close_sock(s)
        for snd in self._senders:
            snd.q.put(_WAKE)
        if not self._senders:
            # Failed while connecting: tell the right neighbour directly, nobody else will.
            for s in self._rights:
                if s is not None and self._error_frame is not None:
                    try:
                        s.send(self._error_frame, socket.MSG_DONTWAIT)
                    except OSError:
                        pass
                    self._close_sock(s)
        return err

    # ------------------------------------------------------------------ failure
    def _fail(self, err: CommError, tags: dict[int, int] | None = None) -> CommError:
        """Record the first error, tell both neighbours, wake every thread blocked on this comm."""
        origin = self.rank
        remote_origin = getattr(err, "_origin", None)
        if remote_origin is not None:
            origin = remote_origin
        frame = pack_error_frame(self.epoch, self.shard, self.rank, err, origin, tags or getattr(err, "_tags", None))
        with self._cond:
            if self._failed is not None:
                return self._failed
            self._error_frame = frame
            self._failed = err
            in_op = self._in_op
            self._cond.notify_all()
        if isinstance(err, CommAborted):
            logger.info("communicator epoch=%d shard=%d rank=%d: %s", self.epoch, self.shard, self.rank, err)
        else:
            logger.warning("communicator epoch=%d shard=%d rank=%d failed: %s", self.epoch, self.shard, self.rank, err)
        lefts = [s for s in self._lefts if s is not None]
        for s in lefts:  # all frames first: a reader woken below closes every left socket
            try:
                s.send(frame, socket.MSG_DONTWAIT)  # backward: the reverse direction is always empty
            except OSError as e:
                logger.debug("rank %d: backward error frame to rank %d not sent: %r", self.rank, self.left, e)
        for s in lefts:
            if in_op:
                _shutdown(s)          # wakes our reader; it closes the fd when it unwinds
            else:
                self._close_sock(s)   # nobody reads it: close now so the left's sender sees a reset
        self._fail_io_done.set()
        for snd in self._senders:
            snd.q.put(_WAKE)
        if not in_op:
            for w in self._workers:
                w.q.put(_STOP)
            if not self._senders:
                for s in self._rights:
                    if s is not None:
                        try:
                            s.send(frame, socket.MSG_DONTWAIT)
                        except OSError:
                            pass
                        self._close_sock(s)
        self._wake_waiters()
        # A failed communicator is dead: new connections for it are refused as "closed", and its
        # threads and sockets go away by themselves even if the owner never calls close().
        self._server._unregister(self)
        return err

    def _wake_waiters(self) -> None:
        with self._lock:
            ws = list(self._waiters)
        for ev in ws:
            ev.set()

    def _error_from_remote(self, r: RemoteError, via: int) -> CommError:
        """Rebuild the error a neighbour reported so this rank blames the same peer."""
        if r.cls is ProtocolMismatch and r.tags:
            mine = self._op_tag
            for rk, tg in sorted(r.tags.items()):
                if rk != self.rank and tg != mine:
                    err = ProtocolMismatch(
                        f"tag mismatch: rank {rk} has tag {tg}, this rank {mine} (reported by rank {r.origin})",
                        peer_rank=rk, peer_addr=self._addr(rk))
                    err._origin = r.origin  # type: ignore[attr-defined]
                    err._tags = {**r.tags, self.rank: mine}  # type: ignore[attr-defined]
                    return err
        peer = r.peer_rank
        if r.cls is CommAborted and peer is None:
            peer = r.origin
        addr = r.peer_addr if r.peer_addr is not None else self._addr(peer)
        if r.cls is CommAborted and r.peer_rank is None:
            reason = f"rank {r.origin} {r.reason}"
        elif r.origin == peer:
            reason = r.reason
        else:
            reason = f"{r.reason} (reported by rank {r.origin})"
        if via != r.origin:
            reason += f" (relayed by rank {via})"
        err = r.cls(reason, peer_rank=peer, peer_addr=addr)
        err._origin = r.origin  # type: ignore[attr-defined]
        if r.tags:
            err._tags = dict(r.tags)  # type: ignore[attr-defined]
        return err

    def _addr(self, rank: int | None) -> str | None:
        if rank is None or not 0 <= rank < self.world:
            return None
        return self.peers[rank]

    # ------------------------------------------------------------------ connections
    def _check_hello(self, h: Hello) -> int:
        """Validate an incoming ring connection for this communicator (called by the server)."""
        if self._failed is not None or self._closed:
            return ST_CLOSED
        if (h.dst != self.rank or h.src != self.left or h.world != self.world or h.lanes != self.lanes
                or h.chunk != self.chunk_bytes or h.lane >= self.lanes):
            self._fail(ProtocolMismatch(
                f"connection from rank {h.src} for (rank {h.dst}, world {h.world}, lanes {h.lanes}, "
                f"chunk {h.chunk}) but this communicator is (rank {self.rank}, world {self.world}, "
                f"left {self.left}, lanes {self.lanes}, chunk {self.chunk_bytes})",
                peer_rank=h.src if h.src < self.world else None))
            return ST_MISMATCH
        with self._lock:
            if self._lefts[h.lane] is not None:
                return ST_MISMATCH
        return ST_OK

    def _attach(self, h: Hello, sock: socket.socket) -> None:
        """Take ownership of an accepted, acknowledged connection from the left neighbour."""
        with self._cond:
            if self._failed is None and self._lefts[h.lane] is None:
                self._lefts[h.lane] = sock
                self._cond.notify_all()
                return
        _close_quietly(sock)

    def _ensure_connected(self) -> None:
        if self._connected:
            return
        t0 = time.monotonic()
        deadline = t0 + self.connect_timeout
        for lane in range(self.lanes):
            if self._rights[lane] is None:
                s = self._connect_lane(lane, deadline)
                with self._lock:
                    self._rights[lane] = s
                    failed = self._failed
                if failed is not None:
                    raise failed
        while True:
            with self._cond:
                if self._failed is not None or all(s is not None for s in self._lefts):
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(min(left, 0.05))
            self._watch_rights()
        if self._failed is not None:
            raise self._failed
        if any(s is None for s in self._lefts):
            raise self._fail(CommTimeout(
                f"rank {self.left} did not connect within connect_timeout={self.connect_timeout:g} s",
                peer_rank=self.left, peer_addr=self.peers[self.left]))
        for lane in range(self.lanes):
            snd = _Sender(self, lane, self._rights[lane], self._inline)  # type: ignore[arg-type]
            self._senders.append(snd)
            snd.start()
        for lane in range(1, self.lanes):
            self._workers.append(_LaneWorker(self, lane))
        self._connected = True
        logger.debug("communicator epoch=%d shard=%d rank=%d connected in %.2f ms",
                     self.epoch, self.shard, self.rank, (time.monotonic() - t0) * 1e3)

    def _watch_rights(self) -> None:
        """While waiting for the left neighbour, notice a right neighbour that already dropped
        our connection (its server expired or refused it and left an error frame behind)."""
        socks = [s for s in self._rights if s is not None]
        if not socks:
            return
        poller = select.poll()
        byfd = {}
        for s in socks:
            try:
                poller.register(s, select.POLLIN)
                byfd[s.fileno()] = s
            except (OSError, ValueError):
                return
        for fd, _ev in poller.poll(0):
            s = byfd[fd]
            remote = read_reverse_error(s)
            if remote is not None:
                self._fail(self._error_from_remote(remote, self.right))
            else:
                self._fail(PeerFailed(f"rank {self.right} closed the connection before the first operation",
                                      peer_rank=self.right, peer_addr=self.peers[self.right]))
            return

    def _connect_lane(self, lane: int, deadline: float) -> socket.socket:
        """Connect to the right neighbour, retrying with backoff while its server is not up."""
        host, port = split_addr(self.peers[self.right])
        source = source_address(getattr(self._server, "_host", None), host)
        backoff = 0.002
        last = "no attempt"
        peer = dict(peer_rank=self.right, peer_addr=self.peers[self.right])
        while True:
            if self._failed is not None:
                raise self._failed
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if "refused" in last:
                    raise self._fail(PeerFailed(f"cannot connect to rank {self.right}: {last}", **peer))
                raise self._fail(CommTimeout(f"cannot connect to rank {self.right} within "
                                             f"connect_timeout={self.connect_timeout:g} s: {last}", **peer))
            sock = None
            # A fresh hello (time + nonce) per attempt: servers accept each hello only once.
            hello = pack_hello(self._secret, KIND_RING, self.epoch, self.shard, self.rank, self.right,
                               self.world, lane, self.lanes, self.chunk_bytes)
            try:
                sock = socket.create_connection((host, port), timeout=min(remaining, 2.0), source_address=source)
                tune_socket(sock, self._bufsize)
                sock.sendall(hello)
                ack = bytearray(ACK_LEN)
                recv_exact(sock, memoryview(ack))
                status = parse_ack(self._secret, hello, bytes(ack))
                if status in (ST_OK, ST_PENDING):
                    sock.settimeout(None)
                    return sock
                _close_quietly(sock)
                sock = None
                if status == ST_BUSY:
                    last = "peer busy"
                elif status == ST_CLOSED:
                    raise self._fail(CommAborted(
                        f"rank {self.right} already closed its communicator of epoch {self.epoch}", **peer))
                else:
                    raise self._fail(ProtocolMismatch(
                        f"rank {self.right} rejected the connection: {STATUS_TEXT.get(status, status)}", **peer))
            except ProtocolMismatch as e:
                if sock is not None:
                    _close_quietly(sock)
                if e.peer_rank is None:
                    e = ProtocolMismatch(e.reason, **peer)
                raise self._fail(e) from None
            except CommError:
                if sock is not None:
                    _close_quietly(sock)
                raise
            except (ConnectionRefusedError, socket.timeout, TimeoutError, EOFError, OSError) as e:
                if sock is not None:
                    _close_quietly(sock)
                last = "connection refused" if isinstance(e, ConnectionRefusedError) else repr(e)
            with self._cond:
                if self._failed is None:
                    self._cond.wait(min(backoff, max(0.0, deadline - time.monotonic())))
            backoff = min(backoff * 2, 0.2)

    # ------------------------------------------------------------------ data movement
    def _run_lanes(self, fn: Any, plans: list[LanePlan], *args: Any) -> Any:
        waiter = threading.Event()
        with self._lock:
            self._waiters.add(waiter)
        try:
            for w in self._workers:
                w.done.clear()
                w.q.put((fn, (w.lane, plans[w.lane], *args)))
            result = fn(0, plans[0], *args)
            for w in self._workers:
                while not w.done.is_set():
                    if self._failed is not None:
                        raise self._failed
                    waiter.wait()
                    waiter.clear()
                if w.result is not None:
                    raise w.result
            return result
        finally:
            with self._lock:
                self._waiters.discard(waiter)

    def _drain(self, snd: _Sender, tmo: float) -> None:
        """Wait until the sender has written everything queued for this op (the caller may reuse
        the tensor as soon as the op returns)."""
        if snd.submitted == snd.completed:
            if self._failed is not None:
                raise self._failed
            return  # everything was written inline or the sender already finished
        ev = threading.Event()
        with self._lock:
            self._waiters.add(ev)
        try:
            snd.q.put(ev)
            deadline = time.monotonic() + tmo + SENDER_GRACE_S
            while not ev.is_set():
                if self._failed is not None:
                    raise self._failed
                if snd.exited.is_set():
                    raise self._failed or self._fail(CommError("sender stopped"))
                left = deadline - time.monotonic()
                if left <= 0:
                    raise self._fail(CommTimeout(
                        f"rank {self.right} did not take our data within {tmo:.3g} s",
                        peer_rank=self.right, peer_addr=self.peers[self.right]))
                ev.wait(left)
            if self._failed is not None:
                raise self._failed
        finally:
            with self._lock:
                self._waiters.discard(ev)

    def _set_recv_slice(self, lane: int, sock: socket.socket, tmo: float) -> None:
        if self._recv_tmo[lane] != tmo:
            set_io_slice(sock, io_slice(tmo), send=False)
            self._recv_tmo[lane] = tmo

    def _recv_header(self, sock: socket.socket, hv: memoryview, prefix_in: bytes, tmo: float,
                     idle: Any) -> tuple:
        while True:
            try:
                recv_exact_timed(sock, hv, tmo, idle)
            except TimeoutError:
                raise self._fail(CommTimeout(
                    f"no data from rank {self.left} for {tmo:.3g} s", peer_rank=self.left,
                    peer_addr=self.peers[self.left])) from None
            except (EOFError, OSError) as e:
                raise self._reader_lost(e) from None
            if hv[:PREFIX_LEN] == prefix_in or not self._bad_prefix(sock, hv, prefix_in):
                return FRAME_SUFFIX.unpack_from(hv, PREFIX_LEN)
            # A keepalive: the left neighbour is alive and itself starved; keep waiting.

    def _idle_hook(self, snd: _Sender, tmo: float) -> Any:
        """While this thread starves on its left neighbour, tell the right neighbour every
        timeout/4 that we are alive (a keepalive frame when nothing else is queued), so that
        only the rank next to a stalled peer times out on it and the others hear its verdict
        instead of blaming their own, innocent, left neighbour."""
        every = tmo / 4
        frame = FRAME_PREFIX.pack(FRAME_MAGIC, OP_KEEPALIVE, 0, self.epoch, self.shard, self.rank, 0, 0, 0) \
            + FRAME_SUFFIX.pack(0, 0, 0, 0, 0)
        state = [every]

        def idle(waited: float) -> None:
            if waited >= state[0]:
                state[0] = waited + every
                if snd.submitted == snd.completed:
                    snd.submit(frame, None)

        return idle

    def _recv_payload(self, sock: socket.socket, view: memoryview, tmo: float, idle: Any = None) -> None:
        try:
            recv_exact_timed(sock, view, tmo, idle)
        except TimeoutError:
            raise self._fail(CommTimeout(
                f"no data from rank {self.left} for {tmo:.3g} s", peer_rank=self.left,
                peer_addr=self.peers[self.left])) from None
        except (EOFError, OSError) as e:
            raise self._reader_lost(e) from None

    def _reader_lost(self, e: BaseException) -> CommError:
        if self._failed is not None:
            return self._failed
        why = "closed the connection" if isinstance(e, EOFError) else f"connection failed ({e!r})"
        return self._fail(PeerFailed(f"rank {self.left} {why}", peer_rank=self.left,
                                     peer_addr=self.peers[self.left]))

    def _bad_prefix(self, sock: socket.socket, hv: memoryview, expected: bytes) -> bool:
        """Slow path: True for a keepalive; raises for an error frame from the left or a frame
        of another op/epoch/tag."""
        got = FRAME_PREFIX.unpack_from(hv)
        exp = FRAME_PREFIX.unpack(expected)
        peer = dict(peer_rank=self.left, peer_addr=self.peers[self.left])
        if got[0] == FRAME_MAGIC and got[1] == OP_KEEPALIVE and got[3:6] == exp[3:6] \
                and FRAME_SUFFIX.unpack_from(hv, PREFIX_LEN)[4] == 0:
            return True
        if got[0] == FRAME_MAGIC and got[1] == OP_ERROR:
            plen = FRAME_SUFFIX.unpack_from(hv, PREFIX_LEN)[4]
            if plen > MAX_ERROR_PAYLOAD:
                raise self._fail(ProtocolMismatch("oversized error frame", **peer))
            payload = bytearray(plen)
            self._recv_payload(sock, memoryview(payload), self.timeout)
            raise self._fail(self._error_from_remote(parse_error_payload(bytes(payload)), self.left))
        names = ("magic", "op", "dtype", "epoch", "shard", "src rank", "op seq", "tag", "total bytes")
        if got[0] != FRAME_MAGIC:
            raise self._fail(ProtocolMismatch("stream out of sync (bad frame magic)", **peer))
        if got[1:7] == exp[1:7] and got[7] != exp[7]:
            what = "tag" if exp[1] == OP_ALLREDUCE else "broadcast root"
            err = ProtocolMismatch(f"{what} mismatch: rank {self.left} has {got[7]}, this rank {exp[7]}", **peer)
            raise self._fail(err, tags={self.left: got[7], self.rank: exp[7]})
        diffs = [f"{n} {g} != {x}" for n, g, x in zip(names, got, exp) if g != x]
        raise self._fail(ProtocolMismatch(f"frame from rank {self.left} does not match this op: "
                                          + ", ".join(diffs), **peer))

    def _check_suffix(self, suffix: tuple, step: int, chunk: int, nbytes: int) -> None:
        st, ch, flags, _count, plen = suffix
        if st != step or ch != chunk or (plen != (0 if flags & F_EMPTY else nbytes)):
            raise self._fail(ProtocolMismatch(
                f"frame from rank {self.left} is step {st} chunk {ch} len {plen}, expected step {step} "
                f"chunk {chunk} len {nbytes} (chunk size or lane count differ?)",
                peer_rank=self.left, peer_addr=self.peers[self.left]))

    def _allreduce_lane(self, lane: int, plan: LanePlan, buf: FlatBuffer, prefix_out: bytes, prefix_in: bytes,
                        contrib: bool, tmo: float) -> int:
        sock = self._lefts[lane]
        snd = self._senders[lane]
        assert sock is not None
        self._set_recv_slice(lane, sock, tmo)
        snd.set_timeout(tmo)
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
        if len(self._scratch[lane]) < self.chunk_bytes:
            self._scratch[lane] = bytearray(self.chunk_bytes)
        scratch = memoryview(self._scratch[lane])
        hv = memoryview(self._hdr[lane])
        idle = self._idle_hook(snd, tmo)
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
                    raise self._fail(ProtocolMismatch(
                        f"rank {self.left} reports {count} contributors, this rank counted {total}",
                        peer_rank=self.left, peer_addr=self.peers[self.left]))
                if total < 0:
                    total = count
            if nxt >= 0:
                g = sends[nxt]
                if out_empty:
                    put(prefix_out + pack(g.step, g.chunk, F_EMPTY, count, 0), None)
                else:
                    put(prefix_out + pack(g.step, g.chunk, 0, count, g.nbytes), mv[g.off:g.off + g.nbytes])
        self._drain(snd, tmo)
        return total

    def _broadcast_lane(self, lane: int, plan: LanePlan, buf: FlatBuffer, prefix_out: bytes, prefix_in: bytes,
                        root: int, tmo: float) -> None:
        sock = self._lefts[lane]
        snd = self._senders[lane]
        assert sock is not None
        self._set_recv_slice(lane, sock, tmo)
        snd.set_timeout(tmo)
        mv = buf.mv
        pack = FRAME_SUFFIX.pack
        put = snd.submit
        for i in range(plan.first_sends):
            f = plan.sends[i]
            put(prefix_out + pack(f.step, f.chunk, 0, root, f.nbytes), mv[f.off:f.off + f.nbytes])
        hv = memoryview(self._hdr[lane])
        idle = self._idle_hook(snd, tmo)
        for f, _reduce, nxt in plan.recvs:
            suffix = self._recv_header(sock, hv, prefix_in, tmo, idle)
            self._check_suffix(suffix, f.step, f.chunk, f.nbytes)
            if f.nbytes:
                self._recv_payload(sock, mv[f.off:f.off + f.nbytes], tmo, idle)
            if nxt >= 0:
                put(prefix_out + pack(f.step, f.chunk, 0, root, f.nbytes), mv[f.off:f.off + f.nbytes])
        self._drain(snd, tmo)

    # ------------------------------------------------------------------ teardown
    def _stop_threads(self) -> None:
        for snd in self._senders:
            snd.q.put(_STOP)
        for w in self._workers:
            w.q.put(_STOP)
        deadline = time.monotonic() + SENDER_GRACE_S
        for snd in self._senders:
            snd.exited.wait(max(0.0, deadline - time.monotonic()))
            if not snd.exited.is_set():
                _shutdown(snd.sock)
        for snd in self._senders:
            snd.thread.join(2.0)
        for w in self._workers:
            w.thread.join(2.0)
        alive = [t.thread.name for t in (*self._senders, *self._workers) if t.thread.is_alive()]
        if alive:
            logger.error("threads did not stop: %s", alive)

    def _close_sock(self, s: socket.socket | None) -> None:
        if s is None:
            return
        with self._lock:
            if id(s) in self._closed_socks:
                return
            self._closed_socks.add(id(s))
        _shutdown(s)
        _close_quietly(s)


def _copy(err: CommError) -> CommError:
    new = type(err)(err.reason, peer_rank=err.peer_rank, peer_addr=err.peer_addr)
    for attr in ("_origin", "_tags"):
        if hasattr(err, attr):
            setattr(new, attr, getattr(err, attr))
    return new


def _shutdown(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _close_quietly(s: socket.socket) -> None:
    try:
        s.close()
    except OSError:
        pass
