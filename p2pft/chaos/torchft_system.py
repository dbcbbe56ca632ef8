"""torchft 0.2.0 as a chaos system: one lighthouse plus one torchft replica process per replica.

It runs under the same schedule and the same harness rules as p2pft: the harness restarts a
replica only when the harness killed it; a replica that exits on its own is a survivor crash
(``Cluster.reap`` records it) and stays down, exactly as a p2pft replica that crashed would.
``P2PFT_TORCHFT_MAX_RESTARTS`` opts in to torchrun-style restarts of crashed replicas (still
counted as crashes), and ``P2PFT_TORCHFT_GRADS`` picks a manual ``manager.allreduce`` (default:
torchft's best mode, it survives a killed replica) or torchft's DDP wrapper (whose comm hook
crashes every survivor of a kill in 0.2.0); docs/torchft.md explains both. The lighthouse is torchft's central
coordinator; it is started with the replicas and stopped after them, and is never a failure
target (the schedule hits replicas only).

With ``--spares N`` torchft gets what p2pft gets: N more replicas, run in torchft's
``WorldSizeMode.FIXED_WITH_SPARES`` with ``min_replica_size`` = the planned replica count, so the
replicas beyond it allreduce zeros and stay current, and one of them takes a lost participant's
rank in the next quorum.

With ``--algo diloco`` the replicas are torchft's DiLoCo on the GPT recipe
(``torchft_diloco_worker.py``: ``torchft.local_sgd.DiLoCo``, healing through its PG transport,
the hour-long quorum timeout its Manager's docs ask for DiLoCo), under the same lighthouse
settings: the row beside p2pft's DiLoCo on the same schedule.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..deploy.ports import free_ports
from .cluster import ChaosConfig, Cluster, Proc, stop_procs

# Lighthouse settings. torchft's README starts it with --min_replicas 1 --quorum_tick_ms 100
# --join_timeout_ms 10000 (heartbeat timeout default 5000 ms). The two timeouts bound how long
# survivors wait for a dead replica before forming a smaller quorum, so they are set low here to
# give torchft its best failover on one machine; see docs/torchft.md. The minimum is a majority
# of the planned replicas (``lighthouse_min_replicas``), not 1: with 1, on hosts, a survivor and a
# restarted replica formed disjoint quorums of one and trained apart (divergent digests).
LIGHTHOUSE_MIN_REPLICAS = 1   # lighthouse_command's default, as torchft's README starts it
LIGHTHOUSE_QUORUM_TICK_MS = 100
LIGHTHOUSE_JOIN_TIMEOUT_MS = 1000
LIGHTHOUSE_HEARTBEAT_TIMEOUT_MS = 1000
# torchft's DiLoCo: the lighthouse as torchft's DiLoCo example starts it (--join_timeout_ms 10000)
# with the default heartbeat timeout. A sync's quorum then waits for every replica still
# heartbeating to end its span; with 1 s timeouts a replica whose span ended a second after the
# others' was left out, and had to heal (its span lost) at the next sync (docs/diloco.md).
DILOCO_JOIN_TIMEOUT_MS = 10000
DILOCO_HEARTBEAT_TIMEOUT_MS = 5000

GRAD_MODES = ("manual", "ddp")
CRASH_RESTART_DELAY = 1.0   # seconds; an in-place launcher restart, quicker than replacing a host


def lighthouse_min_replicas(replicas: int, spares: int = 0) -> int:
    """torchft's best correct lighthouse minimum for a run: a majority of the planned replicas
    (two quorums can never both form, so a partitioned or restarted replica cannot train apart
    from the survivors), and with spares the planned count itself (FIXED_WITH_SPARES commits only
    with ``min_replica_size`` participants, so a smaller quorum could never commit)."""
    if replicas < 1 or spares < 0:
        raise ValueError(f"replicas must be >= 1 and spares >= 0, got {replicas}, {spares}")
    return replicas if spares else replicas // 2 + 1


def lighthouse_command(bind: str, min_replicas: int = LIGHTHOUSE_MIN_REPLICAS,
                       join_timeout_ms: int = LIGHTHOUSE_JOIN_TIMEOUT_MS,
                       quorum_tick_ms: int = LIGHTHOUSE_QUORUM_TICK_MS,
                       heartbeat_timeout_ms: int = LIGHTHOUSE_HEARTBEAT_TIMEOUT_MS) -> list[str]:
    """The ``torchft_lighthouse`` command line, from the interpreter's own environment first."""
    flags = ["--bind", bind, "--min_replicas", str(min_replicas), "--join_timeout_ms", str(join_timeout_ms),
             "--quorum_tick_ms", str(quorum_tick_ms), "--heartbeat_timeout_ms", str(heartbeat_timeout_ms)]
    exe = shutil.which("torchft_lighthouse", path=str(Path(sys.executable).parent)) or shutil.which(
        "torchft_lighthouse")
    if exe:
        return [exe, *flags]
    # The console script is missing (e.g. a vendored install): call the same entry point.
    return [sys.executable, "-c", "import sys; from torchft._torchft import lighthouse_main; "
            "sys.argv[0] = 'torchft_lighthouse'; lighthouse_main()", *flags]


def spare_args(replicas: int, spares: int) -> list[str]:
    """The worker flags for a run with ``spares`` torchft spares (none without spares).

    ``min_replica_size`` is the planned count: a step commits only with that many participants,
    as p2pft's ``--max-participants`` caps its view at the same count.
    """
    if spares < 0:
        raise ValueError("spares must be 0 or more")
    if not spares:
        return []
    return ["--world-size-mode", "fixed_with_spares", "--min-replica-size", str(replicas)]


def worker_command(cfg: ChaosConfig, i: int, stats: Path, lighthouse_url: str, go_file: Path, grads: str,
                   spares: int = 0, host: str | None = None, worker_args: list[str] | None = None) -> list[str]:
    """The command line of torchft replica ``i`` (``python -m p2pft.chaos.torchft_worker ...``)."""
    cmd = [sys.executable, "-m", "p2pft.chaos.torchft_worker", "--replica", str(i),
           "--replicas", str(cfg.replicas), "--lighthouse", lighthouse_url, "--model", cfg.model,
           "--batch", str(cfg.batch), "--step-delay", str(cfg.step_delay), "--stats", str(stats),
           "--digest-every", str(cfg.digest_every), "--seed", str(cfg.seed), "--loss-every", "10",
           "--go-file", str(go_file), "--grads", grads, *spare_args(cfg.replicas, spares),
           *(worker_args or []), *cfg.extra_args]
    if host is not None:
        cmd += ["--host", host]
    return cmd


def diloco_worker_command(cfg: ChaosConfig, i: int, stats: Path, lighthouse_url: str, go_file: Path,
                          host: str | None = None) -> list[str]:
    """The command line of torchft DiLoCo replica ``i`` on the GPT recipe (``--algo diloco``)."""
    cmd = [sys.executable, "-m", "p2pft.chaos.torchft_diloco_worker", "--replica", str(i),
           "--replicas", str(cfg.replicas), "--lighthouse", lighthouse_url, "--model", cfg.model,
           "--batch", str(cfg.batch), "--sync-every", str(cfg.sync_every), "--step-delay", str(cfg.step_delay),
           "--stats", str(stats), "--digest-every", str(cfg.digest_every), "--seed", str(cfg.seed),
           "--go-file", str(go_file), *cfg.extra_args]
    if host is not None:
        cmd += ["--host", host]
    return cmd


def loopback_ifname() -> str | None:
    """Name of the loopback interface, so Gloo's data plane stays on 127.0.0.1."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    for cand in ("lo", "lo0"):
        if cand in names:
            return cand
    return None


@dataclass
class TorchftCluster(Cluster):
    """Replicas running ``python -m p2pft.chaos.torchft_worker`` around one torchft lighthouse."""

    grads: str = field(default_factory=lambda: os.environ.get("P2PFT_TORCHFT_GRADS", "manual"))
    max_restarts: int = field(default_factory=lambda: int(os.environ.get("P2PFT_TORCHFT_MAX_RESTARTS", "0")))
    #: the lighthouse's --min_replicas; None: ``lighthouse_min_replicas`` (P2PFT_TORCHFT_MIN_REPLICAS overrides)
    min_replicas: int | None = field(default_factory=lambda: int(os.environ["P2PFT_TORCHFT_MIN_REPLICAS"])
                                     if os.environ.get("P2PFT_TORCHFT_MIN_REPLICAS") else None)
    worker_args: list[str] = field(default_factory=list)
    lighthouse: subprocess.Popen[bytes] | None = field(default=None, init=False)
    lighthouse_proc: Proc | None = field(default=None, init=False)  # the same process, with its CPU time
    lighthouse_down: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.grads not in GRAD_MODES:
            raise ValueError(f"P2PFT_TORCHFT_GRADS must be one of {', '.join(GRAD_MODES)}, got {self.grads!r}")
        if self.max_restarts < 0:
            raise ValueError("P2PFT_TORCHFT_MAX_RESTARTS must be >= 0")
        if self.cfg.algo == "diloco" and self.spares:
            raise ValueError("torchft's DiLoCo row runs without spares")
        if self.min_replicas is not None and not 1 <= self.min_replicas <= self.size:
            raise ValueError(f"P2PFT_TORCHFT_MIN_REPLICAS must be in [1, {self.size}], got {self.min_replicas}")
        # --hosts netns: the lighthouse on a host of its own, after the replicas' hosts.
        lh_host = self.net[self.lighthouse_host].ip if self.net is not None else "127.0.0.1"
        self.lighthouse_addr = f"{lh_host}:{free_ports(1)[0]}"
        self.crash_restarts = [0] * self.size
        self.pending_crash_restarts: dict[int, float] = {}

    def lighthouse_cmd(self) -> list[str]:
        """The lighthouse never forms a minority quorum (``lighthouse_min_replicas``): with
        ``--min_replicas 1`` a restarted replica and the survivors formed separate quorums (on
        hosts they trained apart; with spares none could commit, and they never merged)."""
        chosen = self.min_replicas if self.min_replicas is not None else lighthouse_min_replicas(self.cfg.replicas,
                                                                                                 self.spares)
        if self.cfg.algo == "diloco":
            return lighthouse_command(self.lighthouse_addr, min_replicas=chosen, join_timeout_ms=DILOCO_JOIN_TIMEOUT_MS,
                                      heartbeat_timeout_ms=DILOCO_HEARTBEAT_TIMEOUT_MS)
        return lighthouse_command(self.lighthouse_addr, min_replicas=chosen)

    @property
    def lighthouse_host(self) -> int:
        """The lighthouse's host: the one after every replica's, spares included."""
        return self.size

    @property
    def lighthouse_url(self) -> str:
        return f"http://{self.lighthouse_addr}"

    def start_lighthouse(self) -> None:
        """Launch the lighthouse without waiting for it.

        Its console script imports torch (seconds on a loaded machine); the replicas import torch
        too and their managers retry the connection, so the two startups overlap instead of
        delaying the replicas.
        """
        if self.lighthouse_proc is not None and self.lighthouse_proc.running():
            return
        log = open(self.workdir / "lighthouse.log", "ab")
        env = dict(os.environ, RUST_BACKTRACE="1")
        p = self.group.spawn(self.on_host(self.lighthouse_host, self.lighthouse_cmd()), stdout=log,
                             stderr=subprocess.STDOUT, env=env)
        log.close()
        self.lighthouse = p
        self.lighthouse_proc = Proc(-1, 0, p, time.time(), self.workdir / "lighthouse.log", kind="lighthouse")
        self.lighthouse_down = False

    def extra_hosts(self) -> int:
        return 1   # the lighthouse's

    def start(self) -> None:
        """Lighthouse and replicas; no p2pft witness peers (torchft's coordinator is the lighthouse)."""
        self.start_lighthouse()
        for i in range(self.size):  # the planned replicas, then the spares
            self.spawn(i)

    def spawn(self, i: int) -> None:
        cfg = self.cfg
        inc = self.incarnations[i]
        self.incarnations[i] += 1
        stats = self.workdir / f"r{i}-{inc}.jsonl"
        host = self.net[i].ip if self.net is not None else None
        if cfg.algo == "diloco":
            cmd = diloco_worker_command(cfg, i, stats, self.lighthouse_url, self.go_file, host=host)
        else:
            cmd = worker_command(cfg, i, stats, self.lighthouse_url, self.go_file, self.grads, spares=self.spares,
                                 host=host, worker_args=self.worker_args)
        env: dict[str, Any] = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                                   TORCHFT_LIGHTHOUSE=self.lighthouse_url, REPLICA_GROUP_ID=str(i),
                                   NUM_REPLICA_GROUPS=str(cfg.replicas))
        ifname = self.net[i].inner if self.net is not None else loopback_ifname()
        if ifname:
            env["GLOO_SOCKET_IFNAME"] = ifname
        err = open(self.workdir / f"r{i}-{inc}.log", "wb")
        p = self.group.spawn(self.on_host(i, cmd), stdout=err, stderr=subprocess.STDOUT, env=env)
        err.close()
        now = time.time()
        self.procs[i] = Proc(i, inc, p, now, stats, kind="replica" if inc == 0 else "joiner")
        self.events.append({"t": now, "kind": "start" if inc == 0 else "restart", "replica": i})

    def reap(self) -> None:
        """Replica crashes as in Cluster; a lighthouse that dies is logged as its own event.

        With ``max_restarts`` > 0 a crashed replica is started again after CRASH_RESTART_DELAY,
        as ``torchrun --max-restarts`` (torchft's torchx component) would do; the crash is still
        recorded and counted. Off by default: every system gets the same harness rules.
        """
        seen = len(self.events)
        super().reap()
        now = time.time()
        for e in self.events[seen:]:
            i = e["replica"]
            if e["kind"] == "crash" and self.crash_restarts[i] < self.max_restarts:
                self.crash_restarts[i] += 1
                self.pending_crash_restarts[i] = now + CRASH_RESTART_DELAY
        for i, due in list(self.pending_crash_restarts.items()):
            if now >= due:
                del self.pending_crash_restarts[i]
                if i not in self.procs:
                    self.spawn(i)
        lh = self.lighthouse_proc
        if lh is not None and not lh.running() and not self.lighthouse_down:
            self.lighthouse_down = True
            self.events.append({"t": time.time(), "kind": "lighthouse_exit", "replica": -1, "rc": lh.returncode})

    def stop(self) -> None:
        self.pending_crash_restarts.clear()
        try:
            super().stop()
        finally:
            self.stop_lighthouse()
            super().close_hosts()

    def close_hosts(self) -> None:
        """Cluster.stop's: the hosts stay until the lighthouse has stopped (see stop)."""

    def stop_lighthouse(self) -> None:
        lh = self.lighthouse_proc
        if lh is None or self.lighthouse is None:
            return
        try:
            stop_procs([lh], 5.0)
        finally:
            self.group.kill()
        self.lighthouse = None

    def cpu_by_kind(self) -> dict[str, float]:
        out = super().cpu_by_kind()
        lh = self.lighthouse_proc
        if lh is not None and lh.cpu_s is not None:
            out["lighthouse"] = round(lh.cpu_s, 2)
        return out
