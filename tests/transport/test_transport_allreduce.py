"""Ring allreduce / broadcast correctness over real loopback sockets (one thread per rank)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from p2pft.transport import CommAborted, CommError, DataServer, PeerFailed, ProtocolMismatch
from transport_testutil import open_fds, p2pft_threads, run_ranks


class Ring:
    """`world` DataServers in this process and the communicators of one epoch."""

    def __init__(self, world: int, epoch: int = 1, timeout: float = 10.0, **server_kw: object) -> None:
        self.servers = [DataServer(**server_kw) for _ in range(world)]  # type: ignore[arg-type]
        self.peers = [s.addr for s in self.servers]
        self.comms = [s.communicator(epoch, 0, r, self.peers, timeout=timeout) for r, s in enumerate(self.servers)]

    def new_epoch(self, epoch: int) -> None:
        self.comms = [s.communicator(epoch, 0, r, self.peers, timeout=10.0) for r, s in enumerate(self.servers)]

    def close(self) -> None:
        for c in self.comms:
            c.close()
        for s in self.servers:
            s.close()


@pytest.fixture
def leak_check():
    fds = open_fds()
    yield
    deadline = time.monotonic() + 2
    while (p2pft_threads() or open_fds() > fds) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert p2pft_threads() == []
    assert open_fds() <= fds


def _inputs(world: int, nel: int, dtype: str, kind: str, seed: int) -> list:
    rng = np.random.default_rng(seed)
    arrs = [rng.standard_normal(nel).astype(dtype) for _ in range(world)]
    if kind == "torch":
        return [torch.from_numpy(a.copy()) for a in arrs]
    return [a.copy() for a in arrs]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype,kind", [("float32", "numpy"), ("float64", "numpy"), ("float32", "torch"),
                                        ("float64", "torch")])
def test_allreduce_matches_float64_reference(world: int, dtype: str, kind: str, leak_check: None) -> None:
    # Small chunks so that odd sizes span several chunks per segment and exercise the pipeline.
    ring = Ring(world, chunk_bytes=4096)
    try:
        for it, nel in enumerate([0, 1, 3, 1021, 12_345]):
            for contrib in ([True] * world, [r % 2 == 1 for r in range(world)], [False] * world):
                xs = _inputs(world, nel, dtype, kind, seed=it)
                ref = sum((np.asarray(x, dtype=np.float64) for x, c in zip(xs, contrib) if c),
                          np.zeros(nel, dtype=np.float64))
                counts = run_ranks([lambda r=r: ring.comms[r].allreduce(xs[r], contribute=contrib[r], tag=it)
                                    for r in range(world)])
                assert counts == [sum(contrib)] * world
                tol = 1e-5 if dtype == "float32" else 1e-12
                for x in xs:
                    np.testing.assert_allclose(np.asarray(x, dtype=np.float64), ref, rtol=tol, atol=tol)
    finally:
        ring.close()


@pytest.mark.parametrize("world,lanes", [(2, 2), (3, 3), (4, 2)])
def test_allreduce_multiple_lanes_and_multidim(world: int, lanes: int, leak_check: None) -> None:
    ring = Ring(world, chunk_bytes=1000, lanes=lanes)  # not a multiple of the element size
    try:
        xs = [torch.randn(7, 13, 11, dtype=torch.float32) for _ in range(world)]
        ref = sum(x.double() for x in xs)
        counts = run_ranks([lambda r=r: ring.comms[r].allreduce(xs[r]) for r in range(world)])
        assert counts == [world] * world
        for x in xs:
            torch.testing.assert_close(x.double(), ref, rtol=1e-5, atol=1e-5)
    finally:
        ring.close()


def test_allreduce_bfloat16_and_float16(leak_check: None) -> None:
    ring = Ring(3, chunk_bytes=256)
    try:
        for dt in (torch.bfloat16, torch.float16):
            xs = [torch.full((999,), float(r + 1), dtype=dt) for r in range(3)]
            run_ranks([lambda r=r: ring.comms[r].allreduce(xs[r]) for r in range(3)])
            for x in xs:
                assert x.dtype == dt and torch.all(x == 6.0)
    finally:
        ring.close()


def test_default_chunk_large_tensor(leak_check: None) -> None:
    ring = Ring(3)
    try:
        xs = [np.full(3_000_001, r + 0.5, dtype=np.float32) for r in range(3)]
        run_ranks([lambda r=r: ring.comms[r].allreduce(xs[r]) for r in range(3)])
        for x in xs:
            assert np.all(x == 4.5)
    finally:
        ring.close()


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_broadcast(world: int, leak_check: None) -> None:
    ring = Ring(world, chunk_bytes=512)
    try:
        for root in range(world):
            xs = [torch.arange(5001, dtype=torch.int64) * (r + 1) for r in range(world)]
            run_ranks([lambda r=r: ring.comms[r].broadcast(xs[r], root) for r in range(world)])
            for x in xs:
                assert torch.equal(x, torch.arange(5001, dtype=torch.int64) * (root + 1))
    finally:
        ring.close()


def test_tag_mismatch_names_the_mismatching_peer_on_every_rank(leak_check: None) -> None:
    ring = Ring(3)
    try:
        tags = [4, 5, 4]
        xs = [np.ones(10_000, dtype=np.float32) for _ in range(3)]
        errs = run_ranks([lambda r=r: ring.comms[r].allreduce(xs[r], tag=tags[r]) for r in range(3)])
        for r, e in enumerate(errs):
            assert isinstance(e, ProtocolMismatch), (r, e)
            assert e.peer_rank is not None and tags[e.peer_rank] != tags[r], (r, e)
            assert e.peer_addr == ring.peers[e.peer_rank]
            # The tags behind the verdict travel as fields (also when relayed by a neighbour).
            assert e.tags[r] == tags[r] and e.tags[e.peer_rank] == tags[e.peer_rank], (r, e.tags)
            assert e.origin != r, (r, e.origin)
        assert errs[0].peer_rank == 1 and errs[2].peer_rank == 1
        # Sticky: the communicator stays failed.
        with pytest.raises(ProtocolMismatch):
            ring.comms[0].allreduce(xs[0], tag=4)
        # The next epoch works in the same processes.
        for c in ring.comms:
            c.close()
        ring.new_epoch(2)
        counts = run_ranks([lambda r=r: ring.comms[r].allreduce(xs[r], tag=9) for r in range(3)])
        assert counts == [3, 3, 3]
    finally:
        ring.close()


def test_mismatched_sizes_and_ops_are_protocol_errors(leak_check: None) -> None:
    ring = Ring(2)
    try:
        a, b = np.ones(100, dtype=np.float32), np.ones(101, dtype=np.float32)
        errs = run_ranks([lambda: ring.comms[0].allreduce(a), lambda: ring.comms[1].allreduce(b)])
        assert all(isinstance(e, ProtocolMismatch) for e in errs), errs
        ring.new_epoch(2)
        errs = run_ranks([lambda: ring.comms[0].allreduce(a), lambda: ring.comms[1].broadcast(a, 0)])
        assert all(isinstance(e, ProtocolMismatch) for e in errs), errs
    finally:
        ring.close()


def test_abort_unblocks_waiting_allreduce_within_100ms(leak_check: None) -> None:
    ring = Ring(3)
    try:
        x = np.ones(1000, dtype=np.float32)
        box: list = []
        th = threading.Thread(target=lambda: box.append(_catch(lambda: ring.comms[0].allreduce(x))))
        th.start()
        time.sleep(0.3)  # rank 0 now waits for ranks 1 and 2, which never start
        t0 = time.monotonic()
        ring.comms[0].abort("new view")
        th.join(2)
        elapsed = time.monotonic() - t0
        assert not th.is_alive()
        assert isinstance(box[0], CommAborted) and box[0].peer_rank is None, box
        assert elapsed < 0.1, elapsed
        ring.comms[0].abort("again")  # idempotent
        assert isinstance(ring.comms[0].failed, CommAborted)
        # Neighbours that start now learn that rank 0 aborted instead of blaming it as dead.
        errs = run_ranks([lambda r=r: ring.comms[r].allreduce(np.ones(1000, dtype=np.float32)) for r in (1, 2)])
        for e in errs:
            assert isinstance(e, CommError) and not isinstance(e, PeerFailed), e
    finally:
        ring.close()


@pytest.mark.parametrize("lanes", [1, 2])
def test_abort_during_data_transfer(lanes: int, leak_check: None) -> None:
    ring = Ring(3, lanes=lanes)
    try:
        xs = [np.ones(8 << 20, dtype=np.float32) for _ in range(3)]
        box: list = [None] * 3

        def rank(r: int) -> None:
            box[r] = _catch(lambda: ring.comms[r].allreduce(xs[r]))

        ths = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
        for t in ths:
            t.start()
        time.sleep(0.05)
        ring.comms[1].abort("test")
        for t in ths:
            t.join(5)
        assert not any(t.is_alive() for t in ths)
        # Unless rank 1 finished before the abort (then the others complete too, since rank 1
        # had already handed them all its data), everybody learns that rank 1 aborted.
        if isinstance(box[1], int):
            assert box == [3, 3, 3], box
        else:
            assert isinstance(box[1], CommAborted), box
            for r in (0, 2):
                assert isinstance(box[r], (CommAborted, int)), box
                if not isinstance(box[r], int):
                    assert box[r].peer_rank == 1, box
    finally:
        ring.close()


@pytest.mark.parametrize("lanes", [1, 2])
def test_an_abort_right_after_an_op_returned_costs_the_neighbours_nothing(lanes: int, leak_check: None) -> None:
    # An op returns once its lanes have handed all their frames to the kernel; the caller may
    # then reuse the tensor or abort. Several rounds: the lanes finish in a different order each time.
    for _ in range(10):
        ring = Ring(3, lanes=lanes)
        try:
            xs = [np.ones(8 << 20, dtype=np.float32) for _ in range(3)]

            def reduce_then_abort() -> int:
                n = ring.comms[1].allreduce(xs[1])
                xs[1].fill(np.nan)  # reused at once: nothing of it may still be on its way
                ring.comms[1].abort("done with this communicator")
                return n

            box = run_ranks([lambda: ring.comms[0].allreduce(xs[0]), reduce_then_abort,
                             lambda: ring.comms[2].allreduce(xs[2])], timeout=10)
            assert box == [3, 3, 3], box
            assert all(np.all(xs[r] == 3.0) for r in (0, 2))
        finally:
            ring.close()


def test_wrong_secret_is_rejected(leak_check: None) -> None:
    a = DataServer(secret=b"alpha")
    b = DataServer(secret=b"beta")
    try:
        peers = [a.addr, b.addr]
        ca = a.communicator(1, 0, 0, peers, connect_timeout=2.0)
        cb = b.communicator(1, 0, 1, peers, connect_timeout=2.0)
        x, y = np.ones(10, dtype=np.float32), np.ones(10, dtype=np.float32)
        errs = run_ranks([lambda: ca.allreduce(x), lambda: cb.allreduce(y)])
        assert all(isinstance(e, ProtocolMismatch) for e in errs), errs
    finally:
        a.close()
        b.close()


def test_same_secret_works() -> None:
    servers = [DataServer(secret=b"s3cret") for _ in range(2)]
    try:
        peers = [s.addr for s in servers]
        cs = [s.communicator(1, 0, r, peers) for r, s in enumerate(servers)]
        xs = [np.ones(10, dtype=np.float32) for _ in range(2)]
        assert run_ranks([lambda r=r: cs[r].allreduce(xs[r]) for r in range(2)]) == [2, 2]
    finally:
        for s in servers:
            s.close()


def test_bad_inputs_raise_clear_errors() -> None:
    ring = Ring(1)
    try:
        c = ring.comms[0]
        with pytest.raises(ValueError, match="contiguous"):
            c.allreduce(torch.ones(4, 4).t())
        with pytest.raises(TypeError, match="dtype"):
            c.allreduce(np.ones(3, dtype=np.uint8))
        with pytest.raises(TypeError, match="numpy"):
            c.allreduce([1.0, 2.0])
        with pytest.raises(ValueError, match="writeable"):
            arr = np.ones(3, dtype=np.float32)
            arr.flags.writeable = False
            c.allreduce(arr)
        with pytest.raises(ValueError, match="root"):
            c.broadcast(np.ones(3), 5)
        with pytest.raises(ValueError, match="timeout"):
            c.allreduce(np.ones(3), timeout=0)
        assert c.failed is None  # bad input does not poison the communicator
        x = np.full(3, 2.0)
        assert c.allreduce(x, contribute=False) == 0 and np.all(x == 0)
        assert c.allreduce(x) == 1
    finally:
        ring.close()
    s = DataServer()
    try:
        with pytest.raises(ValueError, match="rank"):
            s.communicator(1, 0, 3, [s.addr])
        with pytest.raises(ValueError, match="HOST:PORT"):
            s.communicator(1, 0, 0, ["nohost"])
        s.communicator(2, 0, 0, [s.addr])
        with pytest.raises(ValueError, match="already exists"):
            s.communicator(2, 0, 0, [s.addr])
    finally:
        s.close()


def test_many_epochs_reuse_one_server_without_leaks(leak_check: None) -> None:
    ring = Ring(3)
    try:
        for epoch in range(2, 12):
            for c in ring.comms:
                c.close()
            ring.new_epoch(epoch)
            xs = [np.full(1000, float(r), dtype=np.float32) for r in range(3)]
            assert run_ranks([lambda r=r: ring.comms[r].allreduce(xs[r], tag=epoch) for r in range(3)]) == [3] * 3
            assert all(np.all(x == 3.0) for x in xs)
    finally:
        ring.close()


def _catch(fn):
    try:
        return fn()
    except BaseException as e:  # noqa: BLE001
        return e


def test_aborted_communicator_releases_threads_and_sockets_without_close() -> None:
    servers = [DataServer() for _ in range(3)]
    try:
        peers = [s.addr for s in servers]
        fds = open_fds()
        comms = [s.communicator(1, 0, r, peers) for r, s in enumerate(servers)]
        xs = [np.ones(1000, dtype=np.float32) for _ in range(3)]
        assert run_ranks([lambda r=r: comms[r].allreduce(xs[r]) for r in range(3)]) == [3] * 3
        assert open_fds() > fds and p2pft_threads()
        for c in comms:
            c.abort("superseded")  # the owner drops it without close()
        deadline = time.monotonic() + 3
        while (open_fds() > fds or [t for t in p2pft_threads() if "server" not in t]) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert [t for t in p2pft_threads() if "server" not in t] == []
        assert open_fds() <= fds
        # The same (epoch, shard) can be built again on the same servers.
        comms = [s.communicator(1, 0, r, peers) for r, s in enumerate(servers)]
        assert run_ranks([lambda r=r: comms[r].allreduce(xs[r]) for r in range(3)]) == [3] * 3
    finally:
        for s in servers:
            s.close()


@pytest.mark.parametrize("lanes", [1, 2])
def test_an_abort_after_the_right_neighbour_finished_ends_the_left_one_at_once(lanes: int, leak_check: None) -> None:
    # Rank 1 aborts as soon as rank 2 has its result: rank 1 has sent everything, but rank 0 is
    # still writing rank 1's last chunks. Rank 1 shuts its incoming connection, maybe while its
    # receive window is closed; rank 0's writes then block on a window that never opens (the
    # closed socket lingers and answers window probes without a reset). Rank 0 must see the
    # reverse direction end (error frame, EOF) instead of waiting out the op timeout, 30 s here.
    for i in range(8):
        ring = Ring(3, timeout=30.0, lanes=lanes)
        try:
            xs = [np.ones(8 << 20, dtype=np.float32) for _ in range(3)]

            def right_then_abort() -> int:
                n = ring.comms[2].allreduce(xs[2])
                ring.comms[1].abort("the right neighbour finished")
                return n

            t0 = time.monotonic()
            box = run_ranks([lambda: ring.comms[0].allreduce(xs[0]),
                             lambda: ring.comms[1].allreduce(xs[1]), right_then_abort],
                            timeout=20)
            assert time.monotonic() - t0 < 8, (i, box)
            assert box[2] == 3
            for r in (0, 1):
                assert box[r] == 3 or isinstance(box[r], CommAborted), (i, box)
        finally:
            ring.close()
