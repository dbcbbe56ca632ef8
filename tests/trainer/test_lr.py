"""Learning-rate scaling under a changed number of contributors."""
from __future__ import annotations

import math

import pytest

from p2pft.trainer.kernel.lr import LRPolicy, lr_scale


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
