"""Learning-rate scaling under a changed number of contributors."""
from __future__ import annotations

import math

import pytest
import torch

from p2pft.trainer.lr import LRPolicy, apply_lr_scale, base_lrs, lr_scale


@pytest.mark.parametrize(
    "policy, expected",
    [("none", 1.0), ("linear", 0.75), ("sqrt", math.sqrt(0.75)), (LRPolicy.SQRT, math.sqrt(0.75)), ("Linear", 0.75)],
)
def test_lr_scale(policy: str | LRPolicy, expected: float) -> None:
    assert lr_scale(policy, 3, 4) == pytest.approx(expected, rel=1e-15)


def test_full_contribution_is_unscaled() -> None:
    assert all(lr_scale(p, 8, 8) == 1.0 for p in LRPolicy)


@pytest.mark.parametrize(
    "args, message",
    [(("cosine", 1, 2), "unknown learning-rate policy 'cosine'"), (("sqrt", 0, 2), "contributors"),
     (("sqrt", 1, 0), "nominal"), (("linear", 1.5, 2), "contributors")],
)
def test_lr_scale_rejects_bad_input(args: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        lr_scale(*args)


def _two_group_optimizer(tensor_lr: bool = False) -> torch.optim.Optimizer:
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    lr0 = torch.tensor(0.1) if tensor_lr else 0.1
    return torch.optim.AdamW([{"params": [a], "lr": lr0}, {"params": [b], "lr": 0.01}])


def test_apply_lr_scale_sets_every_group_and_is_not_cumulative() -> None:
    opt = _two_group_optimizer()
    bases = base_lrs(opt)
    assert bases == [0.1, 0.01]
    apply_lr_scale(opt, bases, 0.5)
    apply_lr_scale(opt, bases, 0.5)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.05, 0.005])


def test_apply_lr_scale_updates_tensor_lr_in_place() -> None:
    opt = _two_group_optimizer(tensor_lr=True)
    lr_tensor = opt.param_groups[0]["lr"]
    apply_lr_scale(opt, [0.1, 0.01], 0.25)
    assert opt.param_groups[0]["lr"] is lr_tensor
    assert float(lr_tensor) == pytest.approx(0.025)


def test_scaled_lr_changes_the_update() -> None:
    """The scaled lr is the one the optimizer steps with."""
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=1.0)
    apply_lr_scale(opt, [1.0], lr_scale("linear", 1, 4))
    p.grad = torch.ones(1)
    opt.step()
    assert p.item() == pytest.approx(-0.25)


@pytest.mark.parametrize(
    "bases, scale, message",
    [([0.1], 1.0, "1 base learning rates for 2"), ([0.1, 0.1], 0.0, "scale"),
     ([0.1, 0.1], float("inf"), "scale"), ([0.1, -1.0], 1.0, "base_lrs\\[1\\]")],
)
def test_apply_lr_scale_rejects_bad_input(bases: list[float], scale: float, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        apply_lr_scale(_two_group_optimizer(), bases, scale)
