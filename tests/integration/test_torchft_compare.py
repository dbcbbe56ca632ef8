"""torchft 0.2.0 side by side with the failure-free run, under real SIGKILLs.

Real processes throughout: a torchft lighthouse, three torchft replicas (Gloo on loopback) and
three failure-free p2pft replicas. Skipped when the optional ``compare`` extra (torchft) is not
installed, so the suite passes without it.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

pytest.importorskip("torchft", reason="torchft is not installed (pip install 'p2pft[compare]')")

from p2pft.chaos.cluster import ChaosConfig  # noqa: E402
from p2pft.chaos.run import run_chaos  # noqa: E402
from p2pft.chaos.torchft_system import TorchftCluster, lighthouse_command  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]


def _records(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            break  # the tail of a SIGKILLed replica's file may be cut
    return out


def test_torchft_row_side_by_side(tmp_path: Path) -> None:
    cfg = ChaosConfig(duration=15, kill_every=6, restart_after=2)
    report = run_chaos(cfg, tmp_path, systems=("torchft", "failure_free"))
    rows = {r["system"]: r for r in report["systems"]}
    assert set(rows) == {"torchft", "failure_free"}
    tf = rows["torchft"]
    # torchft runs in its best mode by default (manual allreduce), which survives kills: the
    # survivors never crash, and the cluster ends past step 0 having trained samples.
    assert tf["final_step"] > 0 and tf["samples"] > 0
    assert tf["kills"] >= 1
    assert tf["survivor_crashes"] == 0, "torchft's manual-allreduce survivors crashed"
    assert tf["baseline_final_step"] == rows["failure_free"]["final_step"]
    # The worker writes p2pft's stats format: a start record, then per-step records.
    files = sorted((tmp_path / "torchft").glob("r*-*.jsonl"))
    assert files
    recs = _records(files[0])
    assert recs[0]["kind"] == "start"
    assert {"t", "t_process", "t_imported", "node", "step", "pid"} <= set(recs[0])
    steps = [r for r in recs if r.get("kind") is None]
    assert steps
    assert {"t", "step", "c", "role", "n", "r", "e"} <= set(steps[0])
    assert all(r["role"] in ("participant", "joiner") for r in steps)


def test_lighthouse_stops_with_cluster(tmp_path: Path) -> None:
    """stop() ends the lighthouse as well as the replicas: nothing is left running."""
    c = TorchftCluster("torchft", ChaosConfig(replicas=2), tmp_path)
    c.start_lighthouse()
    assert c.lighthouse is not None
    pid = c.lighthouse.pid
    deadline = time.time() + 60
    while time.time() < deadline and "listening" not in _read(tmp_path / "lighthouse.log").lower():
        assert c.lighthouse.poll() is None, _read(tmp_path / "lighthouse.log")
        time.sleep(0.2)
    c.stop()
    assert c.lighthouse is None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_lighthouse_command_flags() -> None:
    cmd = lighthouse_command("127.0.0.1:1234", min_replicas=1, join_timeout_ms=500)
    assert cmd[cmd.index("--bind") + 1] == "127.0.0.1:1234"
    assert cmd[cmd.index("--min_replicas") + 1] == "1"
    assert cmd[cmd.index("--join_timeout_ms") + 1] == "500"


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""
