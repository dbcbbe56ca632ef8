"""Choice of the data-plane backend: the table with given probe results, the errors with the real probe."""

from __future__ import annotations

import subprocess
import sys

import pytest

from p2pft.transport.backend import (
    ENV_DATA_PLANE, Backend, DataPlane, DataPlaneError, NcclSupport, check_data_plane, choose_backend,
    data_plane_from, probe_nccl,
)

OK = NcclSupport(cupy=True, nccl=True, devices=2)
NO_CUPY = NcclSupport(cupy=False, nccl=False, devices=0, detail="ModuleNotFoundError: No module named 'cupy'")
NO_NCCL = NcclSupport(cupy=True, nccl=False, devices=1, detail="cupy.cuda.nccl.available is False")
NO_DEVICE = NcclSupport(cupy=True, nccl=True, devices=0, detail="cudaErrorNoDevice")

REAL = probe_nccl()


@pytest.mark.parametrize("plane,device,support,want", [
    (DataPlane.AUTO, "cuda", OK, Backend.NCCL_AUTO),
    (DataPlane.AUTO, "cpu", OK, Backend.TCP),
    (DataPlane.AUTO, "cuda", NO_CUPY, Backend.TCP),
    (DataPlane.AUTO, "cuda", NO_NCCL, Backend.TCP),
    (DataPlane.AUTO, "cuda", NO_DEVICE, Backend.TCP),
    (DataPlane.TCP, "cuda", OK, Backend.TCP),
    (DataPlane.TCP, "cpu", NO_CUPY, Backend.TCP),
    (DataPlane.NCCL, "cuda", OK, Backend.NCCL),
])
def test_choice_table(plane: DataPlane, device: str, support: NcclSupport, want: Backend) -> None:
    assert choose_backend(plane, device, support) is want


@pytest.mark.parametrize("device,support,words", [
    ("cpu", OK, "CUDA device"),
    ("cuda", NO_CUPY, "CuPy is not importable"),
    ("cuda", NO_NCCL, "no usable NCCL"),
    ("cuda", NO_DEVICE, "no CUDA device"),
])
def test_nccl_where_it_cannot_work_is_one_error(device: str, support: NcclSupport, words: str) -> None:
    with pytest.raises(DataPlaneError, match=words):
        choose_backend(DataPlane.NCCL, device, support)


def test_parse_argument_env_and_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_DATA_PLANE, raising=False)
    assert data_plane_from(None) is DataPlane.AUTO
    assert data_plane_from("TCP") is DataPlane.TCP
    assert data_plane_from(DataPlane.NCCL) is DataPlane.NCCL
    monkeypatch.setenv(ENV_DATA_PLANE, "tcp")
    assert data_plane_from(None) is DataPlane.TCP
    assert data_plane_from("auto") is DataPlane.AUTO  # the argument wins
    monkeypatch.setenv(ENV_DATA_PLANE, "gloo")
    with pytest.raises(DataPlaneError, match=r"unknown data plane 'gloo' \(from \$P2PFT_DATA_PLANE\)"):
        data_plane_from(None)
    with pytest.raises(DataPlaneError, match="choose one of 'auto', 'nccl', 'tcp'"):
        data_plane_from("mpi")


@pytest.mark.skipif(REAL.ok, reason="this machine has CuPy, NCCL and a CUDA device")
def test_real_probe_refuses_nccl_here() -> None:
    """With the real probe on a machine without a usable GPU: a clear reason, auto falls back."""
    assert not REAL.ok
    with pytest.raises(DataPlaneError) as e:
        check_data_plane(DataPlane.NCCL)
    msg = str(e.value)
    assert "data_plane='nccl' cannot work here" in msg and "data_plane='tcp'" in msg
    assert ("CuPy is not importable" in msg) == (not REAL.cupy)
    assert ("no CUDA device" in msg) == (REAL.cupy and REAL.nccl)
    with pytest.raises(DataPlaneError, match="cannot work here"):
        choose_backend(DataPlane.NCCL, "cuda")
    with pytest.raises(DataPlaneError, match="on 'cpu'"):
        choose_backend(DataPlane.NCCL, "cpu")
    assert choose_backend(DataPlane.AUTO, "cuda") is Backend.TCP
    check_data_plane(DataPlane.AUTO)
    check_data_plane(DataPlane.TCP)


@pytest.mark.skipif(REAL.ok, reason="this machine has CuPy, NCCL and a CUDA device")
def test_runtime_refuses_nccl_before_binding_anything() -> None:
    """Runtime(data_plane='nccl') without a usable GPU: one error from start(), no port bound,
    no thread started; a bad name already fails in the constructor."""
    code = r"""
import threading
from p2pft import Runtime
from p2pft.transport.backend import DataPlaneError
try:
    Runtime(replica_id="r", data_plane="mpi")
    raise SystemExit("no error for a bad name")
except DataPlaneError as e:
    print("name:", e)
before = set(threading.enumerate())
rt = Runtime(replica_id="r", data_plane="nccl")
try:
    rt.start()
    raise SystemExit("started")
except DataPlaneError as e:
    print("start:", e)
assert rt.data is None and rt.server is None, "something was bound"
assert set(threading.enumerate()) == before, "a thread was started"
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[-1] == "ok"
    assert any(line.startswith("name: unknown data plane 'mpi'") for line in lines)
    assert any(line.startswith("start: data_plane='nccl' cannot work here") for line in lines)


def test_env_reaches_the_runtime(monkeypatch: pytest.MonkeyPatch) -> None:
    from p2pft import Runtime

    monkeypatch.setenv(ENV_DATA_PLANE, "tcp")
    assert Runtime(replica_id="r").data_plane is DataPlane.TCP
    assert Runtime(replica_id="r", data_plane="auto").data_plane is DataPlane.AUTO
