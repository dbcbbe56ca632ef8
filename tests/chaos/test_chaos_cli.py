"""`p2pft chaos` end to end, short: real replica processes, real SIGKILLs, the report files."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


@pytest.mark.timeout(420)  # three systems of real processes on a shared machine: the run's own limit is 400 s
def test_short_chaos_run_reports_and_holds_invariants(tmp_path: Path) -> None:
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "p2pft.cli", "chaos", "--duration", "16", "--kill-every", "6",
           "--restart-after", "1", "--checkpoint-every", "10", "--systems", "p2pft,ddp,failure_free", "--no-live",
           "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "chaos.json").read_text())
    rows = {r["system"]: r for r in report["systems"]}
    assert set(rows) == {"p2pft", "ddp", "failure_free"}
    p2p = rows["p2pft"]
    for key in ("system", "ett", "sample_ett", "final_step", "baseline_final_step", "kills", "survivor_crashes",
                "stall_p50_s", "stall_max_s", "rejoin_p50_s", "divergent_steps"):
        assert key in p2p, key
    assert p2p["kills"] == 2
    assert p2p["survivor_crashes"] == 0
    assert p2p["divergent_steps"] == 0
    assert p2p["digest_steps_checked"] > 0
    assert rows["failure_free"]["final_step"] > 20
    # Survivors keep training through both kills (a loose bound: the machine is shared).
    assert p2p["ett"] is not None and p2p["ett"] > 0.6
    # Plain DDP: each failure stops every rank (the survivors' ends are no crashes) and the job
    # keeps what its last checkpoint holds.
    ddp = rows["ddp"]
    assert ddp["kills"] == 2 and ddp["survivor_crashes"] == 0 and ddp["divergent_steps"] == 0
    full = json.loads((out / "chaos-full.json").read_text())
    ddp_events = next(s["_events"] for s in full["systems"] if s["system"] == "ddp")
    assert sum(1 for e in ddp_events if e["kind"] == "stop") == 2 * 2  # two survivors per failure
    assert ddp["final_step"] >= 10
    assert ddp["sample_ett"] < p2p["sample_ett"]
    assert report["overhead_vs_ddp"] is not None
    # Where the time went: every second of the run is accounted for, by contributors.
    span = report["t_end"] - report["t0"]
    for row in rows.values():
        assert abs(sum(row["contributor_seconds"].values()) - span) < 1.0, row["contributor_seconds"]
        assert row["step_time_by_phase"]["normal"]["steps"] > 0
    assert rows["failure_free"]["contributor_seconds"]["3"] > 0.8 * span
    assert {"replica", "witness"} <= set(p2p["cpu_s"]) and all(v > 0 for v in p2p["cpu_s"].values())
    assert set(ddp["cpu_s"]) == {"replica"}
    assert (out / "timeline.png").stat().st_size > 10_000
    assert "sample ETT" in proc.stdout and "SIGKILL every 6 s" in proc.stdout


def test_chaos_rejects_a_config_that_cannot_work(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "p2pft.cli", "chaos", "--replicas", "1", "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "at least 2" in proc.stderr and "Traceback" not in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "p2pft.cli", "chaos", "--systems", "p2pft,nonsense",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "unknown system" in proc.stderr
    for extra, message in ((["--algo", "diloco", "--systems", "p2pft,ddp"], "p2pft, failure_free, torchft only"),
                           (["--algo", "diloco", "--workload", "example"], "runs the gpt workload")):
        proc = subprocess.run([sys.executable, "-m", "p2pft.cli", "chaos", *extra, "--out", str(tmp_path)],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
