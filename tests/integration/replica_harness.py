"""Helpers for tests that run real replica processes of the example job on loopback."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from p2pft.chaos.records import read_stats
from p2pft.deploy.ports import free_ports


def ports(n: int) -> list[int]:
    return free_ports(n)


def records(path: Path) -> list[dict[str, Any]]:
    """Every complete record of a replica's stats file (none before it exists)."""
    return read_stats(path)


def steps(path: Path) -> list[dict[str, Any]]:
    return [r for r in records(path) if r.get("kind") is None and "step" in r]


class ProcessSet:
    """Processes of one test, each with a log `<name>.log` (and a stats file for replicas):
    bounded waits that fail at once when a process dies, and a bounded stop."""

    tolerate_sigkill = False   # a SIGKILLed process (the test's own doing) is no failure
    stop_timeout = 20.0        # seconds each process gets to exit after SIGTERM

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.stats: dict[str, Path] = {}

    def wait(self, cond: Callable[[], bool], timeout: float, what: str, allow_exit: tuple[str, ...] = ()) -> float:
        """Poll `cond` until true (returns the seconds it took) or `timeout`; any process that
        exits meanwhile fails the test with its log tail, unless it is named in `allow_exit`."""
        t0 = time.time()
        while time.time() - t0 < timeout:
            if cond():
                return time.time() - t0
            for name, p in self.procs.items():
                if (p.poll() is not None and name not in allow_exit
                        and not (self.tolerate_sigkill and p.returncode == -signal.SIGKILL)):
                    raise AssertionError(f"{name} exited with {p.returncode} while waiting for {what}: "
                                         f"{(self.tmp / (name + '.log')).read_text()[-3000:]}")
            time.sleep(0.05)
        raise AssertionError(f"timed out after {timeout} s waiting for {what}")

    def last_step(self, name: str) -> int:
        st = steps(self.stats[name])
        return int(st[-1]["step"]) if st else -1

    def stop_all(self) -> dict[str, int | None]:
        """SIGTERM everyone, then wait up to `stop_timeout` each; a process still running is
        SIGKILLed and reported as None."""
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        rcs: dict[str, int | None] = {}
        for name, p in self.procs.items():
            try:
                rcs[name] = p.wait(timeout=self.stop_timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                rcs[name] = None
        return rcs


class Replicas(ProcessSet):
    tolerate_sigkill = True

    def __init__(self, tmp: Path, n: int, extra: list[str] | None = None, witnesses: int = 0,
                 running_seeds: bool = False) -> None:
        """``running_seeds``: a process's seeds are only the processes already started, not every
        address of the test. A seed that is not running yet holds bootstrap back for its give-up
        time (10 bootstrap waits, 6 s: ``p2pft.core.node``), which a test that starts some
        processes later would otherwise pay once at the start; the first process started then
        bootstraps the cluster (and leads it) instead of the lowest address."""
        super().__init__(tmp)
        all_ports = ports(n + witnesses)
        self.addrs = [f"127.0.0.1:{p}" for p in all_ports[:n]]
        self.witness_addrs = [f"127.0.0.1:{p}" for p in all_ports[n:]]
        self.extra = extra or []
        self.running_seeds = running_seeds
        self._addr_of: dict[str, str] = {}   # process name -> its control address

    def _seeds(self, me: str) -> str:
        if self.running_seeds:
            running = [a for name, a in self._addr_of.items() if self.procs[name].poll() is None]
            return ",".join(dict.fromkeys(a for a in running if a != me))
        return ",".join(a for a in self.addrs + self.witness_addrs if a != me)

    def spawn(self, i: int, name: str) -> None:
        seeds = self._seeds(self.addrs[i])
        stats = self.tmp / f"{name}.jsonl"
        cmd = [sys.executable, "-m", "p2pft.trainer.examples.replica", "--replica-id", f"r{i}",
               "--listen", self.addrs[i], "--seeds", seeds, "--stats", str(stats), "--step-delay", "0.05",
               "--digest-every", "5", "--batch", "4", "--log-level", "INFO", *self.extra]
        log = open(self.tmp / f"{name}.log", "wb")
        self.procs[name] = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log,
                                            env=dict(os.environ, OMP_NUM_THREADS="1"))
        log.close()
        self.stats[name] = stats
        self._addr_of[name] = self.addrs[i]

    def spawn_witness(self, k: int) -> None:
        addr = self.witness_addrs[k]
        seeds = self._seeds(addr)
        log = open(self.tmp / f"w{k}.log", "wb")
        self.procs[f"w{k}"] = subprocess.Popen(
            [sys.executable, "-m", "p2pft", "--log-level", "INFO", "peer", "--listen", addr, "--seeds", seeds,
             "--replica-id", f"w{k}"], stdout=subprocess.DEVNULL, stderr=log)
        log.close()
        self._addr_of[f"w{k}"] = addr



def check_invariants(stats: dict[str, Path]) -> dict[int, str]:
    digests: dict[int, set[str]] = {}
    trained: dict[int, list[tuple[int, int]]] = {}
    for name, path in stats.items():
        last = -1
        for r in steps(path):
            assert r["step"] >= last, f"{name}: committed step went back from {last} to {r['step']}"
            last = r["step"]
            if "digest" in r:
                digests.setdefault(r["step"], set()).add(r["digest"])
            if r.get("tr"):
                trained.setdefault(r["step"], [])
                trained[r["step"]].extend(tuple(x) for x in r["tr"])
    bad = {s: d for s, d in digests.items() if len(d) > 1}
    assert not bad, f"replicas diverged at steps {sorted(bad)}"
    seen: dict[int, int] = {}
    for step, ranges in trained.items():
        for a, b in ranges:
            for i in range(a, b):
                assert i not in seen, f"sample {i} trained at step {seen[i]} and again at step {step}"
                seen[i] = step
    return {s: next(iter(d)) for s, d in digests.items()}


