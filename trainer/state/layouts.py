"""A replica's shape, as its state travels: the whole model on one rank, or one FSDP shard per rank.

The kernel snapshots, restores and digests a replica's state through a ``StateIO``; these are the
two layouts. An algorithm is independent of them: ``FaultTolerant`` and ``DiLoCo`` use the whole
state of a one-rank replica, ``HSDP`` each rank's shard.
"""
from __future__ import annotations

import torch

from ..kernel.state_io import StateIO
from .shard import capture_shard, restore_shard, shard_digest
from .whole import capture, restore, state_digest


def receive_into(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The joiner's own tensors, by snapshot name: the stream lands in them in place (no
    fresh allocation, no copy at restore). They hold nothing worth keeping while the
    replica catches up, and nothing reads them until the restore."""
    into = {f"param/{n}": p.data for n, p in model.named_parameters()}
    into.update({f"buffer/{n}": b for n, b in model.named_buffers()})
    by_param = {id(p): n for n, p in model.named_parameters()}
    for p, st in opt.state.items():
        name = by_param.get(id(p))
        if name is not None:
            into.update({f"optim/{name}/{k}": v for k, v in st.items() if isinstance(v, torch.Tensor)})
    return into


WHOLE_STATE = StateIO(capture=capture, restore=restore, digest=state_digest, receive_into=receive_into)
SHARD_STATE = StateIO(capture=capture_shard, restore=restore_shard, digest=shard_digest, copy_between_steps=False)

__all__ = ["SHARD_STATE", "WHOLE_STATE", "receive_into"]
