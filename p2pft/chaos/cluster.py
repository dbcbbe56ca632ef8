"""A local cluster of replica processes and the failure schedule that hits it.

Each replica is an ordinary OS process (``python -m p2pft.trainer.examples.replica``) killed
with real signals; nothing is mocked. A *system* decides what a failure means:

- ``p2pft``: only the hit replica dies and is restarted after the delay; the others go on;
- ``sync``: the classic synchronous job under an elastic launcher: any failure stops every
  replica, and all restart from the last disk checkpoint after the delay;
- ``failure_free``: the same job with no failures (the denominator).
"""
from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FAULTS = ("kill", "pause", "leader", "two")
WORKLOADS = {"example": "p2pft.trainer.examples.replica", "gpt": "p2pft.trainer.examples.gpt"}


@dataclass
class ChaosConfig:
    replicas: int = 3
    duration: float = 60.0
    kill_every: float = 10.0
    restart_after: float = 2.0
    fault: str = "kill"               # kill | pause | leader | two
    pause_for: float = 3.0            # SIGSTOP length for fault=pause
    step_delay: float = 0.1           # emulated accelerator time per step
    model: str = "tiny"
    batch: int = 8
    checkpoint_every: int = 20        # steps, for the sync baseline's disk checkpoints
    seed: int = 0
    digest_every: int = 10
    witnesses: int = 2                # `p2pft peer` processes: cheap voters that are never killed
    extra_args: tuple[str, ...] = ()  # passed through to every replica process
    workload: str = "example"         # example (replica.py) | gpt (gpt.py, checked by the replay oracle)

    def validate(self) -> None:
        if self.replicas < 2:
            raise ValueError("--replicas must be at least 2 (one replica cannot survive its own failure)")
        if self.fault == "two" and self.replicas < 4:
            raise ValueError("--fault two needs at least 4 replicas so that a majority survives")
        if self.duration <= 0 or self.kill_every <= 0 or self.restart_after < 0 or self.step_delay < 0:
            raise ValueError("durations must be positive (restart delay and step delay may be 0)")
        if self.fault not in FAULTS:
            raise ValueError(f"--fault must be one of {', '.join(FAULTS)}")
        if self.workload not in WORKLOADS:
            raise ValueError(f"--workload must be one of {', '.join(WORKLOADS)}")
        if self.kill_every < self.restart_after + 1.0:
            raise ValueError("--kill-every must exceed --restart-after by at least 1 s")


_HANDED_OUT: set[int] = set()


def free_ports(n: int) -> list[int]:
    """Ports free now and never handed out before in this process (clusters must not share one)."""
    socks, ports = [], []
    while len(ports) < n:
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            ports.append(port)
            _HANDED_OUT.add(port)
    for s in socks:
        s.close()
    return ports


@dataclass
class Proc:
    replica: int
    incarnation: int
    popen: subprocess.Popen[bytes]
    started: float
    stats: Path
    killed_by_us: bool = False
    paused: bool = False


@dataclass
class Cluster:
    system: str
    cfg: ChaosConfig
    workdir: Path
    events: list[dict[str, Any]] = field(default_factory=list)
    procs: dict[int, Proc] = field(default_factory=dict)
    finished: list[Proc] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.ports = free_ports(self.cfg.replicas + self.cfg.witnesses)
        self.addrs = [f"127.0.0.1:{p}" for p in self.ports[:self.cfg.replicas]]
        self.witness_addrs = [f"127.0.0.1:{p}" for p in self.ports[self.cfg.replicas:]]
        self.witness_procs: list[subprocess.Popen[bytes]] = []
        self.incarnations = [0] * self.cfg.replicas
        if self.workdir.exists():
            shutil.rmtree(self.workdir)  # stats files are appended to: never mix two runs
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.go_file = self.workdir / "go"
        self.t0 = time.time()

    # ------------------------------------------------------------------ processes
    def spawn(self, i: int) -> None:
        cfg = self.cfg
        inc = self.incarnations[i]
        self.incarnations[i] += 1
        stats = self.workdir / f"r{i}-{inc}.jsonl"
        seeds = ",".join([a for j, a in enumerate(self.addrs) if j != i] + self.witness_addrs)
        cmd = [sys.executable, "-m", WORKLOADS[cfg.workload], "--replica-id", f"r{i}",
               "--listen", self.addrs[i], "--seeds", seeds, "--model", cfg.model, "--batch", str(cfg.batch),
               "--step-delay", str(cfg.step_delay), "--stats", str(stats), "--replicas", str(cfg.replicas),
               "--digest-every", str(cfg.digest_every), "--seed", str(cfg.seed), "--loss-every", "10",
               "--min-replicas", str(cfg.replicas) if inc == 0 or self.system == "sync" else "1",
               "--go-file", str(self.go_file), "--log-level", os.environ.get("P2PFT_LOG_LEVEL", "INFO"),
               *cfg.extra_args]
        if cfg.workload == "gpt":  # a survivor's final weights, for the replay oracle
            cmd += ["--final-weights", str(self.workdir / f"r{i}-{inc}.pt"), "--progress", "off"]
        if self.system == "sync":
            cmd += ["--checkpoint-dir", str(self.workdir / f"ckpt-r{i}"), "--checkpoint-every",
                    str(cfg.checkpoint_every)]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        err = open(self.workdir / f"r{i}-{inc}.log", "wb")
        p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env, start_new_session=True)
        err.close()
        now = time.time()
        self.procs[i] = Proc(i, inc, p, now, stats)
        self.events.append({"t": now, "kind": "start" if inc == 0 else "restart", "replica": i})

    def start(self) -> None:
        if not self.witness_procs:
            self.start_witnesses()
        for i in range(self.cfg.replicas):
            self.spawn(i)

    def start_witnesses(self) -> None:
        """Witness peers (members and voters without a trainer) keep a voter majority alive
        while a killed replica is still importing torch: they are part of the deployment, not
        of the fault schedule."""
        everyone = self.addrs + self.witness_addrs
        for k, addr in enumerate(self.witness_addrs):
            seeds = ",".join(a for a in everyone if a != addr)
            log = open(self.workdir / f"w{k}.log", "wb")
            self.witness_procs.append(subprocess.Popen(
                [sys.executable, "-m", "p2pft.cli", "--log-level", "INFO", "peer", "--listen", addr,
                 "--seeds", seeds, "--replica-id", f"w{k}"], stdout=subprocess.DEVNULL, stderr=log,
                start_new_session=True))
            log.close()

    def go(self) -> None:
        """Every replica is up: let them train (restarted replicas find the file at once)."""
        self.go_file.touch()

    def signal(self, i: int, sig: int, kind: str) -> None:
        pr = self.procs.get(i)
        if pr is None or pr.popen.poll() is not None:
            return
        if sig == signal.SIGKILL:
            pr.killed_by_us = True
        try:
            os.kill(pr.popen.pid, sig)
        except ProcessLookupError:
            return
        self.events.append({"t": time.time(), "kind": kind, "replica": i})
        if sig == signal.SIGKILL:
            pr.popen.wait(timeout=5)
            self.finished.append(self.procs.pop(i))

    def live(self) -> list[int]:
        return [i for i, p in self.procs.items() if p.popen.poll() is None and not p.paused]

    def training(self, within: float = 2.0) -> list[int]:
        """Replicas that committed a step recently (not still starting, not paused)."""
        from .metrics import read_stats
        now = time.time()
        out = []
        for i in self.live():
            recs = read_stats(self.procs[i].stats)[-20:]
            if any(r.get("kind") is None and r.get("c") and now - float(r["t"]) < within for r in recs):
                out.append(i)
        return out

    def reap(self) -> None:
        """Processes that ended without us killing them are crashes (survivor crashes)."""
        for i, p in list(self.procs.items()):
            rc = p.popen.poll()
            if rc is not None and not p.killed_by_us:
                self.events.append({"t": time.time(), "kind": "crash", "replica": i, "rc": rc})
                self.finished.append(self.procs.pop(i))

    def stop(self) -> None:
        for i, p in self.procs.items():
            if p.paused:
                os.kill(p.popen.pid, signal.SIGCONT)
            if p.popen.poll() is None:
                p.popen.send_signal(signal.SIGTERM)
        deadline = time.time() + 8
        for p in self.procs.values():
            try:
                p.popen.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                p.killed_by_us = True
                p.popen.kill()
                p.popen.wait(timeout=5)
        for i in list(self.procs):
            p = self.procs.pop(i)
            p.killed_by_us = True  # stopped by us at the end: not a crash
            self.finished.append(p)
        for w in self.witness_procs:
            if w.poll() is None:
                w.send_signal(signal.SIGTERM)
        for w in self.witness_procs:
            try:
                w.wait(timeout=5)
            except subprocess.TimeoutExpired:
                w.kill()
                w.wait(timeout=5)

    def cleanup(self) -> None:
        for d in self.workdir.glob("ckpt-*"):
            shutil.rmtree(d, ignore_errors=True)


class Schedule:
    """Failure times and targets, decided by one seeded RNG so runs can be compared."""

    def __init__(self, cfg: ChaosConfig) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.times = [cfg.kill_every * k for k in range(1, int(cfg.duration / cfg.kill_every) + 1)
                      if cfg.kill_every * k < cfg.duration - 1.0]

    def targets(self, live: list[int], leader: int | None) -> list[int]:
        if not live:
            return []
        if self.cfg.fault == "leader" and leader is not None and leader in live:
            return [leader]
        if self.cfg.fault == "two":
            return self.rng.sample(live, min(2, len(live) - 1))
        return [self.rng.choice(live)]


def leader_replica(cluster: Cluster) -> int | None:
    """Index of the replica whose node leads Raft, read from the latest stats view lines."""
    from .metrics import latest_leader
    return latest_leader(cluster)
