"""capture/restore make a fresh replica bitwise equal to a trained one; the digest proves it."""
from __future__ import annotations

from collections.abc import Callable

import msgpack
import pytest
import torch
from torch import nn

from p2pft.trainer.data import TextDataset
from p2pft.trainer.model import TinyLM
from p2pft.trainer.state.whole import capture, restore, state_digest


SEQ = 16
DATA = TextDataset(SEQ, n_samples=64)


def _lm(seed: int) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(vocab_size=256, d_model=32, n_layers=2, n_heads=4, seq_len=SEQ)


def _lm_step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    opt.zero_grad()
    model.loss(DATA.batch(range(step * 4, step * 4 + 4))).backward()
    opt.step()


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=3e-3)


def _wire(meta: dict) -> dict:
    """Meta as a peer receives it: through msgpack."""
    return msgpack.unpackb(msgpack.packb(meta, use_bin_type=True), raw=False)


def test_restored_adamw_replica_matches_bitwise_and_stays_in_step() -> None:
    src = _lm(0)
    src_opt = _adamw(src)
    for step in range(3):
        _lm_step(src, src_opt, step)
    meta, tensors = capture(src, src_opt, {"step": 3, "cursor": {"frontier": 12, "holes": []}})
    assert meta["extra"]["step"] == 3 and meta["optimizer"]["step"] == 3
    assert any(k.endswith("/exp_avg_sq") for k in tensors) and any(k.endswith("/step") for k in tensors)

    dst = _lm(99)  # a restarted process: different init, fresh optimizer
    dst_opt = _adamw(dst)
    assert state_digest(dst, dst_opt) != state_digest(src, src_opt)
    restore(dst, dst_opt, _wire(meta), tensors)
    assert state_digest(dst, dst_opt) == state_digest(src, src_opt)
    assert dst_opt.param_groups[0]["betas"] == src_opt.param_groups[0]["betas"]

    before = state_digest(src, src_opt)
    _lm_step(src, src_opt, 3)
    _lm_step(dst, dst_opt, 3)
    assert state_digest(src, src_opt) == state_digest(dst, dst_opt) != before


def test_snapshot_is_a_copy_unaffected_by_further_training() -> None:
    model = _lm(0)
    opt = _adamw(model)
    _lm_step(model, opt, 0)
    digest = state_digest(model, opt)
    meta, tensors = capture(model, opt, {})
    saved = {k: v.clone() for k, v in tensors.items()}
    _lm_step(model, opt, 1)  # in-place updates of params and moments
    assert all(torch.equal(tensors[k], saved[k]) for k in saved)
    assert all(t.device.type == "cpu" and t.is_contiguous() for t in tensors.values())
    fresh = _lm(1)
    fresh_opt = _adamw(fresh)
    restore(fresh, fresh_opt, meta, tensors)
    assert state_digest(fresh, fresh_opt) == digest


def _mlp_bn(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))


def _mlp_step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(16, 6, generator=gen)
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()


@pytest.mark.parametrize(
    "make_opt",
    [
        lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, nesterov=True),
        lambda m: torch.optim.AdamW(m.parameters(), lr=torch.tensor(0.01), betas=(0.8, 0.95)),
        lambda m: torch.optim.Adam(m.parameters(), lr=0.01, amsgrad=True),
    ],
    ids=["sgd-momentum", "adamw-tensor-lr", "adam-amsgrad"],
)
def test_other_optimizers_and_buffers_round_trip(make_opt: Callable[[nn.Module], torch.optim.Optimizer]) -> None:
    src = _mlp_bn(0)
    src_opt = make_opt(src)
    for step in range(3):
        _mlp_step(src, src_opt, step)
    meta, tensors = capture(src, src_opt, {})
    assert any(k.startswith("buffer/") and k.endswith("running_mean") for k in tensors)
    dst = _mlp_bn(5)
    dst_opt = make_opt(dst)
    restore(dst, dst_opt, _wire(meta), tensors)
    assert state_digest(dst, dst_opt) == state_digest(src, src_opt)
    _mlp_step(src, src_opt, 3)
    _mlp_step(dst, dst_opt, 3)
    assert state_digest(dst, dst_opt) == state_digest(src, src_opt)


def test_restore_does_not_alias_the_snapshot() -> None:
    """Two replicas restored from one snapshot must not share optimizer state tensors."""
    src = _mlp_bn(0)
    src_opt = torch.optim.SGD(src.parameters(), lr=0.1, momentum=0.9)
    _mlp_step(src, src_opt, 0)
    meta, tensors = capture(src, src_opt, {})
    a, b = _mlp_bn(1), _mlp_bn(2)
    a_opt = torch.optim.SGD(a.parameters(), lr=0.1, momentum=0.9)
    b_opt = torch.optim.SGD(b.parameters(), lr=0.1, momentum=0.9)
    restore(a, a_opt, meta, tensors)
    restore(b, b_opt, meta, tensors)
    _mlp_step(a, a_opt, 1)
    assert state_digest(b, b_opt) == state_digest(src, src_opt)


def test_digest_sees_a_single_bit_of_optimizer_state_and_hyperparameters() -> None:
    model = _lm(0)
    opt = _adamw(model)
    _lm_step(model, opt, 0)
    base = state_digest(model, opt)
    moment = opt.state[next(iter(model.parameters()))]["exp_avg_sq"]
    bits = moment.view(torch.int32)
    bits[0] ^= 1
    assert state_digest(model, opt) != base
    bits[0] ^= 1
    assert state_digest(model, opt) == base
    opt.param_groups[1]["lr"] = 1e-3
    assert state_digest(model, opt) != base


def test_capture_before_first_step_restores_empty_state() -> None:
    src = _lm(0)
    src_opt = _adamw(src)
    meta, tensors = capture(src, src_opt, {})
    assert meta["optimizer"]["step"] == 0
    dst = _lm(1)
    dst_opt = _adamw(dst)
    restore(dst, dst_opt, meta, tensors)
    assert state_digest(dst, dst_opt) == state_digest(src, src_opt)


def test_model_only_snapshot() -> None:
    src = _lm(0)
    meta, tensors = capture(src, None)
    dst = _lm(1)
    restore(dst, None, meta, tensors)
    assert state_digest(dst) == state_digest(src)


def test_mismatched_model_is_rejected_and_left_untouched() -> None:
    src = _lm(0)
    meta, tensors = capture(src, _adamw(src), {})
    other = TinyLM(vocab_size=256, d_model=32, n_layers=1, n_heads=4, seq_len=SEQ)
    other_opt = _adamw(other)
    digest = state_digest(other, other_opt)
    with pytest.raises(ValueError, match="unexpected \\['blocks.1"):
        restore(other, other_opt, meta, tensors)
    wider = TinyLM(vocab_size=256, d_model=32, n_layers=2, n_heads=4, seq_len=SEQ * 2)
    with pytest.raises(ValueError, match="pos_emb.weight"):
        restore(wider, _adamw(wider), meta, tensors)
    assert state_digest(other, other_opt) == digest


def test_mismatched_optimizer_is_rejected() -> None:
    src = _lm(0)
    meta, tensors = capture(src, _adamw(src), {})
    dst = _lm(1)
    with pytest.raises(ValueError, match="snapshot optimizer is 'AdamW', target is 'SGD'"):
        restore(dst, torch.optim.SGD(dst.parameters(), lr=0.1), meta, tensors)
    with pytest.raises(ValueError, match="param groups"):
        restore(dst, torch.optim.AdamW(dst.parameters()), meta, tensors)
    meta_no_opt, tensors_no_opt = capture(src, None)
    with pytest.raises(ValueError, match="no optimizer state"):
        restore(dst, _adamw(dst), meta_no_opt, tensors_no_opt)


def test_bad_extra_meta_is_rejected() -> None:
    model = _lm(0)
    with pytest.raises(ValueError, match="extra_meta is not msgpack-able"):
        capture(model, None, {"when": object()})
    with pytest.raises(ValueError, match="extra_meta must be a dict"):
        capture(model, None, [1, 2])  # type: ignore[arg-type]
