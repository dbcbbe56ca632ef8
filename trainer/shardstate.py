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
        # Plain float32 parameters on the buffer's device get their gradients as views of one
        # flat tensor (as DDP's gradient_as_bucket_view): backward accumulates into it, packing
        # is one copy and the mean one division, instead of an op per parameter on the step's
        # critical path. Not the allreduce buffer itself: a catch-up replays logged steps into
        # the gradients while the training thread reduces `flat`. DTensor shards, other dtypes
        # and gradients the user replaced (zero_grad(set_to_none=True)) take the per-parameter
        # path; the results are bitwise the same.
        plain = all(local(p) is p and p.dtype == torch.float32 and p.device == self.flat.device
                    for p in self.dparams)
        self._grads_gen = 0   # bumped whenever the gradient views are written (unpack, zero)
        # How to pack the last contribution again instead of copying it in save(): (slot, step,
        # gradient generation); None after a per-parameter pack, which save() copies.
        self._repack: tuple[int | None, int, int] | None = None
        self._saved_repack: tuple[int | None, int, int] | None = None
        self.grads: torch.Tensor | None = None
        self._grad_views: list[torch.Tensor] = []
        if plain:
            self.grads = torch.zeros(self.grad_numel, dtype=torch.float32, device=self.flat.device)
            self._grad_views = [self.grads[o:o + v.numel()].view(v.shape) for v, o in zip(self._views, self._offsets)]

    def grads_bound(self) -> bool:
        """Every parameter's gradient is its view of `grads` (what the fast paths need)."""
        if self.grads is None:
            return False
        for p, v in zip(self.dparams, self._grad_views):
            g = p.grad
            if g is None or g.data_ptr() != v.data_ptr():
                return False
        return True

    def zero_grads(self) -> bool:
        """Zero the gradients in place if they are bound views (they stay bound); False if not,
        and the caller clears them its own way."""
        if not self.grads_bound():
            return False
        assert self.grads is not None
        self.grads.zero_()
        self._grads_gen += 1
        return True

    def pack_step(self, slot: int | None, step: int) -> None:
        self._check_pack(slot, step)
        if slot is None:
            self.flat.zero_()
            self._repack = (None, step, -1)
            return
        if self.grads_bound():
            self.flat[:self.grad_numel].copy_(self.grads)
            self.flat[self.grad_numel:].zero_()
            self._repack = (slot, step, self._grads_gen)
        else:
            self.flat.zero_()
            for p, view in zip(self.dparams, self._views):
                if p.grad is not None:
                    view.copy_(local(p.grad).reshape(view.shape))
            self._repack = None
        self.flat[self.grad_numel + slot] = 1.0
        self.flat[self._count_index] = 1.0
        self.flat[self._count_index + 1 + slot] = float(step + 1)

    def unpack(self, divisor: float, source: torch.Tensor | None = None) -> None:
        """Write (source or flat) / divisor into each parameter's local grad shard."""
        if self.grads is not None:
            src = self._check_unpack(divisor, source)
            torch.div(src[:self.grad_numel], divisor, out=self.grads)
            self._grads_gen += 1
            for p, v in zip(self.dparams, self._grad_views):
                g = p.grad
                if g is None or g.data_ptr() != v.data_ptr():
                    p.grad = v
            return
        for p, view in zip(self.dparams, self._unpack_views(divisor, source)):
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            torch.div(view, divisor, out=local(p.grad).view(view.shape))

    def save(self) -> None:
        """Keep the packed contribution for a retry. One packed from the gradient views (or
        nothing) is not copied: restore() packs it again, as nothing writes the gradients
        between a pack and the step's commit."""
        self._saved_repack = self._repack
        if self._repack is None:
            super().save()

    def restore(self) -> None:
        again = self._saved_repack
        if again is None:
            super().restore()
            return
        slot, step, gen = again
        if slot is not None and gen != self._grads_gen:
            raise RuntimeError("the gradients were written since save(): the packed contribution is lost")
        self.pack_step(slot, step)


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
