"""A replica's shape, the second component of every algorithm: one rank, or R FSDP ranks.

An algorithm says what a round reduces and how its mean is applied (``kernel/algorithm.py``); the
shape says how many ranks the replica has and how they agree (``ReplicaGroup``), how its state
travels (the whole model, or each rank's shard: ``state/layouts.py``), where each rank serves
(its data server) and which rank runs the control plane. ``FaultTolerant`` is the mean of
gradients on a one-rank shape, ``HSDP`` the same algorithm on a sharded one; any algorithm builds
its kernel through ``Shape.kernel``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from ...runtime import Runtime
from ...transport import DataServer
from ...transport.addr import advertised, data_bind_host
from ..compose import kernel
from ..kernel.algorithm import Algorithm
from ..kernel.engine import StepEngine, data_server_of
from ..kernel.group import DistGroup, LocalGroup, ReplicaGroup
from ..kernel.options import Options, UpdateRule
from ..kernel.state_io import StateIO
from ..state.layouts import SHARD_STATE, WHOLE_STATE


@dataclass(frozen=True)
class Shape:
    """The ranks of one replica and how its state travels. ``runtime``: rank 0's (None on the
    other ranks of a sharded replica, whose ``comm_timeout`` and ``secret`` then come from the
    options)."""

    runtime: Runtime | None
    group: ReplicaGroup
    layout: StateIO
    data_server: DataServer

    @classmethod
    def one_rank(cls, runtime: Runtime) -> Shape:
        """A replica of one rank holding the whole model; it serves on the Runtime's data server."""
        return cls(runtime, LocalGroup(), WHOLE_STATE, data_server_of(runtime))

    @classmethod
    def sharded(cls, runtime: Runtime | None, data_server: DataServer, group: ProcessGroup | None = None) -> Shape:
        """One rank of an FSDP replica (``fully_shard`` over `group`): each rank its shard and its
        own data server, rank i reducing with rank i of the other replicas."""
        return cls(runtime, DistGroup(group), SHARD_STATE, data_server)

    @classmethod
    def launch(cls, *, replica_id: str, listen: str, seeds: list[str], secret: bytes | None = None,
               data_host: str | None = None, runtime_kw: dict[str, Any] | None = None,
               group: ProcessGroup | None = None) -> Shape:
        """Collective over the replica's ranks: every rank opens its data server and reports the
        address to rank 0, which starts the Runtime announcing all of them (one per shard). The
        data ports bind the host of `listen` unless `data_host` says otherwise."""
        ds = DataServer(data_bind_host(listen, data_host), 0, secret=secret)
        adv = (runtime_kw or {}).get("advertise")
        addrs = DistGroup(group).agree(advertised(ds.addr, advertise=adv, toward=seeds))
        rt = None
        if dist.get_rank(group) == 0:
            rt = Runtime(replica_id=replica_id, listen=listen, seeds=seeds, data_addrs=addrs,
                         shards=len(addrs), secret=secret, **(runtime_kw or {})).start()
        dist.barrier(group)
        return cls.sharded(rt, ds, group)

    def close(self) -> None:
        """Leave and close what ``launch`` opened (the Runtime on rank 0, every rank's data server)."""
        if self.runtime is not None:
            self.runtime.close(leave=True)
        self.data_server.close()

    def kernel(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, algorithm: Algorithm,
               options: Options, *, span: int = 1, update: UpdateRule | None = None) -> StepEngine:
        """The step kernel of this rank driving `algorithm` (`span`: the loop's steps per round;
        `update`: the kernel's update rule when not the options' own, e.g. DiLoCo's outer step)."""
        rt = self.runtime
        eng = options.engine(comm_timeout=rt.comm_timeout if rt is not None else None,
                             secret=rt.secret if rt is not None else None, span=span, update=update)
        return kernel(model, optimizer, algorithm, group=self.group, runtime=rt, data_server=self.data_server,
                      state_io=self.layout, options=eng)


__all__ = ["Shape"]
