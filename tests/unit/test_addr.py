"""Addresses: the one HOST:PORT parser, and where data ports bind and what peers are told.

The defaults matter across hosts: a data port bound or advertised on 127.0.0.1 while the
control port is reachable from other hosts joins every view and trains nothing."""
from __future__ import annotations

import pytest

from p2pft.deploy.launch import cluster_args, data_addrs
from p2pft.runtime import Runtime
from p2pft.transport.addr import (AddressError, HostPort, advertised, data_bind_host, is_loopback, join_hostport,
                                  parse_hostport, reachable_host)


@pytest.mark.parametrize("text, host, port", [
    ("127.0.0.1:80", "127.0.0.1", 80),
    ("[::1]:7000", "::1", 7000),
    ("[fe80::1%eth0]:1", "fe80::1%eth0", 1),
    ("node03.cluster:7100", "node03.cluster", 7100),
    ("0.0.0.0:0", "0.0.0.0", 0),
    (" 10.0.0.1:65535 ", "10.0.0.1", 65535),
])
def test_parse_hostport(text: str, host: str, port: int) -> None:
    hp = parse_hostport(text)
    assert hp == HostPort(host, port) and (hp.host, hp.port) == (host, port)
    assert parse_hostport(str(hp)) == hp                      # str() writes what parse reads
    host_out, port_out = hp                                    # unpacks like the old tuples
    assert (host_out, port_out) == (host, port)


@pytest.mark.parametrize("text, needle", [
    ("", "expected HOST:PORT"),
    ("x", "expected HOST:PORT"),
    (":80", "expected HOST:PORT"),
    ("h:", "not a number"),
    ("h:p", "not a number"),
    ("h:-1", "not a number"),
    ("h:70000", "out of range"),
    ("::1:7000", "needs brackets"),
    ("[::1]7000", "[IPv6]:PORT"),
    ("[::1:7000", "[IPv6]:PORT"),
    ("[zz]:1", "not an IPv6 address"),
])
def test_parse_hostport_rejects_with_one_clear_line(text: str, needle: str) -> None:
    with pytest.raises(AddressError) as err:
        parse_hostport(text, "--listen")
    msg = str(err.value)
    assert needle in msg and msg.startswith("--listen: ") and "\n" not in msg
    assert isinstance(err.value, ValueError)


def test_join_and_classify() -> None:
    assert join_hostport("::1", 7) == "[::1]:7" and join_hostport("h", 7) == "h:7"
    assert parse_hostport("0.0.0.0:1").wildcard and parse_hostport("[::]:1").wildcard
    assert not parse_hostport("10.0.0.1:1").wildcard
    assert is_loopback("127.0.0.5") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("::1234") and not is_loopback("10.0.0.1") and not is_loopback("node1")


def test_reachable_host_is_never_a_wildcard() -> None:
    assert reachable_host("10.0.0.7") == "10.0.0.7"                                   # specific: itself
    assert reachable_host("0.0.0.0", advertise="10.1.2.3:7100") == "10.1.2.3"         # the advertised host
    assert reachable_host("0.0.0.0", toward=["127.0.0.1:7000"]) == "127.0.0.1"        # route to the seeds
    lone = reachable_host("0.0.0.0")
    assert lone and not parse_hostport(f"{lone}:1").wildcard
    assert advertised("0.0.0.0:4242", advertise="[fd00::5]:7100") == "[fd00::5]:4242"
    assert advertised("10.0.0.1:5") == "10.0.0.1:5"


def test_data_port_follows_the_control_host() -> None:
    assert data_bind_host("10.213.0.2:7100") == "10.213.0.2"
    assert data_bind_host("[::1]:7100") == "::1"
    assert data_bind_host("10.213.0.2:7100", "127.0.0.1") == "127.0.0.1"              # told otherwise
    assert data_bind_host("0.0.0.0:7100") == "0.0.0.0"


def announced_data_addr(rt: Runtime) -> str:
    """The data address this node gossips: what its peers connect to."""
    return rt.server.node.gossip.meta.data_addrs[0]


def test_runtime_data_address_defaults() -> None:
    """Runtime(listen=...) alone: the data port binds and is advertised on the listen host; a
    wildcard listen advertises a host peers can reach on both ports, never 0.0.0.0."""
    rt = Runtime(replica_id="a", listen="127.0.0.2:0").start()
    try:
        assert parse_hostport(rt.data.addr).host == "127.0.0.2"
        assert parse_hostport(announced_data_addr(rt)).host == "127.0.0.2"
    finally:
        rt.close(leave=False)
    rt = Runtime(replica_id="b", listen="0.0.0.0:0", seeds=["127.0.0.1:9"]).start()
    try:
        ctl, data = parse_hostport(rt.addr), parse_hostport(announced_data_addr(rt))
        assert ctl.host == data.host == "127.0.0.1"                                   # towards the seeds
        assert data.port == parse_hostport(rt.data.addr).port
    finally:
        rt.close(leave=False)
    rt = Runtime(replica_id="c", listen="0.0.0.0:0", advertise="127.0.0.3:7100").start()
    try:
        assert rt.addr == "127.0.0.3:7100" and parse_hostport(announced_data_addr(rt)).host == "127.0.0.3"
    finally:
        rt.close(leave=False)


def test_scheduler_wildcard_advertises_the_route_to_the_seeds() -> None:
    """torchrun gives no host name: the advertised address is this host's towards MASTER_ADDR
    (not getfqdn(), which may resolve to 127.0.1.1)."""
    ca = cluster_args(seeds_from="torchrun", listen="0.0.0.0:7100", advertise=None, seeds=[], replica_id=None,
                      role="r", env={"MASTER_ADDR": "127.0.0.1", "GROUP_RANK": "0", "LOCAL_RANK": "2"})
    assert ca.advertise == "127.0.0.1:7102"
    assert data_addrs(ca, "0.0.0.0:7300", None) == ("0.0.0.0:7302", "127.0.0.1:7302")
    v6 = cluster_args(seeds_from="torchrun", listen="[::]:7100", advertise="[fd00::1]:7100", seeds=[],
                      replica_id=None, role="r", env={"MASTER_ADDR": "fd00::9", "GROUP_RANK": "0", "LOCAL_RANK": "0"})
    assert v6.seeds == ["[fd00::9]:7100"] and v6.listen == "[::]:7100"
