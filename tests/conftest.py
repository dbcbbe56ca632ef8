"""Shared fixtures: free loopback ports, real `p2pft peer` processes, polling their views.

Every process a test starts is registered with the ``peers`` fixture, whose teardown SIGKILLs
whatever is still running, so a failing or timed-out test never leaves peers behind.
"""
from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterator

import pytest

from p2pft.deploy import ports as _ports
from p2pft.deploy.ports import free_ports
from p2pft.net.admin import admin_request

HOST = "127.0.0.1"


def p2pft_command() -> list[str]:
    """The installed `p2pft` script next to this interpreter, else `python -m p2pft.cli`."""
    script = Path(sys.executable).with_name("p2pft")
    if script.exists():
        return [str(script)]
    found = shutil.which("p2pft")
    return [found] if found else [sys.executable, "-m", "p2pft.cli"]


def child_env() -> dict[str, str]:
    """Environment for children: no inherited P2PFT_* settings, unbuffered stderr."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("P2PFT_")}
    env["PYTHONUNBUFFERED"] = "1"
    return env


@dataclass
class Peer:
    """One `p2pft peer` process."""

    addr: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    ready_path: Path
    started: float = field(default_factory=time.monotonic)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def terminate(self) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""


class PeerSet:
    """Starts peers and guarantees they are all killed at teardown."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.all: list[Peer] = []
        self._n = 0

    def spawn(self, addr: str, seeds: list[str] | None = None, *, secret_file: str | None = None,
              replica_id: str | None = None, log_level: str = "INFO") -> Peer:
        self._n += 1
        log_path = self.tmp / f"peer{self._n}-{addr.replace(':', '_')}.log"
        ready = self.tmp / f"ready{self._n}"
        cmd = p2pft_command() + ["--log-level", log_level, "peer", "--listen", addr, "--ready-file", str(ready)]
        if seeds:
            cmd += ["--seeds", ",".join(seeds)]
        if secret_file:
            cmd += ["--secret-file", secret_file]
        if replica_id:
            cmd += ["--replica-id", replica_id]
        with open(log_path, "wb") as logf:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                                    env=child_env())
        peer = Peer(addr, proc, log_path, ready)
        self.all.append(peer)
        return peer

    def kill_all(self) -> None:
        for p in self.all:
            if p.alive():
                p.proc.send_signal(signal.SIGKILL)
        for p in self.all:
            try:
                p.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:  # pragma: no cover - the kernel always reaps SIGKILL
                pass


@pytest.fixture
def peers(tmp_path: Path) -> Iterator[PeerSet]:
    ps = PeerSet(tmp_path)
    try:
        yield ps
    finally:
        ps.kill_all()


@pytest.fixture(scope="module")
def module_peers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PeerSet]:
    """Like ``peers``, shared by the tests of one module (a cluster that is slow to start)."""
    ps = PeerSet(tmp_path_factory.mktemp("peers"))
    try:
        yield ps
    finally:
        ps.kill_all()


async def report(addr: str, *, secret: bytes | None = None, timeout: float = 1.0) -> dict[str, Any] | None:
    """A peer's `admin.members` answer, or None if it does not answer in time."""
    try:
        return await admin_request(addr, "admin.members", secret=secret, timeout=timeout)
    except (OSError, asyncio.TimeoutError, ConnectionError):
        return None


async def reports(addrs: list[str], **kw: Any) -> dict[str, dict[str, Any] | None]:
    got = await asyncio.gather(*(report(a, **kw) for a in addrs))
    return dict(zip(addrs, got))


async def wait_until(pred: Callable[[], Awaitable[bool]], timeout: float, interval: float = 0.02,
                     what: str = "condition") -> float:
    """Poll an async predicate; returns the seconds it took, fails the test after ``timeout``."""
    t0 = time.monotonic()
    while True:
        if await pred():
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            pytest.fail(f"timed out after {timeout:g} s waiting for {what}")
        await asyncio.sleep(interval)


def member_ids(rep: dict[str, Any] | None) -> set[str]:
    return {m["node"] for m in (rep or {}).get("members", ())}


def member_addrs(rep: dict[str, Any] | None) -> set[str]:
    return {m["addr"] for m in (rep or {}).get("members", ())}


class Ctl:
    """The helpers above, handed to tests as a fixture (test dirs are not packages, so tests
    do not import this module by name)."""

    free_ports = staticmethod(free_ports)
    p2pft_command = staticmethod(p2pft_command)
    child_env = staticmethod(child_env)
    report = staticmethod(report)
    reports = staticmethod(reports)
    wait_until = staticmethod(wait_until)
    member_ids = staticmethod(member_ids)
    member_addrs = staticmethod(member_addrs)
    HOST = HOST


@pytest.fixture(scope="session")
def ctl() -> type[Ctl]:
    return Ctl


# Parallel workers (below) draw their ports from disjoint shares, and so do the harnesses they
# start (``p2pft chaos`` reads the share from the environment): a port one worker checked free
# and binds later is never another's.
if os.environ.get("PYTEST_XDIST_WORKER", "").startswith("gw"):
    _count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    _index = int(os.environ["PYTEST_XDIST_WORKER"][2:]) % _count   # a replaced worker gets a new name
    _ports.share(_index, _count)
    os.environ[_ports.SHARE_ENV] = f"{_index}/{_count}"


# The suite runs on pytest-xdist workers (``-n auto --dist loadgroup``, pyproject's addopts): most
# multi-process tests spend their time waiting on timeouts and sockets, and the whole suite used
# 1.06 of 2 cores run one test at a time (700 s serial, 485-515 s on two workers).
# The files here keep more than a core busy by themselves (CPU seconds per wall second measured
# one test at a time, self + children): they form one group, which one worker runs in turn, so no
# two of them compete for the cores. The namespace tests form another, so two of them never set
# up hosts at once (they pick a free subnet by looking).
XDIST_GROUPS = {
    "tests/integration/test_hsdp.py": "cpu-heavy",                  # 1.67: 2 replicas x 2 ranks
    "tests/chaos/test_chaos_cli.py": "cpu-heavy",                   # 1.72: three systems' clusters
    "tests/chaos/test_chaos_gpt.py": "cpu-heavy",                   # 1.33: GPT replicas, then the oracle
    "tests/chaos/test_chaos_signals.py": "cpu-heavy",               # 1.52
    "tests/integration/test_recipes.py": "cpu-heavy",               # 1.48
    "tests/integration/test_peers.py": "cpu-heavy",                 # 1.53: sixteen peers
    "tests/integration/test_gpt_recipe.py": "cpu-heavy",            # 1.19
    "tests/integration/test_diloco.py": "cpu-heavy",                # 1.19
    "tests/transport/test_nccl_shared_device_job.py": "cpu-heavy",  # 1.56
    "tests/integration/test_job_life_algos.py": "cpu-heavy",        # 2 replicas x 2 ranks, DiLoCo, local SGD
    "tests/integration/test_voter_majority.py": "cpu-heavy",        # 3 replicas and 2 witnesses, twice
    "tests/integration/test_islands.py": "cpu-heavy",               # 2 islands x 2 ranks, a restart
    "tests/chaos/test_wan_islands.py": "cpu-heavy",                 # bench/wan.py --ranks 2: 2 islands x 2 ranks
    "tests/integration/test_hosts.py": "netns",
}


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Multi-process tests (marked ``slow``) run real replicas on a shared 2-core machine, where
    load stretches timings (their ports lie outside the ephemeral range, ``p2pft.deploy.ports``, so no
    outgoing connection takes one): such a test gets one rerun. A second failure fails the
    suite, and pytest reports every rerun (``R`` in the progress line, 'rerun' in the summary).
    Files in ``XDIST_GROUPS`` get their group."""
    for item in items:
        if item.get_closest_marker("slow") is not None and item.get_closest_marker("flaky") is None:
            item.add_marker(pytest.mark.flaky(reruns=1))
        group = XDIST_GROUPS.get(item.nodeid.split("::", 1)[0])   # the file, relative to the rootdir
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
