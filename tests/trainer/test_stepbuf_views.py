"""The step buffer's gradient views: one copy to pack, one division to unpack, bitwise the same.

Plain float32 parameters get their gradients as views of one flat tensor once the first step
is unpacked; backward then accumulates into it. These tests pin what that must not change: the
packed bytes, the mean the optimizer sees (a plain PyTorch loop gives the same weights), a
retry's restored contribution, and the per-parameter path for gradients the user replaced.
"""
from __future__ import annotations

import copy

import pytest
import torch

from p2pft.trainer.kernel.stepbuf import StepBuffer
from p2pft.trainer.state.whole import state_digest


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def _backward(model: torch.nn.Module, step: int) -> None:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(4, 6, generator=g)
    model(x).pow(2).mean().backward()


def _params(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def _bound(buf: StepBuffer, model: torch.nn.Module) -> bool:
    assert buf.grads is not None
    lo, hi = buf.grads.data_ptr(), buf.grads.data_ptr() + buf.grads.numel() * 4
    return all(p.grad is not None and lo <= p.grad.data_ptr() < hi for p in _params(model))


def test_gradients_become_views_and_backward_accumulates_into_them() -> None:
    model = _model()
    buf = StepBuffer(_params(model))
    _backward(model, 0)
    assert not buf.grads_bound()          # backward allocated its own gradients
    buf.pack(0, 0)
    buf.unpack(1.0)
    assert buf.grads_bound() and _bound(buf, model)
    assert buf.zero_grads()
    _backward(model, 1)
    assert buf.grads_bound()              # accumulated in place, not reallocated
    assert float(buf.grads.abs().sum()) > 0


def test_fast_pack_is_bitwise_the_per_parameter_pack() -> None:
    model = _model()
    fast, ref_model = StepBuffer(_params(model)), copy.deepcopy(model)
    slow = StepBuffer(_params(ref_model))
    for m in (model, ref_model):
        _backward(m, 0)
    fast.pack(0, 0)
    fast.unpack(1.0)                      # binds the views
    fast.zero_grads()
    for p in ref_model.parameters():
        p.grad = None
    for m in (model, ref_model):
        _backward(m, 1)
    assert fast.grads_bound() and not slow.grads_bound()
    fast.pack(2, 7)
    slow.pack(2, 7)
    assert torch.equal(fast.flat, slow.flat)


def test_training_through_the_views_equals_a_plain_pytorch_loop() -> None:
    """pack, a one-contributor 'allreduce', unpack, step: the same weights as plain PyTorch."""
    model, plain = _model(), _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    buf = StepBuffer(_params(model))
    for step in range(6):
        _backward(model, step)
        buf.pack(0, step)
        buf.save()
        buf.unpack(float(buf.contributors()))
        opt.step()
        if not buf.zero_grads():
            opt.zero_grad(set_to_none=True)
        _backward(plain, step)
        ref.step()
        ref.zero_grad(set_to_none=True)
    assert state_digest(model, opt) == state_digest(plain, ref)


def test_retry_packs_the_contribution_again_instead_of_copying_it() -> None:
    model = _model()
    buf = StepBuffer(_params(model))
    _backward(model, 0)
    buf.pack(0, 0)
    buf.unpack(1.0)
    buf.zero_grads()
    _backward(model, 1)
    buf.pack(1, 5)
    packed = buf.flat.clone()
    buf.save()
    buf.flat.mul_(3.0).add_(1.0)          # a half-reduced sum after a failed allreduce
    buf.restore()
    assert torch.equal(buf.flat, packed)
    buf.unpack(2.0)                       # the gradients change: the contribution is gone
    with pytest.raises(RuntimeError, match="written since save"):
        buf.restore()


def test_a_bystander_restores_zeros_even_after_the_gradients_changed() -> None:
    model = _model()
    buf = StepBuffer(_params(model))
    _backward(model, 0)
    buf.pack(None, 3)
    buf.save()
    buf.flat.fill_(2.0)
    buf.unpack(1.0)                       # a catch-up wrote the gradients meanwhile
    buf.restore()
    assert float(buf.flat.abs().sum()) == 0.0


def test_gradients_the_user_replaced_take_the_per_parameter_path() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    buf = StepBuffer(_params(model))
    _backward(model, 0)
    buf.pack(0, 0)
    buf.unpack(1.0)
    opt.zero_grad(set_to_none=True)       # the user drops the views
    _backward(model, 1)
    assert not buf.grads_bound() and not buf.zero_grads()
    expect = torch.cat([p.grad.reshape(-1) for p in _params(model)])
    buf.pack(1, 1)
    assert torch.equal(buf.flat[:buf.grad_numel], expect)
    saved = buf.flat.clone()
    buf.save()                            # per-parameter pack: saved by copy
    buf.flat.zero_()
    buf.restore()
    assert torch.equal(buf.flat, saved)
    buf.unpack(2.0)
    assert buf.grads_bound()              # bound again
    assert torch.equal(buf.grads, expect / 2.0)


def test_other_dtypes_keep_their_own_gradients() -> None:
    model = _model().to(torch.bfloat16)
    buf = StepBuffer(_params(model))
    assert buf.grads is None
    x = torch.randn(4, 6, dtype=torch.bfloat16)
    model(x).float().pow(2).mean().backward()
    buf.pack(0, 0)
    buf.unpack(1.0)
    assert not buf.grads_bound()
    assert all(p.grad is not None and p.grad.dtype == torch.bfloat16 for p in model.parameters())
