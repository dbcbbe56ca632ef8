"""A job's edges with real processes on loopback: a failed initial-state check stops the lead
too, and a whole cluster killed at once, witnesses included, restarted on its data directories.

- ``initial_state="check"`` with one replica seeded otherwise: every replica, the lead
  included, exits 2 before step 0 with one ERROR (before, the non-leaders raised and the lead
  trained on alone).
- Total loss: every member SIGKILLed, then the same commands again (same ``--data-dir``): the
  voters' persisted views hold the job's step, so the replicas without a checkpoint refuse to
  train a new model from step 0 (exit 3, one ERROR each); with checkpoints they resume.
"""
from __future__ import annotations

import time
from pathlib import Path

import pytest
from replica_harness import Replicas, steps

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]

FAST = ["--comm-timeout", "2", "--loop-timeout", "3"]


def _errors(tmp: Path, name: str) -> list[str]:
    return [ln for ln in (tmp / f"{name}.log").read_text(errors="replace").splitlines() if " ERROR " in ln]


def test_a_failed_initial_check_stops_the_lead_too(tmp_path: Path) -> None:
    """Three replicas with initial_state='check', r2 seeded otherwise: r2's check fails, it tells
    the lead, and the lead's verdict stops every replica (the lead and the one that matched as
    well) with exit 2 before any step; each says so in one ERROR."""
    base = ["--min-replicas", "3", "--initial-state", "check", "--steps", "20", *FAST]
    rs = Replicas(tmp_path, 3, base, witnesses=1)
    rs.spawn_witness(0)
    for i in range(3):
        rs.extra = base + (["--seed", "7"] if i == 2 else [])
        rs.spawn(i, f"r{i}")
    t0 = time.time()
    try:
        rs.wait(lambda: all(rs.procs[f"r{i}"].poll() is not None for i in range(3)), 90, "every replica to stop",
                allow_exit=("r0", "r1", "r2"))
    finally:
        rcs = rs.stop_all()
    took = time.time() - t0
    assert all(rcs[f"r{i}"] == 2 for i in range(3)), rcs
    for i in range(3):
        assert not steps(rs.stats[f"r{i}"]), f"r{i} trained although the initial states differ"
        errs = _errors(tmp_path, f"r{i}")
        assert len(errs) == 1 and "initial state" in errs[0], errs
        assert i == 2 or "r2" in errs[0], errs      # the others name the replica that differs
    leads = [i for i in range(3) if "holding the initial state for the group" in
             (tmp_path / f"r{i}.log").read_text(errors="replace")]
    assert len(leads) == 1, leads
    assert "differs from this leader's" in _errors(tmp_path, f"r{leads[0]}")[0]
    print(f"\ninitial check: every replica stopped with exit 2 within {took:.1f} s (lead r{leads[0]})")
