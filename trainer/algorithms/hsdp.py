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

from typing import Any, Callable

import torch
import torch.distributed as dist

from ...runtime import Runtime
from ...transport import DataServer
from ...transport.addr import advertised, data_bind_host
from ..kernel.attempt import StepResult
from ..kernel.engine import StepEngine
from ..kernel.errors import StepTimeout, Stopped
from ..kernel.group import DistGroup
from ..kernel.options import JobOptions
from ..kernel.options import (Capacity, CheckpointOptions, DataPlaneOptions, EngineOptions, Timeouts, UpdateRule,
                              exit_replica)
from ..kernel.state_io import StateIO
from ..kernel.optstep import GradHook
from ..state.shard import capture_shard, restore_shard, shard_digest
from ..state.user import Stateful

__all__ = ["HSDP", "StepResult", "StepTimeout", "Stopped", "agree"]

SHARD_STATE = StateIO(capture=capture_shard, restore=restore_shard, digest=shard_digest, copy_between_steps=False)


def agree(obj: Any, group: Any = None) -> list[Any]:
    """All-gather one small picklable object per rank of the replica (in rank order)."""
    return DistGroup(group).agree(obj)


class HSDP(StepEngine):
    """One rank of a multi-rank replica. Rank 0 passes the Runtime; the others pass None."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, data_server: DataServer,
                 runtime: Runtime | None, batch_per_replica: int,
                 nominal_replicas: int | None = UpdateRule.nominal_replicas, lr_policy: str = UpdateRule.lr_policy,
                 max_slots: int = Capacity.max_slots, replay_cap_bytes: int = Capacity.shard_replay_cap_bytes,
                 step_timeout: float = Timeouts.step_timeout, comm_timeout: float = Timeouts.comm_timeout,
                 secret: bytes | None = DataPlaneOptions.secret,
                 state_rate_limit: float | None = DataPlaneOptions.state_rate_limit, group: Any = None,
                 rank_timeout: float = Timeouts.rank_timeout, on_rank_lost: Callable[[int, float], None] = exit_replica,
                 loop_timeout: float | None = Timeouts.loop_timeout, lr_scheduler: Any = None, grad_scaler: Any = None,
                 grad_hook: GradHook | None = None, after_step: GradHook | None = None,
                 state: dict[str, Stateful] | None = None, data_plane: str | None = DataPlaneOptions.data_plane,
                 recent_keep: int = Capacity.recent_keep, checkpoint_dir: str | None = None,
                 checkpoint_every: int = 0, resume: bool = True,
                 total_steps: int | None = None, total_samples: int | None = None,
                 min_replicas: int = JobOptions.min_replicas, start_timeout: float = JobOptions.start_timeout,
                 resume_grace: float = JobOptions.resume_grace,
                 allow_restart_from_scratch: bool = JobOptions.allow_restart_from_scratch,
                 on_finished: str = JobOptions.on_finished.value,
                 initial_state: str = JobOptions.initial_state.value,
                 finish_timeout: float = JobOptions.finish_timeout) -> None:
        options = EngineOptions(
            batch_per_replica=batch_per_replica,
            timeouts=Timeouts(step_timeout=step_timeout, comm_timeout=comm_timeout, loop_timeout=loop_timeout,
                              rank_timeout=rank_timeout),
            update=UpdateRule(lr_policy=lr_policy, nominal_replicas=nominal_replicas, lr_scheduler=lr_scheduler,
                              grad_scaler=grad_scaler, grad_hook=grad_hook, after_step=after_step),
            capacity=Capacity(max_slots=max_slots, recent_keep=recent_keep, replay_cap_bytes=replay_cap_bytes),
            data=DataPlaneOptions(data_plane=data_plane, secret=secret, state_rate_limit=state_rate_limit),
            state=dict(state or {}), on_rank_lost=on_rank_lost,
            job=JobOptions.make(total_steps=total_steps, total_samples=total_samples, min_replicas=min_replicas,
                                start_timeout=start_timeout, resume_grace=resume_grace,
                                allow_restart_from_scratch=allow_restart_from_scratch, on_finished=on_finished,
                                initial_state=initial_state, finish_timeout=finish_timeout),
            checkpoint=CheckpointOptions.of(checkpoint_dir, checkpoint_every, resume))
        super().__init__(model, optimizer, group=DistGroup(group), runtime=runtime, data_server=data_server,
                         state_io=SHARD_STATE, options=options)
        self._start_control()

    @classmethod
    def launch(cls, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, replica_id: str, listen: str,
              seeds: list[str], secret: bytes | None = None, data_host: str | None = None,
              runtime_kw: dict[str, Any] | None = None, **kw: Any) -> "HSDP":
        """Collective over the replica: every rank opens its data server and reports the address
        to rank 0, which starts the Runtime announcing all of them (one per shard). The data
        ports bind the host of `listen` unless `data_host` says otherwise."""
        ds = DataServer(data_bind_host(listen, data_host), 0, secret=secret)
        adv = (runtime_kw or {}).get("advertise")
        addrs = agree(advertised(ds.addr, advertise=adv, toward=seeds), kw.get("group"))
        rt = None
        if dist.get_rank(kw.get("group")) == 0:
            rt = Runtime(replica_id=replica_id, listen=listen, seeds=seeds, data_addrs=addrs,
                         shards=len(addrs), secret=secret, **(runtime_kw or {})).start()
        dist.barrier(kw.get("group"))
        return cls(model, optimizer, data_server=ds, runtime=rt, secret=secret, **kw)

    def commit(self) -> StepResult:
        """Collective over the replica's ranks: allreduce every shard, agree, retry, apply."""
        return self.commit_step()

    def digests(self) -> list[str]:
        """Collective: every rank's shard digest (parameters + optimizer state), in rank order."""
        return self.group.agree(self.digest())

    def full_digest(self) -> str:
        """Collective: the digest of the whole (unsharded) parameters, as a plain PyTorch
        process that loads this replica's checkpoint into an unsharded model computes it
        (``p2pft.trainer.state.whole.params_digest``)."""
        from ..state.whole import params_digest
        full = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p.detach())
                for n, p in self.model.named_parameters()}
        return params_digest(full)

    def close(self) -> None:
        super().close()
        if self.rt is not None:
            self.rt.close(leave=True)
        self.ds.close()
