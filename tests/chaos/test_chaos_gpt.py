"""`p2pft chaos --workload gpt` and `--algo diloco`, short: gpt.py replicas under SIGKILLs, then the oracle."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def test_gpt_workload_is_replayed_exactly_by_the_oracle(tmp_path: Path) -> None:
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "p2pft.cli", "chaos", "--workload", "gpt", "--duration", "12", "--kill-every", "6",
           "--restart-after", "1", "--systems", "p2pft,failure_free", "--no-live", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["system"]: r for r in json.loads((out / "chaos.json").read_text())["systems"]}
    p2p = rows["p2pft"]
    assert p2p["kills"] == 1 and p2p["survivor_crashes"] == 0 and p2p["divergent_steps"] == 0
    for row in rows.values():
        assert "oracle_error" not in row, row.get("oracle_error")
        assert row["oracle_steps"] >= 10 and row["oracle_compared"]
        assert row["oracle_unresolved_steps"] == 0 and row["oracle_cursor_mismatches"] == 0
        # Bitwise: gradients are summed in the ring's order (see p2pft/chaos/oracle.py), every
        # step's, a killed contributor's included (its place is in the survivors' records).
        assert row["oracle_ring_order_steps"] == row["oracle_steps"]
        assert row["oracle_max_abs_diff"] == 0.0 and row["oracle_lr_max_abs_diff"] == 0.0
    assert "oracle" in proc.stdout


def test_diloco_run_with_a_kill_is_replayed_by_the_oracle(tmp_path: Path) -> None:
    """`p2pft chaos --algo diloco`: the GPT recipe with DiLoCo, a replica SIGKILLed mid-run and
    restarted; the oracle replays every sync (each process's inner AdamW steps, the outer step)."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "p2pft.cli", "chaos", "--algo", "diloco", "--sync-every", "4", "--duration", "14",
           "--kill-every", "6", "--restart-after", "1", "--systems", "p2pft,failure_free", "--no-live",
           "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["system"]: r for r in json.loads((out / "chaos.json").read_text())["systems"]}
    p2p = rows["p2pft"]
    assert p2p["kills"] >= 1 and p2p["survivor_crashes"] == 0 and p2p["divergent_steps"] == 0
    for row in rows.values():
        assert "oracle_error" not in row, row.get("oracle_error")
        assert row["oracle_steps"] >= 5 and row["oracle_compared"]
        assert row["oracle_unresolved_steps"] == 0 and row["oracle_cursor_mismatches"] == 0
        # Bitwise where the ring's order is recorded (every sync's, as for steps).
        assert row["oracle_ring_order_steps"] == row["oracle_steps"]
        assert row["oracle_max_abs_diff"] == 0.0 and row["oracle_lr_max_abs_diff"] == 0.0
    assert "oracle" in proc.stdout
