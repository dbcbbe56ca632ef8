"""Network faults for real processes: a TCP fault proxy in front of each node's ports.

Each process gets its own loopback IP (127.0.0.N; all of 127.0.0.0/8 routes to ``lo`` on
Linux), binds its ports there and advertises the address of a proxy instead
(``--advertise`` / ``--advertise-data``). Processes bind the source of their outgoing
connections to their own IP, so a proxy knows who is sending by the client's source address.
Rules are kept per direction ``(from IP or '*', to IP or '*')``: for a proxied connection, bytes
from the client to the node behind the proxy go ``client IP -> node IP`` and the answers on the
same connection ``node IP -> client IP``. The most specific rule wins
(``(a, b)``, then ``(a, '*')``, ``('*', b)``, ``('*', '*')``); no rule means pass. Rules change at
run time, from any thread.

A rule (``Rule``) combines:

- ``blackhole``: bytes in that direction are read and silently discarded; connections stay open
  and new ones are still accepted (a dead link whose endpoints have not noticed). Because TCP
  never loses bytes from the middle of a stream, a connection that lost bytes cannot carry a
  valid stream afterwards: when the cut heals the proxy resets it (as a connection that hit its
  retransmission timeout during a long outage would be), and the endpoints reconnect. A close
  or reset in a cut direction is not passed on either: the other end learns of it at the heal.
- ``delay`` and ``jitter``: every chunk (one ``read()`` of up to 64 KiB) is held for
  ``delay ± uniform(jitter)`` seconds; order is kept (a chunk never overtakes the one before).
- ``drop`` with probability p: TCP cannot lose bytes either, so a lost segment is modelled as
  what the receiver sees: the chunk and everything behind it stall for ``rto`` (default 200 ms,
  Linux's minimum retransmission timeout) before delivery.

What the proxy does not model: a connection to a proxy is accepted even when the node behind it
is dead (its refusal shows up as an immediate close, i.e. an EOF, rather than ECONNREFUSED), and
a cut does not stop new connections from being set up.

Use from a test::

    nf = NetFault(seed=1).start()
    ctl = nf.add_proxy("127.0.0.12:0", "127.0.0.12:7000")    # -> "127.0.0.12:<port>"
    nf.isolate("127.0.0.12"); ...; nf.heal(); nf.stop()

or as a process: ``python -m p2pft.chaos.netfault --proxy LISTEN=TARGET ...`` reading rule
commands from stdin (``blackhole A B``, ``oneway A B``, ``isolate A``, ``delay A B S [J]``,
``drop A B P [RTO]``, ``pass A B``, ``heal``, ``stats``).
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import random
import sys
import threading
from collections import Counter, deque
from dataclasses import dataclass
from typing import Iterable

from ..transport.addr import parse_hostport

log = logging.getLogger(__name__)

ANY = "*"
READ_CHUNK = 1 << 16
MAX_QUEUED = 4 << 20     # bytes held per direction before the proxy stops reading (backpressure)


@dataclass(frozen=True)
class Rule:
    """What happens to bytes in one direction. The default passes them untouched."""

    blackhole: bool = False
    delay: float = 0.0
    jitter: float = 0.0
    drop: float = 0.0
    rto: float = 0.2

    @property
    def passes(self) -> bool:
        return not self.blackhole and not self.delay and not self.jitter and not self.drop


PASS = Rule()
BLACKHOLE = Rule(blackhole=True)


def _split(addr: str) -> tuple[str, int]:
    return parse_hostport(addr, "proxy address")


class _Pipe:
    """One direction of a proxied connection: reads, applies the rule per chunk, writes in order."""

    def __init__(self, conn: "_Conn", src: str, dst: str, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter) -> None:
        self.conn, self.src, self.dst = conn, src, dst
        self.reader, self.writer = reader, writer
        self.q: deque[tuple[float, bytes]] = deque()
        self.queued = 0
        self.last_due = 0.0
        self.eof = False
        self.tainted = False          # bytes were discarded: the stream is broken from here on
        self.has_data = asyncio.Event()
        self.room = asyncio.Event()

    async def read_loop(self) -> None:
        nf = self.conn.nf
        loop = asyncio.get_running_loop()
        while True:
            try:
                data = await self.reader.read(READ_CHUNK)
            except (ConnectionError, OSError):
                if nf.rule_for(self.src, self.dst).blackhole:
                    self.tainted = True    # a reset cannot cross a dead link either: hold until healed
                    return
                raise
            if not data and nf.rule_for(self.src, self.dst).blackhole:
                self.tainted = True        # nor can a FIN: the other end learns at the heal (reset)
                return
            if not data:
                break
            rule = nf.rule_for(self.src, self.dst)
            if rule.blackhole:
                self.tainted = True
                nf.counters["bytes_blackholed"] += len(data)
                continue
            if self.tainted:
                nf.counters["reset_after_cut"] += 1
                self.conn.reset()
                return
            now = loop.time()
            due = now + rule.delay
            if rule.jitter:
                due += nf.rng.uniform(-rule.jitter, rule.jitter)
            if rule.drop and nf.rng.random() < rule.drop:
                due += rule.rto
                nf.counters["stalls"] += 1
            due = max(due, self.last_due, now)    # order kept
            self.last_due = due
            self.q.append((due, data))
            self.queued += len(data)
            nf.counters["bytes_passed"] += len(data)
            self.has_data.set()
            while self.queued > MAX_QUEUED:
                self.room.clear()
                await self.room.wait()
        self.eof = True
        self.has_data.set()

    async def write_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while not self.q:
                if self.eof:
                    if self.writer.can_write_eof():
                        self.writer.write_eof()
                    return
                self.has_data.clear()
                await self.has_data.wait()
            due, data = self.q.popleft()
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            self.writer.write(data)
            await self.writer.drain()
            self.queued -= len(data)
            self.room.set()


class _Conn:
    """A client connection and the proxy's connection to the node behind it."""

    def __init__(self, nf: "NetFault", client: str, node: str, cr: asyncio.StreamReader, cw: asyncio.StreamWriter,
                 tr: asyncio.StreamReader, tw: asyncio.StreamWriter) -> None:
        self.nf = nf
        self.cw, self.tw = cw, tw
        self.fwd = _Pipe(self, client, node, cr, tw)
        self.bwd = _Pipe(self, node, client, tr, cw)
        self.tasks: list[asyncio.Task[None]] = []
        self.closed = False

    async def run(self) -> None:
        self.tasks = [asyncio.ensure_future(c) for c in (self.fwd.read_loop(), self.fwd.write_loop(),
                                                         self.bwd.read_loop(), self.bwd.write_loop())]
        try:
            # Ends when both directions have delivered their EOF, or at the first error.
            pending = set(self.tasks)
            while pending and not self.closed:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if any(t.exception() for t in done if not t.cancelled()):
                    break
        except asyncio.CancelledError:
            pass
        finally:
            self.reset()

    def reset(self) -> None:
        """Abort both sockets (the endpoints see a reset or EOF) and stop the pumps."""
        if self.closed:
            return
        self.closed = True
        for w in (self.cw, self.tw):
            try:
                w.transport.abort()
            except Exception:  # noqa: BLE001 - already closed
                pass
        for t in self.tasks:
            if t is not asyncio.current_task():
                t.cancel()


class NetFault:
    """Fault proxies and their rule table, served by one asyncio loop in a background thread."""

    def __init__(self, seed: int | None = 0) -> None:
        self.rng = random.Random(seed)
        self.counters: Counter[str] = Counter()
        self._rules: dict[tuple[str, str], Rule] = {}
        self._lock = threading.Lock()
        self._conns: set[_Conn] = set()
        self._servers: list[asyncio.base_events.Server] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "NetFault":
        ready = threading.Event()

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            ready.set()
            loop.run_forever()
            loop.close()

        self._thread = threading.Thread(target=run, name="p2pft-netfault", daemon=True)
        self._thread.start()
        ready.wait()
        return self

    def stop(self) -> None:
        loop = self._loop
        if loop is None or not loop.is_running():
            return

        async def shutdown() -> None:
            for s in self._servers:
                s.close()
            for c in list(self._conns):
                c.reset()
            await asyncio.sleep(0.01)

        asyncio.run_coroutine_threadsafe(shutdown(), loop).result(5)
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(5)

    def __enter__(self) -> "NetFault":
        return self.start() if self._loop is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def add_proxy(self, listen: str, target: str, node: str | None = None) -> str:
        """Listen on `listen` (port 0: any) and forward to `target`; `node` is the IP that rules
        name for the node behind it (default: the target's host). Returns the listen address."""
        assert self._loop is not None, "start() first"
        node_ip = node or _split(target)[0]
        thost, tport = _split(target)
        lhost, lport = _split(listen)

        async def open_server() -> str:
            async def on_conn(cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
                client = cw.get_extra_info("peername")[0]
                try:
                    tr, tw = await asyncio.wait_for(asyncio.open_connection(thost, tport), 5.0)
                except (OSError, asyncio.TimeoutError):
                    self.counters["target_unreachable"] += 1
                    cw.transport.abort()
                    return
                self.counters["connections"] += 1
                conn = _Conn(self, client, node_ip, cr, cw, tr, tw)
                self._conns.add(conn)
                try:
                    await conn.run()
                finally:
                    self._conns.discard(conn)

            server = await asyncio.start_server(on_conn, lhost, lport, reuse_address=True)
            self._servers.append(server)
            port = server.sockets[0].getsockname()[1]
            return f"{lhost}:{port}"

        return asyncio.run_coroutine_threadsafe(open_server(), self._loop).result(5)

    # ------------------------------------------------------------------ rules
    def rule_for(self, src: str, dst: str) -> Rule:
        rules = self._rules
        for key in ((src, dst), (src, ANY), (ANY, dst), (ANY, ANY)):
            r = rules.get(key)
            if r is not None:
                return r
        return PASS

    def set_rule(self, src: str, dst: str, rule: Rule | None) -> None:
        """Set (or with None / PASS, remove) the rule for bytes going from `src` to `dst`."""
        with self._lock:
            rules = dict(self._rules)
            if rule is None or rule == PASS:
                rules.pop((src, dst), None)
            else:
                rules[(src, dst)] = rule
            self._rules = rules
        log.info("netfault: %s -> %s: %s", src, dst, rule or PASS)
        self._after_change()

    def blackhole(self, src: str, dst: str) -> None:
        self.set_rule(src, dst, BLACKHOLE)

    def one_way(self, src: str, dst: str) -> None:
        """Cut src -> dst only (dst -> src still passes)."""
        self.blackhole(src, dst)

    def isolate(self, ip: str) -> None:
        """Cut `ip` off from everyone, both directions."""
        self.blackhole(ip, ANY)
        self.blackhole(ANY, ip)

    def partition(self, side_a: Iterable[str], side_b: Iterable[str]) -> None:
        """Cut every pair across the two sides, both directions."""
        side_b = list(side_b)
        for a in side_a:
            for b in side_b:
                self.blackhole(a, b)
                self.blackhole(b, a)

    def degrade(self, src: str, dst: str, *, delay: float = 0.0, jitter: float = 0.0, drop: float = 0.0,
                rto: float = 0.2) -> None:
        self.set_rule(src, dst, Rule(delay=delay, jitter=jitter, drop=drop, rto=rto))

    def heal(self) -> None:
        """Remove every rule."""
        with self._lock:
            self._rules = {}
        log.info("netfault: healed")
        self._after_change()

    def rules(self) -> dict[tuple[str, str], Rule]:
        return dict(self._rules)

    def _after_change(self) -> None:
        loop = self._loop
        if loop is None or not loop.is_running():
            return

        def reset_healed() -> None:
            for c in list(self._conns):
                for p in (c.fwd, c.bwd):
                    if p.tainted and not self.rule_for(p.src, p.dst).blackhole:
                        self.counters["reset_after_cut"] += 1
                        c.reset()
                        break

        loop.call_soon_threadsafe(reset_healed)


# ---------------------------------------------------------------------- command line
def _command(nf: NetFault, line: str) -> str:
    words = line.split()
    if not words:
        return ""
    cmd, args = words[0], words[1:]
    try:
        if cmd == "heal":
            nf.heal()
        elif cmd == "isolate":
            nf.isolate(args[0])
        elif cmd in ("blackhole", "oneway"):
            nf.blackhole(args[0], args[1])
        elif cmd == "pass":
            nf.set_rule(args[0], args[1], None)
        elif cmd == "delay":
            nf.degrade(args[0], args[1], delay=float(args[2]), jitter=float(args[3]) if len(args) > 3 else 0.0)
        elif cmd == "drop":
            nf.degrade(args[0], args[1], drop=float(args[2]), rto=float(args[3]) if len(args) > 3 else 0.2)
        elif cmd == "stats":
            return " ".join(f"{k}={v}" for k, v in sorted(nf.counters.items())) or "no traffic"
        else:
            return f"unknown command {cmd!r}"
    except (IndexError, ValueError) as exc:
        return f"bad command {line!r}: {exc}"
    return "ok"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="TCP fault proxy; rule commands on stdin, one per line.")
    p.add_argument("--proxy", action="append", required=True, metavar="LISTEN=TARGET",
                   help="listen HOST:PORT and forward to HOST:PORT (repeatable)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s netfault %(message)s")
    nf = NetFault(seed=args.seed).start()
    for spec in args.proxy:
        listen, _, target = spec.partition("=")
        print(f"proxy {nf.add_proxy(listen, target)} -> {target}", flush=True)
    try:
        for line in sys.stdin:
            out = _command(nf, line)
            if out:
                print(out, flush=True)
    except KeyboardInterrupt:
        pass
    finally:
        nf.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
