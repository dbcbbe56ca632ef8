"""Without failures, torchft 0.2.0's DiLoCo ends at the weights of the DiLoCo algorithm that
p2pft's DiLoCo matches bitwise (tests/trainer/test_diloco_algorithm.py): same initial weights,
data order, inner AdamW, outer Nesterov SGD and H, two replicas."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchft", reason="torchft is not installed (pip install 'p2pft[compare]')")

import torch  # noqa: E402

from p2pft.chaos.torchft_system import lighthouse_command  # noqa: E402
from p2pft.deploy.ports import free_ports  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]
HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent / "trainer"))
from test_diloco_algorithm import B, reference  # noqa: E402

SYNCS, H = 4, 3


def test_torchft_diloco_ends_at_the_same_weights(tmp_path: Path) -> None:
    port = free_ports(1)[0]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    lh = subprocess.Popen(lighthouse_command(f"127.0.0.1:{port}", min_replicas=2), stdout=subprocess.DEVNULL,
                          stderr=open(tmp_path / "lighthouse.log", "wb"))
    procs = []
    try:
        for r in range(2):
            procs.append(subprocess.Popen(
                [sys.executable, str(HERE / "torchft_diloco_worker.py"), "--replica", str(r), "--lighthouse",
                 f"http://127.0.0.1:{port}", "--syncs", str(SYNCS), "--sync-every", str(H), "--out",
                 str(tmp_path / f"w{r}.pt")], stdout=subprocess.DEVNULL,
                stderr=open(tmp_path / f"r{r}.log", "wb"), env=env))
        for r, p in enumerate(procs):
            rc = p.wait(timeout=90)
            assert rc == 0, f"torchft replica {r} exited with {rc}: {(tmp_path / f'r{r}.log').read_text()[-2000:]}"
    finally:
        for p in procs + [lh]:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    got = [torch.load(tmp_path / f"w{r}.pt") for r in range(2)]
    trained = [[[((2 * s + r) * H * B, (2 * s + r + 1) * H * B)] for s in range(SYNCS)] for r in range(2)]
    want = reference(trained, H, 1, 0, 0.0)
    diff = max(float((a - b).abs().max()) for g in got for a, b in zip(g, want))
    # float tolerance: Gloo sums the two pseudo-gradients and torchft divides by the participants,
    # as the ring does; anything else (order, a fused op) moves only the last bits
    assert diff <= 1e-6, f"torchft's DiLoCo differs from the algorithm (and p2pft's DiLoCo) by {diff}"
