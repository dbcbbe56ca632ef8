"""A ``p2pft chaos`` run never leaves a process behind, however the harness is stopped.

SIGTERM and SIGHUP stop it the way Ctrl-C does (clusters stopped, report written when training
had begun); a SIGKILL, which no handler sees, still takes every replica and witness with it
(their parent-death signal). Each case collects the harness's descendants from /proc before the
signal and checks that every one is gone within 5 s of the harness's end.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")]

# 2 systems x (2 replicas + 1 witness)
EXPECTED_CHILDREN = 6


def _stat(pid: int) -> tuple[int, str, int] | None:
    """(parent pid, state, start time) of a process, None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            data = fh.read().decode(errors="replace")
    except OSError:
        return None
    f = data[data.rfind(")") + 2:].split()
    return int(f[1]), f[0], int(f[19])


def descendants(root: int) -> dict[int, int]:
    """pid -> start time of every live descendant of ``root``."""
    stats = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _stat(int(name))
            if st is not None:
                stats[int(name)] = st
    out: dict[int, int] = {}
    frontier = [root]
    while frontier:
        parent = frontier.pop()
        for pid, (ppid, state, start) in stats.items():
            if ppid == parent and pid not in out and state != "Z":
                out[pid] = start
                frontier.append(pid)
    return out


def alive(procs: dict[int, int]) -> list[int]:
    """The ones still running (same pid and start time, not a zombie)."""
    out = []
    for pid, start in procs.items():
        st = _stat(pid)
        if st is not None and st[2] == start and st[1] != "Z":
            out.append(pid)
    return out


def start_harness(out: Path) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "p2pft.cli", "chaos", "--duration", "120", "--replicas", "2",
           "--witnesses", "1", "--kill-every", "30", "--systems", "p2pft,failure_free", "--no-live",
           "--out", str(out)]
    log = open(out.parent / f"{out.name}.log", "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    return proc


def wait_for(cond: object, timeout: float, what: str, harness: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():  # type: ignore[operator]
            return
        assert harness.poll() is None, f"the harness exited ({harness.returncode}) while waiting for {what}"
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def training(out: Path) -> bool:
    from p2pft.chaos.records import read_stats
    return any(r.get("c") for r in read_stats(out / "runs" / "p2pft" / "r0-0.jsonl"))


@pytest.mark.timeout(200)
def test_no_process_outlives_the_harness(tmp_path: Path) -> None:
    # One harness at a time, each signalled as soon as all its children exist (the SIGTERM one
    # once it trains, to check its report): the others would only add load to the first.
    cases = [(signal.SIGTERM, True), (signal.SIGHUP, False), (signal.SIGKILL, False)]
    seen: dict[int, int] = {}
    harness: subprocess.Popen[bytes] | None = None
    try:
        for sig, wait_training in cases:
            out = tmp_path / sig.name
            out.mkdir()
            harness = h = start_harness(out)
            wait_for(lambda: len(descendants(h.pid)) >= EXPECTED_CHILDREN, 60, "every child", h)
            if wait_training:
                wait_for(lambda: training(out), 120, "training", h)
            kids = descendants(h.pid)
            seen.update(kids)
            os.kill(h.pid, sig)
            rc = h.wait(timeout=60)
            deadline = time.monotonic() + 5          # every child gone within 5 s of the harness
            while alive(kids) and time.monotonic() < deadline:
                time.sleep(0.1)
            left = alive(kids)
            assert not left, f"{sig.name}: {len(left)} of {len(kids)} processes outlived the harness"
            if sig == signal.SIGKILL:
                assert rc == -signal.SIGKILL
                continue
            assert rc == 128 + sig, (rc, (tmp_path / f"{out.name}.log").read_text()[-2000:])
            if wait_training:
                report = json.loads((out / "chaos.json").read_text())
                assert report["interrupted"] == sig.name
                assert {s["system"] for s in report["systems"]} == {"p2pft", "failure_free"}
                assert report["t_end"] > report["t0"]
    finally:
        if harness is not None and harness.poll() is None:
            harness.kill()
            harness.wait(timeout=10)
        for pid in alive(seen):  # only on failure: the processes this test caused to exist
            os.kill(pid, signal.SIGKILL)
