"""The NCCL unique id of one (data epoch, shard): from rank 0 to the other ranks, and a liveness star.

Rank 0 of an NCCL communicator connects to every other rank's DataServer with a hello of kind
``KIND_NCCL_ID``: the ring's handshake (HMAC with the cluster secret, replay guard, pending table
while the peer has not created its communicator yet). Each rank answers with an ack (one byte)
carrying its device identity (PCI bus id or UUID). Only when every rank has answered does rank 0
make the id and say go: one byte, then the 128-byte id and HMAC(secret, hello || id), so the id
itself is authenticated too.

Why the id comes last: ncclGetUniqueId starts NCCL's bootstrap root (a thread and a listening
socket) in the calling process, and the root lives until every rank of that id has reached it,
which never happens for an id whose init does not run. Made before the acks, every failed or
superseded hand-off, and every communicator that ends up on the TCP ring, would leave one behind
for the life of the process. ncclCommInitRank blocks until every rank has called it and cannot
be cancelled, so no rank starts it before every other rank is known to be there and about to
start it too; a rank that never answers is named instead. NCCL refuses two ranks on one device,
so when two identities are equal rank 0 says "use the TCP ring" instead of go (data plane
``auto``; no id is made), or fails every rank with `SharedDevice` (explicit ``nccl``).

Why the data plane and not gossip: the id belongs to one (data epoch, shard), shard ranks other
than 0 of an FSDP replica never see gossip, and the data server already authenticates peers.

The connections stay open for the life of the communicator, a star around rank 0. A peer process
that dies closes its end (rank 0, or the rank whose link to rank 0 breaks, learns at once); a
rank that fails, aborts or closes writes an error frame (the ring's layout) on every link before
closing it, and rank 0 relays what it hears. So an NCCL failure names its peer like a TCP one:
``PeerFailed(peer_rank=the dead rank)``, ``CommAborted(peer_rank=the aborting rank)``.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import select
import socket
import threading
import time
from typing import Callable

from .errors import CommAborted, CommError, CommTimeout, PeerFailed, ProtocolMismatch, SharedDevice
from .failure import error_from_remote
from .options import RingOptions
from .sockutil import close_quietly, shutdown_quietly
from .wire import (
    ACK_LEN, FRAME_LEN, FRAME_PREFIX, FRAME_SUFFIX, MAX_ERROR_PAYLOAD, OP_ERROR, PREFIX_LEN, ST_BUSY, ST_CLOSED,
    ST_MISMATCH, ST_OK, ST_PENDING, STATUS_TEXT, FRAME_MAGIC, Hello, pack_error_frame, pack_hello, parse_ack,
    parse_error_payload, recv_exact, source_address, split_addr, tune_socket,
)

__all__ = ["KIND_NCCL_ID", "UID_BYTES", "SharedDevice", "StarLinks"]

logger = logging.getLogger(__name__)

KIND_NCCL_ID = 3          # hello kind: "here is the NCCL id of (epoch, shard)"
UID_BYTES = 128
_MAC_LEN = 32
_WATCH_SLICE_S = 0.1
ACK = b"\x01"   # rank r -> rank 0: I am here (then my device identity)
GO = b"\x02"    # rank 0 -> every rank: everybody is here; the id follows, start ncclCommInitRank
TCP = b"\x03"   # rank 0 -> every rank: two ranks share a device, use the TCP ring (data_plane auto)


def _shared(idents: dict[int, str]) -> tuple[int, int] | None:
    """The first two ranks with the same non-empty device identity, if any."""
    seen: dict[str, int] = {}
    for r in sorted(idents):
        ident = idents[r]
        if ident and ident in seen:
            return seen[ident], r
        if ident:
            seen[ident] = r
    return None


def uid_mac(secret: bytes | None, hello_raw: bytes, uid: bytes) -> bytes:
    """MAC of an id sent after `hello_raw` (zeros without a secret, like the hello's)."""
    if secret is None:
        return bytes(_MAC_LEN)
    return hmac.new(secret, hello_raw + uid, hashlib.sha256).digest()


class StarLinks:
    """Rank 0's links to every other rank (rank r: its one link to rank 0) of one NCCL communicator.

    `on_error(err)` is the communicator's sticky failure: called once a link reports a failure.
    """

    def __init__(self, *, epoch: int, shard: int, rank: int, peers: list[str], options: RingOptions,
                 on_error: Callable[[CommError], object]) -> None:
        self.epoch = epoch
        self.shard = shard
        self.rank = rank
        self.peers = list(peers)
        self.world = len(peers)
        self.options = options
        self.on_error = on_error
        self.socks: dict[int, socket.socket] = {}
        #: rank -> device identity, on rank 0 once every rank answered
        self.identities: dict[int, str] = {}
        self._hello_raw: bytes | None = None
        self._sent: dict[int, bytes] = {}   # rank 0: the hello sent to each rank (the id's MAC covers it)
        self._cond = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ called by the DataServer
    def check_hello(self, h: Hello) -> int:
        """Ack status for rank 0's id connection (only rank 0 sends one, once, to this rank)."""
        with self._cond:
            if self._closed:
                return ST_CLOSED
            if self.rank == 0 or h.src != 0 or h.dst != self.rank or h.world != self.world or 0 in self.socks:
                return ST_MISMATCH
        return ST_OK

    def attach(self, h: Hello, sock: socket.socket) -> None:
        with self._cond:
            if not self._closed and 0 not in self.socks:
                self.socks[0] = sock
                self._hello_raw = h.raw
                self._cond.notify_all()
                return
        close_quietly(sock)

    # ------------------------------------------------------------------ rank 0
    def push(self, make_uid: Callable[[], bytes], deadline: float, identity: str = "",
             fallback: bool = False) -> bytes | None:
        """Reach every other rank and collect its ack (with its device identity); then make the
        id with `make_uid` and send go with it. Returns the id, or None when two ranks share a
        device and `fallback` (every rank was told to use the TCP ring; no id was made). Raises
        CommError naming a rank that cannot be reached or does not answer in time, and
        `SharedDevice` for a shared device without `fallback` (NCCL refuses that at init)."""
        for r in range(1, self.world):
            sock = self._connect(r, deadline)
            with self._cond:
                if self._closed:
                    close_quietly(sock)
                    raise CommAborted("communicator closed while handing out the NCCL id")
                self.socks[r] = sock
        idents = {0: identity}
        for r in range(1, self.world):
            self._expect(r, ACK, deadline, "answer the NCCL id hand-off")
            idents[r] = self._read_identity(r, deadline)
        self.identities = idents
        shared = _shared(idents)
        if shared is not None and not fallback:
            a, b = shared
            raise SharedDevice(f"ranks {a} and {b} of epoch {self.epoch} shard {self.shard} are on one device "
                               f"({idents[a]}): NCCL refuses two ranks on one GPU; use data_plane='tcp' "
                               "or one GPU per replica", peer_rank=b, peer_addr=self.peers[b])
        uid: bytes | None = None
        if shared is not None:
            logger.info("ranks %d and %d of epoch %d shard %d share device %s: this communicator uses the "
                        "TCP ring", shared[0], shared[1], self.epoch, self.shard, idents[shared[0]])
        else:
            with self._cond:
                if self._closed:   # superseded while collecting acks: no id (no bootstrap root) for it
                    raise CommAborted("communicator closed while handing out the NCCL id")
            uid = make_uid()
            if len(uid) != UID_BYTES:
                raise CommError(f"NCCL unique id of {len(uid)} bytes, expected {UID_BYTES}")
        for r in range(1, self.world):
            msg = TCP if uid is None else GO + uid + uid_mac(self.options.secret, self._sent[r], uid)
            try:
                self.socks[r].sendall(msg)
            except OSError as e:
                raise PeerFailed(f"rank {r} went away before NCCL init: {e!r}", peer_rank=r,
                                 peer_addr=self.peers[r]) from None
        return uid

    def _expect(self, peer: int, byte: bytes, deadline: float, what: str, also: bytes = b"") -> bytes:
        """Read one byte from `peer` (bounded): `byte` (or `also`), returned; anything else is its
        error frame or garbage."""
        s = self.socks[peer]
        addr = self.peers[peer]
        first = b""
        try:
            s.settimeout(max(0.01, deadline - time.monotonic()))
            first = s.recv(1)
            s.settimeout(None)
        except (socket.timeout, TimeoutError):
            raise CommTimeout(f"rank {peer} did not {what} in time", peer_rank=peer, peer_addr=addr) from None
        except OSError:
            pass
        if first == byte or (also and first == also):
            return first
        if not first:
            raise PeerFailed(f"rank {peer} went away before NCCL init", peer_rank=peer, peer_addr=addr)
        raise self._read_verdict(s, peer, first)

    def _read_identity(self, peer: int, deadline: float) -> str:
        s = self.socks[peer]
        try:
            s.settimeout(max(0.01, deadline - time.monotonic()))
            n = bytearray(1)
            recv_exact(s, memoryview(n))
            raw = bytearray(n[0])
            recv_exact(s, memoryview(raw))
            s.settimeout(None)
        except (socket.timeout, TimeoutError):
            raise CommTimeout(f"rank {peer} did not name its device in time", peer_rank=peer,
                              peer_addr=self.peers[peer]) from None
        except (EOFError, OSError):
            raise PeerFailed(f"rank {peer} went away before NCCL init", peer_rank=peer,
                             peer_addr=self.peers[peer]) from None
        return raw.decode("utf-8", "replace")

    def _connect(self, r: int, deadline: float) -> socket.socket:
        opts = self.options
        addr = self.peers[r]
        host, port = split_addr(addr)
        backoff = 0.002
        last = "no attempt"
        while True:
            with self._cond:
                if self._closed:
                    raise CommAborted("communicator closed while handing out the NCCL id")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                cls = PeerFailed if "refused" in last else CommTimeout
                raise cls(f"cannot hand the NCCL id to rank {r}: {last}", peer_rank=r, peer_addr=addr)
            hello = pack_hello(opts.secret, KIND_NCCL_ID, self.epoch, self.shard, 0, r, self.world)
            sock = None
            try:
                sock = socket.create_connection((host, port), timeout=min(remaining, 2.0),
                                                source_address=source_address(opts.source_host, host))
                tune_socket(sock, None)
                sock.sendall(hello)
                ack = bytearray(ACK_LEN)
                recv_exact(sock, memoryview(ack))
                status = parse_ack(opts.secret, hello, bytes(ack))
                if status in (ST_OK, ST_PENDING):
                    sock.settimeout(None)
                    self._sent[r] = hello
                    return sock
                close_quietly(sock)
                sock = None
                if status == ST_CLOSED:
                    raise CommAborted(f"rank {r} already closed its communicator of epoch {self.epoch}",
                                      peer_rank=r, peer_addr=addr)
                if status != ST_BUSY:
                    raise ProtocolMismatch(f"rank {r} rejected the NCCL id: {STATUS_TEXT.get(status, status)}",
                                           peer_rank=r, peer_addr=addr)
                last = "peer busy"
            except ProtocolMismatch as e:
                if sock is not None:
                    close_quietly(sock)
                if e.peer_rank is None:
                    e = ProtocolMismatch(e.reason, peer_rank=r, peer_addr=addr)
                raise e from None
            except CommError:
                raise
            except (EOFError, OSError) as e:
                if sock is not None:
                    close_quietly(sock)
                last = "connection refused" if isinstance(e, ConnectionRefusedError) else repr(e)
            time.sleep(min(backoff, max(0.0, deadline - time.monotonic())))
            backoff = min(backoff * 2, 0.2)

    # ------------------------------------------------------------------ ranks other than 0
    def receive(self, deadline: float, go_deadline: float, identity: str = "") -> bytes | None:
        """Wait (bounded) for rank 0's connection, ack it with this rank's device identity, and
        wait for go and the id (until `go_deadline`, later than rank 0's own wait, so that rank
        0's verdict naming a rank that never answered arrives here first); check the id's MAC.
        None when rank 0 said to use the TCP ring instead."""
        with self._cond:
            while 0 not in self.socks and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CommTimeout(f"rank 0 did not hand over the NCCL id of epoch {self.epoch} shard "
                                      f"{self.shard} in time", peer_rank=0, peer_addr=self.peers[0])
                self._cond.wait(min(left, 0.05))
            if self._closed:
                raise CommAborted("communicator closed while waiting for the NCCL id")
            sock, hello_raw = self.socks[0], self._hello_raw
        assert hello_raw is not None
        try:
            ident = identity.encode()[:255]
            sock.sendall(ACK + bytes([len(ident)]) + ident)
        except OSError as e:
            raise PeerFailed(f"rank 0 went away: {e!r}", peer_rank=0, peer_addr=self.peers[0]) from None
        if self._expect(0, GO, go_deadline, "say go for NCCL init", also=TCP) == TCP:
            return None
        buf = bytearray(UID_BYTES + _MAC_LEN)
        try:
            sock.settimeout(max(0.01, go_deadline - time.monotonic()))
            recv_exact(sock, memoryview(buf))
            sock.settimeout(None)
        except (socket.timeout, TimeoutError):
            raise CommTimeout("rank 0 did not send the NCCL id in time", peer_rank=0, peer_addr=self.peers[0]) from None
        except (EOFError, OSError) as e:
            raise PeerFailed(f"rank 0 closed the NCCL id connection: {e!r}", peer_rank=0,
                             peer_addr=self.peers[0]) from None
        uid, mac = bytes(buf[:UID_BYTES]), bytes(buf[UID_BYTES:])
        if not hmac.compare_digest(mac, uid_mac(self.options.secret, hello_raw, uid)):
            raise ProtocolMismatch("the NCCL id from rank 0 fails its MAC (cluster secret)", peer_rank=0,
                                   peer_addr=self.peers[0])
        return uid

    # ------------------------------------------------------------------ liveness, both sides
    def watch(self) -> None:
        """Watch the links on a thread of their own: EOF or an error frame fails the communicator."""
        name = f"p2pft-nccl-star-e{self.epoch}s{self.shard}r{self.rank}"
        self._thread = threading.Thread(target=self._watch, daemon=True, name=name)
        self._thread.start()

    def _watch(self) -> None:
        while True:
            with self._cond:
                if self._closed:
                    return
                by_sock = {s: r for r, s in self.socks.items()}
            if not by_sock:
                return
            try:
                ready, _, _ = select.select(list(by_sock), [], [], _WATCH_SLICE_S)
            except (OSError, ValueError):  # a socket closed under us: we are closing
                return
            for s in ready:
                err = self._read_verdict(s, by_sock[s])
                self.on_error(err)
                return

    def _read_verdict(self, s: socket.socket, peer: int, first: bytes = b"") -> CommError:
        """The error frame `peer` wrote (its first bytes already read: `first`), or why there is none."""
        addr = self.peers[peer]
        head = bytearray(FRAME_LEN)
        head[:len(first)] = first
        try:
            s.settimeout(1.0)
            recv_exact(s, memoryview(head)[len(first):])
            prefix = FRAME_PREFIX.unpack_from(head)
            plen = FRAME_SUFFIX.unpack_from(head, PREFIX_LEN)[4]
            if prefix[0] != FRAME_MAGIC or prefix[1] != OP_ERROR or plen > MAX_ERROR_PAYLOAD:
                return ProtocolMismatch(f"rank {peer} sent garbage on the NCCL link", peer_rank=peer, peer_addr=addr)
            body = bytearray(plen)
            recv_exact(s, memoryview(body))
        except (EOFError, OSError) as e:
            return PeerFailed(f"rank {peer} went away (its NCCL link closed: {type(e).__name__})",
                              peer_rank=peer, peer_addr=addr)
        remote = parse_error_payload(bytes(body))
        return error_from_remote(remote, peer, rank=self.rank, my_tag=0, peers=self.peers)

    def tell(self, err: CommError) -> None:
        """Write this rank's verdict on every link (rank 0 thereby relays a peer's to the others)."""
        origin = err.origin if err.origin is not None else self.rank
        frame = pack_error_frame(self.epoch, self.shard, self.rank, err, origin)
        with self._cond:
            socks = list(self.socks.values())
        for s in socks:
            try:
                s.send(frame, socket.MSG_DONTWAIT)
            except OSError:
                pass

    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            socks = list(self.socks.values())
            self._cond.notify_all()
        for s in socks:
            shutdown_quietly(s)
            close_quietly(s)
        th = self._thread
        if th is not None and th is not threading.current_thread():
            th.join(1.0)
