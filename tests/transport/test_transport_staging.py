"""CUDA tensors on the tcp backend: the piece schedule, run over real rings with CPU staging.

`staged_allreduce` with a `HostStager` runs exactly the schedule and ring operations a CUDA
tensor takes (only the copies are synchronous CPU copies), so its results and its schedule are
checked here without a GPU; the CUDA copies themselves are checked by bench/gpu_check.py and
the `gpu` test below.
"""

from __future__ import annotations

import pytest
import torch

from p2pft.transport import DataServer
from p2pft.transport.staging import HostStager, Piece, StagingTcpCommunicator, plan_pieces, run_pieces

from transport_testutil import run_ranks


def test_plan_pieces() -> None:
    assert plan_pieces(10, 4, 16) == [Piece(0, 0, 4), Piece(1, 4, 8), Piece(2, 8, 10)]
    assert plan_pieces(0, 4, 16) == [Piece(0, 0, 0)]
    assert plan_pieces(3, 2, 1) == [Piece(0, 0, 1), Piece(1, 1, 2), Piece(2, 2, 3)]  # at least one element
    pieces = plan_pieces(1_000_003, 2, 1 << 16)
    assert pieces[0].start == 0 and pieces[-1].stop == 1_000_003
    assert all(a.stop == b.start for a, b in zip(pieces, pieces[1:]))
    assert max(p.numel for p in pieces) * 2 <= 1 << 16


def test_schedule_overlaps_and_never_reuses_a_busy_slot() -> None:
    t = torch.arange(10, dtype=torch.float32)
    st = HostStager(t, piece_bytes=16)
    seen: list[list[float]] = []

    def op(host: torch.Tensor) -> int:
        seen.append(host.tolist())
        host.mul_(2)
        return 3
    assert run_pieces(plan_pieces(10, 4, 16), st, op, copy_down=True, copy_up=True) == 3
    assert seen == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert t.tolist() == [2 * i for i in range(10)]
    # Piece k+1 is copied down before piece k's operation (overlap), into the other slot.
    assert st.log == [("down", 0, 0), ("down", 1, 1), ("wait", 0, -1), ("up", 0, 0),
                      ("down", 2, 0), ("wait", 1, -1), ("up", 1, 1),
                      ("wait", 2, -1), ("up", 2, 0), ("finish", -1, -1)]
    # Without copies down (a joiner, a broadcast receiver) each slot is reused only after
    # its last copy up finished.
    st2 = HostStager(t, piece_bytes=16)
    run_pieces(plan_pieces(10, 4, 16), st2, lambda h: h.fill_(1), copy_down=False, copy_up=True)
    assert [e for e in st2.log if e[0] in ("reuse", "up")] == [
        ("reuse", -1, 0), ("up", 0, 0), ("reuse", -1, 1), ("up", 1, 1), ("reuse", -1, 0), ("up", 2, 0)]
    assert t.tolist() == [1.0] * 10


@pytest.fixture
def ring3() -> list[StagingTcpCommunicator]:
    servers = [DataServer("127.0.0.1", 0, secret=b"s") for _ in range(3)]
    peers = [s.addr for s in servers]
    comms = [s.communicator(1, 0, r, peers) for r, s in enumerate(servers)]
    assert all(isinstance(c, StagingTcpCommunicator) for c in comms)
    yield comms  # type: ignore[misc]
    for c in comms:
        c.close()
    for s in servers:
        s.close()


@pytest.mark.parametrize("dtype,n,piece", [(torch.float32, 100_003, 1 << 16), (torch.bfloat16, 5_000, 4096),
                                           (torch.float64, 0, 1024), (torch.int64, 7, 8)])
def test_staged_allreduce_over_a_real_ring(ring3: list[StagingTcpCommunicator], dtype: torch.dtype, n: int,
                                           piece: int) -> None:
    for c in ring3:
        c.piece_bytes = piece
    xs = [(torch.arange(n, dtype=torch.float64) * (r + 1) % 97).to(dtype) for r in range(3)]
    want = xs[0].double() + xs[2].double()  # rank 1 does not contribute
    stagers = [HostStager(x, piece) for x in xs]
    got = run_ranks([lambda r=r: ring3[r].staged_allreduce(xs[r], tag=5, contribute=r != 1, stager=stagers[r])
                     for r in range(3)])
    assert got == [2, 2, 2]
    for x in xs:
        assert torch.equal(x.double(), want.to(dtype).double())
    assert len([e for e in stagers[0].log if e[0] == "up"]) == len(plan_pieces(n, xs[0].element_size(), piece))
    assert not any(e[0] == "down" for e in stagers[1].log)  # a non-contributor copies nothing down


def test_staged_broadcast_over_a_real_ring(ring3: list[StagingTcpCommunicator]) -> None:
    for c in ring3:
        c.piece_bytes = 4096
    xs = [torch.full((10_000,), float(r)) for r in range(3)]
    stagers = [HostStager(x, 4096) for x in xs]
    run_ranks([lambda r=r: ring3[r].staged_broadcast(xs[r], 2, stager=stagers[r]) for r in range(3)])
    assert all(torch.all(x == 2.0) for x in xs)
    assert not any(e[0] == "up" for e in stagers[2].log) and not any(e[0] == "down" for e in stagers[0].log)
    # The ring is still usable afterwards for CPU tensors on the zero-copy path.
    ys = [torch.ones(1000) for _ in range(3)]
    assert run_ranks([lambda r=r: ring3[r].allreduce(ys[r]) for r in range(3)]) == [3, 3, 3]


def test_world_one_and_bad_input() -> None:
    s = DataServer("127.0.0.1", 0)
    c = s.communicator(1, 0, 0, [s.addr])
    try:
        x = torch.ones(10)
        assert c.staged_allreduce(x, contribute=False, stager=HostStager(x, 16)) == 0
        assert torch.count_nonzero(x) == 0
        with pytest.raises(ValueError, match="contiguous"):
            c.staged_allreduce(torch.ones(4, 4).t(), stager=HostStager(torch.ones(16), 16))
        assert c.failed is None
    finally:
        c.close()
        s.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_over_tcp() -> None:
    servers = [DataServer("127.0.0.1", 0) for _ in range(2)]
    peers = [s.addr for s in servers]
    comms = [s.communicator(1, 0, r, peers) for r, s in enumerate(servers)]
    try:
        for c in comms:
            c.piece_bytes = 1 << 20
        xs = [torch.full((3_000_001,), float(r + 1), device="cuda") for r in range(2)]
        assert run_ranks([lambda r=r: comms[r].allreduce(xs[r], tag=1) for r in range(2)]) == [2, 2]
        assert all(bool(torch.all(x == 3.0)) for x in xs)
    finally:
        for c in comms:
            c.close()
        for s in servers:
            s.close()
