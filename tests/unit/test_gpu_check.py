"""bench/gpu_check.py: without a GPU it says so and exits 0; on the CPU stand-in it runs the
preflight and every scenario that needs no real GPU end to end, each row saying what was
injected and what was seen (how CI keeps the script working where no GPU is); the preflight
catches a second libnccl in the process."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_check.py"
FAKES = ROOT / "tests" / "fakes"

#: what the stand-in runs: every scenario of one GPU that needs no real CUDA (bench/gpu_check.py)
STANDIN = {"nccl_one_rank", "stream_order"} | {f"pair_one_gpu_{s}" for s in (
    "sum", "count_mismatch", "slow_first_step", "kill_peer", "stop_peer", "stop_peer_watchdog", "close_during",
    "peer_dies_before_init", "catchup_cuda", "fast_forward", "churn", "diloco", "auto_epochs")}


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, **extra)
    env.pop("P2PFT_DEVICE_MODULE", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                        if p and not p.rstrip("/").endswith("fakes"))
    return env


def _scenarios() -> ModuleType:
    """bench/gpu_scenarios.py, the rank side of the script (the preflight lives there)."""
    bench = str(ROOT / "bench")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    import gpu_scenarios
    return gpu_scenarios


def test_without_a_gpu_it_says_so_and_exits_0(tmp_path: Path) -> None:
    out_json = tmp_path / "results" / "gpu.json"   # the folder is made
    env = _env(CUDA_VISIBLE_DEVICES="")  # no device, also on a GPU machine
    out = subprocess.run([sys.executable, str(SCRIPT), "--json", str(out_json)], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert "no GPU found" in out.stdout
    assert json.loads(out_json.read_text()) == {"gpus": 0, "checks": {}}


@pytest.mark.slow
def test_every_stand_in_scenario_says_what_it_injected_and_saw(tmp_path: Path) -> None:
    env = _env(CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join([str(FAKES)] + ([env["PYTHONPATH"]] if env["PYTHONPATH"] else []))
    out_json = tmp_path / "out" / "gpu_check.json"
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, str(SCRIPT), "--json", str(out_json), "--tmp", str(tmp_path / "logs")],
                         capture_output=True, text=True, timeout=170, env=env)
    took = time.monotonic() - t0
    res = json.loads(out_json.read_text())
    why = {n: r.get("why") for n, r in res["checks"].items() if not r.get("ok")}
    assert out.returncode == 0, (out.stdout[-3000:], json.dumps(why)[-3000:])
    assert "on the CPU stand-in, all checks passed" in out.stdout, out.stdout
    assert res["standin"] and res["ok"] and res["preflight"]["ok"]
    assert res["versions"]["cupy"].endswith("-fake") and res["versions"]["nccl_cupy"]
    assert set(res["checks"]) == STANDIN, sorted(res["checks"])
    for name, row in res["checks"].items():
        assert isinstance(row["injected"], str) and row["injected"], name
        assert isinstance(row["expect"], str) and row["expect"], name
        assert isinstance(row["observed"], dict) and row["observed"].get("rank0") is not None, name
        assert row["ok"] is True and row["why"] == [], (name, row)
    obs: dict[str, Any] = {n[len("pair_one_gpu_"):] if n.startswith("pair_") else n: r["observed"]
                           for n, r in res["checks"].items()}
    # The faults were injected once the collective spun, and the outcomes are the claimed ones.
    assert obs["kill_peer"]["rank0"]["spinning_s"] >= 0.5 and obs["kill_peer"]["exits"][1] == -9
    assert obs["kill_peer"]["rank0"]["raised_after_fault_s"] < 5.0
    assert obs["stop_peer"]["rank0"]["error"] == "CommTimeout" and obs["stop_peer"]["rank0"]["released"]
    assert obs["stop_peer_watchdog"]["exits"][0] == 4   # the watchdog's branch, reached
    assert obs["close_during"]["rank0"]["released"]
    assert obs["slow_first_step"]["rank0"]["host_not_blocked"]["compute_running_at_return"]
    assert obs["catchup_cuda"]["rank1"]["control_without_after"]["values"]["-1.0"] > 0
    assert obs["auto_epochs"]["rank0"]["fell_back"] == 30
    assert obs["churn"]["rank0"]["epochs"] >= 30
    # Every process's log is in the one tar file beside the JSON.
    with tarfile.open(out_json.parent / "gpu_check_logs.tar.gz") as tf:
        names = set(tf.getnames())
    for name in STANDIN:
        assert f"gpu_check_logs/{name}/rank0.log" in names, name
    assert took < 150, took   # about 50 s on 2 idle cores


def _maps(*paths: str) -> list[str]:
    return [f"7f0000{i:03x}000-7f0000{i:03x}fff r-xp 00000000 08:01 {1000 + i}                    {p}"
            for i, p in enumerate(paths)] + ["7ffd0000-7ffd1000 rw-p 00000000 00:00 0                  [stack]"]


TORCH_NCCL = "/venv/lib/python3.12/site-packages/nvidia/nccl/lib/libnccl.so.2"
CUPY_NCCL = "/root/.cupy/cuda_lib/12.x/nccl/2.21.5/lib/libnccl.so.2"


def _good_info() -> dict[str, Any]:
    """What the preflight gathers on the lent image (torch cu130, cupy-cuda13x, one NCCL)."""
    return {"torch": "2.11.0+cu130", "torch_cuda": "13.0", "cuda_available": True, "device_count": 1,
            "cupy": "14.2.0", "cupy_dists": ["cupy-cuda13x"], "nccl_dists": ["nvidia-nccl-cu13"],
            "nccl_torch": (2, 27, 7), "nccl_cupy": (2, 27, 7), "cupy_runtime": 13000, "driver": 13000,
            "torch_uuid": "ab" * 16, "cupy_uuid": "ab" * 16, "device_api": "cuda", "probe_nccl": {"ok": True},
            "p2pft_transport": "/repo/transport"}


def test_the_preflight_catches_a_second_libnccl() -> None:
    gs = _scenarios()
    plugin = "/venv/lib/python3.12/site-packages/nvidia/nccl/lib/libnccl-net.so"   # a plugin, not NCCL
    one = _maps(TORCH_NCCL, TORCH_NCCL, plugin, "/usr/lib/x86_64-linux-gnu/libc.so.6")
    two = one + _maps(CUPY_NCCL + " (deleted)")
    assert gs.libnccl_paths(one) == [TORCH_NCCL]
    assert gs.libnccl_paths(two) == sorted([TORCH_NCCL, CUPY_NCCL])
    # The preflight as it runs, its /proc/self/maps reader swapped: judged as on CUDA and on the stand-in.
    for cuda in (True, False):
        got = gs.preflight(read_maps=lambda: two, cuda=cuda)
        checks = {c["check"]: c for c in got["checks"]}
        assert not got["ok"] and not checks["one_libnccl"]["ok"], got["checks"]
        assert "2 NCCL libraries" in checks["one_libnccl"]["detail"] and CUPY_NCCL in checks["one_libnccl"]["detail"]
        assert any(w.startswith("one_libnccl") for w in got["why"])
    assert got["versions"]["libnccl_loaded"] == sorted([TORCH_NCCL, CUPY_NCCL])
    ok = {c["check"]: c["ok"] for c in gs.preflight(read_maps=lambda: one, cuda=True)["checks"]}
    assert ok["one_libnccl"]


def test_the_preflight_judges_the_lent_image() -> None:
    gs = _scenarios()
    checks = gs.preflight_checks(_good_info(), [TORCH_NCCL], cuda=True)
    assert all(c["ok"] for c in checks), checks

    def failed(**change: Any) -> set[str]:
        info = {**_good_info(), **change}
        return {c["check"] for c in gs.preflight_checks(info, [TORCH_NCCL], cuda=True) if not c["ok"]}
    assert failed(cupy_dists=["cupy-cuda12x", "cupy-cuda13x"]) == {"one_cupy"}
    assert failed(nccl_cupy=(2, 21, 5)) == {"nccl_versions_agree"}
    assert failed(cupy_runtime=12080) == {"same_cuda_runtime"}
    assert failed(driver=12080) == {"driver_new_enough"}
    assert failed(cupy_uuid="cd" * 16) == {"same_device"}
    assert failed(torch_uuid=None, cupy_uuid=None, torch_pci=[0, 0x1A, 0], cupy_pci=[0, 0x1A, 0]) == set()
    assert failed(torch_uuid=None, cupy_uuid=None) == {"same_device"}   # nothing to compare is no pass
    assert failed(p2pft_transport="ModuleNotFoundError: No module named 'p2pft.transport'") == {"p2pft_installed"}
    assert "one_libnccl" in {c["check"] for c in gs.preflight_checks(_good_info(), [], cuda=True) if not c["ok"]}
    assert gs._nccl_tuple(22707) == (2, 27, 7) and gs._nccl_tuple((2, 27, 7)) == (2, 27, 7)
    assert gs._norm_uuid(bytes.fromhex("ab" * 16)) == gs._norm_uuid("GPU-abababab-abab-abab-abab-abababababab")
