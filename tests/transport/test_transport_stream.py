"""State streaming: round trip, corruption detection, donor failures, rate cap, bounded memory."""

from __future__ import annotations

import threading
import time
import tracemalloc

import pytest
import torch

from p2pft.transport import CommError, DataServer, PeerFailed, ProtocolMismatch, StateSnapshot, fetch_state
from transport_testutil import open_fds


def _snapshot() -> StateSnapshot:
    g = torch.Generator().manual_seed(0)
    return StateSnapshot(
        meta={"step": 42, "cursor": [3, 7], "name": "r1"},
        tensors={
            "w": torch.randn(513, 77, generator=g),
            "b16": torch.randn(1001, generator=g).to(torch.bfloat16),
            "ids": torch.arange(-5, 12345, dtype=torch.int64).reshape(5, -1),
            "scalar": torch.tensor(3.5, dtype=torch.float64),
            "empty": torch.empty(0, 4, dtype=torch.float32),
        },
    )


@pytest.fixture
def donor():
    s = DataServer(state_chunk_bytes=64 << 10)
    yield s
    s.close()


def test_receive_into_existing_tensors(donor: DataServer) -> None:
    snap = _snapshot()
    donor.serve_state(lambda req: snap)
    mine = {"w": torch.zeros(513, 77), "ids": torch.zeros(3, 3, dtype=torch.int64)}  # ids: wrong shape
    w = mine["w"]
    got = fetch_state(donor.addr, {}, into=mine, timeout=10)
    assert got.tensors["w"] is w and torch.equal(w, snap.tensors["w"])
    assert got.tensors["ids"] is not mine["ids"] and torch.equal(got.tensors["ids"], snap.tensors["ids"])


def test_round_trip_dtypes_shapes_meta(donor: DataServer) -> None:
    snap = _snapshot()
    seen: list[dict] = []
    donor.serve_state(lambda req: seen.append(req) or snap)
    got = fetch_state(donor.addr, {"from_step": 40}, timeout=10)
    assert seen == [{"from_step": 40}]
    assert got.meta == snap.meta
    assert list(got.tensors) == list(snap.tensors)
    for k, t in snap.tensors.items():
        assert got.tensors[k].dtype == t.dtype and got.tensors[k].shape == t.shape, k
        assert torch.equal(got.tensors[k], t), k


def test_corrupted_chunk_is_detected(donor: DataServer) -> None:
    donor.serve_state(lambda req: _snapshot())

    def flip(seq: int, payload: memoryview) -> bytes:
        if seq != 2:
            return payload
        b = bytearray(payload)
        b[len(b) // 2] ^= 0x10
        return bytes(b)

    donor.state_chunk_hook = flip
    with pytest.raises(ProtocolMismatch, match="crc32"):
        fetch_state(donor.addr, {}, timeout=10)
    donor.state_chunk_hook = None
    assert torch.equal(fetch_state(donor.addr, {}, timeout=10).tensors["w"], _snapshot().tensors["w"])


def test_donor_dies_mid_stream(donor: DataServer) -> None:
    donor.serve_state(lambda req: _snapshot())

    def die(seq: int, payload: memoryview) -> memoryview:
        if seq == 3:
            raise RuntimeError("donor crashed")
        return payload

    donor.state_chunk_hook = die
    with pytest.raises(PeerFailed) as ei:
        fetch_state(donor.addr, {}, timeout=10)
    assert ei.value.peer_addr == donor.addr


def test_no_snapshot_and_no_provider(donor: DataServer) -> None:
    with pytest.raises(CommError, match="serves no state"):
        fetch_state(donor.addr, {}, timeout=5)
    donor.serve_state(lambda req: None)
    with pytest.raises(CommError, match="no snapshot"):
        fetch_state(donor.addr, {}, timeout=5)
    donor.serve_state(lambda req: 1 / 0)
    with pytest.raises(CommError, match="provider failed"):
        fetch_state(donor.addr, {}, timeout=5)


def test_secret_required() -> None:
    s = DataServer(secret=b"k1")
    try:
        s.serve_state(lambda req: _snapshot())
        with pytest.raises(ProtocolMismatch):
            fetch_state(s.addr, {}, timeout=5)
        with pytest.raises(ProtocolMismatch):
            fetch_state(s.addr, {}, secret=b"k2", timeout=5)
        assert fetch_state(s.addr, {}, secret=b"k1", timeout=5).meta["step"] == 42
    finally:
        s.close()


def test_unreachable_donor() -> None:
    s = DataServer()
    addr = s.addr
    s.close()
    with pytest.raises(PeerFailed):
        fetch_state(addr, {}, timeout=2)


def test_stalled_donor_times_out(donor: DataServer) -> None:
    release = threading.Event()

    def slow(req: dict) -> StateSnapshot:
        release.wait(5)
        return _snapshot()

    donor.serve_state(slow)
    t0 = time.monotonic()
    try:
        with pytest.raises(CommError) as ei:
            fetch_state(donor.addr, {}, timeout=0.5)
        assert type(ei.value).__name__ == "CommTimeout"
        assert 0.4 < time.monotonic() - t0 < 2.0
    finally:
        release.set()


def test_rate_limit_is_honoured(donor: DataServer) -> None:
    snap = StateSnapshot(meta={}, tensors={"x": torch.zeros(4 << 20, dtype=torch.uint8)})
    donor.serve_state(lambda req: snap)
    t0 = time.monotonic()
    fetch_state(donor.addr, {}, rate_limit_bytes_per_s=16e6, timeout=10)
    assert time.monotonic() - t0 >= 0.2  # 4 MiB at 16 MB/s is >= 0.26 s
    donor.state_rate_limit = 16e6
    t0 = time.monotonic()
    fetch_state(donor.addr, {}, timeout=10)
    assert time.monotonic() - t0 >= 0.2


def test_python_heap_stays_small_for_large_snapshot(donor: DataServer) -> None:
    """Neither side copies payloads through Python buffers: beyond the received tensors, a 64 MB
    move allocates well under 16 MB of traced memory (bytearrays, bytes and numpy are traced)."""
    snap = StateSnapshot(meta={}, tensors={f"t{i}": torch.ones(4 << 20, dtype=torch.float32) for i in range(4)})
    donor.serve_state(lambda req: snap)
    fds = open_fds()
    tracemalloc.start()
    try:
        got = fetch_state(donor.addr, {}, timeout=30)
        _cur, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    received = sum(t.numel() * t.element_size() for t in got.tensors.values())
    assert peak - received < 16 << 20, (peak, received)  # the result itself may be numpy-allocated
    assert all(torch.equal(got.tensors[k], snap.tensors[k]) for k in snap.tensors)
    time.sleep(0.1)
    assert open_fds() <= fds
