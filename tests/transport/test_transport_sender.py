"""A lane's sender: drain() returns only once every queued byte is written.

An op returns after its lanes drain, and the caller may then reuse the tensor, so a drain that
returned early would let the caller overwrite data that is still being sent, or let a later abort
drop the unsent frames that a neighbour is waiting for.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest

from p2pft.transport import CommError
from p2pft.transport.failure import FailHooks, FailState
from p2pft.transport.sender import LaneSender

OWN_RING_LOOP = True  # the Python sender alone: the C loop writes without it


def _fail_into(state: FailState):
    def fail(err: CommError) -> CommError:
        with state.lock:
            if state.failed is None:
                state.failed = err
        state.wake_waiters()
        return state.failed  # type: ignore[return-value]
    return fail


@pytest.fixture
def lane():
    """A sender writing into one end of a socket pair whose other end nobody reads yet."""
    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 10)
    b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
    state = FailState()
    hooks = FailHooks(state=state, fail=_fail_into(state), from_remote=lambda r, via: CommError(r.reason))
    snd = LaneSender("test-sender", a, inline=False, right=1, right_addr="127.0.0.1:1", hooks=hooks,
                     close_sock=lambda s: s.close())
    snd.start()
    snd.set_timeout(10.0)
    yield snd, b, state
    snd.stop()
    b.close()
    snd.thread.join(5)
    a.close()


def _read_all(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    sock.settimeout(10)
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        assert chunk, "sender closed early"
        out += chunk
    return bytes(out)


def test_drain_waits_for_the_queued_bytes_through_other_wake_ups(lane) -> None:
    snd, peer, state = lane
    payload = memoryview(bytes(range(256)) * (16 << 10))  # 4 MiB: far more than the socket buffers
    snd.submit(b"HDR!", payload)
    done = threading.Event()
    errors: list[BaseException] = []

    def drain() -> None:
        try:
            snd.drain(10.0)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
        done.set()

    t = threading.Thread(target=drain)
    t.start()
    # Another lane finishing wakes every waiter of the communicator; that is no reason to return.
    for _ in range(20):
        time.sleep(0.01)
        state.wake_waiters()
    assert not done.is_set(), "drain returned while the frame was still unsent"
    got = _read_all(peer, 4 + payload.nbytes)
    assert done.wait(5), "drain did not return once the frame was written"
    t.join(5)
    assert errors == []
    assert got == b"HDR!" + bytes(payload)
    assert snd.completed == snd.submitted == 1


def test_drain_raises_the_failure_that_happens_while_it_waits(lane) -> None:
    snd, peer, state = lane
    snd.submit(b"HDR!", memoryview(bytes(4 << 20)))
    errors: list[BaseException] = []
    t = threading.Thread(target=lambda: errors.append(_raised(lambda: snd.drain(10.0))))
    t.start()
    time.sleep(0.05)
    snd.hooks.fail(CommError("neighbour gone"))
    t.join(5)
    assert not t.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], CommError) and "neighbour gone" in str(errors[0])


def _raised(fn) -> BaseException | None:
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 - the test inspects it
        return e
    return None
