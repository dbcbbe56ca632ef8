"""A replica started by hand says that it works, and stops promptly on SIGTERM, even while it is
waiting for a view after a peer died (the wait looks at the stop flag)."""
from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from replica_harness import Replicas

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def test_progress_and_a_prompt_sigterm_while_a_peer_is_dead(tmp_path: Path) -> None:
    rs = Replicas(tmp_path, 2, ["--progress", "on", "--comm-timeout", "5", "--loop-timeout", "30"])
    try:
        rs.spawn(0, "a")
        rs.spawn(1, "b")
        rs.wait(lambda: min(rs.last_step("a"), rs.last_step("b")) >= 40, 90, "40 steps on both")
        rs.wait(lambda: "steps/s" in (tmp_path / "a.log").read_text(), 15, "a progress line (one every 5 s)")
        rs.procs["b"].send_signal(signal.SIGKILL)
        rs.procs["b"].wait(timeout=5)
        time.sleep(0.3)  # a's allreduce fails; with nobody else to form a view it waits for one
        t0 = time.monotonic()
        rs.procs["a"].send_signal(signal.SIGTERM)
        rc = rs.procs["a"].wait(timeout=20)
        took = time.monotonic() - t0
    finally:
        rs.stop_all()
    log = (tmp_path / "a.log").read_text()
    print(f"\nSIGTERM to exit: {took:.2f} s")
    assert rc == 0, log[-2000:]
    assert "steps/s" in log and "contributing" in log, "no progress line"
    assert "[r0] stopped at step" in log, "no summary at exit"
    assert took < 1.0, f"exit took {took:.2f} s after SIGTERM"
