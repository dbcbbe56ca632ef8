"""Byte layouts of the data plane: connection handshake, ring frames, error payloads.

All integers are little-endian. See docs/transport.md for the full description.
"""

from __future__ import annotations

import collections
import errno
import hashlib
import hmac
import ipaddress
import os
import select
import socket
import struct
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import msgpack

from .addr import parse_hostport
from .errors import ERROR_CLASSES, CommError, ProtocolMismatch
from .sockutil import close_quietly

PROTOCOL_VERSION = 2   # 2: the hello's nonce is a send time + 8 random bytes (replay protection)

KIND_RING = 1      # one lane of a ring edge of a communicator
KIND_STATE = 2     # a state-streaming request

# --- handshake -------------------------------------------------------------------------------
HELLO_MAGIC = b"P2FH"
# magic, version, kind, pad, epoch, shard, src rank, dst rank, world, lane, lanes, chunk bytes,
# nonce = send time (u64 microseconds since the epoch) + 8 random bytes
HELLO_BODY = struct.Struct("<4sHBxQIIIIHHQQ8s")
MAC_LEN = 32
HELLO_LEN = HELLO_BODY.size + MAC_LEN

ACK_MAGIC = b"P2FA"
ACK_BODY = struct.Struct("<4sHBx16s")  # magic, version, status, pad, nonce
ACK_LEN = ACK_BODY.size + MAC_LEN

ST_OK = 0
ST_PENDING = 1        # accepted; the communicator does not exist yet on the server
ST_AUTH = 2           # bad or missing HMAC
ST_VERSION = 3
ST_CLOSED = 4         # that communicator was already closed on the server
ST_BUSY = 5           # pending table full / too many state streams
ST_MISMATCH = 6       # rank, world, lanes or chunk size disagree
ST_BAD = 7            # malformed hello
ST_NO_STATE = 8       # no state provider registered
ST_REPLAY = 9         # a handshake seen before, or sent outside the acceptance window

STATUS_TEXT = {
    ST_OK: "ok", ST_PENDING: "pending", ST_AUTH: "authentication failed (cluster secret)",
    ST_VERSION: "protocol version mismatch", ST_CLOSED: "communicator already closed on peer",
    ST_BUSY: "peer busy", ST_MISMATCH: "communicator parameters differ", ST_BAD: "malformed handshake",
    ST_NO_STATE: "peer serves no state", ST_REPLAY: "handshake replayed or outside the time window (clocks apart?)",
}


@dataclass(frozen=True)
class Hello:
    kind: int
    epoch: int
    shard: int
    src: int
    dst: int
    world: int
    lane: int
    lanes: int
    chunk: int
    raw: bytes  # the full hello as sent (MAC input for the ack)
    ts: float = 0.0         # sender's wall clock, seconds
    nonce: bytes = b""      # time + random part: unique per handshake


def _mac(secret: bytes | None, data: bytes) -> bytes:
    if secret is None:
        return bytes(MAC_LEN)
    return hmac.new(secret, data, hashlib.sha256).digest()


def pack_hello(secret: bytes | None, kind: int, epoch: int, shard: int, src: int, dst: int,
               world: int, lane: int = 0, lanes: int = 1, chunk: int = 0) -> bytes:
    body = HELLO_BODY.pack(HELLO_MAGIC, PROTOCOL_VERSION, kind, epoch, shard, src, dst, world,
                           lane, lanes, chunk, int(time.time() * 1e6), os.urandom(8))
    return body + _mac(secret, body)


def parse_hello(secret: bytes | None, raw: bytes) -> tuple[int, Hello | None]:
    """Return (status, hello); status is ST_OK when the hello is well formed and authenticated."""
    try:
        magic, ver, kind, epoch, shard, src, dst, world, lane, lanes, chunk, ts_us, _rand = HELLO_BODY.unpack_from(raw)
    except struct.error:
        return ST_BAD, None
    if magic != HELLO_MAGIC:
        return ST_BAD, None
    if ver != PROTOCOL_VERSION:
        return ST_VERSION, None
    if secret is not None and not hmac.compare_digest(raw[HELLO_BODY.size:], _mac(secret, raw[:HELLO_BODY.size])):
        return ST_AUTH, None
    return ST_OK, Hello(kind, epoch, shard, src, dst, world, lane, lanes, chunk, bytes(raw), ts_us / 1e6,
                        bytes(raw[HELLO_BODY.size - 16:HELLO_BODY.size]))


class HelloGuard:
    """Server-side replay check of authenticated handshakes.

    A captured hello sent again would otherwise attach the sender's socket to a communicator or
    start a state stream (the bytes after the handshake are not authenticated). A hello is
    accepted once: its send time must be within ``window`` seconds of this clock (peers' clocks
    must agree to well within it) and its nonce not seen in that window. Seen nonces are kept
    until they leave the window, at most ``max_entries``; past that the oldest is dropped and the
    acceptance floor rises to its send time, so a dropped nonce can never be accepted again.
    """

    def __init__(self, window: float = 30.0, max_entries: int = 65536, start_slack: float = 1.0) -> None:
        self.window = float(window)
        self.max_entries = int(max_entries)
        self.floor = time.time() - start_slack
        self._seen: collections.OrderedDict[bytes, float] = collections.OrderedDict()

    def check(self, hello: Hello, now: float | None = None) -> str | None:
        """None if fresh (and remember it), else the reason to reject it."""
        now = time.time() if now is None else now
        if abs(now - hello.ts) > self.window:
            return f"sent {now - hello.ts:+.1f} s from now, outside the {self.window:g} s window"
        if hello.ts <= self.floor:
            return "older than this server's replay table"
        if hello.nonce in self._seen:
            return "nonce already used (replayed handshake)"
        seen = self._seen
        while seen:
            first_ts = next(iter(seen.values()))
            if now - first_ts > self.window:
                seen.popitem(last=False)          # out of the window: a replay is stale anyway
            elif len(seen) >= self.max_entries:
                seen.popitem(last=False)          # full: nothing at or below it may pass again
                self.floor = max(self.floor, first_ts)
            else:
                break
        seen[hello.nonce] = hello.ts
        return None


def source_address(own: str | None, dest: str) -> tuple[str, int] | None:
    """(own IP, 0) to bind a connection's source to this process's own listen IP, or None to let
    the kernel choose: only a specific IP literal, only towards an IP literal of the same family,
    and a loopback IP only towards loopback (the default 127.0.0.1 never breaks a connection to
    another host). With one loopback IP per process (127.0.0.N) a fault proxy can tell processes
    apart by source address. p2pft/net/driver.py applies the same rule to control connections."""
    if not own:
        return None
    try:
        o, d = ipaddress.ip_address(own), ipaddress.ip_address(dest)
    except ValueError:
        return None
    if o.is_unspecified or o.version != d.version or (o.is_loopback and not d.is_loopback):
        return None
    return (own, 0)


def pack_ack(secret: bytes | None, hello_raw: bytes, status: int) -> bytes:
    body = ACK_BODY.pack(ACK_MAGIC, PROTOCOL_VERSION, status, os.urandom(16))
    return body + _mac(secret, hello_raw + body)


def parse_ack(secret: bytes | None, hello_raw: bytes, raw: bytes) -> int:
    """Return the status of an ack; raise ProtocolMismatch if it is malformed or unauthenticated."""
    magic, ver, status, _nonce = ACK_BODY.unpack_from(raw)
    if magic != ACK_MAGIC:
        raise ProtocolMismatch("peer answered the handshake with garbage (not a p2pft data server?)")
    if ver != PROTOCOL_VERSION:
        raise ProtocolMismatch(f"peer speaks data protocol version {ver}, this process {PROTOCOL_VERSION}")
    if status != ST_AUTH and secret is not None and not hmac.compare_digest(
            raw[ACK_BODY.size:], _mac(secret, hello_raw + raw[:ACK_BODY.size])):
        raise ProtocolMismatch("peer failed to authenticate with the cluster secret")
    return status


# --- ring frames -----------------------------------------------------------------------------
FRAME_MAGIC = b"P2FD"
# The first 48 bytes are constant for one op in one direction, so a receiver checks them with a
# single bytes comparison: magic, op, dtype, pad, epoch, shard, src rank, op seq, tag, total bytes.
FRAME_PREFIX = struct.Struct("<4sBBxxQIIQqQ")
# Then: step, chunk index, flags, pad, count (contributors so far / broadcast root), payload length.
FRAME_SUFFIX = struct.Struct("<IIBxxxIQ")
FRAME_LEN = FRAME_PREFIX.size + FRAME_SUFFIX.size
PREFIX_LEN = FRAME_PREFIX.size

OP_ALLREDUCE = 1
OP_BROADCAST = 2
OP_ERROR = 3       # payload: msgpack error description; ends the stream
OP_KEEPALIVE = 4   # no payload: "I am alive and waiting on my own left neighbour"

F_EMPTY = 1        # no payload: the region holds no contribution (counts as zeros)

MAX_ERROR_PAYLOAD = 64 * 1024


def pack_error_frame(epoch: int, shard: int, src: int, err: CommError, origin: int,
                     tags: dict[int, int] | None = None) -> bytes:
    """An OP_ERROR frame telling a neighbour why this rank stops, so it can blame the right peer."""
    body = msgpack.packb({
        "cls": type(err).__name__, "reason": err.reason[:4000], "peer_rank": err.peer_rank,
        "peer_addr": err.peer_addr, "origin": origin,
        "tags": {int(k): int(v) for k, v in (tags or {}).items()},
    })
    hdr = FRAME_PREFIX.pack(FRAME_MAGIC, OP_ERROR, 0, epoch, shard, src, 0, 0, 0)
    return hdr + FRAME_SUFFIX.pack(0, 0, 0, 0, len(body)) + body


@dataclass
class RemoteError:
    cls: type[CommError]
    reason: str
    peer_rank: int | None
    peer_addr: str | None
    origin: int
    tags: dict[int, int]


def parse_error_payload(payload: bytes) -> RemoteError:
    try:
        d = msgpack.unpackb(payload, strict_map_key=False)
        cls = ERROR_CLASSES.get(str(d["cls"]), CommError)
        return RemoteError(cls, str(d["reason"]), d.get("peer_rank"), d.get("peer_addr"),
                           int(d["origin"]), {int(k): int(v) for k, v in (d.get("tags") or {}).items()})
    except Exception as e:  # noqa: BLE001 - any garbage is a protocol error
        raise ProtocolMismatch(f"malformed error frame: {e}") from None


def find_error_frame(data: bytes) -> RemoteError | None:
    """Scan bytes read from the reverse direction of a connection for an OP_ERROR frame."""
    if len(data) < FRAME_LEN:
        return None
    p = FRAME_PREFIX.unpack_from(data)
    plen = FRAME_SUFFIX.unpack_from(data, PREFIX_LEN)[4]
    if p[0] != FRAME_MAGIC or p[1] != OP_ERROR or plen > MAX_ERROR_PAYLOAD or len(data) < FRAME_LEN + plen:
        return None
    try:
        return parse_error_payload(data[FRAME_LEN:FRAME_LEN + plen])
    except ProtocolMismatch:
        return None


_REVERSE_READ_CAP = FRAME_LEN + MAX_ERROR_PAYLOAD


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


# --- socket helpers --------------------------------------------------------------------------
CONNECT_POLL_S = 0.05   # how often a pending connect looks whether it was given up on


def connect_abortable(host: str, port: int, timeout: float, source: tuple[str, int] | None,
                      given_up: Callable[[], bool]) -> socket.socket | None:
    """socket.create_connection that a failed or aborted communicator can stop: a connect to a
    host that vanished (no reset: its SYNs go unanswered) would otherwise hold the caller for
    the whole `timeout` after a newer view made the connection pointless. Returns the
    connected blocking socket, or None once `given_up()`; raises OSError (socket.timeout after
    `timeout`) like create_connection."""
    last: OSError = OSError("no address")
    for family, kind, proto, _name, sockaddr in socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM):
        sock = socket.socket(family, kind, proto)
        try:
            if source is not None:
                sock.bind(source)
            sock.setblocking(False)
            err = sock.connect_ex(sockaddr)
            deadline = time.monotonic() + timeout
            p = select.poll()
            p.register(sock.fileno(), select.POLLOUT)
            while err in (errno.EINPROGRESS, errno.EALREADY, errno.EWOULDBLOCK, errno.EINTR):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise socket.timeout("timed out")
                if p.poll(int(min(left, CONNECT_POLL_S) * 1000) + 1):
                    err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                    break
                if given_up():
                    close_quietly(sock)
                    return None
            if err:
                raise OSError(err, os.strerror(err))
            sock.setblocking(True)
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            return sock
        except OSError as e:
            close_quietly(sock)
            last = e
    raise last


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill `view` from `sock` (Python-level timeout, if any, applies per call); EOFError if the peer closes first."""
    got = 0
    n = view.nbytes
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise EOFError("connection closed by peer")
        got += k


def send_all(sock: socket.socket, bufs: Sequence[Any]) -> None:
    """sendmsg() every buffer completely (header and payload in one syscall when possible)."""
    views = [memoryview(b).cast("B") for b in bufs if len(b)]
    while views:
        sent = sock.sendmsg(views)
        while sent:
            if sent >= views[0].nbytes:
                sent -= views[0].nbytes
                views.pop(0)
            else:
                views[0] = views[0][sent:]
                sent = 0


# Ring sockets are blocking (no Python-level timeout, which would cost a poll() per call) with a
# kernel timeout slice (SO_RCVTIMEO / SO_SNDTIMEO): a call that makes no progress for one slice
# fails with EAGAIN and the caller compares the time since the last progress to the op timeout.
# MSG_WAITALL lets the kernel fill a whole chunk before waking the Python thread.
_TIMEVAL = struct.Struct("@ll")


def set_io_slice(sock: socket.socket, seconds: float, *, recv: bool = True, send: bool = True) -> None:
    """Set the kernel send/receive timeout slice of a blocking socket."""
    sec = int(seconds)
    usec = int((seconds - sec) * 1e6)
    if sec == 0 and usec == 0:
        usec = 1  # a zero timeval would mean "block forever"
    tv = _TIMEVAL.pack(sec, usec)
    if recv:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    if send:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


def recv_exact_timed(sock: socket.socket, view: memoryview, timeout: float,
                     on_idle: Callable[[float], None] | None = None) -> None:
    """Fill `view`; TimeoutError after `timeout` s without any byte, EOFError if the peer closes.
    `on_idle(seconds waited)` runs after every idle slice (used to send keepalives)."""
    got = 0
    n = view.nbytes
    last = time.monotonic()
    while got < n:
        try:
            k = sock.recv_into(view[got:], n - got, socket.MSG_WAITALL)
        except BlockingIOError:  # one slice without data
            idle = time.monotonic() - last
            if idle >= timeout:
                raise TimeoutError("no data") from None
            if on_idle is not None:
                on_idle(idle)
            continue
        if k == 0:
            raise EOFError("connection closed by peer")
        got += k
        last = time.monotonic()


def send_all_timed(sock: socket.socket, bufs: Sequence[Any], timeout: float, since: float = 0.0) -> float:
    """send_all() with TimeoutError after `timeout` s in which the peer took no byte, counted
    from `since` (the last progress known to the caller) if later than now - nothing.
    Returns the time of the last progress. For ring connections only: a slice without progress
    looks at the reverse direction, and a peer that ended the connection (its error frame or
    EOF: it may never open its receive window again) is a ConnectionResetError at once."""
    views = [memoryview(b).cast("B") for b in bufs if b is not None and len(b)]
    last = since or time.monotonic()
    while views:
        try:
            sent = sock.sendmsg(views)
        except BlockingIOError:
            if time.monotonic() - last >= timeout:
                raise TimeoutError("peer takes no data") from None
            if right_link_stopped(sock):
                raise ConnectionResetError(errno.ECONNRESET, "the peer ended the connection") from None
            continue
        last = time.monotonic()
        while sent:
            if sent >= views[0].nbytes:
                sent -= views[0].nbytes
                views.pop(0)
            else:
                views[0] = views[0][sent:]
                sent = 0
    return last


def send_nowait(sock: socket.socket, bufs: Sequence[Any]) -> list[memoryview]:
    """Write as much of `bufs` as the socket takes without blocking; return what is left."""
    views = [memoryview(b).cast("B") for b in bufs if b is not None and len(b)]
    while views:
        try:
            sent = sock.sendmsg(views, (), socket.MSG_DONTWAIT)
        except BlockingIOError:
            return views
        while sent:
            if sent >= views[0].nbytes:
                sent -= views[0].nbytes
                views.pop(0)
            else:
                views[0] = views[0][sent:]
                sent = 0
    return views


def io_slice(timeout: float) -> float:
    """Kernel timeout slice for an op timeout: fine enough to time out within a few percent."""
    return max(0.001, min(IO_SLICE_S, timeout / 20))


IO_SLICE_S = 0.05


def tune_socket(sock: socket.socket, bufsize: int | None) -> None:
    """TCP_NODELAY for small frames; optionally fixed kernel buffers (None keeps autotuning)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if bufsize:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, bufsize)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, bufsize)


_TCP_INFO = struct.Struct("8B13I")   # struct tcp_info up to tcpi_last_ack_recv (linux/tcp.h)


def unacknowledged(sock: socket.socket, after: float) -> bool:
    """Whether the peer's host has acknowledged nothing for `after` seconds while data we sent
    waits and the kernel already retransmitted it (TCP_INFO: retransmits, unacked,
    last_ack_recv).

    The peer's kernel acknowledges, not its process, so a live host whose process is busy,
    descheduled or SIGSTOPped does not match: a full receive window is probed (zero-window
    probes, not retransmissions) and the probes are answered. A host that vanished without a
    reset (power, panic, link) matches after Linux's first retransmission (its minimum RTO is
    0.2 s). TCP_USER_TIMEOUT would do this in the kernel, but it also fails a connection whose
    window stays closed that long (Linux 6: a sender to a SIGSTOPped receiver got ETIMEDOUT
    after 0.3 s), so a paused receiver would be blamed. The
    caller makes sure its first unacknowledged send is at least `after` old (a connection idle
    before the send has an old last ACK). False where TCP_INFO is not available."""
    opt = getattr(socket, "TCP_INFO", None)
    if opt is None:
        return False
    try:
        raw = sock.getsockopt(socket.IPPROTO_TCP, opt, _TCP_INFO.size)
    except OSError:
        return False
    if len(raw) < _TCP_INFO.size:
        return False
    f = _TCP_INFO.unpack_from(raw)
    retransmits, unacked, last_ack_recv_ms = f[2], f[8 + 4], f[8 + 12]
    return retransmits > 0 and unacked > 0 and last_ack_recv_ms >= after * 1000


def right_link_stopped(sock: socket.socket) -> bool:
    """Whether a ring connection to the right neighbour ended while nothing was being written to
    it: the neighbour sent what it only ever sends back, its error frame or EOF, or the kernel
    failed the connection. Non-destructive: the error and the frame stay for the code that
    reports them (sender.write_failed)."""
    try:
        p = select.poll()
        p.register(sock.fileno(), select.POLLIN | getattr(select, "POLLRDHUP", 0))  # ERR/HUP come always
        return any(ev for _fd, ev in p.poll(0))
    except (OSError, ValueError):
        return True   # closed under us: stopped


def split_addr(addr: str) -> tuple[str, int]:
    """'host:port' or '[v6]:port' -> (host, port); ValueError naming the string otherwise."""
    return parse_hostport(addr, "data address")
