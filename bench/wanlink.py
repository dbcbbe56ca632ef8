"""Rate-limited links between replicas on one host, behind one function (``open_links``).

Each replica binds its data port on loopback and advertises the address of a token-bucket TCP
proxy in front of it instead: every byte another replica sends it (its ring neighbour's
allreduce chunks, a joiner's snapshot request) and every byte it answers on those connections
(a donor's snapshot) passes a bucket of ``rate`` bytes/s per direction. In a ring each replica
receives from one neighbour, so each ring link runs at ``rate``. The control plane (gossip,
Raft) is not limited. Several data ports may sit behind one host (``host_of``: the ranks of an
FSDP island, each serving its shard): their proxies share the host's buckets, as the ranks of a
namespace host share its one link.

Where network namespaces can be made (root, iproute2), ``open_links`` makes the real thing
instead: each replica on a host of its own (``p2pft.chaos.hosts``: a namespace, a veth link to a
shared bridge, ``tc tbf`` on the link at ``rate`` in both directions), every byte between
replicas (control and data) crossing two limited links. Both give the same ``Links``: where to
bind and what to advertise, how to start a process on a replica's host, the bytes carried.
"""
from __future__ import annotations

import socket
import subprocess
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
    """Loopback links of one run: replica i binds `ip(i)`; `advertise[j]` is what target j
    announces as its data address (its proxy; the proxies of one host share its buckets)."""

    def __init__(self, kind: str, targets: list[tuple[str, int]], rate_bytes: float,
                 host_of: list[int] | None = None) -> None:
        self.kind = kind
        self.rate_bytes = rate_bytes
        self._proxies: list[_Proxy] = []
        self.advertise: list[str] = []
        hosts = host_of if host_of is not None else list(range(len(targets)))
        buckets: dict[int, tuple[Bucket, Bucket]] = {}
        for (host, port), h in zip(targets, hosts):
            ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            ls.bind((host, 0))
            ls.listen(64)
            inbound, outbound = buckets.setdefault(h, (Bucket(rate_bytes), Bucket(rate_bytes)))
            px = _Proxy(ls, (host, port), inbound, outbound)
            threading.Thread(target=px.serve, daemon=True, name=f"wanlink-{port}").start()
            self._proxies.append(px)
            self.advertise.append(f"{host}:{ls.getsockname()[1]}")

    def ip(self, i: int) -> str:
        return "127.0.0.1"

    def spawn(self, i: int, argv: list[str], **popen: object) -> "subprocess.Popen[bytes]":
        return subprocess.Popen(argv, **popen)  # type: ignore[call-overload]

    def bytes_total(self) -> int:
        """Bytes carried by all links (each byte between replicas crosses one proxy)."""
        return sum(p.bytes_in + p.bytes_out for p in self._proxies)

    def close(self) -> None:
        for p in self._proxies:
            p.close()


class NetnsLinks:
    """Replicas on namespace hosts whose links are limited with tc tbf (p2pft.chaos.hosts)."""

    kind = "netns-tc-tbf"

    def __init__(self, n: int, data_ports: list[int], rate_mbit: float, extra_hosts: int = 0,
                 host_of: list[int] | None = None) -> None:
        from p2pft.chaos.hosts import Hosts
        self.hosts = Hosts(n + extra_hosts, link_mbit=rate_mbit).create()
        hosts = host_of if host_of is not None else list(range(len(data_ports)))
        self.advertise = [f"{self.hosts[h].ip}:{p}" for h, p in zip(hosts, data_ports)]
        self._base = [self._counter(i) for i in range(n + extra_hosts)]

    def ip(self, i: int) -> str:
        return self.hosts[i].ip

    def ifname(self, i: int) -> str:
        """Host i's interface (Gloo binds it: GLOO_SOCKET_IFNAME)."""
        return self.hosts[i].inner

    def spawn(self, i: int, argv: list[str], **popen: object) -> "subprocess.Popen[bytes]":
        return self.hosts.spawn(i, argv, **popen)

    def _counter(self, i: int) -> int:
        """Bytes host i sent into its link (received by the bridge's end of it)."""
        with open(f"/sys/class/net/{self.hosts[i].veth}/statistics/rx_bytes") as f:
            return int(f.read())

    def bytes_total(self) -> int:
        """Bytes all hosts sent (control and data, with headers; an extra host's too)."""
        return sum(self._counter(i) - b for i, b in enumerate(self._base))

    def close(self) -> None:
        self.hosts.close()


def open_links(targets: list[tuple[str, int]], rate_mbit: float, kind: str = "auto",
               extra_hosts: int = 0, host_of: list[int] | None = None) -> "Links | NetnsLinks":
    """Rate-limited links for replicas whose data ports are `targets` (host, port).

    kind: 'netns' (namespaces + tc tbf), 'proxy' (loopback token buckets), or 'auto' (netns where
    it can be made, else proxy; `kind` on the result says which). `extra_hosts` (netns only):
    hosts after the replicas' (host n, ...) for a process that is no replica, e.g. a lighthouse.
    `host_of`: the host of each target (default: one host each), for hosts with several ports."""
    n = max(host_of) + 1 if host_of else len(targets)
    if kind in ("auto", "netns"):
        from p2pft.chaos.hosts import unavailable
        why = unavailable()
        if why is None:
            return NetnsLinks(n, [p for _, p in targets], rate_mbit, extra_hosts, host_of)
        if kind == "netns":
            raise RuntimeError(f"network namespaces cannot be made here: {why}")
        print(f"wanlink: {why}; falling back to rate-limited proxies on loopback")
    return Links("loopback-token-bucket", targets, rate_mbit * 1e6 / 8, host_of)


__all__ = ["Bucket", "Links", "NetnsLinks", "open_links"]
