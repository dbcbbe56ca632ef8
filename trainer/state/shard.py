"""Shard-local state of an FSDP2 model: snapshot, restore and digest.

Under FSDP2 (``fully_shard``) every parameter, gradient and optimizer moment is a ``DTensor``
whose local tensor is this rank's shard. Across replicas, rank i allreduces only its own
shards with rank i of the others, so everything here works on ``_local`` tensors (the step
buffer, ``trainer/kernel/stepbuf.py``, packs local gradient shards too): a catch-up snapshot holds the
local parameter and optimizer shards, and the digest hashes exactly those bytes (rank i of two replicas at the
same step must hash equal). AdamW is elementwise, so shard i's state depends only on shard i's
mean gradients: each rank can restore and replay its own shard independently.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import cast

import torch
from torch import nn

from .whole import _cpu_copy, _group_names, _msgpack_check, _plain, _tuples, state_digest
from ..kernel.stepbuf import local

FORMAT = "p2pft-shard-1"
_GROUP_SKIP = ("params", "param_names")


def capture_shard(model: nn.Module, optimizer: torch.optim.Optimizer,
                  extra: dict[str, object]) -> tuple[dict[str, object], dict[str, torch.Tensor]]:
    """CPU copies of this rank's parameter and optimizer shards (call at a step boundary)."""
    tensors: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        tensors[f"param/{name}"] = _cpu_copy(local(p))
    groups: list[dict[str, object]] = []
    state: dict[str, dict[str, object]] = {}
    for group, names in zip(optimizer.param_groups, _group_names(model, optimizer)):
        groups.append({k: _plain(v) for k, v in group.items() if k not in _GROUP_SKIP
                       and not isinstance(v, torch.Tensor)})
        for p, name in zip(group["params"], names):
            plain: dict[str, object] = {}
            for key, value in optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor):
                    tensors[f"optim/{name}/{key}"] = _cpu_copy(local(value))
                    plain[key] = "dtensor" if local(value) is not value else "tensor"
                else:
                    plain[key] = _plain(value)
            state[name] = plain
    meta: dict[str, object] = {"format": FORMAT, "groups": groups, "state": state, "extra": extra}
    _msgpack_check("shard snapshot meta", meta)
    return meta, tensors


def restore_shard(model: nn.Module, optimizer: torch.optim.Optimizer, meta: Mapping[str, object],
                  tensors: dict[str, torch.Tensor]) -> None:
    """Load a capture_shard snapshot in place: bitwise equal to the donor's shard afterwards."""
    if meta.get("format") != FORMAT:
        raise ValueError(f"not a shard snapshot: {meta.get('format')!r}")
    params = dict(model.named_parameters())
    for name, p in params.items():
        src = tensors.get(f"param/{name}")
        if src is None or src.shape != local(p).shape or src.dtype != p.dtype:
            raise ValueError(f"shard snapshot does not match parameter {name!r}")
    with torch.no_grad():
        for name, p in params.items():
            local(p).copy_(tensors[f"param/{name}"])
        saved_groups = cast("list[dict[str, object]]", meta["groups"])   # as capture_shard wrote them
        for group, saved, names in zip(optimizer.param_groups, saved_groups, _group_names(model, optimizer)):
            for k, v in saved.items():
                group[k] = _tuples(v)
            for p, name in zip(group["params"], names):
                entry: dict[str, object] = {}
                for key, kind in cast("dict[str, dict[str, object]]", meta["state"]).get(name, {}).items():
                    if kind in ("dtensor", "tensor"):
                        src = tensors[f"optim/{name}/{key}"]
                        if kind == "dtensor":
                            dst = torch.zeros_like(p)
                            local(dst).copy_(src)
                        else:
                            dst = src.clone()
                        entry[key] = dst
                    else:
                        entry[key] = _tuples(kind)
                if entry:
                    optimizer.state[p] = entry
                else:
                    optimizer.state.pop(p, None)


def shard_digest(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> str:
    """blake2b over this rank's parameter shards, optimizer shards and group hyperparameters."""
    return state_digest(model, optimizer, view=local, buffers=False)
