"""Ring connects that a newer view gives up on: a connect to a host that answers nothing (its SYNs
dropped, as when it vanished) returns as soon as the communicator is given up on, instead of
holding the rank for the connect timeout."""
from __future__ import annotations

import socket
import threading
import time

import pytest

from p2pft.transport.wire import connect_abortable


def _silent_listener() -> tuple[socket.socket, list[socket.socket], int]:
    """A listener whose accept queue is full: Linux drops further SYNs, so a connect hangs."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(0)
    port = srv.getsockname()[1]
    fillers = []
    for _ in range(4):    # the queue holds backlog + 1; the rest hang in SYN_SENT
        c = socket.socket()
        c.setblocking(False)
        c.connect_ex(("127.0.0.1", port))
        fillers.append(c)
    time.sleep(0.1)
    return srv, fillers, port


def test_connect_to_a_silent_host_stops_when_given_up() -> None:
    srv, fillers, port = _silent_listener()
    try:
        with pytest.raises(socket.timeout):      # nothing answers: the timeout, as create_connection
            connect_abortable("127.0.0.1", port, 0.3, None, lambda: False)
        flag = threading.Event()
        threading.Timer(0.2, flag.set).start()
        t = time.monotonic()
        assert connect_abortable("127.0.0.1", port, 5.0, None, flag.is_set) is None
        assert time.monotonic() - t < 1.0, "the connect was not given up on"
    finally:
        for c in fillers:
            c.close()
        srv.close()


def test_connect_succeeds_and_refusal_raises() -> None:
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    s = connect_abortable("127.0.0.1", port, 2.0, ("127.0.0.1", 0), lambda: False)
    assert s is not None
    peer, _ = srv.accept()
    s.sendall(b"hello")
    assert peer.recv(5) == b"hello"
    for x in (s, peer, srv):
        x.close()
    with pytest.raises(ConnectionRefusedError):
        connect_abortable("127.0.0.1", port, 2.0, None, lambda: False)
