"""Asyncio driver: binds a sans-IO ``Node`` to real TCP sockets and the real clock.

Messages are one-way frames: every node keeps at most one outgoing connection per peer
address and answers on its own outgoing connection, so the protocol needs no request/response
pairing (the simulator delivers the same messages the same way). Admin requests
(``admin.*``, used by ``p2pft members``; client in ``p2pft.net.admin``) are the exception and
are answered on the connection they came in on.

Transport errors are evidence for the membership layer: a refused connection to a member's
address means its process is gone (declared dead at once); an EOF on an outgoing connection
starts suspicion at once. A bad frame closes only the connection that carried it; the node is
never taken down by what a peer sends. Hostile connections are bounded: at ``max_inbound`` open
inbound connections the longest-idle one is closed to make room, idle ones are closed after
``idle_timeout``, and a client that does not read its admin answers for ``drain_timeout`` loses
its connection; each of these is counted and logged.

A node given a data directory (``data_dir``) is a durable voter: its Raft hard state is loaded
from there at start and written there (``VoterStore``: atomic replace, fsync) whenever a step
changed it, before any message of that step is sent or any view published.

A node may advertise an address other than the one it binds (``advertise``: a NAT or, in tests,
the fault proxy in front of it); when it binds a specific IP, its outgoing connections use that
IP as their source, so that a proxy can tell the nodes apart by source address.
"""
from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from ..core import codec
from ..core.config import DEFAULT, Profile
from ..core.meta import MemberStatus, NodeSpec
from ..core.node import Node
from ..core.view import Role, View
from ..ops.log import set_context
from ..ops.observe import Observer
from ..transport.addr import is_wildcard, join_hostport, parse_hostport, reachable_host
from ..transport.wire import source_address
from .admin import members_report
from .store import VoterStore
from .aio import Wakeup, read_or_idle
from .wire import DEFAULT_MAX_FRAME, FrameDecoder, ReplayGuard, WireError, encode

log = logging.getLogger(__name__)

MAX_QUEUE = 1024          # frames queued per peer; the oldest is dropped past it (gossip tolerates loss)
CONNECT_TIMEOUT = 1.0
REJECT_LOG_EVERY = 5.0    # seconds between two log lines about the same kind of rejected connection
MEMBERS_EVERY_S = 0.05    # the members snapshot other threads read is refreshed at most this often


@dataclass(frozen=True)
class ConnLimits:
    """Bounds on what peers can make this node hold: frame size, open inbound connections, idle
    and slow readers, accepted clock skew of frames. Grouped because together they are the
    node's defence against hostile or broken connections (``p2pft peer --max-inbound`` ...)."""

    max_frame: int = DEFAULT_MAX_FRAME
    max_inbound: int = 2048       # past it the longest-idle inbound connection is closed
    idle_timeout: float = 60.0    # an inbound connection that sends nothing for this long is closed
    drain_timeout: float = 2.0    # a peer that does not read for this long loses its connection
    replay_window: float = 30.0   # accepted send-time skew of control frames, seconds

    def __post_init__(self) -> None:
        for name in ("max_frame", "max_inbound", "idle_timeout", "drain_timeout", "replay_window"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"{name} must be positive, got {v!r}")


ACCEPT_BACKLOG = 1024
"""The listen socket's accept queue. A burst of connects (a fleet restarting at once, a flood)
completes in the kernel faster than the loop accepts; asyncio's default of 100 drops the SYNs
past it, and each dropped connect waits a 1 s retransmission before it is tried again. The
kernel caps it at net.core.somaxconn (4096 on Linux >= 5.4)."""


class _Peer:
    """Outgoing connection to one address with a bounded send queue."""

    def __init__(self, server: "NodeServer", addr: str) -> None:
        self.server = server
        self.addr = addr
        self.queue: deque[bytes] = deque()
        self.wake = Wakeup()
        self.task = asyncio.get_running_loop().create_task(self._run())
        self.last_used = time.monotonic()

    def send(self, frame: bytes) -> None:
        if len(self.queue) >= MAX_QUEUE:
            self.queue.popleft()
            self.server.counters["send_dropped"] += 1
        self.queue.append(frame)
        self.last_used = time.monotonic()
        self.wake.set()

    async def _run(self) -> None:
        host, port = parse_hostport(self.addr)
        try:
            while not self.server.closing:
                try:
                    reader, writer = await asyncio.wait_for(self.server.open_connection(host, port),
                                                            CONNECT_TIMEOUT)
                except ConnectionRefusedError as exc:
                    self.queue.clear()
                    self.server.counters["connect_refused"] += 1
                    self.server.observer.connect_failed(self.addr, exc)
                    self.server.evidence(self.addr, certain=True)
                    return
                except (OSError, asyncio.TimeoutError) as exc:
                    self.queue.clear()
                    self.server.counters["connect_failed"] += 1
                    self.server.observer.connect_failed(self.addr, exc)
                    return
                eof = asyncio.get_running_loop().create_task(reader.read(1))
                eof.add_done_callback(lambda _f: self.wake.set())
                try:
                    while not self.server.closing:
                        while self.queue:
                            writer.write(self.queue.popleft())
                        if writer.transport.get_write_buffer_size():
                            await asyncio.wait_for(writer.drain(), self.server.limits.drain_timeout)
                        self.wake.clear()
                        if self.queue:
                            continue  # queued while we drained
                        woken = await self.wake.wait(self.server.limits.idle_timeout / 2)
                        if eof.done():
                            self.server.counters["peer_eof"] += 1
                            self.server.evidence(self.addr, certain=False)
                            await self._check_refused(host, port)
                            return
                        if not woken and not self.queue:
                            return  # idle: let the connection go, reconnect on the next send
                except (OSError, asyncio.TimeoutError, RuntimeError):
                    # RuntimeError: uvloop's write on a transport the peer's reset already closed
                    # ("the handler is closed"); asyncio's own loop raises nothing there.
                    self.server.counters["send_failed"] += 1
                    return
                finally:
                    eof.cancel()
                    writer.close()
        finally:
            self.server.peer_gone(self)


    async def _check_refused(self, host: str, port: int) -> None:
        """After an EOF, knock once: a killed process's port refuses at once, which is certain
        evidence (milliseconds) where suspicion alone would wait out a timeout."""
        try:
            _, writer = await asyncio.wait_for(self.server.open_connection(host, port), CONNECT_TIMEOUT)
        except ConnectionRefusedError:
            self.server.counters["connect_refused"] += 1
            self.server.evidence(self.addr, certain=True)
            return
        except (OSError, asyncio.TimeoutError):
            return
        writer.close()


class NodeServer:
    """Runs one node on a TCP listen address until stopped."""

    def __init__(self, *, listen: str, spec: NodeSpec = NodeSpec(), seeds: list[str] | tuple[str, ...] = (),
                 secret: bytes | None = None, profile: Profile = DEFAULT, limits: ConnLimits = ConnLimits(),
                 advertise: str | None = None, seed: int | None = None, data_dir: str | None = None) -> None:
        self.listen = listen
        self.host, self.port = parse_hostport(listen, "listen address")
        if advertise:
            parse_hostport(advertise, "advertised address")
        self.advertise = advertise or None
        # A wildcard bind is never advertised: peers get this host's address towards the seeds.
        self.reach_host = reachable_host(self.host, toward=seeds or ()) if is_wildcard(self.host) else None
        self.limits = limits
        self.replay = ReplayGuard(window=limits.replay_window)
        self.spec = spec
        self.data_dir = data_dir or None
        self.store: VoterStore | None = None
        self.seeds = list(seeds)
        self.secret = secret
        self.profile = profile
        self.rng = random.Random(seed)
        self.node: Node | None = None
        self.counters: Counter[str] = Counter()
        self.closing = False
        self.view_wall_time: float | None = None
        self.on_view: list[Callable[[View], None]] = []     # called on the loop thread per committed view
        # Every member's step and metadata as of the last flush (at most MEMBERS_EVERY_S old):
        # replaced, never mutated, so other threads read it without touching the node.
        self.members: Mapping[str, MemberStatus] = {}
        self._members_due = 0.0
        self.log_context = True   # one node per process: show its id/epoch in every log line
        self._peers: dict[str, _Peer] = {}
        # inbound connections, least recently active first (the one to close when full)
        self._inbound: OrderedDict[asyncio.StreamWriter, float] = OrderedDict()
        self._last_reject_log: dict[str, float] = {}
        self._server: asyncio.base_events.Server | None = None
        self._timer: asyncio.Task[None] | None = None
        self._wake: Wakeup | None = None
        self.observer = Observer(self)   # events for `p2pft top`, message counts, seed warnings

    @property
    def addr(self) -> str:
        """The address peers use to reach this node (the advertised one, if any)."""
        return self.advertise or join_hostport(self.reach_host or self.host, self.port)

    @property
    def bound_addr(self) -> str:
        """The address this node actually listens on."""
        return join_hostport(self.host, self.port)

    def open_connection(self, host: str, port: int) -> Any:
        """asyncio.open_connection from this node's own IP when it binds a specific one."""
        src = source_address(self.host, host)  # the data plane's rule, shared
        if src is None:
            return asyncio.open_connection(host, port)
        return asyncio.open_connection(host, port, local_addr=src)

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Bind, then create the node (its id and start stamp) and join through the seeds."""
        self._server = await asyncio.start_server(self._on_conn, self.host, self.port, limit=1 << 20,
                                                  reuse_address=True, backlog=ACCEPT_BACKLOG)
        if self.port == 0:
            self.port = self._server.sockets[0].getsockname()[1]
        self.replay = ReplayGuard(window=self.replay.window)   # the start of this process's table
        restore = None
        try:
            if self.data_dir:
                self.store = VoterStore(self.data_dir)
                restore = self.store.load()
            self.node = Node(self.spec, addr=self.addr, seeds=self.seeds, profile=self.profile, rng=self.rng,
                             now=time.monotonic(), start_stamp=time.time(), durable=self.store is not None,
                             restore=restore)
        except BaseException:
            self._server.close()
            if self.store is not None:
                self.store.close()
                self.store = None
            raise
        self._wake = Wakeup()
        self._timer = asyncio.get_running_loop().create_task(self._timer_loop())
        self._flush()
        log.info("listening on %s%s as %s (seeds: %s)", self.bound_addr,
                 f" (advertised as {self.addr})" if self.addr != self.bound_addr else "", self.node.id,
                 ",".join(self.seeds) or "none", extra={"node": self.node.id})

    def peer_gone(self, peer: "_Peer") -> None:
        """A peer's connection task ended: forget it (a newer one for the address stays)."""
        if self._peers.get(peer.addr) is peer:
            del self._peers[peer.addr]

    async def stop(self, leave: bool = True, timeout: float = 1.0) -> None:
        if self.closing:
            return
        if leave and self.node is not None:
            self.node.leave(time.monotonic())
            self._flush()
            deadline = time.monotonic() + timeout
            while any(p.queue for p in self._peers.values()) and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
        self.closing = True
        if self._timer:
            self._timer.cancel()
        if self._server:
            self._server.close()
        if self.store is not None:
            self.store.close()
        for w in list(self._inbound):
            w.close()
        for p in list(self._peers.values()):
            p.wake.set()
            p.task.cancel()
        await asyncio.sleep(0)

    # ------------------------------------------------------------------ loop
    def poke(self) -> None:
        """Re-evaluate timers and flush outputs (after a call into the node from outside)."""
        self._flush()
        if self._wake:
            self._wake.set()

    async def _timer_loop(self) -> None:
        assert self.node is not None and self._wake is not None
        while not self.closing:
            delay = self.node.next_deadline() - time.monotonic()
            if delay > 0:
                self._wake.clear()
                await self._wake.wait(min(delay, 1.0))
            try:
                self.node.tick(time.monotonic())
            except Exception:  # a bug must not stop the timers of a live node
                self.counters["tick_error"] += 1
                log.exception("tick failed")
            self._flush()

    def _flush(self) -> None:
        """Act on the node's Ready: send its messages, publish its committed views."""
        node = self.node
        if node is None or self.counters["store_failed"]:
            return
        ready = node.ready()
        if ready.hard_state is not None and self.store is not None:
            try:
                self.store.save(ready.hard_state)
            except OSError as exc:
                # Sending now could acknowledge a vote or an entry this voter would forget: stop.
                self.counters["store_failed"] += 1
                log.critical("cannot write the voter state to %s (%s): this node stops", self.store.path,
                             exc.strerror or exc)
                self.closing = True
                if self._timer:
                    self._timer.cancel()
                if self._server:
                    self._server.close()
                return
        last: Any = None
        body: dict[str, Any] = {}
        for addr, msg in ready.messages:
            if addr == self.addr:
                continue
            if msg is not last:  # one message value sent to many (a view to every member): one body
                last, body = msg, codec.to_wire(msg)
            try:
                # a frame per destination: each gets its own send sequence number
                frame = encode(body["t"], node.id, body, secret=self.secret, max_frame=self.limits.max_frame)
            except WireError as exc:
                self.counters["encode_failed"] += 1
                log.warning("not sending %s to %s: %s", body["t"], addr, exc)
                continue
            peer = self._peers.get(addr)
            if peer is None or peer.task.done():
                if self.closing:
                    continue
                peer = self._peers[addr] = _Peer(self, addr)
            peer.send(frame)
            self.counters["frames_sent"] += 1
            self.observer.note_sent(addr, body["t"])
        now = time.monotonic()
        if ready.views or now >= self._members_due:
            self.members = node.member_statuses()
            self._members_due = now + MEMBERS_EVERY_S
        for view in ready.views:
            self.view_wall_time = time.time()
            if self.log_context:
                set_context(node=node.id, epoch=view.epoch)
            log.info("view e%d: %s", view.epoch, _describe(view), extra={"epoch": view.epoch})
            for cb in list(self.on_view):
                try:
                    cb(view)
                except Exception:
                    log.exception("view callback failed")

    def evidence(self, addr: str, certain: bool) -> None:
        if self.node is None or self.closing:
            return
        self.node.report_unreachable(addr, time.monotonic(), certain)
        self.poke()

    # ------------------------------------------------------------------ inbound
    async def _on_conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        if self.closing:
            writer.close()
            return
        now = time.monotonic()
        while len(self._inbound) >= self.limits.max_inbound:
            # Full: the connection idle longest goes (a flood of idle connections cannot lock out
            # peers and admin clients; a live peer whose connection goes simply reconnects).
            old, since = self._inbound.popitem(last=False)
            self.counters["inbound_evicted"] += 1
            self._log_reject("inbound_evicted", "%d inbound connections (the limit): closing the one idle "
                             "longest (%.1f s, from %s)", self.limits.max_inbound, now - since,
                             _fmt_peer(old.get_extra_info("peername")))
            old.close()
        self._inbound[writer] = now
        decoder = FrameDecoder(secret=self.secret, max_frame=self.limits.max_frame, guard=self.replay)
        try:
            while not self.closing:
                data = await read_or_idle(reader, writer, 1 << 16, self.limits.idle_timeout)
                if data is None:
                    self.counters["idle_closed"] += 1
                    self._log_reject("idle_closed", "closing connection from %s: nothing received for %g s",
                                     _fmt_peer(peer), self.limits.idle_timeout)
                    return
                if writer not in self._inbound:
                    return  # evicted to make room
                self._inbound[writer] = time.monotonic()
                self._inbound.move_to_end(writer)
                if not data:
                    try:
                        decoder.eof()
                    except WireError as exc:
                        self.counters[f"bad_frame_{exc.kind}"] += 1
                        log.warning("connection from %s: %s", _fmt_peer(peer), exc)
                    return
                try:
                    messages = decoder.feed(data)
                except WireError as exc:
                    self.counters[f"bad_frame_{exc.kind}"] += 1
                    log.warning("closing connection from %s: %s", _fmt_peer(peer), exc)
                    return
                for m in messages:
                    if not self._dispatch(m.type, m.body, writer):
                        self.counters["bad_message"] += 1
                        log.warning("closing connection from %s: malformed %r message", _fmt_peer(peer), m.type)
                        return
                if writer.transport.get_write_buffer_size():
                    # Admin answers are waiting: a client that does not read them is not served
                    # more (no reads meanwhile), and loses the connection after drain_timeout.
                    try:
                        await asyncio.wait_for(writer.drain(), self.limits.drain_timeout)
                    except asyncio.TimeoutError:
                        self.counters["slow_reader_closed"] += 1
                        self._log_reject("slow_reader_closed", "closing connection from %s: it has not read "
                                         "its answers (%d bytes waiting) for %g s", _fmt_peer(peer),
                                         writer.transport.get_write_buffer_size(), self.limits.drain_timeout)
                        writer.transport.abort()
                        return
        except (ConnectionError, OSError):
            return
        finally:
            self._inbound.pop(writer, None)
            writer.close()

    def _log_reject(self, kind: str, fmt: str, *args: Any) -> None:
        """One WARNING per kind of rejected connection every REJECT_LOG_EVERY seconds (a flood
        must not flood the log too); the counters have the exact numbers."""
        now = time.monotonic()
        if now - self._last_reject_log.get(kind, -REJECT_LOG_EVERY) >= REJECT_LOG_EVERY:
            self._last_reject_log[kind] = now
            log.warning(fmt + " [%s=%d]", *args, kind, self.counters[kind])

    def _dispatch(self, mtype: str, body: dict[str, Any], writer: asyncio.StreamWriter) -> bool:
        node = self.node
        if node is None:
            return True
        if mtype.startswith("admin."):
            reply = self._admin(mtype, body)
            try:
                writer.write(encode("admin.reply", node.id, reply, secret=self.secret, max_frame=self.limits.max_frame))
            except WireError:
                return False
            return True
        body["t"] = mtype
        self.observer.note_received(mtype)
        try:
            node.handle(codec.from_wire(body), time.monotonic())
        except (KeyError, TypeError, ValueError, AttributeError, IndexError, OverflowError):
            return False
        except Exception:  # content no check anticipated: still the sender's fault, never fatal
            log.exception("unexpected error handling a %r message", mtype)
            return False
        finally:
            self._flush()
            if self._wake:
                self._wake.set()
        return True

    # ------------------------------------------------------------------ admin
    def _admin(self, mtype: str, body: dict[str, Any]) -> dict[str, Any]:
        if mtype == "admin.members":
            return self.members_report()
        if mtype == "admin.top":
            return self.observer.top_report()
        if mtype == "admin.stats":
            return {"counters": dict(self.counters), "node": dict(self.node.stats) if self.node else {}}
        return {"error": f"unknown admin request {mtype!r}"}

    def members_report(self) -> dict[str, Any]:
        """The committed view as this node sees it (the `p2pft members --json` object)."""
        assert self.node is not None
        return members_report(self.node, self.view_wall_time)


#: one letter per role in a view's log line ("paused" must not read as a participant's "p")
ROLE_LETTER = {Role.PARTICIPANT: "p", Role.JOINER: "j", Role.WITNESS: "w", Role.PAUSED: "z"}


def _describe(view: View) -> str:
    voters = set(view.voters)
    return " ".join(f"{m.replica_id}({ROLE_LETTER.get(m.role, '?')}{'*' if m.voter_id in voters else ''})"
                    for m in view.members)


def _fmt_peer(peer: Any) -> str:
    if isinstance(peer, tuple) and len(peer) >= 2:
        return f"{peer[0]}:{peer[1]}"
    return str(peer)
