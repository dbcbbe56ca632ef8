"""`p2pft chaos --algo diloco` with torchft 0.2.0's DiLoCo beside p2pft's, on one schedule, in one command.

The torchft row is torchft's own DiLoCo (``torchft.local_sgd.DiLoCo``) on the GPT recipe; a
killed replica is restarted and must heal through torchft's PG transport (its log has no
recovery error, its first sync is a heal) and then contribute its own inner steps."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchft", reason="torchft is not installed (pip install 'p2pft[compare]')")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_torchft_diloco_row_beside_p2pft_under_kills(tmp_path: Path) -> None:
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "p2pft.cli", "chaos", "--algo", "diloco", "--sync-every", "4", "--duration", "30",
           "--kill-every", "14", "--restart-after", "1", "--systems", "p2pft,torchft", "--no-live", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=220)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["system"]: r for r in json.loads((out / "chaos.json").read_text())["systems"]}
    assert set(rows) == {"p2pft", "torchft", "failure_free"}, rows.keys()
    tft, p2p = rows["torchft"], rows["p2pft"]
    assert tft["kills"] == p2p["kills"] >= 1, "both systems lose a replica on the same schedule"
    assert tft["survivor_crashes"] == 0 and tft["divergent_steps"] == 0 and tft["digest_steps_checked"] >= 1
    assert tft["final_step"] >= 5, f"torchft's DiLoCo committed only {tft['final_step']} syncs"
    runs = out / "runs" / "torchft"
    logs = "".join(p.read_text(errors="replace") for p in runs.glob("r*.log"))
    assert "got exception in recovery" not in logs, "torchft's recovery failed (see its logs)"
    first_restart = sorted(runs.glob("r*-1.jsonl"))[0]
    syncs = [r for r in _records(first_restart) if r.get("kind") is None]
    assert syncs and syncs[0]["healed"] == 1 and "Loaded state dict" in logs, \
        f"the restarted replica's first sync is not a heal: {syncs[:2]}"
    assert any(r["c"] and r["role"] == "participant" for r in syncs), \
        f"the restarted torchft replica never contributed its own inner steps: {syncs}"
    assert "torchft" in proc.stdout
