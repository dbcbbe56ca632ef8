"""Child processes that never outlive the process that started them.

Every launcher the project ships (the chaos harness, the HSDP example's local launcher, the
benchmarks) starts its children here. Two mechanisms, because each covers what the other cannot:

- ``PR_SET_PDEATHSIG(SIGKILL)``, set in the child between fork and exec (it survives exec): the
  kernel kills the child when its parent dies, however it dies. A SIGKILLed parent runs no
  handler and no ``finally``, so nothing else can take its children down. It is Linux only, it
  covers direct children only, and it fires when the *thread* that forked exits: spawn from a
  thread that lives as long as the process (the main thread, as every launcher here does).
- a process group per cluster (``ProcGroup``): the parent reaches a whole cluster, grandchildren
  included (a launcher's ranks, a console script's own children), with one ``killpg``, and its
  final sweep also finds a process whose own parent is already gone. The group is not the
  terminal's foreground group, so a Ctrl-C reaches the parent alone and the parent decides the
  order of the stop (replicas first, then the peers they talk to).
"""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

PR_SET_PDEATHSIG = 1

# Resolved once in the parent: loading a library between fork and exec is not safe.
_PRCTL: Any = None
if sys.platform.startswith("linux"):
    try:
        _PRCTL = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # pragma: no cover - every Linux libc has prctl
        _PRCTL = None


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists (a zombie not yet reaped counts; one of another user too)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def die_with_parent(parent: int | None = None) -> None:
    """Ask the kernel for SIGKILL when the parent dies; die now if it already has.

    Call it in the child: ``spawn`` does so before exec; a ``multiprocessing`` target calls it
    first thing with the parent's pid. No-op where prctl does not exist (not Linux).
    """
    if _PRCTL is None:
        return
    _PRCTL(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if parent is not None and os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGKILL)  # the parent died before the request took effect


@dataclass
class ProcGroup:
    """One process group for the processes of one cluster; the first spawn creates it."""

    pgid: int | None = None

    def spawn(self, cmd: Sequence[str], **popen: Any) -> subprocess.Popen[bytes]:
        return spawn(cmd, group=self, **popen)

    def signal(self, sig: int) -> None:
        """Signal every process still in the group (grandchildren included); none left is fine."""
        if self.pgid is None:
            return
        try:
            os.killpg(self.pgid, sig)
        except ProcessLookupError:
            pass
        except PermissionError:  # pragma: no cover - the group id was reused by someone else
            pass

    def kill(self) -> None:
        """SIGKILL whatever is left: the last step of a stop."""
        self.signal(signal.SIGKILL)


def _child_setup(parent: int, pgid: int | None) -> Callable[[], None]:
    def setup() -> None:
        die_with_parent(parent)
        if pgid is not None:
            try:
                os.setpgid(0, pgid)
                return
            except OSError:
                pass  # every member of the group has exited: start a fresh one
        os.setpgid(0, 0)
    return setup


def spawn(cmd: Sequence[str], group: ProcGroup | None = None, **popen: Any) -> subprocess.Popen[bytes]:
    """``subprocess.Popen(cmd, **popen)`` for a child that dies with this process.

    With ``group`` the child joins that process group (creating it on the first spawn, or anew
    once all its members have exited); without, it gets a group of its own.
    """
    for key in ("preexec_fn", "start_new_session", "process_group"):
        if key in popen:
            raise ValueError(f"spawn sets {key} itself")
    # Not the terminal's foreground group: a read from the terminal would stop the child (SIGTTIN).
    popen.setdefault("stdin", subprocess.DEVNULL)
    p: subprocess.Popen[bytes] = subprocess.Popen(
        list(cmd), preexec_fn=_child_setup(os.getpid(), group.pgid if group else None), **popen)
    if group is not None:
        try:
            group.pgid = os.getpgid(p.pid)  # unreaped, even an exited child still has its group
        except ProcessLookupError:  # pragma: no cover - reaped by someone else already
            pass
    return p


@dataclass(frozen=True)
class Exit:
    """How a child ended: its status and the CPU seconds it used (None where unreadable)."""

    returncode: int
    cpu_s: float | None


_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a process (also of an exited, not yet reaped one), Linux."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            data = fh.read().decode(errors="replace")
    except OSError:
        return None
    fields = data[data.rfind(")") + 2:].split()  # the command name may hold spaces and parentheses
    try:
        return (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime: fields 14 and 15 of stat
    except (IndexError, ValueError):
        return None


def collect(p: subprocess.Popen[bytes], timeout: float = 0.0) -> Exit | None:
    """Wait up to ``timeout`` s for ``p`` to exit; reap it and say how it ended, or None if it runs.

    The CPU time is read between the exit and the reaping (``waitid(WNOWAIT)``), the only moment
    when a process that ran to its end still has one to read.
    """
    deadline = time.monotonic() + timeout
    while True:
        if p.returncode is not None:
            return Exit(p.returncode, None)
        try:
            info = os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:  # reaped elsewhere
            info = None
            rc = p.poll()
            if rc is not None:
                return Exit(rc, None)
        if info is not None:
            cpu = cpu_seconds(p.pid)
            return Exit(p.wait(), cpu)
        if time.monotonic() >= deadline:
            return None
        time.sleep(min(0.02, max(0.0, deadline - time.monotonic())))


def exit_now(rc: int | None) -> None:
    """End a replica process once it has closed everything itself: flush logs and standard
    streams, then leave without the interpreter's teardown of torch and its modules, which takes
    1-2 s on a busy machine and would make a SIGTERM'd replica slow to go (a launcher waiting to
    restart it, a scheduler's grace period)."""
    import logging
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(int(rc or 0))


def terminate(procs: Sequence[subprocess.Popen[bytes]], grace: float) -> None:
    """SIGTERM every process still running, give each up to `grace` seconds, then SIGKILL."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=5)
