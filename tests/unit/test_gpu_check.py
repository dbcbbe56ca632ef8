"""bench/gpu_check.py on a machine (or a process) without a GPU: says so, exits 0, writes its JSON."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu_check.py"


def test_without_a_gpu_it_says_so_and_exits_0(tmp_path: Path) -> None:
    out_json = tmp_path / "results" / "gpu.json"   # the folder is made
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # no device, also on a GPU machine
    out = subprocess.run([sys.executable, str(SCRIPT), "--json", str(out_json)], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert "no GPU found" in out.stdout
    assert json.loads(out_json.read_text()) == {"gpus": 0, "checks": {}}
