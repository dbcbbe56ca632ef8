"""Hosts as Linux network namespaces: distinct addresses, real links, host loss without a reset.

Processes on one loopback interface flatter a distributed system: every address is 127.0.0.1,
and a killed process answers with a reset, so death is detected in milliseconds. Here each host
is a network namespace with one veth link to a shared bridge and its own address in a private
/24 (``10.213.X.0/24``, X free on this machine). A host's link can go down (packets vanish: no
reset, no refusal, as when a machine loses power or its switch port), its link can be rate
limited (``tc tbf``), and one TCP port can be dropped on input (a firewall), all inside
namespaces this module created. Names resolve inside a host without DNS: the set's hosts from
a hosts file, anything else refused at once (``NETNS_ETC``).

Names start with ``p2pft-`` and carry the owner's pid (``p2pft-<pid:06x><seq:x>...``), so
whatever a SIGKILLed run left behind (namespaces, links, processes inside them) is found and
removed by the next one (``sweep``). Cleanup runs on ``close()``, at interpreter exit, and on
SIGTERM/SIGHUP; where namespaces cannot be made (not root, no ``ip``), ``unavailable()`` gives
the one-line reason.
"""
from __future__ import annotations

import atexit
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import Any, Sequence

from ..deploy.procs import ProcGroup, pid_alive

log = logging.getLogger(__name__)

PREFIX = "p2pft-"
SUBNET = "10.213"         # 10.213.X.0/24, X chosen free per set of hosts
MAX_HOSTS = 99            # two decimal digits in an interface name (15 characters at most)
IP_TIMEOUT = 10.0         # seconds for one `ip`/`tc` command
#: `ip netns exec` bind-mounts the files of /etc/netns/<name>/ over /etc/. Each host gets a hosts
#: file naming every host of its set and a resolver that fails at once: a namespace's DNS
#: queries would otherwise leave through the bridge to the machine's resolver and wait out its
#: timeout (a reverse lookup took 10.0 s there; torch's c10d looks up every peer it connects to).
NETNS_ETC = "/etc/netns"
RESOLV_CONF = "# p2pft host namespace: no DNS; names of this set's hosts are in /etc/hosts\n" \
              "nameserver 127.0.0.1\noptions timeout:1 attempts:1\n"

_seq = 0
_live: "set[Hosts]" = set()
_lock = threading.Lock()
_handlers_installed = False


class NetnsUnavailable(RuntimeError):
    """Namespaces cannot be made here; the message is the one-line reason."""


def _run(argv: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    try:
        res = subprocess.run(list(argv), capture_output=True, text=True, timeout=IP_TIMEOUT)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NetnsUnavailable(f"{' '.join(argv)}: {exc}") from None
    if check and res.returncode != 0:
        raise NetnsUnavailable(f"{' '.join(argv)}: {res.stderr.strip() or f'exit {res.returncode}'}")
    return res


def unavailable() -> str | None:
    """Why network namespaces cannot be made here (None: they can)."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return "network namespaces need root (run as root, or use loopback)"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    res = _run(["ip", "netns", "list"], check=False)
    if res.returncode != 0:
        return f"`ip netns` does not work here: {res.stderr.strip()}"
    return None


def _owner(name: str) -> int | None:
    """The pid encoded in one of our names, None for a name that is not ours."""
    if not name.startswith(PREFIX) or len(name) < len(PREFIX) + 6:
        return None
    try:
        return int(name[len(PREFIX):len(PREFIX) + 6], 16)
    except ValueError:
        return None


def _kill_inside(ns: str) -> None:
    res = _run(["ip", "netns", "pids", ns], check=False)
    for tok in res.stdout.split():
        try:
            os.kill(int(tok), signal.SIGKILL)
        except (ValueError, ProcessLookupError, PermissionError):
            pass


def _remove_etc(ns: str) -> None:
    shutil.rmtree(os.path.join(NETNS_ETC, ns), ignore_errors=True)


def sweep() -> list[str]:
    """Remove namespaces and links named by a p2pft run whose owner process is dead (a
    SIGKILLed harness), killing what still runs inside them; returns the names removed."""
    removed: list[str] = []
    if unavailable() is not None:
        return removed
    for line in _run(["ip", "netns", "list"], check=False).stdout.splitlines():
        name = line.split(" ", 1)[0]
        pid = _owner(name)
        if pid is not None and not pid_alive(pid):
            _kill_inside(name)
            _remove_etc(name)
            if _run(["ip", "netns", "del", name], check=False).returncode == 0:
                removed.append(name)
    try:
        leftovers = [n for n in os.listdir(NETNS_ETC) if n.startswith(PREFIX)]
    except OSError:
        leftovers = []
    for name in leftovers:   # the files of a namespace already gone
        pid = _owner(name)
        if pid is not None and not pid_alive(pid):
            _remove_etc(name)
    for line in _run(["ip", "-o", "link", "show"], check=False).stdout.splitlines():
        parts = line.split(":")
        if len(parts) < 2:
            continue
        name = parts[1].strip().split("@", 1)[0]
        pid = _owner(name)
        if pid is not None and not pid_alive(pid):
            if _run(["ip", "link", "del", name], check=False).returncode == 0:
                removed.append(name)
    if removed:
        log.warning("removed %d namespace(s)/link(s) left by dead runs: %s", len(removed), " ".join(removed))
    return removed


def _free_subnet() -> int:
    used = _run(["ip", "-4", "-o", "addr", "show"], check=False).stdout
    for x in range(256):
        if f" {SUBNET}.{x}." not in used:
            return x
    raise NetnsUnavailable(f"no free {SUBNET}.X.0/24 on this machine")


@dataclass(frozen=True)
class Host:
    """One namespace: its name, its address, and the two ends of its link."""

    index: int
    netns: str
    ip: str
    veth: str        # the end on the bridge (root namespace)
    inner: str       # the end inside the namespace


class Hosts:
    """N hosts on one bridge. Use as a context manager (or call close())."""

    def __init__(self, n: int, *, link_mbit: float | None = None) -> None:
        global _seq
        if not 1 <= n <= MAX_HOSTS:
            raise ValueError(f"hosts: need 1..{MAX_HOSTS}, got {n}")
        if link_mbit is not None and link_mbit <= 0:
            raise ValueError(f"link_mbit must be positive, got {link_mbit}")
        with _lock:
            _seq = (_seq + 1) % 16
            self.run_id = f"{os.getpid():06x}{_seq:x}"
        self.n = n
        self.link_mbit = link_mbit
        self.bridge = f"{PREFIX}{self.run_id}br"
        self.hosts: list[Host] = []
        self.group = ProcGroup()
        self._procs: list[subprocess.Popen[bytes]] = []   # started by spawn: reaped on close
        self._made: list[str] = []       # namespaces and links to remove, in creation order
        self._closed = False

    # ------------------------------------------------------------------ life
    def __enter__(self) -> "Hosts":
        return self.create()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def create(self) -> "Hosts":
        """Sweep what dead runs left, then make the bridge, the namespaces and their links."""
        why = unavailable()
        if why is not None:
            raise NetnsUnavailable(why)
        sweep()
        with _lock:
            _live.add(self)
        _install_handlers()
        try:
            x = _free_subnet()
            _run(["ip", "link", "add", self.bridge, "type", "bridge"])
            self._made.append(self.bridge)
            _run(["ip", "addr", "add", f"{SUBNET}.{x}.1/24", "dev", self.bridge])
            _run(["ip", "link", "set", self.bridge, "up"])
            for i in range(self.n):
                self.hosts.append(self._make_host(i, x))
            self._write_etc(x)
        except BaseException:
            self.close()
            raise
        log.info("made %d host namespace(s) on %s (%s.%d.0/24)%s", self.n, self.bridge, SUBNET, x,
                 f", links limited to {self.link_mbit:g} Mbit/s" if self.link_mbit else "")
        return self

    def _make_host(self, i: int, x: int) -> Host:
        ns, veth, inner = f"{PREFIX}{self.run_id}-h{i}", f"{PREFIX}{self.run_id}{i:02d}", "eth0"
        ip = f"{SUBNET}.{x}.{i + 2}"
        _run(["ip", "netns", "add", ns])
        self._made.append(ns)
        _run(["ip", "link", "add", veth, "type", "veth", "peer", "name", inner, "netns", ns])
        self._made.append(veth)
        _run(["ip", "link", "set", veth, "master", self.bridge, "up"])
        for argv in (["link", "set", "lo", "up"], ["addr", "add", f"{ip}/24", "dev", inner],
                     ["link", "set", inner, "up"], ["route", "add", "default", "via", f"{SUBNET}.{x}.1"]):
            _run(["ip", "-n", ns, *argv])
        host = Host(i, ns, ip, veth, inner)
        if self.link_mbit:
            self.limit(host, self.link_mbit)
        return host

    def _write_etc(self, x: int) -> None:
        """Name resolution inside the hosts: every host of this set by name and address from
        /etc/hosts, anything else refused at once (see NETNS_ETC)."""
        lines = ["127.0.0.1 localhost", "::1 localhost ip6-localhost", f"{SUBNET}.{x}.1 {self.bridge}"]
        lines += [f"{h.ip} {h.netns}" for h in self.hosts]
        for h in self.hosts:
            d = os.path.join(NETNS_ETC, h.netns)
            os.makedirs(d, exist_ok=True)
            with open(os.path.join(d, "hosts"), "w") as f:
                f.write("\n".join(lines) + "\n")
            with open(os.path.join(d, "resolv.conf"), "w") as f:
                f.write(RESOLV_CONF)

    def close(self) -> None:
        """Kill what runs inside, remove the namespaces and links (idempotent, never raises)."""
        if self._closed:
            return
        self._closed = True
        for name in self._made:
            if name.startswith(PREFIX) and "-h" in name:
                _kill_inside(name)
        try:
            self.group.kill()
        except Exception:
            pass
        for p in self._procs:
            try:
                p.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                pass
        for name in reversed(self._made):
            kind = "netns" if "-h" in name else "link"
            if kind == "netns":
                _remove_etc(name)
            _run(["ip", kind, "del", name], check=False)
        self._made.clear()
        with _lock:
            _live.discard(self)

    # ------------------------------------------------------------------ use
    def __getitem__(self, i: int) -> Host:
        return self.hosts[i]

    def cmd(self, i: int, argv: Sequence[str]) -> list[str]:
        """argv run inside host i (`ip netns exec` execs it: the pid is the command's own)."""
        return ["ip", "netns", "exec", self.hosts[i].netns, *argv]

    def spawn(self, i: int, argv: Sequence[str], **popen: Any) -> "subprocess.Popen[bytes]":
        """Start argv inside host i, in this set's process group, dying with its parent."""
        p = self.group.spawn(self.cmd(i, argv), **popen)
        self._procs = [q for q in self._procs if q.poll() is None] + [p]
        return p

    def run(self, i: int, argv: Sequence[str], timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.cmd(i, argv), capture_output=True, text=True, timeout=timeout)

    def link(self, i: int, up: bool) -> None:
        """Take host i's link down (its packets vanish: no reset, no refusal) or back up."""
        h = self.hosts[i]
        _run(["ip", "link", "set", h.veth, "up" if up else "down"])
        _run(["ip", "-n", h.netns, "link", "set", h.inner, "up" if up else "down"])
        if up:   # a link going down drops the namespace's routes through it
            gw = self._gateway()
            _run(["ip", "-n", h.netns, "route", "replace", "default", "via", gw])

    def _gateway(self) -> str:
        return self.hosts[0].ip.rsplit(".", 1)[0] + ".1"

    def block_port(self, i: int, port: int, blocked: bool = True) -> None:
        """Drop TCP packets to `port` arriving at host i, silently (a firewall's DROP): policy
        routing sends them to a blackhole ahead of the local table."""
        ns, pref = self.hosts[i].netns, str(1000 + port % 30000)
        if blocked:
            rules = _run(["ip", "-n", ns, "rule", "show"]).stdout.splitlines()
            if not any(r.startswith("32000:") for r in rules):
                _run(["ip", "-n", ns, "rule", "add", "pref", "32000", "lookup", "local"])
                _run(["ip", "-n", ns, "rule", "del", "pref", "0"])
            _run(["ip", "-n", ns, "rule", "add", "pref", pref, "ipproto", "tcp", "dport", str(port), "blackhole"])
        else:
            _run(["ip", "-n", ns, "rule", "del", "pref", pref], check=False)

    def limit(self, host: Host, mbit: float) -> None:
        """Rate-limit both directions of the host's link with a token bucket (tc tbf)."""
        rate_bytes = mbit * 1e6 / 8
        burst = max(32 * 1024, int(rate_bytes / 250))        # at least one timer tick's worth
        spec = ["root", "tbf", "rate", f"{mbit:g}mbit", "burst", str(burst), "latency", "50ms"]
        _run(["tc", "qdisc", "replace", "dev", host.veth, *spec])
        _run(["ip", "netns", "exec", host.netns, "tc", "qdisc", "replace", "dev", host.inner, *spec])


def _cleanup_all() -> None:
    with _lock:
        live = list(_live)
    for h in live:
        h.close()


def _install_handlers() -> None:
    """atexit, and SIGTERM/SIGHUP: clean up, then whatever the handler before ours did."""
    global _handlers_installed
    with _lock:
        if _handlers_installed:
            return
        _handlers_installed = True
    atexit.register(_cleanup_all)
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGTERM, signal.SIGHUP):
        prev = signal.getsignal(sig)

        def handler(signum: int, frame: Any, prev: Any = prev) -> None:
            _cleanup_all()
            if callable(prev):
                prev(signum, frame)
            elif prev != signal.SIG_IGN:
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)
        signal.signal(sig, handler)


__all__ = ["Host", "Hosts", "NetnsUnavailable", "sweep", "unavailable"]
