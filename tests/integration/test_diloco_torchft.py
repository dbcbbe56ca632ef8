"""Without failures, p2pft's DiLoCo and torchft 0.2.0's DiLoCo end at the same weights, from ONE
record: two p2pft DiLoCo replicas (real processes) train and record their initial weights and,
per sync, the samples each trained; two torchft DiLoCo replicas (real processes, a real Manager
and lighthouse) replay that record with the same model, inner AdamW, outer Nesterov SGD and H.
Their final global weights are compared with p2pft's."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchft", reason="torchft is not installed (pip install 'p2pft[compare]')")

import torch  # noqa: E402

from p2pft.chaos.torchft_system import lighthouse_command  # noqa: E402
from p2pft.deploy.ports import free_ports  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]
HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from diloco_replica import LR  # noqa: E402
from test_diloco import DiLoCoReplicas  # noqa: E402

SYNCS, H, BATCH = 6, 4, 4


def _p2pft_run(tmp: Path) -> DiLoCoReplicas:
    rs = DiLoCoReplicas(tmp, 2)
    for i in range(2):
        rs.spawn(i, f"r{i}", "--min-replicas", "2", "--syncs", str(SYNCS), "--sync-every", str(H),
                 "--batch", str(BATCH), "--step-delay", "0")
    try:
        rs.wait(lambda: all(p.poll() is not None for p in rs.procs.values()), 60, f"{SYNCS} syncs on both replicas",
                allow_exit=("r0", "r1"))
    finally:
        rcs = rs.stop_all()
    assert rcs == {"r0": 0, "r1": 0}, f"exit statuses {rcs}"
    return rs


def _torchft_run(tmp: Path, records: list[Path]) -> list[list[torch.Tensor]]:
    port = free_ports(1)[0]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    lh = subprocess.Popen(lighthouse_command(f"127.0.0.1:{port}", min_replicas=2), stdout=subprocess.DEVNULL,
                          stderr=open(tmp / "lighthouse.log", "wb"))
    procs = []
    try:
        for r, rec in enumerate(records):
            procs.append(subprocess.Popen(
                [sys.executable, str(HERE / "torchft_diloco_worker.py"), "--replica", str(r), "--lighthouse",
                 f"http://127.0.0.1:{port}", "--record", str(rec), "--out", str(tmp / f"tft{r}.pt")],
                stdout=subprocess.DEVNULL, stderr=open(tmp / f"tft{r}.log", "wb"), env=env))
        for r, p in enumerate(procs):
            rc = p.wait(timeout=90)
            assert rc == 0, f"torchft replica {r} exited with {rc}: {(tmp / f'tft{r}.log').read_text()[-2000:]}"
    finally:
        for p in procs + [lh]:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    return [torch.load(tmp / f"tft{r}.pt") for r in range(len(records))]


def test_p2pft_and_torchft_diloco_end_at_the_same_weights(tmp_path: Path) -> None:
    rs = _p2pft_run(tmp_path)
    records = []
    for i in range(2):
        syncs = rs.syncs(f"r{i}")
        assert [s["step"] for s in syncs] == list(range(1, SYNCS + 1)), syncs
        assert all(s["c"] and s["n"] == 2 and s["tr"] for s in syncs), f"a sync without both replicas: {syncs}"
        rec = tmp_path / f"record{i}.json"
        rec.write_text(json.dumps({"init": str(rs.stats[f"r{i}"]) + ".init.pt", "ranges": [s["tr"] for s in syncs],
                                   "sync_every": H, "batch": BATCH, "lr": LR}))
        records.append(rec)
    p2pft = [torch.load(str(rs.stats[f"r{i}"]) + ".final.pt") for i in range(2)]
    assert all(f["syncs"] == SYNCS for f in p2pft)
    assert all(torch.equal(a, b) for a, b in zip(p2pft[0]["weights"], p2pft[1]["weights"]))
    init = torch.load(str(rs.stats["r0"]) + ".init.pt")
    moved = max(float((a - b).abs().max()) for a, b in zip(p2pft[0]["weights"], init))
    assert moved > 1e-2, f"the global weights barely moved ({moved}): nothing was compared"
    torchft = _torchft_run(tmp_path, records)
    diff = max(float((a - b).abs().max()) for g in torchft for a, b in zip(g, p2pft[0]["weights"]))
    print(f"max abs difference p2pft vs torchft DiLoCo after {SYNCS} syncs: {diff:.3g} (weights moved {moved:.3g})")
    # Float tolerance: both compute the same pseudo-gradients with the same AdamW kernels; with two
    # replicas the sum of two pseudo-gradients does not depend on the order, and both divide it
    # by 2 (exact). What may differ is how each fuses the outer step's ops: a few float32 ulps.
    assert diff <= 1e-6, f"p2pft's and torchft's DiLoCo differ by {diff}"
