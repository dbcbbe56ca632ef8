"""The one buffer a step allreduces: gradients, who contributed, and at which step.

Layout: ``[gradients][mask: K slots][contributor count][steps: K slots]``. A contributor writes
1.0 at its slot in the mask, 1.0 at the count, and ``step + 1`` at its slot in the steps
region. After the sum, every rank reads the *same* mask, divisor and per-slot steps from the
same reduced buffer, so all ranks take the same decision (commit, or discard because some
participant is behind after a partially committed earlier step) without another round trip.
Steps travel as float32, exact below 2**24 (16.7M steps).
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

from .gradbuf import GradBuffer, SlotCollisionError

MAX_EXACT_STEP = (1 << 24) - 2


class StepBuffer(GradBuffer):
    def __init__(self, params: Iterable[torch.nn.Parameter], max_slots: int = 256,
                 device: torch.device | str | None = None) -> None:
        super().__init__(params, max_slots=max_slots, device=device)
        base = self.flat
        self.flat = torch.zeros(base.numel() + max_slots, dtype=base.dtype, device=base.device)
        offset = 0
        self._views = []
        for p in self.params:
            self._views.append(self.flat[offset:offset + p.numel()].view(p.shape))
            offset += p.numel()
        self._count_index = self.grad_numel + max_slots

    @property
    def tail(self) -> torch.Tensor:
        return self.flat[self.grad_numel:self.grad_numel + self.max_slots]

    @property
    def steps_region(self) -> torch.Tensor:
        return self.flat[self._count_index + 1:]

    def contributors(self) -> int:
        return int(round(float(self.flat[self._count_index])))

    def _check_pack(self, slot: int | None, step: int) -> None:
        if step > MAX_EXACT_STEP:
            raise ValueError(f"step {step} is too large to travel exactly in float32")
        if slot is not None and not 0 <= slot < self.max_slots:
            raise ValueError(f"slot must be in [0, {self.max_slots}), got {slot!r}")

    def pack_step(self, slot: int | None, step: int) -> None:
        """Pack local gradients for `slot` at `step` (slot None: contribute nothing)."""
        self._check_pack(slot, step)
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
        self.flat[self._count_index] = 1.0
        self.flat[self._count_index + 1 + slot] = float(step + 1)

    def pack(self, slot: int | None) -> None:  # GradBuffer API: step 0
        self.pack_step(slot, 0)

    def slot_steps(self) -> dict[int, int]:
        """slot -> step of every contributor, read from the reduced buffer."""
        mask = self.mask()
        steps = self.steps_region.tolist()
        out: dict[int, int] = {}
        for i, on in enumerate(mask):
            if on:
                v = int(round(steps[i])) - 1
                if v < 0:
                    raise SlotCollisionError(f"slot {i} contributed without a step")
                out[i] = v
        return out
