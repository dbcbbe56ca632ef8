"""bench/gpu_check.py: without a GPU it says so and exits 0; on the CPU stand-in it runs every
two-rank NCCL scenario end to end (how CI keeps the script working where no GPU is)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_check.py"
FAKES = ROOT / "tests" / "fakes"


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, **extra)
    env.pop("P2PFT_DEVICE_MODULE", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                        if p and not p.rstrip("/").endswith("fakes"))
    return env


def test_without_a_gpu_it_says_so_and_exits_0(tmp_path: Path) -> None:
    out_json = tmp_path / "results" / "gpu.json"   # the folder is made
    env = _env(CUDA_VISIBLE_DEVICES="")  # no device, also on a GPU machine
    out = subprocess.run([sys.executable, str(SCRIPT), "--json", str(out_json)], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert "no GPU found" in out.stdout
    assert json.loads(out_json.read_text()) == {"gpus": 0, "checks": {}}


@pytest.mark.slow
def test_every_two_rank_scenario_runs_on_the_stand_in(tmp_path: Path) -> None:
    env = _env(CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join([str(FAKES)] + ([env["PYTHONPATH"]] if env["PYTHONPATH"] else []))
    out_json = tmp_path / "gpu.json"
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, str(SCRIPT), "--json", str(out_json), "--tmp", str(tmp_path / "logs")],
                         capture_output=True, text=True, timeout=150, env=env)
    took = time.monotonic() - t0
    res = json.loads(out_json.read_text())
    assert out.returncode == 0, (out.stdout[-3000:], json.dumps(res)[-3000:])
    assert "on the CPU stand-in, all checks passed" in out.stdout, out.stdout
    assert res["standin"] and res["versions"]["cupy"].endswith("-fake") and res["versions"]["nccl_cupy"] > 0
    names = {f"pair_one_gpu_{s}" for s in ("sum", "count_mismatch", "slow_first_step", "kill_peer", "stop_peer",
                                           "close_during", "fast_forward", "auto_epochs")}
    assert set(res["checks"]) == names, sorted(res["checks"])
    assert all(c["ok"] for c in res["checks"].values())
    stop = res["checks"]["pair_one_gpu_stop_peer"]
    assert stop["ranks"][0]["error"] == "CommTimeout" and stop.get("watchdog_exit"), stop   # the stand-in's abort hangs
    assert res["checks"]["pair_one_gpu_auto_epochs"]["ranks"][0]["fell_back"] == 30
    assert took < 90, took
