"""The TCP fault proxy (p2pft.chaos.netfault) with real sockets: each mode, rules changed at run
time, senders told apart by their source IP; and the source binding of real nodes."""
from __future__ import annotations

import asyncio
import os
import random
import socket
import subprocess
import sys
import threading
import time
from typing import Iterator

import pytest

from p2pft.chaos.netfault import ANY, NetFault

pytestmark = pytest.mark.timeout(60)

_NET = random.Random(os.getpid()).randrange(10, 250)


def ip(k: int) -> str:
    """A loopback IP of this test run (127.0.0.0/8 all routes to lo)."""
    return f"127.{_NET}.{os.getpid() % 250 + 1}.{k}"


class Server:
    """A TCP server on `host` that echoes, optionally greets each client, and logs what it got."""

    def __init__(self, host: str, greet: bytes = b"") -> None:
        self.sock = socket.create_server((host, 0))
        self.addr = f"{host}:{self.sock.getsockname()[1]}"
        self.greet = greet
        self.peers: list[str] = []
        self.got = bytearray()
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                c, peer = self.sock.accept()
            except OSError:
                return
            self.peers.append(peer[0])
            self.conns.append(c)
            threading.Thread(target=self._serve, args=(c,), daemon=True).start()

    def _serve(self, c: socket.socket) -> None:
        try:
            if self.greet:
                c.sendall(self.greet)
            while True:
                data = c.recv(65536)
                if not data:
                    return
                self.got += data
                c.sendall(data)
        except OSError:
            return

    def close(self) -> None:
        self.sock.close()
        for c in self.conns:
            c.close()


def client(addr: str, src: str, timeout: float = 2.0) -> socket.socket:
    host, port = addr.rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=timeout, source_address=(src, 0))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def recv_n(s: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            break
        buf += chunk
    return bytes(buf)


def silent_for(s: socket.socket, seconds: float) -> bool:
    """True if nothing (no data, no EOF) arrives on `s` for `seconds`."""
    s.settimeout(seconds)
    try:
        s.recv(1)
    except socket.timeout:
        return True
    finally:
        s.settimeout(2.0)
    return False


@pytest.fixture
def nf() -> Iterator[NetFault]:
    n = NetFault(seed=3).start()
    try:
        yield n
    finally:
        n.stop()


@pytest.fixture
def server() -> Iterator[Server]:
    s = Server(ip(2), greet=b"hi")
    try:
        yield s
    finally:
        s.close()


def test_pass_keeps_every_byte_in_order(nf: NetFault, server: Server) -> None:
    proxy = nf.add_proxy(f"{ip(2)}:0", server.addr)
    s = client(proxy, ip(1))
    assert recv_n(s, 2) == b"hi"
    blob = os.urandom(1 << 20)
    threading.Thread(target=s.sendall, args=(blob,), daemon=True).start()
    assert recv_n(s, len(blob)) == blob
    assert len(server.peers) == 1
    assert nf.counters["bytes_passed"] >= 2 * len(blob)
    s.close()


def test_blackhole_discards_keeps_connections_open_and_resets_them_on_heal(nf: NetFault, server: Server) -> None:
    proxy = nf.add_proxy(f"{ip(2)}:0", server.addr)
    a, c = ip(1), ip(3)
    sa, sc = client(proxy, a), client(proxy, c)
    assert recv_n(sa, 2) == b"hi" and recv_n(sc, 2) == b"hi"
    nf.isolate(a)
    sa.sendall(b"lost")
    sc.sendall(b"kept")
    assert recv_n(sc, 4) == b"kept"            # another sender on the same proxy is untouched
    assert silent_for(sa, 0.5)                 # no echo, no EOF: the link is just dead
    assert b"lost" not in server.got
    sa2 = client(proxy, a)                     # new connections are accepted, but nothing passes
    assert silent_for(sa2, 0.3)
    assert nf.counters["bytes_blackholed"] >= 4
    nf.heal()
    # Bytes were lost mid-stream: the healed connection is reset (EOF or reset at the client).
    sa.settimeout(2.0)
    try:
        assert sa.recv(1) == b""
    except ConnectionResetError:
        pass
    assert nf.counters["reset_after_cut"] >= 1
    s = client(proxy, a)                       # a fresh connection works again
    assert recv_n(s, 2) == b"hi"
    s.sendall(b"back")
    assert recv_n(s, 4) == b"back"
    for x in (sa, sa2, sc, s):
        x.close()


def test_a_close_does_not_cross_a_cut(nf: NetFault, server: Server) -> None:
    """The node closing its end during a cut is not seen by the client until the heal."""
    proxy = nf.add_proxy(f"{ip(2)}:0", server.addr)
    a = ip(1)
    s = client(proxy, a)
    assert recv_n(s, 2) == b"hi"
    nf.isolate(a)
    for c in server.conns:
        c.shutdown(socket.SHUT_RDWR)
    assert silent_for(s, 0.5)                  # no FIN through a dead link
    nf.heal()
    s.settimeout(2.0)
    try:
        assert s.recv(1) == b""
    except ConnectionResetError:
        pass
    s.close()


def test_one_way_cut_blocks_one_direction_only(nf: NetFault, server: Server) -> None:
    proxy = nf.add_proxy(f"{ip(2)}:0", server.addr)
    a, b = ip(1), ip(2)
    nf.one_way(a, b)                           # a -> b dead, b -> a alive
    s = client(proxy, a)
    assert recv_n(s, 2) == b"hi"               # the node's greeting reaches a
    s.sendall(b"ping")
    assert silent_for(s, 0.4) and b"ping" not in server.got
    s.close()
    nf.heal()
    nf.one_way(b, a)                           # now b -> a dead, a -> b alive
    s = client(proxy, a)
    s.sendall(b"pong")
    deadline = time.time() + 2
    while b"pong" not in server.got and time.time() < deadline:
        time.sleep(0.01)
    assert b"pong" in server.got               # a's bytes arrive ...
    assert silent_for(s, 0.4)                  # ... but neither the greeting nor the echo comes back
    s.close()


def test_delay_with_jitter_keeps_order(nf: NetFault, server: Server) -> None:
    proxy = nf.add_proxy(f"{ip(2)}:0", server.addr)
    a = ip(1)
    s = client(proxy, a)
    assert recv_n(s, 2) == b"hi"
    nf.degrade(a, ANY, delay=0.05, jitter=0.04)
    nf.degrade(ANY, a, delay=0.05, jitter=0.04)
    rtts = []
    for i in range(8):
        t0 = time.monotonic()
        s.sendall(b"%03d" % i)
        assert recv_n(s, 3) == b"%03d" % i
        rtts.append(time.monotonic() - t0)
    assert min(rtts) >= 0.02 - 0.005 and max(rtts) < 1.0, rtts   # 2 x (50 ms +- 40 ms)
    # A burst of small writes: chunks are held for different times but never reordered.
    msgs = b"".join(b"%04d" % i for i in range(300))
    for i in range(300):
        s.sendall(b"%04d" % i)
    assert recv_n(s, len(msgs)) == msgs
    nf.heal()
    t0 = time.monotonic()
    s.sendall(b"x")
    assert recv_n(s, 1) == b"x" and time.monotonic() - t0 < 0.05 + 0.5
    s.close()


def test_drop_is_a_retransmission_stall(nf: NetFault, server: Server) -> None:
    proxy = nf.add_proxy(f"{ip(2)}:0", server.addr)
    a = ip(1)
    s = client(proxy, a)
    assert recv_n(s, 2) == b"hi"
    nf.degrade(a, ANY, drop=1.0, rto=0.15)     # every chunk "lost" once
    t0 = time.monotonic()
    s.sendall(b"abc")
    assert recv_n(s, 3) == b"abc"              # nothing is lost, only late
    assert time.monotonic() - t0 >= 0.14
    nf.degrade(a, ANY, drop=0.3, rto=0.05)
    before = nf.counters["stalls"]
    for i in range(40):
        s.sendall(b"%02d" % i)
        assert recv_n(s, 2) == b"%02d" % i
    stalled = nf.counters["stalls"] - before
    assert 2 <= stalled <= 25, stalled         # p=0.3 of 40 chunks, seeded
    s.close()


def test_rules_change_at_run_time_on_an_open_connection(nf: NetFault, server: Server) -> None:
    proxy = nf.add_proxy(f"{ip(2)}:0", server.addr)
    a = ip(1)
    s = client(proxy, a)
    assert recv_n(s, 2) == b"hi"
    nf.degrade(a, ANY, delay=0.2)
    t0 = time.monotonic()
    s.sendall(b"1")
    assert recv_n(s, 1) == b"1" and time.monotonic() - t0 >= 0.19
    nf.set_rule(a, ANY, None)
    t0 = time.monotonic()
    s.sendall(b"2")
    assert recv_n(s, 1) == b"2" and time.monotonic() - t0 < 0.19
    s.close()


def test_node_server_binds_its_source_ip_and_advertises_the_proxy(nf: NetFault) -> None:
    """Outgoing control connections of a node bound to 127.0.0.N come from 127.0.0.N, and the
    address in views is the advertised one."""
    from p2pft.core.meta import NodeSpec
    from p2pft.net.driver import NodeServer
    from p2pft.transport.wire import source_address

    assert source_address("127.0.0.1", "10.1.2.3") is None        # loopback never towards another host
    assert source_address("0.0.0.0", "127.0.0.1") is None
    assert source_address("localhost", "127.0.0.1") is None
    assert source_address("::1", "127.0.0.1") is None
    assert source_address(ip(5), "127.0.0.1") == (ip(5), 0)
    sink = Server(ip(9))
    ports = []
    for h in (ip(5), ip(6)):
        with socket.socket() as t:
            t.bind((h, 0))
            ports.append(t.getsockname()[1])
    b_real = f"{ip(6)}:{ports[1]}"
    b_adv = nf.add_proxy(f"{ip(6)}:0", b_real)

    async def run() -> None:
        b = NodeServer(listen=b_real, advertise=b_adv, spec=NodeSpec(replica_id="b"))
        await b.start()
        a = NodeServer(listen=f"{ip(5)}:{ports[0]}", spec=NodeSpec(replica_id="a"), seeds=[b_adv, sink.addr])
        await a.start()
        try:
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                if a.node.view and len(a.node.view.members) == 2:
                    break
                await asyncio.sleep(0.05)
            addrs = {m.replica_id: m.addr for m in a.node.view.members}
            assert addrs == {"a": f"{ip(5)}:{ports[0]}", "b": b_adv}
        finally:
            await a.stop(leave=False)
            await b.stop(leave=False)

    try:
        asyncio.run(run())
        assert ip(5) in sink.peers             # a's knock on its other seed came from a's own IP
    finally:
        sink.close()


def test_data_plane_connections_bind_their_source_ip() -> None:
    import numpy as np

    from p2pft.transport import CommError, DataServer
    from p2pft.transport.stream import StateSnapshot, fetch_state

    srv = [DataServer(ip(7)), DataServer(ip(8))]
    sink = Server(ip(9))
    try:
        peers = [s.addr for s in srv]
        comms = [s.communicator(1, 0, r, peers) for r, s in enumerate(srv)]
        out: list[int] = []
        th = threading.Thread(target=lambda: out.append(comms[1].allreduce(np.ones(8, dtype=np.float32))))
        th.start()
        assert comms[0].allreduce(np.ones(8, dtype=np.float32)) == 2
        th.join(10)
        srv[0].serve_state(lambda req: StateSnapshot(meta={"ok": 1}))
        # A replica names its data server's host as the source of its fetches (no process-wide default).
        # The sink only echoes: the fetch fails as a transfer (not as a bug in the caller).
        with pytest.raises((CommError, EOFError, OSError)):
            fetch_state(sink.addr, {}, timeout=0.5, source_host=srv[1].host)
        assert sink.peers == [ip(8)]
        assert fetch_state(srv[0].addr, {}, source_host=ip(8), timeout=5).meta == {"ok": 1}
        for c in comms:
            c.close()
    finally:
        for s in srv:
            s.close()
        sink.close()


def test_command_line_proxy(server: Server) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "p2pft.chaos.netfault", "--proxy", f"{ip(2)}:0={server.addr}"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = proc.stdout.readline()          # "proxy HOST:PORT -> TARGET"
        addr = line.split()[1]
        s = client(addr, ip(1))
        assert recv_n(s, 2) == b"hi"
        proc.stdin.write(f"blackhole {ip(1)} *\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "ok"
        s.sendall(b"zz")
        assert silent_for(s, 0.3)
        proc.stdin.write("stats\n")
        proc.stdin.flush()
        assert "bytes_blackholed=2" in proc.stdout.readline()
        s.close()
    finally:
        proc.stdin.close()
        proc.wait(timeout=10)
