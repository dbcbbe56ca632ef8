"""DataServer: the one listening data-plane socket of a process.

One acceptor thread multiplexes (selectors) new connections through their handshake and routes
each one: ring connections to the communicator of their (epoch, shard) — or, if this process has
not created it yet, to a bounded pending table that expires entries — and state-streaming
connections to a bounded pool of donor threads.

Hostile input is bounded and never fatal: at most ``max_handshakes`` connections may be waiting
for their handshake (more are closed at once), each for ``handshake_timeout``; a hello with a
bad MAC, another version, or one already seen (``HelloGuard``: replay) is refused; a state
stream whose joiner stops reading is dropped after ``state_timeout``. Each case has a counter in
``DataServer.counters`` and a WARNING line (at most one per kind every few seconds).
"""

from __future__ import annotations

import collections
import logging
import selectors
import socket
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Protocol

from .backend import Backend
from .errors import CommTimeout, ProtocolMismatch
from .devcopy import prime_pinned
from .nccl import NcclCommunicator
from .ncclid import KIND_NCCL_ID
from .options import (DEFAULT_CHUNK_BYTES, DEFAULT_STATE_CHUNK_BYTES, RING_ACK_TIMEOUT_S, ChunkHook, DonorLimits,
                      RingOptions, configured_bufsize, ring_bufsize_for)
from .sockutil import close_quietly, shutdown_quietly
from .stream import StateSnapshot, serve_state_connection
from .staging import DEFAULT_PIECE_BYTES, StagingTcpCommunicator
from .wire import (
    HELLO_LEN, KIND_RING, KIND_STATE, ST_BAD, ST_BUSY, ST_CLOSED, ST_MISMATCH, ST_NO_STATE, ST_OK, ST_PENDING,
    ST_REPLAY, Hello, HelloGuard, pack_ack, pack_error_frame, parse_hello, split_addr, tune_socket,
)

if TYPE_CHECKING:
    from .base import Communicator

__all__ = ["DataServer"]

logger = logging.getLogger(__name__)

_TICK_S = 0.1
_CLOSED_KEYS_CAP = 4096
_LOG_EVERY_S = 5.0


class _Registered(Protocol):
    """What the server needs of a communicator it routes connections to (tcp or nccl)."""

    epoch: int
    shard: int
    hello_kind: int

    def check_hello(self, h: Hello) -> int: ...
    def attach(self, h: Hello, sock: socket.socket) -> None: ...
    def reject_kind(self, h: Hello) -> None: ...
    def peer_started(self) -> bool: ...
    def close(self) -> None: ...


class _Handshake:
    __slots__ = ("sock", "buf", "got", "deadline")

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock = sock
        self.buf = bytearray(HELLO_LEN)
        self.got = 0
        self.deadline = deadline


class DataServer:
    """Listening data-plane socket shared by all communicators of all epochs and by state streaming.

    Parameters beyond the address tune the whole process (all ranks of a communicator must use
    the same `chunk_bytes` and `lanes`; a mismatch is reported as ProtocolMismatch).
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, secret: bytes | None = None,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, lanes: int = 1, sock_bufsize: int | None = None,
                 pending_timeout: float = 30.0, max_pending: int = 256, handshake_timeout: float = 5.0,
                 max_state_streams: int = 2, state_rate_limit: float | None = None,
                 state_chunk_bytes: int = DEFAULT_STATE_CHUNK_BYTES, state_timeout: float = 60.0,
                 inline_send: bool = True, max_handshakes: int = 1024, replay_window: float = 30.0) -> None:
        if secret is not None and not isinstance(secret, (bytes, bytearray)):
            raise TypeError("secret must be bytes or None")
        if chunk_bytes < 64 or lanes < 1 or lanes > 64:
            raise ValueError(f"bad chunk_bytes={chunk_bytes} / lanes={lanes} "
                             "(need chunk_bytes >= 64, 1 <= lanes <= 64)")
        self.secret = bytes(secret) if secret is not None else None
        self.chunk_bytes = int(chunk_bytes)
        self.lanes = int(lanes)
        self.sock_bufsize = configured_bufsize(sock_bufsize)
        self.inline_send = inline_send
        self.pending_timeout = pending_timeout
        self.max_pending = max_pending
        self.handshake_timeout = handshake_timeout
        self.max_state_streams = max_state_streams
        #: bytes/s cap for state streams served by this process (None: unlimited).
        self.state_rate_limit = state_rate_limit
        self.state_chunk_bytes = state_chunk_bytes
        #: donor side: seconds without progress before a state stream to a stalled joiner is dropped.
        self.state_timeout = state_timeout
        #: fault-injection hook for tests: (chunk seq, payload) -> payload actually sent.
        self.state_chunk_hook: ChunkHook | None = None
        #: RingOptions.ack_timeout of this process's rings (None: off). A runtime sets it from
        #: its timing profile; docs/control-plane.md says how it was chosen.
        self.ring_ack_timeout: float | None = RING_ACK_TIMEOUT_S

        self.max_handshakes = int(max_handshakes)
        #: rejections and drops, by kind (see the module docstring)
        self.counters: collections.Counter[str] = collections.Counter()
        #: completed collectives: count, bytes and seconds by op (read by the metrics at scrape time)
        self.ops: collections.defaultdict[str, float] = collections.defaultdict(int)  # counts, bytes, seconds
        self._guard = HelloGuard(window=replay_window)
        self._last_log: dict[str, float] = {}

        self._lsock = socket.create_server((host, port), backlog=256)
        self._lsock.setblocking(False)
        self._host = host
        self._port = self._lsock.getsockname()[1]
        # Re-entrant: a communicator that fails inside check_hello (called under this lock)
        # unregisters itself.
        self._lock = threading.RLock()
        self._comms: dict[tuple[int, int], _Registered] = {}
        #: test hook: makes the NCCL unique id on rank 0 (default: cupy's get_unique_id)
        self.nccl_uid_factory: Callable[[], bytes] | None = None
        #: staging piece size of CUDA tensors on the tcp backend (see staging.py)
        self.piece_bytes = DEFAULT_PIECE_BYTES
        self._pending: dict[tuple[int, int], list[tuple[socket.socket, Hello, float]]] = {}
        self._npending = 0
        self._closed_keys: collections.OrderedDict[tuple[int, int], None] = collections.OrderedDict()
        self._provider: Callable[[dict], StateSnapshot | None] | None = None
        self._streams: dict[int, tuple[threading.Thread, socket.socket]] = {}
        self._stream_seq = 0
        self._closing = threading.Event()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._lsock, selectors.EVENT_READ, None)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._handshakes: dict[int, _Handshake] = {}
        self._thread = threading.Thread(target=self._loop, daemon=True, name=f"p2pft-data-server-{self._port}")
        self._thread.start()
        logger.info("data server listening on %s", self.addr)

    # ------------------------------------------------------------------ public API
    @property
    def host(self) -> str:
        """The IP this server listens on: also the source of this process's outgoing data
        connections (communicators, ``fetch_state(source_host=...)``), as peers see it."""
        return self._host

    @property
    def addr(self) -> str:
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"{host}:{self._port}"

    def communicator(self, epoch: int, shard: int, rank: int, peers: list[str], *, timeout: float = 10.0,
                     connect_timeout: float = 5.0, backend: "Backend | str" = Backend.TCP,
                     device: int | None = None) -> "Communicator":
        """Create the communicator of (epoch, shard) in which this process is `rank`.

        peers[i] is the data address of rank i (peers[rank] is this server). tcp: connections are
        made lazily by the first operation, which waits up to `connect_timeout` for the
        neighbours; CUDA tensors go through pinned staging. nccl: rank 0 hands the unique id to
        the others within `connect_timeout` and ncclCommInitRank runs on a helper thread on CUDA
        device `device` (default: the caller's current one); every rank must pick the same backend."""
        try:
            backend = Backend(backend)
        except ValueError:
            raise ValueError(f"unknown backend {backend!r}; choose 'tcp' or 'nccl'") from None
        if self._closing.is_set():
            raise RuntimeError("data server is closed")
        if epoch < 0 or shard < 0:
            raise ValueError(f"epoch and shard must be >= 0, got epoch={epoch} shard={shard}")
        if not peers:
            raise ValueError("peers must list at least this rank's address")
        if not 0 <= rank < len(peers):
            raise ValueError(f"rank {rank} out of range for {len(peers)} peers")
        for p in peers:
            split_addr(p)
        if not (timeout > 0 and connect_timeout > 0):
            raise ValueError("timeout and connect_timeout must be > 0")
        key = (int(epoch), int(shard))
        comm: Any
        if backend.nccl:  # auto: ranks on one device make a TCP ring with self.communicator
            comm = NcclCommunicator(key[0], key[1], int(rank), len(peers), None, timeout=float(timeout),
                                    device=device, peers=list(peers), options=self._ring_options(peers, rank),
                                    connect_timeout=float(connect_timeout), on_dead=self._unregister,
                                    make_uid=self.nccl_uid_factory,
                                    fallback=self.communicator if backend is Backend.NCCL_AUTO else None)
        else:
            comm = StagingTcpCommunicator(key[0], key[1], int(rank), list(peers), timeout=float(timeout),
                                          connect_timeout=float(connect_timeout),
                                          options=self._ring_options(peers, rank),
                                          on_dead=self._unregister, on_op=self.note_op,
                                          piece_bytes=self.piece_bytes)
        with self._lock:
            if key in self._comms:
                raise ValueError(f"a communicator for epoch {epoch} shard {shard} already exists")
            self._closed_keys.pop(key, None)
            self._comms[key] = comm
            waiting = self._pending.pop(key, [])
            self._npending -= len(waiting)
        for sock, hello, _t in waiting:
            if hello.kind != comm.hello_kind:
                comm.reject_kind(hello)
                self._reject_pending(sock, hello, "the ranks use different data planes")
            elif comm.check_hello(hello) == ST_OK:
                comm.attach(hello, sock)
            else:
                self._reject_pending(sock, hello, "communicator parameters differ")
        return comm

    def calling(self, min_epoch: int, shard: int) -> bool:
        """A peer has started a collective of data epoch `min_epoch` or later with us on `shard`:
        its ring connection waits here for a communicator not built yet, or its first bytes on
        one built earlier (a DiLoCo replica back mid-span trains until then; ``offring.py``)."""
        with self._lock:
            if any(e >= min_epoch and s == shard and any(h.kind == KIND_RING for _, h, _ in socks)
                   for (e, s), socks in self._pending.items()):
                return True
            comms = [c for (e, s), c in self._comms.items() if e >= min_epoch and s == shard]
        # A ring this process built earlier at that epoch keeps its connections between
        # operations: there the call is the neighbour's first bytes.
        return any(c.peer_started() for c in comms)

    def serve_state(self, provider: Callable[[dict], "StateSnapshot | None"]) -> None:
        """Register the donor callback: provider(request) -> snapshot (None: nothing to give).
        Where there is a device, the pinned chunk buffers of a donor and of a joiner are
        allocated now, before training: a pinned allocation synchronizes the device implicitly,
        and made while serving it waited for a collective stuck on the very joiner served."""
        self._provider = provider
        prime_pinned(self.state_chunk_bytes, 4)

    def close(self) -> None:
        """Stop accepting, close every communicator and state stream (idempotent)."""
        if self._closing.is_set():
            return
        self._closing.set()
        self._wake()
        self._thread.join(5.0)
        with self._lock:
            comms = list(self._comms.values())
            pending = [s for lst in self._pending.values() for s, _h, _t in lst]
            self._pending.clear()
            self._npending = 0
            streams = list(self._streams.values())
        for c in comms:
            c.close()
        for s in pending:
            close_quietly(s)
        for _th, s in streams:
            shutdown_quietly(s)
        for th, _s in streams:
            th.join(2.0)
        for hs in self._handshakes.values():
            close_quietly(hs.sock)
        self._handshakes.clear()
        self._sel.close()
        close_quietly(self._lsock)
        close_quietly(self._wake_r)
        close_quietly(self._wake_w)
        logger.info("data server %s closed", self.addr)

    def __enter__(self) -> "DataServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ settings handed out
    def _ring_options(self, peers: list[str], rank: int) -> RingOptions:
        return RingOptions(chunk_bytes=self.chunk_bytes, lanes=self.lanes,
                           sock_bufsize=ring_bufsize_for(peers, rank, self.sock_bufsize),
                           inline_send=self.inline_send, secret=self.secret, source_host=self._host,
                           ack_timeout=self.ring_ack_timeout)

    def _donor_limits(self) -> DonorLimits:
        return DonorLimits(timeout=self.state_timeout, rate_limit=self.state_rate_limit,
                           chunk_bytes=self.state_chunk_bytes, chunk_hook=self.state_chunk_hook)

    # ------------------------------------------------------------------ communicator callback
    def _unregister(self, comm: Any) -> None:
        """on_dead of every communicator: refuse later connections for its (epoch, shard)."""
        key = (comm.epoch, comm.shard)
        with self._lock:
            if self._comms.get(key) is comm:
                del self._comms[key]
                self._closed_keys[key] = None
                while len(self._closed_keys) > _CLOSED_KEYS_CAP:
                    self._closed_keys.popitem(last=False)

    # ------------------------------------------------------------------ acceptor thread
    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass

    def _loop(self) -> None:
        next_sweep = time.monotonic() + _TICK_S
        while not self._closing.is_set():
            try:
                events = self._sel.select(_TICK_S)
            except OSError:
                break
            for key, _mask in events:
                obj = key.fileobj
                if obj is self._lsock:
                    self._accept()
                elif obj is self._wake_r:
                    try:
                        self._wake_r.recv(4096)
                    except OSError:
                        pass
                else:
                    self._read_hello(key.data)
            now = time.monotonic()
            if now >= next_sweep:
                self._sweep(now)
                next_sweep = now + _TICK_S

    def _accept(self) -> None:
        while True:
            try:
                sock, _addr = self._lsock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                logger.warning("accept failed: %s", e)
                return
            if len(self._handshakes) >= self.max_handshakes:
                self._reject("handshakes_full", "%d data connections already wait for their handshake: "
                             "closing a new one from %s", self.max_handshakes, _peer(sock))
                close_quietly(sock)
                continue
            sock.setblocking(False)
            hs = _Handshake(sock, time.monotonic() + self.handshake_timeout)
            self._handshakes[sock.fileno()] = hs
            self._sel.register(sock, selectors.EVENT_READ, hs)

    def _read_hello(self, hs: _Handshake) -> None:
        try:
            k = hs.sock.recv_into(memoryview(hs.buf)[hs.got:])
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            k = 0
        if k == 0:
            self._drop_handshake(hs, close=True)
            return
        hs.got += k
        if hs.got < HELLO_LEN:
            return
        self._drop_handshake(hs, close=False)
        self._route(hs.sock, bytes(hs.buf))

    def _drop_handshake(self, hs: _Handshake, *, close: bool) -> None:
        self._handshakes.pop(hs.sock.fileno(), None)
        try:
            self._sel.unregister(hs.sock)
        except (KeyError, ValueError):
            pass
        if close:
            close_quietly(hs.sock)

    def _send_ack(self, sock: socket.socket, raw_hello: bytes, status: int) -> bool:
        try:
            sock.send(pack_ack(self.secret, raw_hello, status))
            return True
        except OSError:
            return False

    def _route(self, sock: socket.socket, raw: bytes) -> None:
        status, hello = parse_hello(self.secret, raw)
        if hello is None:
            kind = {2: "hello_bad_mac", 3: "hello_version"}.get(status, "hello_malformed")
            self._reject(kind, "rejected data connection from %s: %s", _peer(sock),
                         {2: "bad secret", 3: "version"}.get(status, "malformed"))
            self._send_ack(sock, raw, status)
            close_quietly(sock)
            return
        why = self._guard.check(hello)
        if why is not None:
            self._reject("hello_replay", "rejected data connection from %s: handshake %s", _peer(sock), why)
            self._send_ack(sock, raw, ST_REPLAY)
            close_quietly(sock)
            return
        if hello.kind in (KIND_RING, KIND_NCCL_ID):
            self._route_comm(sock, hello)
        elif hello.kind == KIND_STATE:
            self._route_state(sock, hello)
        else:
            self._send_ack(sock, raw, ST_BAD)
            close_quietly(sock)

    def _route_comm(self, sock: socket.socket, hello: Hello) -> None:
        """A ring lane (tcp) or an NCCL id connection: to its communicator, or pending."""
        key = (hello.epoch, hello.shard)
        with self._lock:
            comm = self._comms.get(key)
            if comm is not None and comm.hello_kind != hello.kind:
                comm.reject_kind(hello)
                status = ST_MISMATCH
            elif comm is not None:
                status = comm.check_hello(hello)
            elif key in self._closed_keys:
                status = ST_CLOSED
            elif self._npending >= self.max_pending:
                status = ST_BUSY
            else:
                status = ST_PENDING
            if not self._send_ack(sock, hello.raw, status):
                close_quietly(sock)
                return
            if status not in (ST_OK, ST_PENDING):
                close_quietly(sock)
                return
            sock.setblocking(True)
            tune_socket(sock, None)  # its buffers are the communicator's choice (attach)
            if status == ST_PENDING:
                self._pending.setdefault(key, []).append((sock, hello, time.monotonic()))
                self._npending += 1
                return
        comm.attach(hello, sock)  # type: ignore[union-attr]

    def _route_state(self, sock: socket.socket, hello: Hello) -> None:
        provider = self._provider
        with self._lock:
            if provider is None:
                status = ST_NO_STATE
            elif len(self._streams) >= self.max_state_streams:
                status = ST_BUSY
            else:
                status = ST_OK
            if not self._send_ack(sock, hello.raw, status) or status != ST_OK:
                close_quietly(sock)
                return
            self._stream_seq += 1
            sid = self._stream_seq
            sock.setblocking(True)
            tune_socket(sock, self.sock_bufsize or None)
            th = threading.Thread(target=self._run_stream, args=(sid, sock, provider, self._donor_limits()),
                                  daemon=True, name=f"p2pft-state-donor-{sid}")
            self._streams[sid] = (th, sock)
        th.start()

    def _run_stream(self, sid: int, sock: socket.socket, provider: Callable[[dict], "StateSnapshot | None"],
                    limits: DonorLimits) -> None:
        try:
            serve_state_connection(sock, provider, limits)
        except (socket.timeout, TimeoutError):
            self._reject("state_stream_timeout", "state stream %d dropped: the joiner at %s took no data for "
                         "%g s", sid, _peer(sock), limits.timeout)
        except (ConnectionError, BrokenPipeError) as e:  # the joiner went away: normal, no traceback
            self._reject("state_stream_lost", "state stream %d ended: the joiner at %s went away (%s)",
                         sid, _peer(sock), e.__class__.__name__)
        except Exception:  # noqa: BLE001 - a bad joiner must never take the donor down
            self.counters["state_stream_failed"] += 1
            logger.exception("state stream %d failed", sid)
        finally:
            close_quietly(sock)
            with self._lock:
                self._streams.pop(sid, None)

    def _sweep(self, now: float) -> None:
        for hs in [h for h in self._handshakes.values() if h.deadline <= now]:
            self._reject("handshake_timeout", "data connection from %s sent no handshake within %.3g s",
                         _peer(hs.sock), self.handshake_timeout)
            self._drop_handshake(hs, close=True)
        expired: list[tuple[socket.socket, Hello]] = []
        with self._lock:
            for key in list(self._pending):
                keep = []
                for sock, hello, t in self._pending[key]:
                    if now - t >= self.pending_timeout:
                        expired.append((sock, hello))
                    else:
                        keep.append((sock, hello, t))
                if keep:
                    self._pending[key] = keep
                else:
                    del self._pending[key]
            self._npending -= len(expired)
        for sock, hello in expired:
            err = CommTimeout(f"rank {hello.dst} did not open its communicator of epoch {hello.epoch} "
                              f"shard {hello.shard} within {self.pending_timeout:g} s", peer_rank=hello.dst)
            self._send_farewell(sock, hello, err)

    def note_op(self, op: str, nbytes: int, seconds: float) -> None:
        """A communicator finished a collective (one dict update per op: not per chunk)."""
        ops = self.ops
        ops[op] += 1
        ops[op + "_bytes"] += nbytes
        ops[op + "_seconds"] += seconds

    def _reject(self, kind: str, fmt: str, *args: object) -> None:
        """Count a rejection; log it, at most once per kind every few seconds (floods)."""
        self.counters[kind] += 1
        now = time.monotonic()
        if now - self._last_log.get(kind, -_LOG_EVERY_S) >= _LOG_EVERY_S:
            self._last_log[kind] = now
            logger.warning(fmt + " [%s=%d]", *args, kind, self.counters[kind])

    def _reject_pending(self, sock: socket.socket, hello: Hello, why: str) -> None:
        self._send_farewell(sock, hello, ProtocolMismatch(f"rank {hello.dst} rejected the connection: {why}",
                                                          peer_rank=hello.dst))

    @staticmethod
    def _send_farewell(sock: socket.socket, hello: Hello, err: Exception) -> None:
        """Leave an error frame on the reverse direction so the connecting side's sender can tell why."""
        try:
            sock.send(pack_error_frame(hello.epoch, hello.shard, hello.dst, err, hello.dst), socket.MSG_DONTWAIT)  # type: ignore[arg-type]
        except OSError:
            pass
        close_quietly(sock)


def _peer(sock: socket.socket) -> str:
    try:
        host, port = sock.getpeername()[:2]
        return f"{host}:{port}"
    except OSError:
        return "?"
