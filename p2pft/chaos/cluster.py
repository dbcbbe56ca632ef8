"""A local cluster of replica processes and the failure schedule that hits it.

Each replica is an ordinary OS process (``python -m p2pft.trainer.examples.replica``) killed
with real signals; nothing is mocked. All processes of a cluster share one process group and die
with the harness (``p2pft.deploy.procs``), so no run, however it ends, leaves a process behind. A *system* decides what a failure means:

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
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..deploy.ports import free_ports
from ..deploy.procs import ProcGroup, collect
from .hosts import Hosts
from .records import read_stats

FAULTS = ("kill", "pause", "leader", "two", "host")
HOSTS = ("loopback", "netns")
SPARE_SYSTEMS = ("p2pft", "torchft")  # the systems that run --spares extra replicas
REPLICA_PORT, WITNESS_PORT = 7100, 7000      # on a host of its own every process can use the same port
WORKLOADS = {"example": "p2pft.trainer.examples.replica", "gpt": "p2pft.trainer.examples.gpt"}
ALGOS = ("ft", "diloco")                     # FaultTolerant (an allreduce per step) | DiLoCo (gpt.py --sync-every)
# the systems that run DiLoCo (the others have no DiLoCo): torchft's is torchft.local_sgd.DiLoCo
DILOCO_SYSTEMS = ("p2pft", "failure_free", "torchft")


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
    spares: int = 0                   # p2pft and torchft: extra replicas that wait as spares
    hosts: str = "loopback"           # loopback | netns (each replica and witness on a host of its own)
    link_mbit: float | None = None    # with netns: each host's link limited to this rate (tc tbf)
    algo: str = "ft"                  # ft | diloco (the gpt workload with DiLoCo: a step is a sync)
    sync_every: int = 5               # algo diloco: inner steps between syncs (H)

    def validate(self) -> None:
        if self.replicas < 2:
            raise ValueError("--replicas must be at least 2 (one replica cannot survive its own failure)")
        if self.fault == "two" and self.replicas < 4:
            raise ValueError("--fault two needs at least 4 replicas so that a majority survives")
        if self.duration <= 0 or self.kill_every <= 0 or self.restart_after < 0 or self.step_delay < 0:
            raise ValueError("durations must be positive (restart delay and step delay may be 0)")
        if self.spares < 0:
            raise ValueError("--spares must be 0 or more")
        if self.fault not in FAULTS:
            raise ValueError(f"--fault must be one of {', '.join(FAULTS)}")
        if self.workload not in WORKLOADS:
            raise ValueError(f"--workload must be one of {', '.join(WORKLOADS)}")
        if self.hosts not in HOSTS:
            raise ValueError(f"--hosts must be one of {', '.join(HOSTS)}")
        if self.fault == "host" and self.hosts != "netns":
            raise ValueError("--fault host needs --hosts netns (a host's link goes down)")
        if self.link_mbit is not None and (self.hosts != "netns" or self.link_mbit <= 0):
            raise ValueError("--link-mbit needs --hosts netns and a positive rate")
        if self.algo not in ALGOS:
            raise ValueError(f"--algo must be one of {', '.join(ALGOS)}")
        if self.algo == "diloco" and (self.workload != "gpt" or self.sync_every < 1):
            raise ValueError("--algo diloco runs the gpt workload (checked by the replay oracle) with --sync-every >= 1")
        if self.kill_every < self.restart_after + 1.0:
            raise ValueError("--kill-every must exceed --restart-after by at least 1 s")


@dataclass
class Proc:
    replica: int
    incarnation: int
    popen: subprocess.Popen[bytes]
    started: float
    stats: Path
    kind: str = "replica"             # replica | joiner (a restart) | witness | lighthouse
    killed_by_us: bool = False
    paused: bool = False
    returncode: int | None = None
    cpu_s: float | None = None        # user + system CPU seconds, read when it exited

    def running(self, timeout: float = 0.0) -> bool:
        """False once the process has exited (then reaped, its status and CPU time recorded)."""
        if self.returncode is not None:
            return False
        ex = collect(self.popen, timeout)
        if ex is None:
            return True
        self.returncode, self.cpu_s = ex.returncode, ex.cpu_s
        return False


@dataclass
class Cluster:
    system: str
    cfg: ChaosConfig
    workdir: Path
    events: list[dict[str, Any]] = field(default_factory=list)
    procs: dict[int, Proc] = field(default_factory=dict)
    finished: list[Proc] = field(default_factory=list)

    # sync: any failure stops every replica and restarts them all from the last checkpoint
    restarts_all: bool = field(default=False, init=False)
    stop_grace: float = field(default=8.0, init=False)  # seconds a replica has to exit at the end

    def __post_init__(self) -> None:
        # p2pft runs `spares` extra replicas capped at `replicas` participants: hot spares;
        # torchft as many, in its FIXED_WITH_SPARES mode (torchft_system.py).
        self.spares = self.cfg.spares if self.system in SPARE_SYSTEMS else 0
        self.size = self.cfg.replicas + self.spares
        self.ports = free_ports(self.size + self.cfg.witnesses)
        self.addrs = [f"127.0.0.1:{p}" for p in self.ports[:self.size]]
        self.witness_addrs = [f"127.0.0.1:{p}" for p in self.ports[self.size:]]
        # --hosts netns: replica i on host i; the hosts after them carry what is never a victim
        # (witnesses here, torchft's lighthouse), `extra_hosts` of them.
        self.net: Hosts | None = None
        self.link_down: set[int] = set()
        if self.cfg.hosts == "netns":
            self.net = Hosts(self.size + self.extra_hosts(), link_mbit=self.cfg.link_mbit).create()
            self.addrs = [f"{self.net[i].ip}:{REPLICA_PORT}" for i in range(self.size)]
            self.witness_addrs = [f"{self.net[self.size + k].ip}:{WITNESS_PORT}"
                                  for k in range(min(self.cfg.witnesses, self.extra_hosts()))]
        self.witness_procs: list[Proc] = []
        self.group = ProcGroup()
        self.incarnations = [0] * self.size
        self.restarts_all = self.system == "sync"
        if self.workdir.exists():
            shutil.rmtree(self.workdir)  # stats files are appended to: never mix two runs
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.go_file = self.workdir / "go"
        self.t0 = time.time()

    def extra_hosts(self) -> int:
        """Hosts beyond one per replica (witnesses; torchft: its lighthouse)."""
        return self.cfg.witnesses

    def on_host(self, i: int, cmd: list[str]) -> list[str]:
        """`cmd` run on host i with --hosts netns (a victim's host comes back with its fresh
        process); unchanged on loopback."""
        if self.net is None:
            return cmd
        if i in self.link_down:
            self.net.link(i, True)
            self.link_down.discard(i)
        return self.net.cmd(i, cmd)

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
        if self.spares:
            cmd += ["--max-participants", str(cfg.replicas)]
        if cfg.algo == "diloco":
            cmd += ["--sync-every", str(cfg.sync_every)]
        if cfg.workload == "gpt":  # a survivor's final weights, for the replay oracle
            cmd += ["--final-weights", str(self.workdir / f"r{i}-{inc}.pt"), "--progress", "off"]
        if self.system == "sync":
            # It restarts every replica from its last checkpoint, older than the high-water step
            # the witnesses keep: say so, or the replicas refuse to lose those steps.
            cmd += ["--checkpoint-dir", str(self.workdir / f"ckpt-r{i}"), "--checkpoint-every",
                    str(cfg.checkpoint_every), "--allow-restart-from-scratch"]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        err = open(self.workdir / f"r{i}-{inc}.log", "wb")
        p = self.group.spawn(self.on_host(i, cmd), stdout=subprocess.DEVNULL, stderr=err, env=env)
        err.close()
        now = time.time()
        # A restarted p2pft replica joins as a joiner; a restarted sync job starts all over.
        self.procs[i] = Proc(i, inc, p, now, stats, kind="joiner" if inc and not self.restarts_all else "replica")
        self.events.append({"t": now, "kind": "start" if inc == 0 else "restart", "replica": i})

    def start(self) -> None:
        if not self.witness_procs:
            self.start_witnesses()
        for i in range(self.size):
            self.spawn(i)

    def start_witnesses(self) -> None:
        """Witness peers (members and voters without a trainer) keep a voter majority alive
        while a killed replica is still importing torch: they are part of the deployment, not
        of the fault schedule."""
        everyone = self.addrs + self.witness_addrs
        for k, addr in enumerate(self.witness_addrs):
            seeds = ",".join(a for a in everyone if a != addr)
            log = open(self.workdir / f"w{k}.log", "wb")
            cmd = [sys.executable, "-m", "p2pft.cli", "--log-level", "INFO", "peer", "--listen", addr, "--seeds",
                   seeds, "--replica-id", f"w{k}"]
            p = self.group.spawn(self.on_host(self.size + k, cmd), stdout=subprocess.DEVNULL, stderr=log)
            log.close()
            self.witness_procs.append(Proc(-1 - k, 0, p, time.time(), self.workdir / f"w{k}.log", kind="witness"))

    def go(self) -> None:
        """Every replica is up: let them train (restarted replicas find the file at once)."""
        self.go_file.touch()

    def signal(self, i: int, sig: int, kind: str) -> None:
        pr = self.procs.get(i)
        if pr is None:
            return
        if not pr.running():
            if sig == signal.SIGKILL and pr.killed_by_us:  # a job-wide stop found it already gone
                self.events.append({"t": time.time(), "kind": kind, "replica": i})
                self.finished.append(self.procs.pop(i))
            return
        if sig == signal.SIGKILL:
            pr.killed_by_us = True
        try:
            os.kill(pr.popen.pid, sig)
        except ProcessLookupError:
            return
        self.events.append({"t": time.time(), "kind": kind, "replica": i})
        if sig == signal.SIGKILL:
            pr.running(timeout=5)
            self.finished.append(self.procs.pop(i))

    def lose_host(self, i: int) -> None:
        """--fault host: replica i's host disappears (its link goes down: packets vanish, no
        reset), then its processes die; the restart brings the link back (see spawn). Where the
        system runs on loopback, a plain SIGKILL."""
        self.host_down(i)
        self.signal(i, signal.SIGKILL, "kill")

    def host_down(self, i: int) -> None:
        if self.net is not None and i in self.procs and i not in self.link_down:
            self.net.link(i, False)
            self.link_down.add(i)
            self.events.append({"t": time.time(), "kind": "host_down", "replica": i})

    def kill_job(self, targets: list[int]) -> None:
        """A failure stops a job that restarts as a whole: SIGKILL every replica at once (so that
        no survivor sees the victim's death first), then reap them all."""
        procs = list(self.procs.items())
        now = time.time()
        for i, p in procs:
            p.killed_by_us = True  # a survivor that fails on its own in between is no crash
            if p.running():
                try:
                    os.kill(p.popen.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self.events.append({"t": now, "kind": "kill" if i in targets else "stop", "replica": i})
        for i, p in procs:
            p.running(timeout=5)
            self.finished.append(self.procs.pop(i))

    def live(self) -> list[int]:
        return [i for i, p in self.procs.items() if p.running() and not p.paused]

    def training(self, within: float = 2.0) -> list[int]:
        """Replicas that committed a step recently (not still starting, not paused); with hot
        spares, only participants: a spare's failure would cost nothing and flatter the run."""
        now = time.time()
        out = []
        for i in self.live():
            recs = read_stats(self.procs[i].stats)[-20:]
            if any(r.get("kind") is None and r.get("c") and now - float(r["t"]) < within
                   and (not self.spares or r.get("role") == "participant") for r in recs):
                out.append(i)
        return out

    def reap(self) -> None:
        """Processes that ended without us killing them are crashes (survivor crashes)."""
        for i, p in list(self.procs.items()):
            if not p.running() and not p.killed_by_us:
                self.events.append({"t": time.time(), "kind": "crash", "replica": i, "rc": p.returncode})
                self.finished.append(self.procs.pop(i))

    def stop(self) -> None:
        """Replicas first (SIGTERM, 8 s to finish), then the witnesses; then SIGKILL to the whole
        process group, which also takes any grandchild and anything that ignored SIGTERM."""
        try:
            stop_procs(list(self.procs.values()), self.stop_grace)
            for i in list(self.procs):
                p = self.procs.pop(i)
                p.killed_by_us = True  # stopped by us at the end: not a crash
                self.finished.append(p)
            stop_procs(self.witness_procs, 5.0)
        finally:
            self.group.kill()
            self.close_hosts()

    def close_hosts(self) -> None:
        if self.net is not None:
            self.net.close()

    def cpu_by_kind(self) -> dict[str, float]:
        """CPU seconds of every process that exited, summed per kind (replica, joiner, witness...)."""
        out: dict[str, float] = {}
        for p in [*self.finished, *self.witness_procs]:
            if p.cpu_s is not None:
                out[p.kind] = round(out.get(p.kind, 0.0) + p.cpu_s, 2)
        return out

    def leader(self) -> int | None:
        """Ask a live replica's control port who leads Raft; map the leader to a replica index."""
        from ..net import aio
        from ..net.admin import admin_request
        for i in self.live():
            try:
                rep = aio.run(admin_request(self.addrs[i], "admin.members", timeout=1.0))
            except Exception:
                continue
            leader = rep.get("leader")
            for m in rep.get("members", []):
                if m["node"] == leader:
                    rid = str(m["replica_id"])
                    if rid.startswith("r") and rid[1:].isdigit():
                        return int(rid[1:])
        return None

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

    def targets(self, training: list[int], live: list[int], leader: int | None) -> list[int]:
        """Victims among the replicas that train (a failure of a process still importing torch
        tests nothing), except that a destructive fault never takes the last replica that holds
        the model state while the others are still starting: that kills every in-memory copy
        and measures disk recovery (covered by tests/integration/test_reliability.py), and on
        an overloaded machine, where a restart takes longer than the kill interval, it would
        happen in most runs. A starting replica fails instead; with nobody else alive, nobody."""
        if self.cfg.fault == "pause" or len(training) >= 2:
            pool = training or live
        else:
            pool = [i for i in live if i not in training]
        if not pool:
            return []
        if self.cfg.fault == "leader" and leader is not None and leader in pool:
            return [leader]
        if self.cfg.fault == "two":
            return self.rng.sample(pool, min(2, len(pool) - 1 if pool is training else len(pool)))
        return [self.rng.choice(pool)]


def stop_procs(procs: list[Proc], grace: float) -> None:
    """SIGTERM (a paused process is continued first), ``grace`` seconds to exit, then SIGKILL."""
    for p in procs:
        if p.paused:
            os.kill(p.popen.pid, signal.SIGCONT)
            p.paused = False
        if p.running():
            p.popen.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in procs:
        if p.running(timeout=max(0.1, deadline - time.monotonic())):
            p.killed_by_us = True
            p.popen.kill()
            p.running(timeout=5)
