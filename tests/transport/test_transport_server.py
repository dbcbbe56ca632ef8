"""DataServer routing: pending table, closed epochs, junk connections, handshake and wire helpers."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from p2pft.transport import CommAborted, CommTimeout, DataServer, ProtocolMismatch
from p2pft.transport.wire import (
    ACK_LEN, KIND_RING, ST_AUTH, ST_OK, ST_VERSION, pack_ack, pack_error_frame, pack_hello, parse_ack, parse_hello,
    find_error_frame, split_addr,
)
from transport_testutil import open_fds, p2pft_threads, run_ranks


def test_hello_and_ack_round_trip_with_secret() -> None:
    raw = pack_hello(b"k", KIND_RING, 7, 2, 1, 0, 3, 1, 2, 4096)
    st, h = parse_hello(b"k", raw)
    assert st == ST_OK and h is not None
    assert ((h.kind, h.epoch, h.shard, h.src, h.dst, h.world, h.lane, h.lanes, h.chunk)
            == (KIND_RING, 7, 2, 1, 0, 3, 1, 2, 4096))
    assert parse_hello(b"other", raw)[0] == ST_AUTH
    assert parse_hello(None, raw)[0] == ST_OK  # a server without a secret accepts anyone
    bad_version = bytearray(raw)
    bad_version[4] = 99
    assert parse_hello(None, bytes(bad_version))[0] == ST_VERSION
    ack = pack_ack(b"k", raw, ST_OK)
    assert parse_ack(b"k", raw, ack) == ST_OK
    with pytest.raises(ProtocolMismatch):
        parse_ack(b"k", raw, pack_ack(None, raw, ST_OK))  # server that does not know the secret


def test_error_frame_round_trip() -> None:
    err = CommTimeout("no data", peer_rank=3, peer_addr="127.0.0.1:1")
    frame = pack_error_frame(1, 0, 2, err, origin=2, tags={1: 5})
    r = find_error_frame(frame)
    assert r is not None and r.cls is CommTimeout and r.peer_rank == 3 and r.origin == 2 and r.tags == {1: 5}
    assert find_error_frame(frame[:-1]) is None
    assert find_error_frame(b"garbage" * 20) is None


def test_comm_error_fields_survive_copy_and_pickle() -> None:
    import pickle

    err = ProtocolMismatch("tag mismatch", peer_rank=1, peer_addr="127.0.0.1:9", origin=2, tags={1: 5, 2: 4})
    for other in (err.copy(), pickle.loads(pickle.dumps(err))):
        assert type(other) is ProtocolMismatch and other is not err
        assert (other.reason, other.peer_rank, other.peer_addr, other.origin, other.tags) == \
            ("tag mismatch", 1, "127.0.0.1:9", 2, {1: 5, 2: 4})
        assert str(other) == "tag mismatch [peer rank 1 @ 127.0.0.1:9]"
    plain = CommAborted("closed")
    assert (plain.peer_rank, plain.peer_addr, plain.origin, plain.tags) == (None, None, None, {})


def test_split_addr() -> None:
    assert split_addr("127.0.0.1:80") == ("127.0.0.1", 80)
    assert split_addr("[::1]:80") == ("::1", 80)
    for bad in ("", "x", ":80", "h:", "h:p"):
        with pytest.raises(ValueError):
            split_addr(bad)


def test_connection_before_communicator_waits_in_pending_table() -> None:
    a, b = DataServer(), DataServer()
    try:
        peers = [a.addr, b.addr]
        ca = a.communicator(1, 0, 0, peers)
        x, y = np.ones(100, dtype=np.float32), np.full(100, 2.0, dtype=np.float32)
        box: list = []
        th = threading.Thread(target=lambda: box.append(ca.allreduce(x)))
        th.start()
        time.sleep(0.3)  # rank 0 has connected to b, which has no communicator yet
        cb = b.communicator(1, 0, 1, peers)
        assert cb.allreduce(y) == 2
        th.join(5)
        assert box == [2] and np.all(x == 3.0) and np.all(y == 3.0)
    finally:
        a.close()
        b.close()


def test_pending_connection_expires_with_a_reason() -> None:
    a, b = DataServer(), DataServer(pending_timeout=0.3)
    try:
        ca = a.communicator(1, 0, 0, [a.addr, b.addr], timeout=5.0, connect_timeout=3.0)
        t0 = time.monotonic()
        with pytest.raises((CommTimeout, CommAborted)) as ei:
            ca.allreduce(np.ones(10, dtype=np.float32))
        assert ei.value.peer_rank == 1
        assert time.monotonic() - t0 < 1.5  # the expiry (0.3 s), not connect_timeout (3 s)
    finally:
        a.close()
        b.close()


def test_connection_for_closed_epoch_is_refused_as_aborted() -> None:
    a, b = DataServer(), DataServer()
    try:
        peers = [a.addr, b.addr]
        b.communicator(1, 0, 1, peers).close()
        ca = a.communicator(1, 0, 0, peers, connect_timeout=2.0)
        with pytest.raises(CommAborted) as ei:
            ca.allreduce(np.ones(10, dtype=np.float32))
        assert ei.value.peer_rank == 1 and "closed" in ei.value.reason
    finally:
        a.close()
        b.close()


def test_mismatched_world_is_a_protocol_error() -> None:
    a, b = DataServer(), DataServer()
    try:
        ca = a.communicator(1, 0, 0, [a.addr, b.addr], connect_timeout=2.0)
        cb = b.communicator(1, 0, 1, [a.addr, b.addr, "127.0.0.1:9"], connect_timeout=2.0)
        errs = run_ranks([lambda: ca.allreduce(np.ones(4)), lambda: cb.allreduce(np.ones(4))])
        assert isinstance(errs[0], ProtocolMismatch), errs
    finally:
        a.close()
        b.close()


def test_junk_and_silent_connections_do_not_hurt_the_server() -> None:
    s = DataServer(handshake_timeout=0.3)
    try:
        host, port = split_addr(s.addr)
        silent = socket.create_connection((host, port))
        junk = socket.create_connection((host, port))
        junk.sendall(b"GET / HTTP/1.1\r\n" * 10)
        junk.settimeout(2)
        data = junk.recv(ACK_LEN)  # rejected with an ack carrying an error status, then closed
        assert len(data) in (0, ACK_LEN)
        silent.settimeout(2)
        assert silent.recv(10) == b""  # closed after handshake_timeout
        silent.close()
        junk.close()
        # Still serving real communicators.
        c = s.communicator(1, 0, 0, [s.addr])
        assert c.allreduce(np.ones(3)) == 1
    finally:
        s.close()


def test_server_close_releases_everything() -> None:
    fds = open_fds()
    servers = [DataServer() for _ in range(3)]
    peers = [x.addr for x in servers]
    comms = [x.communicator(1, 0, r, peers) for r, x in enumerate(servers)]
    xs = [np.ones(1000, dtype=np.float32) for _ in range(3)]
    assert run_ranks([lambda r=r: comms[r].allreduce(xs[r]) for r in range(3)]) == [3, 3, 3]
    for x in servers:
        x.close()  # closes its communicators too
    assert all(c.failed is not None for c in comms)
    time.sleep(0.05)
    assert p2pft_threads() == []
    assert open_fds() <= fds


def test_ring_socket_buffers_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """$P2PFT_RING_BUFSIZE fixes the ring sockets' kernel buffers; unset, the server leaves the
    choice to each ring; a bad value is one clear error."""
    monkeypatch.setenv("P2PFT_RING_BUFSIZE", "262144")
    servers = [DataServer() for _ in range(3)]
    try:
        assert all(x.sock_bufsize == 262144 for x in servers)
        peers = [x.addr for x in servers]
        comms = [x.communicator(1, 0, r, peers) for r, x in enumerate(servers)]
        xs = [np.full(3 << 20, r + 1, dtype=np.float32) for r in range(3)]   # 12 MB: many chunks
        assert run_ranks([lambda r=r: comms[r].allreduce(xs[r]) for r in range(3)]) == [3, 3, 3]
        assert all(float(x.min()) == float(x.max()) == 6.0 for x in xs)
        # Linux reports twice what was asked (room for its bookkeeping), on both ends of a link.
        for sock in comms[0]._links.rights + comms[1]._links.lefts:
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) == 2 * 262144
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) == 2 * 262144
    finally:
        for x in servers:
            x.close()
    monkeypatch.setenv("P2PFT_RING_BUFSIZE", "lots")
    with pytest.raises(ValueError, match="P2PFT_RING_BUFSIZE='lots': expected a size in bytes"):
        DataServer()
    monkeypatch.delenv("P2PFT_RING_BUFSIZE")
    s = DataServer()
    assert s.sock_bufsize is None
    s.close()


def test_ring_socket_buffers_chosen_per_ring() -> None:
    """Unset, small buffers exactly when more members of the ring listen on this host than it
    has cores; a configured size (0: autotuning) wins."""
    from p2pft.transport.options import SHARED_CORES_BUFSIZE, ring_bufsize_for

    local3 = ["127.0.0.1:7000", "127.0.0.1:7001", "localhost:7002"]
    assert ring_bufsize_for(local3, 1, None, cores=2) == SHARED_CORES_BUFSIZE
    assert ring_bufsize_for(local3, 1, None, cores=3) is None
    two_hosts = ["10.0.0.1:7000", "10.0.0.2:7000", "10.0.0.1:7001", "10.0.0.2:7001"]
    assert ring_bufsize_for(two_hosts, 0, None, cores=1) == SHARED_CORES_BUFSIZE   # 2 here, 1 core
    assert ring_bufsize_for(two_hosts, 0, None, cores=2) is None                   # a core each
    assert ring_bufsize_for(local3, 0, 0, cores=1) is None
    v6 = ["[::1]:7000", "[::1234]:7001", "[::1234]:7002"]                            # ::1234 is not loopback
    assert ring_bufsize_for(v6, 0, None, cores=1) is None
    assert ring_bufsize_for(v6, 1, None, cores=1) == SHARED_CORES_BUFSIZE
    assert ring_bufsize_for(local3, 0, 65536, cores=64) == 65536
    with pytest.raises(ValueError, match="sock_bufsize=100"):
        DataServer(sock_bufsize=100)


@pytest.mark.parametrize("cores,setting,small", [(2, None, True), (8, None, False), (2, "0", False)])
def test_ring_sockets_follow_the_per_ring_choice(cores: int, setting: str | None, small: bool,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Both ends of every link carry the choice: the connecting side when it connects, the
    accepting side when its communicator takes the connection."""
    from p2pft.transport import options

    monkeypatch.setattr(options.os, "cpu_count", lambda: cores)
    if setting is None:
        monkeypatch.delenv("P2PFT_RING_BUFSIZE", raising=False)
    else:
        monkeypatch.setenv("P2PFT_RING_BUFSIZE", setting)
    servers = [DataServer() for _ in range(3)]
    try:
        peers = [x.addr for x in servers]
        comms = [x.communicator(1, 0, r, peers) for r, x in enumerate(servers)]
        xs = [np.full(1 << 20, r + 1, dtype=np.float32) for r in range(3)]
        assert run_ranks([lambda r=r: comms[r].allreduce(xs[r]) for r in range(3)]) == [3, 3, 3]
        for sock in comms[0]._links.rights + comms[1]._links.lefts:
            for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
                assert (sock.getsockopt(socket.SOL_SOCKET, opt) == 2 * options.SHARED_CORES_BUFSIZE) == small
    finally:
        for x in servers:
            x.close()
