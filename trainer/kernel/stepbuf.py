"""The one buffer a step allreduces: gradients, who contributed, and at which step.

Layout: ``[gradients][mask: K slots][contributor count][steps: K slots][held: K data ranks]
[short: K slots]``, float32. A contributor writes 1.0 at its slot in the mask, 1.0 at the count,
and ``step + 1`` at its slot in the steps region; one that trained only the first part of its
slot's samples (a DiLoCo replica back mid-span) writes how many it left untrained in the short
region, so every replica consumes the same samples and divides by the same work
(``Entry.divisor``). Every member that holds the committed state (contributing or not: a hot
spare, a participant demoted for this round) writes ``step + 1`` at its data rank in the held
region (``set_held``). After the sum every rank reads the *same*
mask, divisor, per-slot steps and held steps from the same reduced buffer, so all ranks take the
same decision (commit; or discard because some member is behind, or *ahead*, after a partially
committed earlier step) without another round trip. A member ahead that contributes nothing
still stops the others from committing that step again with other gradients. Steps travel as
float32, exact below 2**24 (16.7M steps).

The gradients are this rank's *local* tensors: the whole parameter for a plain model, the shard
for an FSDP2 ``DTensor``. Plain float32 parameters get their gradients as views of one flat
tensor (as DDP's ``gradient_as_bucket_view``): backward accumulates into it, packing is one copy
and the mean one division, instead of an op per parameter on the step's critical path. It is not
the allreduce buffer itself: a catch-up replays logged steps into the gradients while the
training thread reduces ``flat``. DTensor shards, other dtypes and gradients the user replaced
(``zero_grad(set_to_none=True)``) take the per-parameter path; both give the same bytes.
"""
from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

MAX_EXACT_STEP = (1 << 24) - 2


class SlotCollisionError(RuntimeError):
    """Two contributors wrote the same mask slot: the slot assignment is inconsistent."""


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (the tensor itself otherwise); aliases the storage."""
    lt = getattr(t, "_local_tensor", None)
    return lt if lt is not None else t


class StepBuffer:
    """Packs the local gradients of `params` with the step header into one float32 tensor."""

    def __init__(self, params: Iterable[nn.Parameter], max_slots: int = 256,
                 device: torch.device | str | None = None) -> None:
        self.params = list(params)
        if not self.params:
            raise ValueError("a step buffer needs at least one parameter")
        if isinstance(max_slots, bool) or not isinstance(max_slots, int) or max_slots < 1:
            raise ValueError(f"max_slots must be a positive int, got {max_slots!r}")
        shards = [local(p.detach()) for p in self.params]
        for s in shards:
            if not s.dtype.is_floating_point:
                raise ValueError(f"parameter of dtype {s.dtype} cannot carry gradients")
        if device is None:
            devices = {s.device for s in shards}
            if len(devices) > 1:
                raise ValueError(f"parameters live on several devices {sorted(map(str, devices))}; pass device=")
            device = devices.pop()
        self.max_slots = max_slots
        self.grad_numel = sum(s.numel() for s in shards)
        self._count_index = self.grad_numel + max_slots
        self._held_index = self._count_index + 1 + max_slots
        self._short_index = self._held_index + max_slots
        self.flat = torch.zeros(self._short_index + max_slots, dtype=torch.float32, device=device)
        self._offsets: list[int] = []
        self._views: list[torch.Tensor] = []
        offset = 0
        for s in shards:
            self._offsets.append(offset)
            self._views.append(self.flat[offset:offset + s.numel()].view(s.shape))
            offset += s.numel()
        self._saved: torch.Tensor | None = None
        self._grads_gen = 0   # bumped whenever the gradient views are written (unpack, zero)
        # How to pack the last contribution again instead of copying it in save(): (slot, step,
        # gradient generation); None after a per-parameter pack, which save() copies.
        self._repack: tuple[int | None, int, int, int] | None = None
        self._saved_repack: tuple[int | None, int, int, int] | None = None
        plain = all(local(p) is p and p.dtype == torch.float32 and p.device == self.flat.device
                    for p in self.params)
        self.grads: torch.Tensor | None = None
        self._grad_views: list[torch.Tensor] = []
        if plain:
            self.grads = torch.zeros(self.grad_numel, dtype=torch.float32, device=self.flat.device)
            self._grad_views = [self.grads[o:o + v.numel()].view(v.shape) for v, o in zip(self._views, self._offsets)]

    # ------------------------------------------------------------------ regions of flat
    @property
    def tail(self) -> torch.Tensor:
        """The mask slots (a view into `flat`)."""
        return self.flat[self.grad_numel:self._count_index]

    @property
    def steps_region(self) -> torch.Tensor:
        return self.flat[self._count_index + 1:self._held_index]

    @property
    def held_region(self) -> torch.Tensor:
        """Per data rank: step + 1 of each member holding the committed state (0: none)."""
        return self.flat[self._held_index:self._short_index]

    @property
    def short_region(self) -> torch.Tensor:
        """Per slot: samples of its assignment a contributor left untrained (0: it trained all)."""
        return self.flat[self._short_index:]

    # ------------------------------------------------------------------ gradients
    def grads_bound(self) -> bool:
        """Every parameter's gradient is its view of `grads` (what the fast paths need)."""
        if self.grads is None:
            return False
        for p, v in zip(self.params, self._grad_views):
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

    # ------------------------------------------------------------------ pack
    def pack(self, slot: int | None, step: int = 0, short: int = 0) -> None:
        """Pack the local gradients for `slot` at `step` (slot None: contribute nothing, zeros);
        `short`: samples at the end of the slot's assignment left untrained."""
        if isinstance(short, bool) or not isinstance(short, int) or not 0 <= short <= MAX_EXACT_STEP:
            raise ValueError(f"short must be an int in [0, {MAX_EXACT_STEP}], got {short!r}")
        if slot is not None and (isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < self.max_slots):
            raise ValueError(f"slot must be None or an int in [0, {self.max_slots}), got {slot!r}")
        if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_EXACT_STEP:
            raise ValueError(f"step must be an int in [0, {MAX_EXACT_STEP}] (exact in float32), got {step!r}")
        if slot is None:
            self.flat.zero_()
            self._repack = (None, step, -1, 0)
            return
        if self.grads_bound():
            assert self.grads is not None
            self.flat[:self.grad_numel].copy_(self.grads)
            self.flat[self.grad_numel:].zero_()
            self._repack = (slot, step, self._grads_gen, short)
        else:
            self.flat.zero_()
            for p, view in zip(self.params, self._views):
                if p.grad is not None:
                    view.copy_(local(p.grad).reshape(view.shape))
            self._repack = None
        self.flat[self.grad_numel + slot] = 1.0
        self.flat[self._count_index] = 1.0
        self.flat[self._count_index + 1 + slot] = float(step + 1)
        if short:
            self.flat[self._short_index + slot] = float(short)

    def set_held(self, rank: int | None, step: int) -> None:
        """Before each allreduce: say that the member at data rank `rank` holds the committed
        state at `step` (None: it does not, e.g. it catches up). Clears the region first, so a
        contribution restored from an earlier attempt carries no stale rank."""
        region = self.held_region
        region.zero_()
        if rank is None:
            return
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.max_slots:
            raise ValueError(f"data rank must be an int in [0, {self.max_slots}) (max_slots), got {rank!r}")
        if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_EXACT_STEP:
            raise ValueError(f"step must be an int in [0, {MAX_EXACT_STEP}] (exact in float32), got {step!r}")
        region[rank] = float(step + 1)

    # ------------------------------------------------------------------ read the reduced header
    def contributors(self) -> int:
        """How many replicas contributed to the reduced buffer (the divisor for the mean)."""
        return int(round(float(self.flat[self._count_index])))

    def mask(self) -> list[bool]:
        """Which slots contributed, read from the reduced tail; raises if slots collided."""
        out: list[bool] = []
        for i, v in enumerate(self.tail.tolist()):
            if not math.isfinite(v) or v < -0.5 or v > 1.5:
                raise SlotCollisionError(f"mask slot {i} holds {v} after the allreduce; expected 0 or 1")
            out.append(v > 0.5)
        count = self.contributors()
        if count != sum(out):
            raise SlotCollisionError(f"contributor count {count} disagrees with {sum(out)} marked slots")
        return out

    def slot_steps(self) -> dict[int, int]:
        """slot -> step of every contributor, read from the reduced buffer."""
        steps = self.steps_region.tolist()
        out: dict[int, int] = {}
        for i, on in enumerate(self.mask()):
            if on:
                v = int(round(steps[i])) - 1
                if v < 0:
                    raise SlotCollisionError(f"slot {i} contributed without a step")
                out[i] = v
        return out

    def held_steps(self) -> dict[int, int]:
        """data rank -> step of every member that said it holds the committed state."""
        out: dict[int, int] = {}
        for r, v in enumerate(self.held_region.tolist()):
            if not math.isfinite(v) or v < -0.5:
                raise SlotCollisionError(f"held step of data rank {r} reads {v} after the allreduce")
            if v > 0.5:
                out[r] = int(round(v)) - 1
        return out

    def shorts(self, source: torch.Tensor | None = None) -> dict[int, int]:
        """slot -> samples left untrained, of every contributor that left some, read from the
        reduced buffer (or `source`, a logged one of the same layout)."""
        src = self.flat if source is None else source
        out: dict[int, int] = {}
        for i, v in enumerate(src[self._short_index:self._short_index + self.max_slots].tolist()):
            if not math.isfinite(v) or v < -0.5:
                raise SlotCollisionError(f"short slot {i} reads {v} after the allreduce")
            if v > 0.5:
                out[i] = int(round(v))
        return out

    # ------------------------------------------------------------------ unpack
    def unpack(self, divisor: float, source: torch.Tensor | None = None) -> None:
        """Write (source or flat) / divisor into each parameter's local gradient.

        `source` (same layout as `flat`) reads another reduced buffer, e.g. a logged step, so
        that a background catch-up never touches the buffer the training thread allreduces."""
        if (isinstance(divisor, bool) or not isinstance(divisor, (int, float)) or not math.isfinite(divisor)
                or divisor <= 0):
            raise ValueError(f"divisor must be a finite positive number, got {divisor!r}")
        src = self.flat
        if source is not None and source is not self.flat:
            if source.shape != self.flat.shape:
                raise ValueError(f"source of shape {tuple(source.shape)} does not match the buffer "
                                 f"{tuple(self.flat.shape)}")
            src = source
        if self.grads is not None:
            torch.div(src[:self.grad_numel], divisor, out=self.grads)
            self._grads_gen += 1
            for p, v in zip(self.params, self._grad_views):
                g = p.grad
                if g is None or g.data_ptr() != v.data_ptr():
                    p.grad = v
            return
        for p, view, o in zip(self.params, self._views, self._offsets):
            part = src[o:o + view.numel()].view(view.shape)
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            g = local(p.grad)
            if g.dtype == torch.float32 and g.device == src.device:
                torch.div(part, divisor, out=g.view(view.shape))
            else:
                g.copy_((part / divisor).reshape(g.shape))

    # ------------------------------------------------------------------ retry
    def save(self) -> None:
        """Keep the packed contribution for a retry. One packed from the gradient views (or
        nothing) is not copied: restore() packs it again, as nothing writes the gradients
        between a pack and the step's commit."""
        self._saved_repack = self._repack
        if self._repack is None:
            if self._saved is None:
                self._saved = torch.empty_like(self.flat)
            self._saved.copy_(self.flat)

    def restore(self) -> None:
        """Put the saved local contribution back (the buffer may hold a half-reduced sum)."""
        again = self._saved_repack
        if again is None:
            if self._saved is None:
                raise RuntimeError("restore() called before save(): no local contribution was kept")
            self.flat.copy_(self._saved)
            return
        slot, step, gen, short = again
        if slot is not None and gen != self._grads_gen:
            raise RuntimeError("the gradients were written since save(): the packed contribution is lost")
        self.pack(slot, step, short)


__all__ = ["MAX_EXACT_STEP", "SlotCollisionError", "StepBuffer", "local"]
