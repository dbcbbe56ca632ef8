"""``p2pft chaos --data-plane nccl`` where the NCCL plane cannot work: one clear error, not a table.

The example replica keeps its step buffer on the CPU, so an explicit NCCL data plane cannot work
on any machine (with or without CUDA): every replica exits at once with one line saying so. The
harness used to wait for them, print a table of dashes and exit 0.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

OWN_RING_LOOP = True
pytestmark = pytest.mark.slow


def test_chaos_on_a_data_plane_that_cannot_work_exits_1_naming_the_replica_error(tmp_path: Path) -> None:
    env = dict(os.environ)
    env.pop("P2PFT_DEVICE_MODULE", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                        if p and not p.rstrip("/").endswith("fakes"))
    out = subprocess.run([sys.executable, "-m", "p2pft.cli", "chaos", "--data-plane", "nccl", "--systems", "p2pft",
                          "--replicas", "2", "--duration", "20", "--no-live", "--out", str(tmp_path / "chaos")],
                         capture_output=True, text=True, timeout=150, env=env)
    assert out.returncode == 1, (out.returncode, out.stdout[-2000:], out.stderr[-2000:])
    err = [ln for ln in out.stderr.splitlines() if ln.startswith("p2pft chaos: error:")]
    assert len(err) == 1, out.stderr[-3000:]
    assert "cannot train" in err[0] and "exited with status" in err[0], err
    assert "data_plane='nccl'" in err[0], err   # the replica's own line
    assert not (tmp_path / "chaos" / "chaos.json").exists()
