"""One flat buffer per step that carries gradients and the contribution mask in a single allreduce.

Layout: [all gradients, flattened, float32][max_slots mask entries][contributor count]. Each
contributor writes 1.0 at its slot and at the count; after the sum every replica reads the same
mask and the same divisor from the same reduced buffer, so no extra round trip is needed to agree
on who contributed. The packed local contribution can be saved and restored, so a failed
allreduce is retried on the next view without recomputing forward and backward.
"""
from __future__ import annotations

import math
from collections.abc import Iterable

import torch


class SlotCollisionError(RuntimeError):
    """Two contributors wrote the same mask slot: the slot assignment is inconsistent."""


class GradBuffer:
    """Packs the gradients of `params` into one float32 tensor, with a contribution-mask tail."""

    def __init__(
        self, params: Iterable[torch.nn.Parameter], max_slots: int = 256, device: torch.device | str | None = None
    ) -> None:
        self.params = list(params)
        if not self.params:
            raise ValueError("GradBuffer needs at least one parameter")
        if isinstance(max_slots, bool) or not isinstance(max_slots, int) or max_slots < 1:
            raise ValueError(f"max_slots must be a positive int, got {max_slots!r}")
        devices = {p.device for p in self.params}
        if device is None:
            if len(devices) > 1:
                raise ValueError(f"parameters live on several devices {sorted(map(str, devices))}; pass device=")
            device = devices.pop()
        for p in self.params:
            if not p.dtype.is_floating_point:
                raise ValueError(f"parameter of dtype {p.dtype} cannot carry gradients")
        self.max_slots = max_slots
        self.grad_numel = sum(p.numel() for p in self.params)
        self.flat = torch.zeros(self.grad_numel + max_slots + 1, dtype=torch.float32, device=device)
        self._views: list[torch.Tensor] = []
        self._offsets: list[int] = []
        offset = 0
        for p in self.params:
            self._views.append(self.flat[offset:offset + p.numel()].view(p.shape))
            self._offsets.append(offset)
            offset += p.numel()
        self._saved: torch.Tensor | None = None

    @property
    def tail(self) -> torch.Tensor:
        """The mask slots (a view into `flat`)."""
        return self.flat[self.grad_numel:self.grad_numel + self.max_slots]

    def pack(self, slot: int | None) -> None:
        """Copy local gradients in and mark `slot`; None packs zeros (a joiner or a bystander)."""
        if slot is not None and (isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < self.max_slots):
            raise ValueError(f"slot must be None or an int in [0, {self.max_slots}), got {slot!r}")
        if slot is None:
            self.flat.zero_()
            return
        for p, view in zip(self.params, self._views):
            if p.grad is None:
                view.zero_()
            else:
                view.copy_(p.grad)
        self.flat[self.grad_numel:].zero_()
        self.flat[self.grad_numel + slot] = 1.0
        self.flat[-1] = 1.0

    def contributors(self) -> int:
        """How many replicas contributed to the reduced buffer (the divisor for the mean)."""
        return int(round(float(self.flat[-1])))

    def mask(self) -> list[bool]:
        """Which slots contributed, read from the reduced tail; raises if slots collided."""
        tail = self.tail.tolist()
        out: list[bool] = []
        for i, v in enumerate(tail):
            if not math.isfinite(v) or v < -0.5 or v > 1.5:
                raise SlotCollisionError(f"mask slot {i} holds {v} after the allreduce; expected 0 or 1")
            out.append(v > 0.5)
        count = self.contributors()
        if count != sum(out):
            raise SlotCollisionError(f"contributor count {count} disagrees with {sum(out)} marked slots")
        return out

    def unpack(self, divisor: float, source: torch.Tensor | None = None) -> None:
        """Write buffer / divisor into each p.grad (allocating grads that are None).

        `source` (same layout as `flat`) reads another reduced buffer, e.g. a logged step, so
        that a background catch-up never touches the buffer the training thread allreduces."""
        for p, view in zip(self.params, self._unpack_views(divisor, source)):
            if p.grad is None:
                p.grad = torch.empty_like(p)
            if p.grad.dtype == torch.float32 and p.grad.device == self.flat.device:
                torch.div(view, divisor, out=p.grad)
            else:
                p.grad.copy_(view / divisor)

    def _check_unpack(self, divisor: float, source: torch.Tensor | None) -> torch.Tensor:
        """Check the divisor and the source's layout; the buffer to read (default: `flat`)."""
        if isinstance(divisor, bool) or not isinstance(divisor, (int, float)) or not math.isfinite(divisor) or divisor <= 0:
            raise ValueError(f"divisor must be a finite positive number, got {divisor!r}")
        if source is None or source is self.flat:
            return self.flat
        if source.shape != self.flat.shape:
            raise ValueError(f"source of shape {tuple(source.shape)} does not match the buffer {tuple(self.flat.shape)}")
        return source

    def _unpack_views(self, divisor: float, source: torch.Tensor | None) -> list[torch.Tensor]:
        """Check the divisor; the per-parameter views of `source` (default: `flat`)."""
        src = self._check_unpack(divisor, source)
        if src is self.flat:
            return self._views
        return [src[o:o + v.numel()].view(v.shape) for v, o in zip(self._views, self._offsets)]

    def save(self) -> None:
        """Keep a copy of the packed local contribution for a retry."""
        if self._saved is None:
            self._saved = torch.empty_like(self.flat)
        self._saved.copy_(self.flat)

    def restore(self) -> None:
        """Put the saved local contribution back (the buffer may hold a half-reduced sum)."""
        if self._saved is None:
            raise RuntimeError("restore() called before save(): no local contribution was kept")
        self.flat.copy_(self._saved)
