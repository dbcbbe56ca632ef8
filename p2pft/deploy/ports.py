"""Listen ports for local clusters that no outgoing connection can take.

A harness picks every process's listen port before starting it (the peers need each other's
addresses as seeds), and a restarted replica binds its old port again seconds later. A port
found by binding port 0 comes from the kernel's ephemeral range, which is also where every
outgoing connection on the machine takes its local port: one of them can hold the port when
the process binds it, and the replica fails to start (EADDRINUSE). Ports outside that range are
only ever taken by an explicit bind, so those are handed out: checked free at the time, and
never the same twice in one process.
"""
from __future__ import annotations

import os
import random
import socket
import threading
from pathlib import Path

__all__ = ["ephemeral_range", "free_ports", "share"]

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LINUX_DEFAULT = (32768, 60999)
LOWEST = 10000          # below: ports services commonly listen on
MIN_SPAN = 256          # a smaller gap outside the ephemeral range is not worth drawing from

SHARE_ENV = "P2PFT_PORT_SHARE"   # "index/count": this process's share of the ports (see share())

_handed_out: set[int] = set()
_lock = threading.Lock()
_rng = random.Random()  # seeded from the OS: concurrent harnesses draw different ports


def _checked_share(index: int, count: int, where: str) -> tuple[int, int]:
    if count < 1 or not 0 <= index < count:
        raise ValueError(f"{where}: a share is index/count with 0 <= index < count, got {index}/{count}")
    return index, count


def _parse_share(raw: str) -> tuple[int, int]:
    try:
        index, count = (int(x) for x in raw.split("/"))
    except ValueError:
        raise ValueError(f"${SHARE_ENV} must be index/count, e.g. 0/2, got {raw!r}") from None
    return _checked_share(index, count, f"${SHARE_ENV}")


_share = _parse_share(os.environ[SHARE_ENV]) if os.environ.get(SHARE_ENV) else (0, 1)


def share(index: int, count: int) -> None:
    """Hand out only ports p with p % count == index. A port is checked free when handed out
    but bound later (a restarted replica binds its old port again seconds later), so harnesses
    running side by side on one machine (parallel test workers) could draw the same port; each
    with its own index never does. Also read from ``$P2PFT_PORT_SHARE`` ("index/count"), which
    a harness's child processes inherit."""
    global _share
    _share = _checked_share(index, count, "share()")


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for automatically assigned local ports (inclusive)."""
    try:
        lo, hi = (int(x) for x in EPHEMERAL_RANGE.read_text().split())
        return lo, hi
    except (OSError, ValueError):
        return LINUX_DEFAULT


def _spans(lo: int, hi: int) -> list[tuple[int, int]]:
    spans = [(LOWEST, lo - 1), (hi + 1, 65535)]
    return [(a, b) for a, b in spans if b - a + 1 >= MIN_SPAN]


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _kernel_ports(n: int, host: str) -> list[int]:
    """The fallback where no room is left outside the ephemeral range: the kernel's choice."""
    out: list[int] = []
    held = []
    try:
        while len(out) < n:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            held.append(s)
            s.bind((host, 0))
            port = s.getsockname()[1]
            if port not in _handed_out and port not in out:
                out.append(port)
    finally:
        for s in held:
            s.close()
    return out


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """`n` distinct ports on `host`, free now, outside the ephemeral range where it leaves room,
    and never handed out before by this process."""
    if n < 0:
        raise ValueError("n must be 0 or more")
    spans = _spans(*ephemeral_range())
    total = sum(b - a + 1 for a, b in spans)
    out: list[int] = []
    with _lock:
        for _ in range(100 * n + 100 if total else 0):
            if len(out) == n:
                break
            k = _rng.randrange(total)
            port = 0
            for a, b in spans:
                if k <= b - a:
                    port = a + k + (_share[0] - (a + k)) % _share[1]   # the next port of our share
                    if port > b:
                        port = 0
                    break
                k -= b - a + 1
            if port and port not in _handed_out and port not in out and _bindable(host, port):
                out.append(port)
        if len(out) < n:
            out += _kernel_ports(n - len(out), host)
        _handed_out.update(out)
    return out
