"""p2pft.deploy.procs: children die with their parent, a group reaches grandchildren, CPU time is read."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from p2pft.deploy.procs import ProcGroup, collect, spawn

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux only")

# A parent that starts a `sleep` through p2pft.deploy.procs, prints its pid, then waits to be killed.
PARENT = ("import sys, time; from p2pft.deploy.procs import spawn; "
          "p = spawn(['sleep', '60']); print(p.pid, flush=True); time.sleep(60)")


def _gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as fh:
                if fh.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def test_a_child_dies_when_its_parent_is_sigkilled() -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    child = 0
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert not _gone(child, 0.3)
        parent.kill()  # no handler runs: only the kernel can take the child down
        parent.wait(timeout=10)
        assert _gone(child, 5.0), "the child outlived its SIGKILLed parent"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(timeout=10)
        if child and not _gone(child, 0):
            os.kill(child, signal.SIGKILL)


def test_a_group_reaches_grandchildren_and_is_rebuilt_when_empty() -> None:
    g = ProcGroup()
    mid = g.spawn([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    try:
        assert mid.stdout is not None
        grandchild = int(mid.stdout.readline())
        assert os.getpgid(grandchild) != g.pgid  # spawn without a group gives the grandchild its own
        second = g.spawn(["sleep", "60"])
        assert os.getpgid(second.pid) == g.pgid == mid.pid
        g.kill()
        assert collect(mid, 5.0) is not None and collect(second, 5.0) is not None
        assert _gone(grandchild, 5.0)  # its parent died: the kernel killed it
        third = g.spawn(["sleep", "60"])  # every member is gone: a fresh group
        assert g.pgid == third.pid
        g.kill()
        ex = collect(third, 5.0)
        assert ex is not None and ex.returncode == -signal.SIGKILL
    finally:
        g.kill()


def test_collect_reads_the_cpu_time_of_an_exited_child() -> None:
    p = spawn([sys.executable, "-c", "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass"])
    ex = collect(p, 30.0)
    assert ex is not None and ex.returncode == 0
    assert ex.cpu_s is not None and ex.cpu_s >= 0.3
    assert collect(p) == type(ex)(0, None)  # already reaped: the status stays, the time is gone


def test_spawn_refuses_to_be_told_how_to_start_the_child() -> None:
    with pytest.raises(ValueError, match="start_new_session"):
        spawn(["true"], start_new_session=True)
