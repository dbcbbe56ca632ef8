"""The C allreduce loop against the Python loop: same bytes, same wire, safe on bad input."""

from __future__ import annotations

import contextlib
import pathlib
import re
import shutil
import signal
import socket
import sysconfig
import threading
import time
from array import array
from typing import Any, Iterator

import numpy as np
import pytest

from p2pft.transport import CommTimeout, DataServer, native
from p2pft.transport import receiver as receiver_mod
from transport_testutil import run_ranks

OWN_RING_LOOP = True  # these tests choose the loop of each rank themselves

needs_native = pytest.mark.skipif(native._MODULE is None, reason="the C ring loop is not built")


def test_the_c_loop_is_built_where_a_compiler_exists() -> None:
    """The extension is optional for installs without a compiler; it must not go missing
    silently on a machine that has one (the Python loop would then carry every op)."""
    has_cc = shutil.which(sysconfig.get_config_var("CC").split()[0] if sysconfig.get_config_var("CC") else "cc")
    if has_cc is None:
        pytest.skip("no C compiler on this machine: the Python loop is the one in use")
    assert native._MODULE is not None, "a C compiler exists but transport/_ringloop.c was not built"


def _allreduce(world: int, arrays: list[np.ndarray], contrib: list[bool], native_ranks: set[int],
               monkeypatch: pytest.MonkeyPatch, chunk_bytes: int, lanes: int = 1) -> tuple[list, list]:
    """One allreduce on a fresh ring; ranks in `native_ranks` run the C loop on lane 0."""
    mod = native._MODULE
    used: set[int] = set()

    def pick() -> object:
        name = threading.current_thread().name
        if name.startswith("test-rank-") and int(name.rsplit("-", 1)[1]) in native_ranks:
            used.add(int(name.rsplit("-", 1)[1]))
            return mod
        return None

    monkeypatch.setattr(receiver_mod, "native_loop", pick)
    servers = [DataServer(chunk_bytes=chunk_bytes, lanes=lanes) for _ in range(world)]
    peers = [s.addr for s in servers]
    comms = [s.communicator(1, 0, r, peers, timeout=10.0) for r, s in enumerate(servers)]
    xs = [a.copy() for a in arrays]
    try:
        counts = run_ranks([lambda r=r: comms[r].allreduce(xs[r], contribute=contrib[r]) for r in range(world)])
    finally:
        for c in comms:
            c.close()
        for s in servers:
            s.close()
    assert used == native_ranks  # the C loop ran exactly where asked
    return counts, xs


def _data(dtype: str, world: int, nel: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    if dtype.startswith("int"):
        big = np.iinfo(dtype).max
        return [rng.integers(-big, big, nel, dtype=dtype, endpoint=True) for _ in range(world)]  # wraps
    return [rng.standard_normal(nel).astype(dtype) * 10.0 ** rng.integers(-3, 4) for _ in range(world)]


@needs_native
@pytest.mark.parametrize("dtype", ["float32", "float64", "int32", "int64"])
@pytest.mark.parametrize("world,nel,contrib", [
    (2, 1, [True, True]),
    (3, 2, [True, False, True]),          # fewer elements than ranks: empty segments
    (3, 100_003, [True, True, True]),     # many chunks, uneven segments
    (4, 65_537, [False, True, False, True]),
    (3, 50_000, [False, False, False]),   # nobody contributes: zeros, count 0
])
def test_c_python_and_mixed_rings_agree_bitwise(dtype: str, world: int, nel: int, contrib: list[bool],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    data = _data(dtype, world, nel, seed=nel + world)
    chunk = 4096  # many frames per segment
    ref_counts, ref = _allreduce(world, data, contrib, set(), monkeypatch, chunk)
    assert ref_counts == [sum(contrib)] * world
    for native_ranks in ({*range(world)}, {0, world - 1} if world > 2 else {1}):
        counts, out = _allreduce(world, data, contrib, native_ranks, monkeypatch, chunk)
        assert counts == ref_counts, native_ranks
        for r in range(world):
            assert out[r].tobytes() == ref[r].tobytes(), (native_ranks, r)
    if not any(contrib):
        assert all(not o.any() for o in ref)
    elif dtype.startswith("int"):  # integer sums are exact (with wrap-around): check the values too
        want = np.sum([d for d, c in zip(data, contrib) if c], axis=0, dtype=dtype)
        assert all(np.array_equal(o, want) for o in ref)


@needs_native
def test_c_loop_with_lanes_and_python_loop_on_the_others(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lane 0 runs in C, lanes 1-2 on worker threads in Python: one op, two loops, same result."""
    data = _data("float32", 3, 300_000, seed=7)
    ref_counts, ref = _allreduce(3, data, [True] * 3, set(), monkeypatch, 8192, lanes=3)
    counts, out = _allreduce(3, data, [True] * 3, {0, 1, 2}, monkeypatch, 8192, lanes=3)
    assert counts == ref_counts == [3, 3, 3]
    assert all(out[r].tobytes() == ref[r].tobytes() for r in range(3))


@needs_native
def test_c_loop_rejects_plans_outside_its_buffers() -> None:
    """A plan that would read or write outside the tensor, the scratch or the send queue is a
    ValueError, checked before any I/O, never a memory error."""
    mod = native._MODULE
    a, b = socket.socketpair()
    try:
        buf = bytearray(64)
        scratch = bytearray(16)
        prefix = bytes(48)
        ka = bytes(72)
        good_sends = array("q", [0, 0, 0, 32])
        two_sends = array("q", [0, 0, 0, 32, 0, 1, 32, 32])
        big = 1 << 62
        cases = [
            (array("q", [0, 0, 48, 32]), 1, array("q")),                   # send past the end
            (array("q", [0, 0, big, big]), 1, array("q")),                 # offset + size overflows int64
            (good_sends, 1, array("q", [0, 0, 0, 32, 1, -1])),             # reduce chunk > scratch
            (good_sends, 1, array("q", [0, 0, 60, 8, 0, -1])),             # receive past the end
            (good_sends, 1, array("q", [0, 0, big, big, 0, -1])),          # offset + size overflows int64
            (good_sends, 1, array("q", [0, 0, 0, 8, 0, 5])),               # unlocks a send that is not there
            (good_sends, 1, array("q", [0, 0, 0, 6, 0, -1])),              # not whole elements
            (good_sends, 2, array("q")),                                   # more first sends than sends
            (two_sends, 1, array("q", [0, 0, 0, 8, 0, 1] * 2)),            # one send unlocked twice
            (two_sends, 1, array("q", [0, 0, 0, 8, 0, 0])),                # unlocks a first send again
        ]
        for sends, first, recvs in cases:
            with pytest.raises(ValueError):
                mod.allreduce_lane(a.fileno(), b.fileno(), buf, scratch, sends, first, recvs, prefix, prefix, ka,
                                   True, 3, 2, 1.0, 0.05, None)
        with pytest.raises(ValueError):  # a dtype the C loop does not add
            mod.allreduce_lane(a.fileno(), b.fileno(), buf, scratch, good_sends, 1, array("q"), prefix, prefix,
                               ka, True, 2, 2, 1.0, 0.05, None)
        with pytest.raises(ValueError):  # a failure state without `failed`
            mod.allreduce_lane(a.fileno(), b.fileno(), buf, scratch, good_sends, 1, array("q"), prefix, prefix,
                               ka, True, 3, 2, 1.0, 0.05, object())
        with pytest.raises(TypeError):  # a read-only tensor
            mod.allreduce_lane(a.fileno(), b.fileno(), bytes(64), scratch, good_sends, 1, array("q"), prefix,
                               prefix, ka, True, 3, 2, 1.0, 0.05, None)
    finally:
        a.close()
        b.close()


def test_the_environment_switch_selects_the_python_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(native.NATIVE_ENV, "0")
    assert native.native_loop() is None
    monkeypatch.delenv(native.NATIVE_ENV)
    assert native.native_loop() is native._MODULE


def test_python_reads_the_statuses_the_c_loop_returns() -> None:
    """Status numbers live twice (ringloop.h and native.Status); a drift would map, say, a
    receive timeout to a send error. Read the header's enum and compare."""
    header = pathlib.Path(native.__file__).with_name("ringloop") / "ringloop.h"
    in_c = {m.group(1): int(m.group(2)) for m in re.finditer(r"\bST_([A-Z_]+) = (\d+)", header.read_text())}
    in_py = {k: v for k, v in vars(native.Status).items() if k.isupper()}
    assert in_c and in_c == in_py


class _Alarm(Exception):
    pass


@contextlib.contextmanager
def _idle_neighbour(loop: str, monkeypatch: pytest.MonkeyPatch, *, timeout: float) -> Iterator[Any]:
    """Rank 0's communicator of a 2-rank ring on the chosen loop, whose rank 1 connects its side
    and then neither sends nor reads."""
    if loop == "native" and native._MODULE is None:
        pytest.skip("the C ring loop is not built")
    monkeypatch.setenv(native.NATIVE_ENV, "1" if loop == "native" else "0")
    servers = [DataServer() for _ in range(2)]
    peers = [s.addr for s in servers]
    comm = servers[0].communicator(1, 0, 0, peers, timeout=timeout)
    other = servers[1].communicator(1, 0, 1, peers, timeout=timeout)
    connecting = threading.Thread(target=other._ensure_connected, daemon=True)
    connecting.start()
    try:
        yield comm
        connecting.join(5)
    finally:
        comm.close()
        other.close()
        for s in servers:
            s.close()


@pytest.mark.parametrize("loop", ["native", "python"])
def test_a_signal_handler_that_raises_interrupts_a_waiting_allreduce(loop: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C (or any handler that raises) reaches the caller within a slice, not after the op
    timeout, and leaves the communicator failed; the C loop runs handlers between its calls."""
    def alarm(signum: int, frame: object) -> None:
        raise _Alarm()

    with _idle_neighbour(loop, monkeypatch, timeout=20.0) as comm:
        old = signal.signal(signal.SIGALRM, alarm)
        try:
            signal.setitimer(signal.ITIMER_REAL, 0.3)
            t0 = time.monotonic()
            with pytest.raises(_Alarm):
                comm.allreduce(np.ones(1 << 16, dtype=np.float32))
            assert time.monotonic() - t0 < 2.0
            assert comm.failed is not None and "interrupted" in str(comm.failed)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)


def _in_thread(fn: Any, limit: float) -> tuple[Any, BaseException | None, float]:
    """Run `fn` on a daemon thread; fail the test if it is still running after `limit` s (a
    C loop stuck without the GIL cannot be interrupted from Python)."""
    out: list[Any] = [None, None]

    def run() -> None:
        try:
            out[0] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out[1] = e

    t0 = time.monotonic()
    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(limit)
    assert not th.is_alive(), f"still running after {limit} s"
    return out[0], out[1], time.monotonic() - t0


@pytest.mark.parametrize("loop", ["native", "python"])
def test_a_neighbour_that_takes_no_data_fails_the_op_within_its_timeout(loop: str,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1 connects and then neither reads nor sends; rank 0's 64 MB allreduce must end in
    CommTimeout after about its timeout. The op timeout here equals every default a lane
    starts with, so no slice is left unset on a socket."""
    with _idle_neighbour(loop, monkeypatch, timeout=1.0) as comm:
        _, err, took = _in_thread(lambda: comm.allreduce(np.ones(16 << 20, dtype=np.float32)), 10.0)
        assert isinstance(err, CommTimeout), err
        assert took < 5.0


class _State:
    failed: object | None = None


def _send_to_a_stalled_right(*, tmo: float, state: Any) -> tuple[int, float]:
    """One C lane with nothing to receive and 32 MB to send to a right neighbour that takes
    nothing, on sockets the caller left blocking (no SO_SNDTIMEO); returns (status, seconds)."""
    mod = native._MODULE
    l0, l1 = socket.socketpair()
    r0, r1 = socket.socketpair()
    n = 32 << 20
    try:
        res, err, took = _in_thread(lambda: mod.allreduce_lane(
            l0.fileno(), r0.fileno(), bytearray(n), bytearray(mod.SCRATCH_BYTES), array("q", [0, 0, 0, n]), 1,
            array("q"), bytes(48), bytes(48), bytes(72), True, 3, 2, tmo, 0.05, state), 10.0)
        assert err is None, err
        return res[0], took
    finally:
        for s in (l0, l1, r0, r1):
            s.close()


@needs_native
def test_a_draining_lane_stops_when_the_communicator_fails_elsewhere() -> None:
    """Everything received, a frame still queued for a right neighbour that takes nothing: a
    failure recorded by another thread (another lane, abort) ends the C loop within a slice,
    not after the op timeout, with the status that says so."""
    state = _State()
    timer = threading.Timer(0.3, lambda: setattr(state, "failed", RuntimeError("another lane")))
    timer.start()
    status, took = _send_to_a_stalled_right(tmo=20.0, state=state)
    timer.join()
    assert status == native.Status.FAILED
    assert took < 3.0


@needs_native
def test_the_c_loop_times_out_on_a_socket_the_caller_left_blocking() -> None:
    """The loop sets its own socket slices: a right neighbour that takes nothing ends the call
    with SEND_TIMEOUT after the op timeout even if the caller never set a send timeout."""
    status, took = _send_to_a_stalled_right(tmo=1.0, state=None)
    assert status == native.Status.SEND_TIMEOUT
    assert 0.9 < took < 3.0
