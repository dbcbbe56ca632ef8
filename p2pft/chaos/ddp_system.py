"""Plain PyTorch DDP over Gloo as a chaos system: the job restarts as a whole on any failure.

``torchrun`` (elastic) does this for a DDP job: when a rank dies the agent stops every other
rank, waits, and starts them all again with a new rendezvous; they resume from the last disk
checkpoint. ``DdpCluster`` does the same with the same delay the other systems get, so its row
shows what a failure costs a job without in-job fault tolerance. Between failures it is the
plain DDP step, the anchor for p2pft's failure-free overhead.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass, field

from ..deploy.ports import free_ports
from .cluster import Cluster, Proc


@dataclass
class DdpCluster(Cluster):
    """Ranks running ``python -m p2pft.chaos.ddp_worker``; no witnesses, no coordinator."""

    generation: int = field(default=-1, init=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.restarts_all = True
        self.stop_grace = 2.0  # a rank that stops first leaves the others blocked in an allreduce

    def start(self) -> None:
        """Every rank, with a new rendezvous port: the first start and each whole-job restart."""
        self.generation += 1
        host = self.net[0].ip if self.net is not None else "127.0.0.1"
        self.master = f"{host}:{free_ports(1)[0]}"
        for i in range(self.cfg.replicas):
            self.spawn(i)

    def spawn(self, i: int) -> None:
        cfg = self.cfg
        inc = self.incarnations[i]
        self.incarnations[i] += 1
        stats = self.workdir / f"r{i}-{inc}.jsonl"
        cmd = [sys.executable, "-m", "p2pft.chaos.ddp_worker", "--rank", str(i), "--world", str(cfg.replicas),
               "--master", self.master, "--model", cfg.model, "--batch", str(cfg.batch), "--step-delay",
               str(cfg.step_delay), "--stats", str(stats), "--checkpoint-dir", str(self.workdir / "ckpt"),
               "--checkpoint-every", str(cfg.checkpoint_every), "--digest-every", str(cfg.digest_every),
               "--loss-every", "10", "--seed", str(cfg.seed), "--go-file", str(self.go_file), "--generation",
               str(self.generation), *cfg.extra_args]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        if self.net is not None:
            env["GLOO_SOCKET_IFNAME"] = self.net[i].inner   # Gloo on the host's own link
        log = open(self.workdir / f"r{i}-{inc}.log", "wb")
        p = self.group.spawn(self.on_host(i, cmd), stdout=subprocess.DEVNULL, stderr=log, env=env)
        log.close()
        now = time.time()
        self.procs[i] = Proc(i, inc, p, now, stats)
        self.events.append({"t": now, "kind": "start" if inc == 0 else "restart", "replica": i})

    def extra_hosts(self) -> int:
        return 0   # no witnesses, no coordinator: rank 0 hosts the rendezvous

    def leader(self) -> int | None:
        return None  # no leader: every rank is as fatal as any other
