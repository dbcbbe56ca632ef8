"""nccl backend: import and input checks everywhere; real collectives only where CUDA + cupy exist."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from p2pft.transport import CommAborted, CommTimeout, NcclCommunicator, nccl_available

HAVE_NCCL = nccl_available()
gpu = pytest.mark.skipif(not HAVE_NCCL, reason="needs cupy with NCCL and a CUDA device")


def test_module_imports_without_cupy_or_torch() -> None:
    code = ("import sys; import p2pft.transport.nccl as n; import p2pft.transport.base; "
            "assert 'torch' not in sys.modules, 'torch imported'; assert 'cupy' not in sys.modules; "
            "print(n.nccl_available() in (True, False))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"


def test_argument_validation() -> None:
    with pytest.raises(ValueError, match="rank"):
        NcclCommunicator(0, 0, 2, 2, bytes(128))
    with pytest.raises(ValueError, match="128 bytes"):
        NcclCommunicator(0, 0, 0, 1, b"short")


def test_cpu_tensor_is_rejected() -> None:
    c = NcclCommunicator(0, 0, 0, 1, bytes(128), timeout=1.0)
    try:
        with pytest.raises(TypeError, match="CUDA"):
            c.allreduce(torch.ones(3))
    finally:
        c.close()


@gpu
@pytest.mark.gpu
def test_world_one_allreduce_broadcast_abort() -> None:
    from p2pft.transport import nccl_unique_id

    c = NcclCommunicator(1, 0, 0, 1, nccl_unique_id(), timeout=30.0)
    try:
        x = torch.arange(1001, dtype=torch.float32, device="cuda")
        assert c.allreduce(x, tag=3) == 1
        torch.testing.assert_close(x, torch.arange(1001, dtype=torch.float32, device="cuda"))
        assert c.allreduce(x, contribute=False) == 0
        assert torch.count_nonzero(x).item() == 0
        y = torch.ones(10, dtype=torch.bfloat16, device="cuda")
        c.broadcast(y, 0)
        assert torch.all(y == 1)
        c.abort("test")
        with pytest.raises(CommAborted):
            c.allreduce(x)
    finally:
        c.close()


@gpu
@pytest.mark.gpu
def test_missing_peer_times_out() -> None:
    from p2pft.transport import nccl_unique_id

    c = NcclCommunicator(1, 0, 0, 2, nccl_unique_id(), timeout=1.0)
    t0 = time.monotonic()
    try:
        with pytest.raises(CommTimeout):
            c.allreduce(torch.ones(4, device="cuda"))
        assert time.monotonic() - t0 < 3.0
    finally:
        c.close()


_TWO_RANK = r"""
import sys, torch
from p2pft.transport import NcclCommunicator
rank, uid = int(sys.argv[1]), bytes.fromhex(sys.argv[2])
torch.cuda.set_device(rank)
c = NcclCommunicator(1, 0, rank, 2, uid, timeout=60.0)
x = torch.full((1 << 20,), float(rank + 1), device="cuda")
n = c.allreduce(x, contribute=True, tag=5)
assert n == 2 and torch.all(x == 3.0), (n, x[:4])
c.close()
print("ok")
"""


@gpu
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_processes_two_gpus() -> None:
    from p2pft.transport import nccl_unique_id

    uid = nccl_unique_id().hex()
    procs = [subprocess.Popen([sys.executable, "-c", _TWO_RANK, str(r), uid], stdout=subprocess.PIPE, text=True)
             for r in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0] and all("ok" in o for o in outs)
