"""Device tensors in state streams: the chunk logic (with a CPU pair) and, on a GPU, the real path."""

from __future__ import annotations

import pytest
import torch

from p2pft.transport import DataServer, StateSnapshot, fetch_state
from p2pft.transport.devcopy import DeviceSink, DeviceSource, PinnedPair, iter_chunks


@pytest.mark.parametrize("dtype,n,chunk", [(torch.bfloat16, 1001, 64), (torch.float32, 16, 64), (torch.int64, 0, 8)])
def test_chunks_out_and_in(dtype: torch.dtype, n: int, chunk: int) -> None:
    src = (torch.arange(n) * 7 % 251).to(dtype)
    pair = PinnedPair(chunk, "cpu")
    assert pair.nbytes == 2 * chunk
    dst = torch.zeros_like(src)
    sink = DeviceSink(dst, pair)
    offs = []
    for off, payload in iter_chunks(DeviceSource(src, pair), chunk):
        assert payload.nbytes <= chunk
        offs.append(off)
        view = sink.buffer(payload.nbytes)
        view[:] = payload
        sink.commit(off, payload.nbytes)
    pair.finish()
    assert offs == list(range(0, src.numel() * src.element_size(), chunk))
    assert torch.equal(dst, src)


def _serve(tensors: dict[str, torch.Tensor], chunk: int) -> DataServer:
    s = DataServer("127.0.0.1", 0)
    s.state_chunk_bytes = chunk
    s.serve_state(lambda req: StateSnapshot(meta={"step": 3}, tensors=tensors))
    return s


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_snapshot_into_cuda_tensors() -> None:
    src = {"w": torch.randn(1_000_003, device="cuda"), "b": torch.arange(10, device="cuda").to(torch.bfloat16)}
    into = {k: torch.zeros_like(v) for k, v in src.items()}
    s = _serve(src, 1 << 20)
    try:
        snap = fetch_state(s.addr, {}, into=into, timeout=30.0)
    finally:
        s.close()
    assert snap.tensors["w"] is into["w"] and snap.meta["_staging_bytes"] == 2 << 20
    assert all(torch.equal(into[k], src[k]) for k in src)
