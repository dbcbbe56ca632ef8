"""Rate-limited links between replicas on one host, behind one function (``open_links``).

Each replica binds its data port on loopback and advertises the address of a token-bucket TCP
proxy in front of it instead: every byte another replica sends it (its ring neighbour's
allreduce chunks, a joiner's snapshot request) and every byte it answers on those connections
(a donor's snapshot) passes a bucket of ``rate`` bytes/s per direction. In a ring each replica
receives from one neighbour, so each ring link runs at ``rate``. The control plane (gossip,
Raft) is not limited.

Network namespaces joined by veth pairs with ``tc qdisc ... tbf`` on each replica's link are
the real thing; ``open_links`` is the one place that would create them instead and return the
same ``Links`` (the addresses to advertise, the bytes carried, ``close``).
"""
from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass, field

CHUNK = 16 << 10
BURST_S = 0.02          # a bucket holds at most this many seconds of its rate


class Bucket:
    """A token bucket: ``take(n)`` returns once n bytes fit the rate (debt paid by sleeping)."""

    def __init__(self, rate: float) -> None:
        if rate <= 0:
            raise ValueError(f"rate must be positive, got {rate}")
        self.rate = rate
        self.burst = max(float(CHUNK), rate * BURST_S)
        self.tokens = self.burst
        self.t = time.monotonic()
        self.lock = threading.Lock()

    def take(self, n: int) -> None:
        with self.lock:
            now = time.monotonic()
            self.tokens = min(self.burst, self.tokens + (now - self.t) * self.rate)
            self.t = now
            self.tokens -= n
            wait = -self.tokens / self.rate if self.tokens < 0 else 0.0
        if wait > 0:
            time.sleep(wait)


@dataclass
class _Proxy:
    listen: socket.socket
    target: tuple[str, int]
    inbound: Bucket
    outbound: Bucket
    bytes_in: int = 0
    bytes_out: int = 0
    closed: bool = False
    conns: list[socket.socket] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def serve(self) -> None:
        while not self.closed:
            try:
                client, _ = self.listen.accept()
            except OSError:
                return
            try:
                node = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            for s in (client, node):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                s.settimeout(None)
            with self.lock:
                self.conns += [client, node]
            threading.Thread(target=self._pump, args=(client, node, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(node, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, inbound: bool) -> None:
        bucket = self.inbound if inbound else self.outbound
        try:
            while True:
                data = src.recv(CHUNK)
                if not data:
                    break
                bucket.take(len(data))
                dst.sendall(data)
                if inbound:
                    self.bytes_in += len(data)
                else:
                    self.bytes_out += len(data)
        except OSError:
            pass
        for s in (src, dst):  # one side gone: end both (a killed replica's peers see the close)
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        self.closed = True
        self.listen.close()
        with self.lock:
            for s in self.conns:
                try:
                    s.close()
                except OSError:
                    pass


class Links:
    """The links of one run: `advertise[i]` is what replica i announces as its data address."""

    def __init__(self, kind: str, targets: list[tuple[str, int]], rate_bytes: float) -> None:
        self.kind = kind
        self.rate_bytes = rate_bytes
        self._proxies: list[_Proxy] = []
        self.advertise: list[str] = []
        for host, port in targets:
            ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            ls.bind((host, 0))
            ls.listen(64)
            px = _Proxy(ls, (host, port), Bucket(rate_bytes), Bucket(rate_bytes))
            threading.Thread(target=px.serve, daemon=True, name=f"wanlink-{port}").start()
            self._proxies.append(px)
            self.advertise.append(f"{host}:{ls.getsockname()[1]}")

    def bytes_received(self, i: int) -> int:
        """Bytes delivered to replica i through its link (what the others sent it)."""
        return self._proxies[i].bytes_in

    def bytes_total(self) -> int:
        return sum(p.bytes_in + p.bytes_out for p in self._proxies)

    def close(self) -> None:
        for p in self._proxies:
            p.close()


def open_links(targets: list[tuple[str, int]], rate_mbit: float) -> Links:
    """Rate-limited links in front of each replica's data port (host, port).

    Network namespaces with ``tc tbf`` would be created here; on this build the links are the
    loopback token-bucket proxies above (``Links.kind`` says which)."""
    return Links("loopback-token-bucket", targets, rate_mbit * 1e6 / 8)


__all__ = ["Bucket", "Links", "open_links"]
