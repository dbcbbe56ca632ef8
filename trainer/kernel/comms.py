"""This rank's communicators across replicas, one per data epoch, and their timely abort.

Rank i of a replica allreduces its shard with rank i of the other replicas on the communicator
of ``(data epoch, shard i)``. A newer data epoch means a member left or a fresh communicator was
asked for; an allreduce still blocked on the old one (a dead or paused peer) must end at once,
not after its timeout. Rank 0 sees views; the other ranks of an FSDP replica do not (a blocked
collective could not tell them), so rank 0 announces each new data epoch over a tiny side
channel, on which it also pings the ranks: a rank that is stopped or wedged keeps its sockets
open, no peer sees an error, and without the ping the replica would stay in the view while the
other replicas' allreduces time out again and again.

On the NCCL plane a new communicator is a rendezvous of every rank (id hand-off,
ncclCommInitRank, connect), so rank 0 builds this shard's communicator of a new data epoch as
soon as the view announces it, on the view thread, and tells every other rank on the side
channel which one to build (data epoch, rank, peers): the set-up overlaps the step being
computed instead of following it, and the engine's next attempt finds it built.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterable

from ...core.view import Role, View
from ...transport import Communicator, SharedDevice
from ...transport.backend import Backend
from .ports import CommFactory, DataServerPort, RuntimePort

log = logging.getLogger(__name__)

_PING = struct.pack(">q", -1)   # on the side channel: "answer if you are running"
_PREPARE = -2                   # on the side channel: a JSON body follows (length, then bytes)
_PREPARE_HEAD = struct.Struct(">qI")
MAX_PREPARE_BYTES = 1 << 16     # a body's data addresses; a longer one is a broken peer
SIDE_CONNECTIONS = 8            # only rank 0 connects (two connections); refuse a flood
PING_EVERY_S = 0.5
SIDE_NONCE = 16                 # a side-channel connection's challenge (bytes), fresh per connection
SIDE_MAC = 32                   # HMAC-SHA256 of it under the cluster secret
SIDE_AUTH_S = 5.0               # how long either end waits for the other's half of the handshake
SIDE_TAG = b"p2pft-side-channel/1"
PREPARE_THREADS = 2             # communicators a rank other than 0 builds ahead at once (views can come fast)


class ShardComms:
    """Communicator cache of one rank; rank 0 also drives aborts and rank liveness."""

    def __init__(self, ds: DataServerPort, shard: int, comm_timeout: float, backend: Backend = Backend.TCP,
                 device: int | None = None, factory: CommFactory | None = None, secret: bytes | None = None) -> None:
        self.ds = ds
        self.secret = secret      # the cluster secret: rank 0 proves it on every side-channel connection
        # What builds a communicator: the data server's (TCP ring or NCCL), unless one is given
        # (a test's in-memory communicators); either way built here only, on the same keywords.
        self._make: CommFactory = factory if factory is not None else ds.communicator
        self._lazy = factory is None   # the data server's own communicators: a peer's ring call waits there
        self.backend = backend    # every communicator of this rank: tcp, nccl or nccl-auto (transport.backend)
        self.device = device      # CUDA device index for nccl
        self.shard = shard
        self.comm_timeout = comm_timeout
        # How long a new communicator's first operation waits for its ring neighbours to
        # connect; DiLoCo raises it to comm_timeout (a joiner reaches a sync a span early).
        self.connect_timeout = 5.0
        self._comms: dict[int, Communicator] = {}
        self._keys: dict[int, tuple[int, tuple[str, ...]]] = {}   # data epoch -> (rank, peers) it was built for
        self._build = threading.Lock()   # the training thread and the view thread may build the same epoch
        self._superseded_by = -1  # newest data epoch announced: older communicators are dead
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._side_slots = threading.BoundedSemaphore(SIDE_CONNECTIONS)
        self._refusals = 0        # side-channel connections refused for a wrong proof of the secret
        self._prepare_slots = threading.BoundedSemaphore(PREPARE_THREADS)
        self._closed = threading.Event()
        # The first refusal no retry can fix, kept after its communicator is replaced: a job
        # whose peer went away after the refusal must still hear of it (``unusable``).
        self._refused: SharedDevice | None = None

    # ------------------------------------------------------------------ communicators
    def get(self, d: int, rank: int, peers: list[str]) -> Communicator:
        """The communicator of data epoch `d` (built once; a failed one is replaced)."""
        key = (rank, tuple(peers))
        with self._build:
            with self._lock:
                comm = self._comms.get(d)
                if comm is not None and self._keys.get(d) == key:
                    if comm.failed is None:
                        return comm
                    if isinstance(comm.failed, SharedDevice):
                        raise comm.failed   # prepared and refused: building it again cannot work
                old = [self._comms.pop(k) for k in [k for k in self._comms if k <= d]]
                for k in [k for k in self._keys if k <= d]:
                    del self._keys[k]
                self._keep_refusal(old)
            for c in old:
                c.abort(f"replaced by data epoch {d}")
                c.close()
            comm = self._make(d, self.shard, rank, peers, timeout=self.comm_timeout, backend=self.backend,
                              device=self.device, connect_timeout=self.connect_timeout)
            with self._lock:
                if d < self._superseded_by:
                    # A newer data epoch was announced while this attempt was being planned: the new
                    # communicator must not wait out its connect timeout on a dead peer.
                    comm.abort(f"superseded by data epoch {self._superseded_by} before first use")
                if self._closed.is_set():   # closed while this was built (the view thread prepares)
                    comm.abort("closing")
                self._comms[d] = comm
                self._keys[d] = key
            return comm

    @property
    def sees_calls(self) -> bool:
        """Whether `calling` can see a peer start a collective with this rank: the data server's
        TCP rings connect at their first operation, so a peer's connection waits for us there."""
        return self._lazy and self.backend is Backend.TCP

    def calling(self, min_epoch: int) -> bool:
        """A peer has started a collective of data epoch `min_epoch` or later with this rank."""
        return self.ds.calling(min_epoch, self.shard)

    def prepare(self, view: View, node: str, world: int) -> None:
        """Rank 0, when a view brings a new data epoch: build this shard's NCCL communicator of it
        now, with the rank and peers the engine's attempt will ask for (the same view), so that its
        set-up runs while the training thread still computes. The TCP ring connects lazily and
        cheaply: nothing to prepare."""
        plan = self._plan(view, node, world, self.shard)
        if plan is not None:
            self._prepare(*plan)

    def _plan(self, view: View, node: str, world: int, shard: int) -> tuple[int, int, list[str]] | None:
        """(data epoch, rank, peers) of `shard`'s communicator in `view`, when one is worth
        building ahead: NCCL, and this replica on the data plane with every rank's address."""
        if not self.backend.nccl or self._closed.is_set():
            return None
        me = view.member(node)
        if me is None or me.role not in (Role.PARTICIPANT, Role.JOINER) or any(
                len(m.data_addrs) != world for m in view.data_members):
            return None
        return view.data_epoch, view.data_rank(node), view.shard_addrs(shard)

    def _prepare(self, d: int, rank: int, peers: list[str]) -> Communicator | None:
        """The communicator of data epoch `d`, built now; None when it could not be."""
        try:
            return self.get(d, rank, peers)
        except Exception as exc:  # noqa: BLE001 - the training thread builds it, and reports, itself
            log.debug("communicator of data epoch %d not prepared: %r", d, exc)
            return None

    def prepare_frame(self, view: View, node: str, world: int, shard: int) -> bytes:
        """Rank 0: what tells rank `shard` to build its communicator of `view`'s data epoch ahead
        (it does not see views); empty when there is nothing to prepare."""
        plan = self._plan(view, node, world, shard)
        if plan is None:
            return b""
        d, rank, peers = plan
        body = json.dumps({"d": d, "rank": rank, "peers": peers}).encode()
        return _PREPARE_HEAD.pack(_PREPARE, len(body)) + body

    def unusable(self) -> BaseException | None:
        """A communicator's failure that no retry can fix (two ranks on one device under an
        explicit 'nccl'), seen by a prepared communicator before any attempt asked for one."""
        with self._lock:
            self._keep_refusal(self._comms.values())
            return self._refused

    def _keep_refusal(self, comms: Iterable[Communicator]) -> None:
        """Under the lock: remember the first SharedDevice refusal among `comms`."""
        if self._refused is None:
            self._refused = next((c.failed for c in comms if isinstance(c.failed, SharedDevice)), None)

    def abort_below(self, d: int) -> None:
        with self._lock:
            self._superseded_by = max(self._superseded_by, d)
            stale = [c for k, c in self._comms.items() if k < d]
        for c in stale:
            c.abort(f"superseded by data epoch {d}")

    def abort_all(self, reason: str) -> None:
        """Unblock an allreduce in flight (graceful stop)."""
        with self._lock:
            comms = list(self._comms.values())
        for c in comms:
            c.abort(reason)

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            comms = list(self._comms.values())
            self._comms.clear()
        for c in comms:
            c.abort("closing")
            c.close()
        if self._listener is not None:
            self._listener.close()

    # ------------------------------------------------------------------ side channel
    def listen(self, host: str) -> tuple[str, int]:
        """Ranks other than 0: accept rank 0's side-channel connections; returns the address."""
        self._listener = socket.create_server((host, 0))
        threading.Thread(target=self._accept, daemon=True, name="p2pft-side").start()
        return host, self._listener.getsockname()[1]

    def _accept(self) -> None:
        assert self._listener is not None
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            if not self._side_slots.acquire(blocking=False):
                conn.close()
                continue
            threading.Thread(target=self._serve_side, args=(conn,), daemon=True, name="p2pft-side-conn").start()

    def _serve_side(self, conn: socket.socket) -> None:
        """Abort communicators older than each data epoch rank 0 announces; build the new one
        ahead when told to (NCCL); answer pings. A malformed frame, or (with a secret) a
        connection that does not prove it, ends the connection."""
        buf = b""
        try:
            if not self._admit(conn):
                return
            while True:
                try:
                    chunk = conn.recv(4096)
                except OSError:
                    return
                if not chunk:
                    return
                buf += chunk
                while len(buf) >= 8:
                    (d,) = struct.unpack(">q", buf[:8])
                    if d >= 0:
                        buf = buf[8:]
                        self.abort_below(d)
                    elif d == _PREPARE:
                        if len(buf) < _PREPARE_HEAD.size:
                            break
                        _, n = _PREPARE_HEAD.unpack(buf[:_PREPARE_HEAD.size])
                        if n > MAX_PREPARE_BYTES:
                            log.warning("side channel: a prepare frame of %d bytes; closing the connection", n)
                            return
                        if len(buf) < _PREPARE_HEAD.size + n:
                            break
                        body, buf = buf[_PREPARE_HEAD.size:_PREPARE_HEAD.size + n], buf[_PREPARE_HEAD.size + n:]
                        if not self._start_prepare(body):
                            return
                    else:
                        buf = buf[8:]
                        try:
                            conn.sendall(b"\x01")
                        except OSError:
                            return
        finally:
            conn.close()
            self._side_slots.release()

    def _admit(self, conn: socket.socket) -> bool:
        """With a secret: a fresh nonce out, its MAC back within `SIDE_AUTH_S` (rank 0's
        ``_side_connect``), or the connection is refused; without one, every connection."""
        if self.secret is None:
            return True
        nonce = os.urandom(SIDE_NONCE)
        try:
            conn.settimeout(SIDE_AUTH_S)
            conn.sendall(nonce)
            mac = _recv_exact(conn, SIDE_MAC)
            conn.settimeout(None)
        except OSError:
            return False
        if mac is not None and hmac.compare_digest(mac, _side_mac(self.secret, nonce)):
            return True
        self._refusals += 1
        if self._refusals in (1, 10, 100) or self._refusals % 1000 == 0:
            log.warning("side channel: refused a connection that does not hold the cluster secret (%d so far)",
                        self._refusals)
        return False

    def _side_connect(self, addr: tuple[str, int]) -> socket.socket:
        """Rank 0: a side-channel connection to another rank, proving the secret when there is one."""
        sock = socket.create_connection(addr, timeout=1.0)
        if self.secret is not None:
            try:
                sock.settimeout(SIDE_AUTH_S)
                nonce = _recv_exact(sock, SIDE_NONCE)
                if nonce is None:
                    raise ConnectionError("side channel closed during the handshake")
                sock.sendall(_side_mac(self.secret, nonce))
                sock.settimeout(1.0)
            except OSError:
                sock.close()
                raise
        return sock

    def _start_prepare(self, body: bytes) -> bool:
        """Build the communicator rank 0 described, on a thread of its own (the side channel
        keeps answering pings meanwhile); False for a body that is not one."""
        try:
            msg = json.loads(body)
            d, rank, peers = int(msg["d"]), int(msg["rank"]), [str(p) for p in msg["peers"]]
        except (ValueError, KeyError, TypeError):
            log.warning("side channel: a malformed prepare frame; closing the connection")
            return False
        if d < self._superseded_by or self._closed.is_set():
            return True
        if not self._prepare_slots.acquire(blocking=False):
            return True   # builds still waiting on older epochs: the attempt builds this one itself

        def build() -> None:
            try:
                comm = self._prepare(d, rank, peers)
                # The communicator sets itself up on threads of its own (id hand-off, init,
                # warm-up): the slot is held until its init thread is done with NCCL (a failed
                # set-up's abort included: ``wait_init`` turns true only then), so that the slots
                # bound set-ups in progress, not just the calls that start them.
                bound = time.monotonic() + 2 * self.connect_timeout + self.comm_timeout
                wait_init = getattr(comm, "wait_init", None)
                while (comm is not None and wait_init is not None and time.monotonic() < bound
                       and not self._closed.is_set()):
                    if wait_init(0.05):
                        break
            finally:
                self._prepare_slots.release()
        threading.Thread(target=build, daemon=True, name=f"p2pft-prepare-e{d}").start()
        return True

    # ------------------------------------------------------------------ rank 0
    def follow_views(self, rt: RuntimePort, ranks: list[tuple[str, int]]) -> None:
        """Rank 0: abort older communicators of every rank at each new data epoch."""
        threading.Thread(target=self._follow, args=(rt, ranks), daemon=True, name="p2pft-views").start()

    def _follow(self, rt: RuntimePort, ranks: list[tuple[str, int]]) -> None:
        seen = -1
        socks: dict[int, socket.socket] = {}
        while not rt.closed and not self._closed.is_set():
            v = rt.wait_view(lambda v: v.data_epoch > seen, 1.0)
            if v is None:
                continue
            seen = v.data_epoch
            self.abort_below(seen)
            self.prepare(v, rt.node_id, len(ranks) + 1)
            for i, addr in enumerate(ranks):
                frame = struct.pack(">q", seen) + self.prepare_frame(v, rt.node_id, len(ranks) + 1, i + 1)
                for _ in range(2):  # one reconnect: the rank may have restarted its accept
                    try:
                        if i not in socks:
                            socks[i] = self._side_connect(addr)
                        socks[i].sendall(frame)
                        break
                    except OSError:
                        old = socks.pop(i, None)
                        if old is not None:
                            old.close()

    def watch_ranks(self, rt: RuntimePort, ranks: list[tuple[str, int]], rank_timeout: float,
                    stopping: Callable[[], bool], on_lost: Callable[[int, float], None]) -> None:
        """Rank 0: past `rank_timeout` of silence from a rank, leave the view at once and take
        the replica down (`on_lost`), to be restarted whole."""
        if ranks:
            threading.Thread(target=self._watch, args=(rt, ranks, rank_timeout, stopping, on_lost),
                             daemon=True, name="p2pft-watch").start()

    def _watch(self, rt: RuntimePort, ranks: list[tuple[str, int]], rank_timeout: float,
               stopping: Callable[[], bool], on_lost: Callable[[int, float], None]) -> None:
        conns: dict[int, socket.socket] = {}
        last_ok = {i: time.monotonic() for i in range(len(ranks))}
        while not stopping() and not rt.closed and not self._closed.is_set():
            for i, addr in enumerate(ranks):
                try:
                    if i not in conns:
                        conns[i] = self._side_connect(addr)
                    conns[i].settimeout(1.0)
                    conns[i].sendall(_PING)
                    if not conns[i].recv(1):
                        raise ConnectionError("closed")
                    last_ok[i] = time.monotonic()
                except OSError:
                    old = conns.pop(i, None)
                    if old is not None:
                        old.close()
                silent = time.monotonic() - last_ok[i]
                if silent > rank_timeout and not stopping() and not rt.closed:
                    log.error("rank %d of this replica has not answered for %.1f s: leaving the view and "
                              "taking the replica down (it restarts whole)", i + 1, silent)
                    rt.close(leave=True, timeout=2.0)
                    on_lost(i + 1, silent)
                    return
            time.sleep(PING_EVERY_S)
        for c in conns.values():
            c.close()


def _side_mac(secret: bytes, nonce: bytes) -> bytes:
    return hmac.new(secret, SIDE_TAG + nonce, hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    """`n` bytes, or None when the peer closed first."""
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            return None
        out += chunk
    return out


__all__ = ["ShardComms"]
