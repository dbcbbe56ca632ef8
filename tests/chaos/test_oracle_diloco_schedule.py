"""The DiLoCo replay advances a restarted process's inner schedule as the replica does: to the
replicated inner step, before the first inner optimizer step, without PyTorch's warning."""
from __future__ import annotations

import warnings

import torch

from p2pft.chaos.oracle_diloco import _Inner, fast_forward


def _fresh_inner() -> _Inner:
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return _Inner(model=model, opt=opt, sched=sched, scaler=None)


def test_fast_forward_reaches_the_step_silently() -> None:
    # The warning this is about: a fresh optimizer's schedule stepped before the optimizer.
    inner = _fresh_inner()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        inner.sched.step()
    assert any("lr_scheduler.step()" in str(w.message) for w in seen)

    inner = _fresh_inner()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fast_forward(inner, 15)
    assert not [w for w in seen if "lr_scheduler" in str(w.message)]
    assert inner.sched_steps == 15 and inner.sched.last_epoch == 15
    assert abs(inner.opt.param_groups[0]["lr"] - 1e-3 / 16) < 1e-12
    fast_forward(inner, 10)   # already past: nothing moves
    assert inner.sched_steps == 15
