"""Host:port addresses: one type, one parser, and the rule for the address peers can reach.

Every layer takes addresses from users (``--listen``, ``--seeds``, ``--advertise``, data
ports), so the parser lives at the bottom layer where the control plane and the transport can
both import it. IPv6 literals are written in brackets, ``[::1]:7000``; hostnames are kept as
given (resolved when connecting).

A socket bound on a wildcard (``0.0.0.0``, ``::``) has no address a peer can use: peers are
told the advertised control host when there is one, else this host's address on the route
towards the seeds (what the kernel would pick as the source), else the first non-loopback
address of an interface. Never the wildcard itself.
"""
from __future__ import annotations

import ipaddress
import logging
import socket
import struct
from typing import Iterable, NamedTuple

log = logging.getLogger(__name__)

WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", ""})
# TEST-NET-1 (RFC 5737): a UDP "connect" towards it reveals the default route's source address
# without sending a packet.
_PROBE_DEST = "192.0.2.1"


class AddressError(ValueError):
    """An address a user gave is not HOST:PORT; the message names it."""


class HostPort(NamedTuple):
    """A parsed address: host without brackets, port as an int (0: any port)."""

    host: str
    port: int

    def __str__(self) -> str:
        return join_hostport(self.host, self.port)

    @property
    def wildcard(self) -> bool:
        return is_wildcard(self.host)

    @property
    def loopback(self) -> bool:
        return is_loopback(self.host)


def parse_hostport(text: str, what: str = "address") -> HostPort:
    """'host:port', '[v6]:port' -> HostPort; AddressError (a ValueError) naming `what` otherwise."""
    if not isinstance(text, str):
        raise AddressError(f"{what}: expected HOST:PORT, got {text!r}")
    s = text.strip()
    if s.startswith("["):
        end = s.find("]")
        if end < 0 or s[end + 1:end + 2] != ":":
            raise AddressError(f"{what}: expected [IPv6]:PORT, got {text!r}")
        host, port = s[1:end], s[end + 2:]
        try:
            ipaddress.IPv6Address(host.split("%", 1)[0])
        except ValueError:
            raise AddressError(f"{what}: {host!r} in {text!r} is not an IPv6 address") from None
    else:
        host, sep, port = s.rpartition(":")
        if not sep or not host:
            raise AddressError(f"{what}: expected HOST:PORT, got {text!r}")
        if ":" in host:
            raise AddressError(f"{what}: an IPv6 address needs brackets, e.g. [{host}]:{port}, got {text!r}")
    if not port.isdigit():
        raise AddressError(f"{what}: port in {text!r} is not a number")
    p = int(port)
    if p > 65535:
        raise AddressError(f"{what}: port in {text!r} is out of range")
    return HostPort(host, p)


def join_hostport(host: str, port: int) -> str:
    """The inverse of parse_hostport: brackets around an IPv6 host."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def is_wildcard(host: str) -> bool:
    return host.strip("[]") in WILDCARD_HOSTS


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 and 'localhost' (by address, not by string prefix)."""
    h = host.strip("[]")
    if h.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(h.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


def source_toward(dest_host: str) -> str | None:
    """The local IP the kernel would use as source towards `dest_host` (None: no route, or
    the name does not resolve). A UDP connect sends nothing."""
    try:
        infos = socket.getaddrinfo(dest_host, 9, type=socket.SOCK_DGRAM)
    except (OSError, UnicodeError):
        return None
    for family, _, _, _, sockaddr in infos:
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect(sockaddr)
                return str(s.getsockname()[0])
        except OSError:
            continue
    return None


def interface_ipv4() -> list[str]:
    """IPv4 addresses of this host's interfaces, loopback last (Linux ioctl; [] elsewhere)."""
    try:
        import fcntl
        names = [name for _, name in socket.if_nameindex()]
    except (ImportError, OSError, AttributeError):
        return []
    out: list[str] = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for name in names:
            try:
                req = struct.pack("256s", name.encode()[:15])
                res = fcntl.ioctl(s.fileno(), 0x8915, req)   # SIOCGIFADDR
                out.append(socket.inet_ntoa(res[20:24]))
            except OSError:
                continue   # an interface without an IPv4 address, or down
    return sorted(out, key=is_loopback)


def reachable_host(bind_host: str, *, advertise: str | None = None, toward: Iterable[str] = ()) -> str:
    """The host peers should use for a socket bound on `bind_host`.

    A specific host is itself. For a wildcard: the host of `advertise` (HOST:PORT), else this
    host's source address towards the first seed (HOST:PORT) that has a route, else towards the
    default route, else the first non-loopback interface address; loopback only when nothing
    else exists (a lone host), with a warning."""
    if not is_wildcard(bind_host):
        return bind_host.strip("[]")
    if advertise:
        return parse_hostport(advertise, "advertised address").host
    for seed in toward:
        try:
            host = parse_hostport(seed, "seed").host
        except AddressError:
            continue
        src = source_toward(host)
        if src and (not is_loopback(src) or is_loopback(host)):
            return src
    src = source_toward(_PROBE_DEST)
    if src and not is_loopback(src):
        return src
    ips = interface_ipv4()
    if ips and not is_loopback(ips[0]):
        return ips[0]
    log.warning("listening on %s: no route and no non-loopback address found; peers are told 127.0.0.1",
                bind_host or "the wildcard address")
    return "127.0.0.1"


def advertised(bound: str, *, advertise: str | None = None, toward: Iterable[str] = ()) -> str:
    """The address peers use for a server bound at `bound` (HOST:PORT with its real port): the
    bound address itself, or for a wildcard bind the reachable host (see reachable_host)."""
    hp = parse_hostport(bound, "bound address")
    if not hp.wildcard:
        return str(hp)
    return join_hostport(reachable_host(hp.host, advertise=advertise, toward=toward), hp.port)


def data_bind_host(listen: str, data_host: str | None = None) -> str:
    """Where a data server binds when the user named no data address: `data_host` if given,
    else the control listen address's host (the data port follows the control port's host;
    an empty host binds every interface, written 0.0.0.0)."""
    host = data_host if data_host is not None else parse_hostport(listen, "listen address").host
    return host or "0.0.0.0"


__all__ = ["advertised", "data_bind_host", "AddressError", "HostPort", "WILDCARD_HOSTS", "interface_ipv4",
           "is_loopback", "is_wildcard", "join_hostport", "parse_hostport", "reachable_host", "source_toward"]
