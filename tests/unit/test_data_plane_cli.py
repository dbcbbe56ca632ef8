"""The example replica refuses an impossible data plane with one line and exit status 2."""
from __future__ import annotations

import subprocess
import sys

import pytest

from p2pft.transport.backend import probe_nccl


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_replica_refuses_nccl_where_it_cannot_work(device: str) -> None:
    if device == "cuda" and probe_nccl().ok:
        pytest.skip("NCCL works on this machine")
    out = subprocess.run([sys.executable, "-m", "p2pft.trainer.examples.replica", "--replica-id", "r0",
                          "--device", device, "--data-plane", "nccl"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("replica: data_plane='nccl'"), out.stderr
    assert "Traceback" not in out.stderr
