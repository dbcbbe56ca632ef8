"""What one optimizer step is, from the averaged gradient to the weights after it.

Everything between the mean gradient and the new weights runs here, as one deterministic
function of the reduced buffer and the replicated state: the contributor-count factor on top of
whatever learning rate the user's scheduler set, the user's gradient hook (clipping,
inspection), ``GradScaler`` unscale and the skip of a step with inf/nan gradients, the optimizer,
the scheduler's own step, and the user's ``after_step`` hook (EMA weights, counters). It runs
on every replica for a committed step, and again, identically, when a joiner replays logged
steps or a replica fast-forwards: so a scheduler is stepped here, once per committed step, never
by the training loop (which does not see replayed or fast-forwarded steps). For the same
reason, registered state that changes per step (an EMA of the weights) must change in
``after_step``, not in the loop.

Every input is equal across replicas: the averaged gradient (bitwise), the contributor count,
and the state in snapshots (optimizer, scheduler, scaler, the peak contributor count). A
``GradScaler``'s inf check reads the averaged gradient, so every replica skips the same steps.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Protocol, SupportsFloat

import torch

from .lr import LRPolicy, lr_scale
from .user_state import Stateful

#: a user hook called with no arguments; what it returns is ignored
GradHook = Callable[[], object]


class LRSchedulerLike(Stateful, Protocol):
    """A learning-rate scheduler (``torch.optim.lr_scheduler.LRScheduler`` or the user's own):
    stepped once per committed step, and registered as replica state. If it has an
    ``optimizer`` attribute, that must be the optimizer p2pft steps."""

    def step(self) -> object: ...


class GradScalerLike(Stateful, Protocol):
    """A gradient scaler (``torch.amp.GradScaler``): unscales the averaged gradients and skips a
    step with inf/nan ones; registered as replica state."""

    def scale(self, outputs: torch.Tensor) -> object: ...

    def unscale_(self, optimizer: torch.optim.Optimizer) -> object: ...

    def step(self, optimizer: torch.optim.Optimizer) -> object: ...

    def update(self) -> object: ...

    def get_scale(self) -> SupportsFloat: ...


class OptimizerStep:
    def __init__(self, optimizer: torch.optim.Optimizer, *, lr_policy: LRPolicy | str = "sqrt",
                 nominal_replicas: int | None = None, lr_scheduler: LRSchedulerLike | None = None,
                 grad_scaler: GradScalerLike | None = None,
                 grad_hook: GradHook | None = None, after_step: GradHook | None = None,
                 clip_norm: float | None = None) -> None:
        if nominal_replicas is not None and (isinstance(nominal_replicas, bool) or not isinstance(nominal_replicas, int)
                                             or nominal_replicas < 1):
            raise ValueError(f"nominal_replicas must be a positive int or None, got {nominal_replicas!r}")
        if lr_scheduler is not None:
            allowed = {id(optimizer), *(id(o) for o in getattr(optimizer, "optimizers", ()))}
            for s in getattr(lr_scheduler, "schedulers", [lr_scheduler]):   # several: ``Schedulers``
                if id(getattr(s, "optimizer", optimizer)) not in allowed:
                    raise ValueError("lr_scheduler drives another optimizer than the one p2pft steps")
        for name, fn in (("grad_hook", grad_hook), ("after_step", after_step)):
            if fn is not None and not callable(fn):
                raise TypeError(f"{name} must be callable")
        self.opt = optimizer
        self.policy = LRPolicy.parse(lr_policy)
        self.nominal = nominal_replicas
        self.scheduler = lr_scheduler
        self.scaler = grad_scaler
        self.hook = grad_hook
        self.after = after_step
        self.clip_norm = clip_norm
        # The planned replica count when none is given: the most contributors any committed
        # step had (replicated: every replica sees the same headers, a joiner gets it in the
        # snapshot). With 3 replicas of which one died, 2 contributors then scale by sqrt(2/3).
        self.peak = 0
        self.last_lrs: list[float] = []   # the learning rates the last step ran with
        self.last_skipped = False         # GradScaler found inf/nan and skipped the last step
        self.last_norm: float | None = None   # the global gradient norm the last step clipped by
        self.last_clip = 1.0                  # the coefficient it applied (1.0: not clipped)

    def planned(self, contributors: int) -> int:
        return self.nominal if self.nominal is not None else max(self.peak, contributors)

    def scale(self, contributors: int) -> float:
        """The factor on the scheduler's learning rate for a step of `contributors`."""
        return lr_scale(self.policy, contributors, self.planned(contributors))

    def __call__(self, contributors: int, norm: float | None = None) -> None:
        """Gradients hold the mean: take the step (see the module docstring). `norm`: the mean
        gradient's global norm over the replica's shards, as measured in lockstep (with
        ``clip_norm``; None: measured here, over this optimizer's gradients, for a whole model)."""
        factor = self.scale(contributors)
        self.peak = max(self.peak, contributors)
        scale = 1.0
        if self.scaler is not None:
            # A replica that contributed nothing (a joiner, a replay) never called scale(): scale
            # a scalar on the gradients' device so the scaler holds its scale before unscaling.
            self.scaler.scale(torch.zeros((), device=_grad_device(self.opt)))
            scale = float(self.scaler.get_scale())
            self.scaler.unscale_(self.opt)
        if self.clip_norm is not None:
            # a measured norm is of the scaled mean; one measured here, of the unscaled gradients
            self._clip(norm, scale) if norm is not None else self._clip(grad_norm(_grads(self.opt)), 1.0)
        if self.hook is not None:
            self.hook()
        groups = self.opt.param_groups
        saved = [g["lr"] for g in groups]
        plain = [float(lr) for lr in saved]
        for g, lr in zip(groups, plain):
            _set_lr(g, lr * factor)
        self.last_lrs = [lr * factor for lr in plain]
        try:
            if self.scaler is not None:
                before = float(self.scaler.get_scale())
                self.scaler.step(self.opt)
                self.scaler.update()
                self.last_skipped = float(self.scaler.get_scale()) < before
            else:
                self.opt.step()
                self.last_skipped = False
        finally:
            for g, lr in zip(groups, plain):
                _set_lr(g, lr)
        if self.scheduler is not None:
            self.scheduler.step()
        if self.after is not None:
            self.after()

    def _clip(self, norm: float, scale: float) -> None:
        """Scale the (unscaled) gradients so that their global norm is at most ``clip_norm``,
        as ``torch.nn.utils.clip_grad_norm_`` does; `norm` was measured before unscaling."""
        assert self.clip_norm is not None
        total = norm / scale if scale != 1.0 else norm
        self.last_norm, self.last_clip = total, 1.0
        if not math.isfinite(total):   # inf/nan: a GradScaler skips this step; without one the step goes on
            return
        coef = self.clip_norm / (total + 1e-6)
        if coef < 1.0:
            self.last_clip = coef
            for g in _grads(self.opt):
                g.mul_(coef)

    def state_dict(self) -> dict[str, int]:
        return {"peak": self.peak}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        self.peak = int(state.get("peak", 0))


def grad_norm(grads: list[torch.Tensor]) -> float:
    """The L2 norm of `grads` as one vector, summed in float64 (their local parts for DTensors)."""
    sq = 0.0
    for g in grads:
        t = getattr(g, "_local_tensor", g)
        sq += float(torch.linalg.vector_norm(t, dtype=torch.float64)) ** 2
    return math.sqrt(sq)


def _grads(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]


def _grad_device(opt: torch.optim.Optimizer) -> torch.device:
    for g in opt.param_groups:
        for p in g["params"]:
            return p.device
    return torch.device("cpu")


def _set_lr(group: dict[str, object], value: float) -> None:
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"learning rate {value!r} is not a finite non-negative number")
    if isinstance(group["lr"], torch.Tensor):
        group["lr"].fill_(value)
    else:
        group["lr"] = value


__all__ = ["GradHook", "GradScalerLike", "LRSchedulerLike", "OptimizerStep", "grad_norm"]
