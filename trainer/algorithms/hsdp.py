"""``HSDP``: the step protocol for a replica of R ranks sharded with FSDP2 (one object per rank).

Inside the replica the ranks use an ordinary ``torch.distributed`` process group (gloo on CPU,
nccl on GPU) and ``fully_shard``; across replicas rank i allreduces its local gradient shards
with rank i of the others on the communicator of ``(data epoch, shard i)``. Only rank 0 runs a
``p2pft.Runtime``; the other ranks never see gossip. It is the engine of ``FaultTolerant``
with a process group for the in-replica agreement and shard-local state (see engine.py,
docs/hsdp.md): every rank of the replica commits a step or none does, and a replica found
behind catches up shard by shard.
"""
from __future__ import annotations

from typing import Any, TypeVar

import torch
from torch.distributed import ProcessGroup

from ...runtime import Runtime
from ...transport import DataServer
from ..kernel.algorithm import MeanGradient
from ..kernel.attempt import StepResult
from ..kernel.errors import StepTimeout, Stopped
from ..kernel.group import DistGroup
from ..kernel.options import Options
from .front import Front
from .shape import Shape

__all__ = ["HSDP", "StepResult", "StepTimeout", "Stopped", "agree"]

T = TypeVar("T")


def agree(obj: T, group: ProcessGroup | None = None) -> list[T]:
    """All-gather one small picklable object per rank of the replica (in rank order)."""
    return DistGroup(group).agree(obj)


class HSDP(Front):
    """One rank of a multi-rank replica: the mean of the replicas' gradients, rank i reducing its
    shard with rank i of the others. Rank 0 passes the Runtime; the other ranks pass None (their
    ``comm_timeout`` and ``secret`` then come from ``options``). ``group``: the replica's
    process group (None: the default one)."""

    def __init__(self, runtime: Runtime | None, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 options: Options | None = None, *, data_server: DataServer,
                 group: ProcessGroup | None = None, **overrides: object) -> None:
        opts = Options.of(options, **overrides)
        self.ds = data_server
        self.shape = Shape.sharded(runtime, data_server, group)
        self.kernel = self.shape.kernel(model, optimizer, MeanGradient.of(model, opts.max_slots), opts)

    @classmethod
    def launch(cls, model: torch.nn.Module, optimizer: torch.optim.Optimizer, options: Options | None = None, *,
               replica_id: str, listen: str, seeds: list[str], secret: bytes | None = None,
               data_host: str | None = None, runtime_kw: dict[str, Any] | None = None,
               group: ProcessGroup | None = None, **overrides: object) -> "HSDP":
        """Collective over the replica: every rank opens its data server and reports the address
        to rank 0, which starts the Runtime announcing all of them (one per shard): ``Shape.launch``.
        The data ports bind the host of `listen` unless `data_host` says otherwise."""
        shape = Shape.launch(replica_id=replica_id, listen=listen, seeds=seeds, secret=secret, data_host=data_host,
                             runtime_kw=runtime_kw, group=group)
        if "comm_timeout" in (runtime_kw or {}):   # every rank's, as rank 0's Runtime has it
            overrides.setdefault("comm_timeout", (runtime_kw or {})["comm_timeout"])
        return cls(shape.runtime, model, optimizer, options, data_server=shape.data_server, group=group,
                   secret=secret, **overrides)

    def begin(self, stop: bool = False) -> list[int]:
        """Collective over the replica's ranks: this rank's share of the step's samples."""
        return self.kernel.begin(stop)

    def commit(self) -> StepResult:
        """Collective over the replica's ranks: allreduce every shard, agree, retry, apply."""
        return self.kernel.commit()

    def replica_total(self, n: int) -> int:
        """Collective over the replica's ranks: the sum of each rank's `n`. A loss normalised by
        the replica's tokens (torchtitan's ``train_step`` sums the valid tokens over the ranks)
        divides by this, not by one rank's count, which is off by the number of ranks."""
        return sum(self.kernel.group.agree(int(n)))

    def close(self) -> None:
        super().close()
        self.shape.close()   # the Runtime (rank 0) and this rank's data server
