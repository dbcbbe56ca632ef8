"""An explicit ``data_plane="nccl"`` job whose replicas share one device stops with one clear error.

NCCL refuses two ranks of a communicator on one GPU; under ``auto`` such a communicator uses the
TCP ring, but an explicit ``nccl`` cannot work, and retrying (new data epoch, new communicator,
the same refusal) would go on until the step timeout while blaming a healthy peer. Two example
replicas on the CPU stand-in (``tests/fakes`` on ``PYTHONPATH``), given the same fake device.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from p2pft.deploy.ports import free_ports

OWN_RING_LOOP = True   # the ring loop is not what this is about: run once
FAKES = Path(__file__).resolve().parent.parent / "fakes"
pytestmark = pytest.mark.slow


def test_explicit_nccl_on_one_shared_device_stops_every_replica(tmp_path: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", P2PFT_FAKE_GPU="0")
    env["PYTHONPATH"] = os.pathsep.join([str(FAKES)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.pop("P2PFT_DATA_PLANE", None)
    addrs = [f"127.0.0.1:{p}" for p in free_ports(2)]
    procs = {}
    for i in range(2):
        log = open(tmp_path / f"r{i}.log", "wb")
        procs[i] = subprocess.Popen(
            [sys.executable, "-m", "p2pft.trainer.examples.replica", "--replica-id", f"r{i}", "--listen", addrs[i],
             "--seeds", addrs[1 - i], "--stats", str(tmp_path / f"r{i}.jsonl"), "--data-plane", "nccl",
             "--batch", "4", "--log-level", "INFO", "--comm-timeout", "5", "--loop-timeout", "20",
             "--step-timeout", "30"],  # on the old code: retried until this, then StepTimeout (exit 3)
            stdout=subprocess.DEVNULL, stderr=log, env=env)
        log.close()
    deadline = time.monotonic() + 50
    try:
        rcs = {i: p.wait(timeout=max(1.0, deadline - time.monotonic())) for i, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(10)
    for i, rc in rcs.items():
        text = (tmp_path / f"r{i}.log").read_text()
        errors = [line for line in text.splitlines() if " ERROR " in line]
        assert rc == 2, f"r{i} exited {rc}: {text[-3000:]}"
        assert len(errors) == 1, errors
        assert "SharedDevice" in errors[0] and "one device" in errors[0] and "data_plane='tcp'" in errors[0], errors
        assert "StepTimeout" not in text and "Traceback" not in text, text[-3000:]
        exits = [json.loads(line) for line in (tmp_path / f"r{i}.jsonl").read_text().splitlines()
                 if '"exit"' in line]
        assert exits and exits[-1]["error"] == "data_plane", exits
