"""Shard-local state of an FSDP2 model: step buffer, snapshot, restore and digest.

Under FSDP2 (``fully_shard``) every parameter, gradient and optimizer moment is a ``DTensor``
whose local tensor is this rank's shard. Across replicas, rank i allreduces only its own
shards with rank i of the others, so everything here works on ``_local`` tensors: the step
buffer packs local gradient shards, a catch-up snapshot holds the local parameter and
optimizer shards, and the digest hashes exactly those bytes (rank i of two replicas at the
same step must hash equal). AdamW is elementwise, so shard i's state depends only on shard i's
mean gradients: each rank can restore and replay its own shard independently.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .state import _cpu_copy, _group_names, _msgpack_check, _plain, _tuples, state_digest
from .stepbuf import StepBuffer

FORMAT = "p2pft-shard-1"
_GROUP_SKIP = ("params", "param_names")


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (the tensor itself otherwise); aliases the storage."""
    lt = getattr(t, "_local_tensor", None)
    return lt if lt is not None else t


class ShardStepBuffer(StepBuffer):
    """A StepBuffer over the local shards of (possibly DTensor) parameters and their grads."""

    def __init__(self, params: list[nn.Parameter], max_slots: int = 256) -> None:
        self.dparams = list(params)
        super().__init__([local(p.detach()) for p in self.dparams], max_slots=max_slots)

    def pack_step(self, slot: int | None, step: int) -> None:
        super().pack_step(None, step)  # validates the step; zeros everything
        if slot is None:
            return
        if not 0 <= slot < self.max_slots:
            raise ValueError(f"slot must be in [0, {self.max_slots}), got {slot!r}")
        for p, view in zip(self.dparams, self._views):
            if p.grad is not None:
                view.copy_(local(p.grad).reshape(view.shape))
        self.flat[self.grad_numel + slot] = 1.0
        self.flat[self._count_index] = 1.0
        self.flat[self._count_index + 1 + slot] = float(step + 1)

    def unpack(self, divisor: float, source: torch.Tensor | None = None) -> None:
        """Write (source or flat) / divisor into each parameter's local grad shard."""
        for p, view in zip(self.dparams, self._unpack_views(divisor, source)):
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            torch.div(view, divisor, out=local(p.grad).view(view.shape))


def capture_shard(model: nn.Module, optimizer: torch.optim.Optimizer,
                  extra: dict[str, Any]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """CPU copies of this rank's parameter and optimizer shards (call at a step boundary)."""
    tensors: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        tensors[f"param/{name}"] = _cpu_copy(local(p))
    groups: list[dict[str, Any]] = []
    state: dict[str, dict[str, Any]] = {}
    for group, names in zip(optimizer.param_groups, _group_names(model, optimizer)):
        groups.append({k: _plain(v) for k, v in group.items() if k not in _GROUP_SKIP
                       and not isinstance(v, torch.Tensor)})
        for p, name in zip(group["params"], names):
            plain: dict[str, Any] = {}
            for key, value in optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor):
                    tensors[f"optim/{name}/{key}"] = _cpu_copy(local(value))
                    plain[key] = "dtensor" if local(value) is not value else "tensor"
                else:
                    plain[key] = _plain(value)
            state[name] = plain
    meta = {"format": FORMAT, "groups": groups, "state": state, "extra": extra}
    _msgpack_check("shard snapshot meta", meta)
    return meta, tensors


def restore_shard(model: nn.Module, optimizer: torch.optim.Optimizer, meta: dict[str, Any],
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
        for group, saved, names in zip(optimizer.param_groups, meta["groups"], _group_names(model, optimizer)):
            for k, v in saved.items():
                group[k] = _tuples(v)
            for p, name in zip(group["params"], names):
                entry: dict[str, Any] = {}
                for key, kind in meta["state"].get(name, {}).items():
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
