"""StepBuffer: gradients, the contribution mask, the count and the slot steps in one flat tensor."""
from __future__ import annotations


import pytest
import torch

from p2pft.trainer.kernel.stepbuf import MAX_EXACT_STEP, SlotCollisionError, StepBuffer
from p2pft.trainer.model import TinyLM


MAX_SLOTS = 8


def _replica(seed: int) -> tuple[TinyLM, list[torch.Tensor]]:
    """A model with gradients from its own random batch; returns it and a copy of its grads."""
    torch.manual_seed(0)
    model = TinyLM(vocab_size=40, d_model=16, n_layers=1, n_heads=2, seq_len=8)
    gen = torch.Generator().manual_seed(seed)
    model.loss(torch.randint(0, 40, (3, 9), generator=gen)).backward()
    return model, [p.grad.clone() for p in model.parameters()]


def _allreduce(buffers: list[StepBuffer]) -> None:
    """What a sum-allreduce leaves in every participant's buffer."""
    total = torch.stack([b.flat for b in buffers]).sum(0)
    for b in buffers:
        b.flat.copy_(total)


def test_layout() -> None:
    model, _ = _replica(1)
    buf = StepBuffer(model.parameters(), max_slots=MAX_SLOTS)
    n = sum(p.numel() for p in model.parameters())
    assert buf.flat.shape == (n + MAX_SLOTS + 1 + 3 * MAX_SLOTS,) and buf.flat.dtype == torch.float32
    assert buf.grad_numel == n and buf.tail.shape == (MAX_SLOTS,) and buf.steps_region.shape == (MAX_SLOTS,)
    assert buf.held_region.shape == (MAX_SLOTS,) and buf.short_region.shape == (MAX_SLOTS,)


def test_a_partial_contribution_says_how_many_samples_it_left_and_survives_a_retry() -> None:
    replicas = [_replica(seed) for seed in (1, 2)]
    buffers = [StepBuffer(m.parameters(), max_slots=MAX_SLOTS) for m, _ in replicas]
    buffers[0].pack(0, step=3)
    buffers[1].pack(2, step=3, short=24)   # trained the first part of its slot's samples only
    buffers[1].save()
    _allreduce(buffers)
    assert buffers[0].shorts() == {2: 24} and buffers[0].slot_steps() == {0: 3, 2: 3}
    buffers[1].restore()                   # a retry packs the same contribution again
    assert buffers[1].shorts() == {2: 24} and buffers[1].contributors() == 1
    with pytest.raises(ValueError, match="short"):
        buffers[0].pack(0, step=3, short=-1)


def test_pack_allreduce_unpack_gives_mean_of_contributors() -> None:
    replicas = [_replica(seed) for seed in (1, 2, 3)]
    buffers = [StepBuffer(m.parameters(), max_slots=MAX_SLOTS) for m, _ in replicas]
    buffers[0].pack(5)
    buffers[1].pack(0)
    buffers[2].pack(None)  # a joiner: takes part, contributes nothing
    _allreduce(buffers)
    assert [b.mask() for b in buffers] == [[i in (0, 5) for i in range(MAX_SLOTS)]] * 3
    assert buffers[2].contributors() == 2
    for buf in buffers:
        buf.unpack(buf.contributors())
    grads_a, grads_b = replicas[0][1], replicas[1][1]
    for model, _ in replicas:
        for p, a, b in zip(model.parameters(), grads_a, grads_b):
            torch.testing.assert_close(p.grad, (a + b) / 2, rtol=0, atol=1e-7)
    # Every replica ends with bitwise the same gradients.
    first = list(replicas[0][0].parameters())
    for model, _ in replicas[1:]:
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), first))


def test_missing_grads_pack_as_zeros_and_unpack_allocates() -> None:
    a = torch.nn.Parameter(torch.ones(2, 3))
    b = torch.nn.Parameter(torch.ones(4))
    a.grad = torch.full((2, 3), 6.0)
    buf = StepBuffer([a, b], max_slots=2)
    buf.pack(1, step=6)
    assert buf.flat.tolist() == [6.0] * 6 + [0.0] * 4 + [0.0, 1.0] + [1.0] + [0.0, 7.0] + [0.0, 0.0] + [0.0, 0.0]
    buf.unpack(3.0)
    assert torch.equal(a.grad, torch.full((2, 3), 2.0))
    assert b.grad is not None and torch.equal(b.grad, torch.zeros(4))


def test_non_contributor_packs_all_zeros_even_with_grads() -> None:
    model, _ = _replica(1)
    buf = StepBuffer(model.parameters(), max_slots=MAX_SLOTS)
    buf.pack(2)
    buf.pack(None)
    assert not buf.flat.any()


def test_low_precision_grads_round_trip() -> None:
    p = torch.nn.Parameter(torch.zeros(5, dtype=torch.bfloat16))
    p.grad = torch.tensor([1.0, -2.0, 0.5, 4.0, 8.0], dtype=torch.bfloat16)
    buf = StepBuffer([p], max_slots=1)
    buf.pack(0)
    buf.unpack(2.0)
    assert p.grad.dtype == torch.bfloat16
    assert p.grad.tolist() == [0.5, -1.0, 0.25, 2.0, 4.0]


def test_retry_restores_the_saved_local_contribution() -> None:
    model, grads = _replica(1)
    buf = StepBuffer(model.parameters(), max_slots=MAX_SLOTS)
    buf.pack(3)
    packed = buf.flat.clone()
    buf.save()
    buf.flat.mul_(7.0).add_(1.0)  # a ring allreduce that died half way leaves partial sums
    model.zero_grad(set_to_none=True)  # and the trainer may already have moved on
    buf.restore()
    assert torch.equal(buf.flat, packed)
    # The retry on the next view reduces the restored contribution.
    other_model, other_grads = _replica(2)
    other = StepBuffer(other_model.parameters(), max_slots=MAX_SLOTS)
    other.pack(4)
    _allreduce([buf, other])
    buf.unpack(buf.contributors())
    assert buf.mask() == [i in (3, 4) for i in range(MAX_SLOTS)]
    for p, a, b in zip(model.parameters(), grads, other_grads):
        torch.testing.assert_close(p.grad, (a + b) / 2, rtol=0, atol=1e-7)


def test_restore_without_save_is_an_error() -> None:
    model, _ = _replica(1)
    buf = StepBuffer(model.parameters())
    with pytest.raises(RuntimeError, match="before save"):
        buf.restore()


def test_slot_collision_is_detected() -> None:
    replicas = [_replica(seed) for seed in (1, 2)]
    buffers = [StepBuffer(m.parameters(), max_slots=MAX_SLOTS) for m, _ in replicas]
    for b in buffers:
        b.pack(1)
    _allreduce(buffers)
    with pytest.raises(SlotCollisionError, match="mask slot 1 holds 2.0"):
        buffers[0].mask()


@pytest.mark.parametrize("slot", [-1, MAX_SLOTS, True, 1.0])
def test_bad_slot_is_rejected(slot: object) -> None:
    model, _ = _replica(1)
    buf = StepBuffer(model.parameters(), max_slots=MAX_SLOTS)
    with pytest.raises(ValueError, match="slot must be None or an int"):
        buf.pack(slot)  # type: ignore[arg-type]


@pytest.mark.parametrize("divisor", [0, -1.0, float("nan")])
def test_bad_divisor_is_rejected(divisor: float) -> None:
    model, _ = _replica(1)
    buf = StepBuffer(model.parameters())
    with pytest.raises(ValueError, match="divisor"):
        buf.unpack(divisor)


def test_bad_construction_is_rejected() -> None:
    with pytest.raises(ValueError, match="at least one parameter"):
        StepBuffer([])
    with pytest.raises(ValueError, match="max_slots"):
        StepBuffer([torch.nn.Parameter(torch.ones(1))], max_slots=0)


def test_unpack_from_another_buffer_leaves_flat_alone_and_matches() -> None:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(3, 5)), torch.nn.Parameter(torch.randn(7))]
    for p in params:
        p.grad = torch.randn_like(p)
    buf = StepBuffer(params, max_slots=4)
    buf.pack(1)
    logged = buf.flat.clone() * 3.0
    before = buf.flat.clone()
    buf.unpack(3.0, source=logged)
    assert torch.equal(buf.flat, before)  # the training thread's buffer is untouched
    ref = StepBuffer(params, max_slots=4)
    ref.flat.copy_(logged)
    expect = [p.grad.clone() for p in params]
    ref.unpack(3.0)
    for p, e in zip(params, expect):
        assert torch.equal(p.grad, e)  # bit-identical to unpacking a copy in place
    with pytest.raises(ValueError, match="does not match"):
        buf.unpack(1.0, source=torch.zeros(5))


def test_slot_steps_read_each_contributors_step_from_the_sum() -> None:
    replicas = [_replica(seed) for seed in (1, 2, 3)]
    buffers = [StepBuffer(m.parameters(), max_slots=MAX_SLOTS) for m, _ in replicas]
    buffers[0].pack(2, step=41)
    buffers[1].pack(6, step=40)    # behind: a step committed at some replicas only
    buffers[2].pack(None, step=41)
    _allreduce(buffers)
    assert all(b.slot_steps() == {2: 41, 6: 40} for b in buffers)


def test_held_steps_carry_members_that_contribute_nothing() -> None:
    """A member ahead that contributes nothing (a hot spare, one at the end barrier) says its
    step by data rank; a replica catching up says nothing. Each attempt starts from a clean
    region, whatever a restored contribution held."""
    replicas = [_replica(seed) for seed in (1, 2, 3)]
    buffers = [StepBuffer(m.parameters(), max_slots=MAX_SLOTS) for m, _ in replicas]
    buffers[0].pack(0, step=40)
    buffers[1].pack(None, step=41)
    buffers[2].pack(None, step=12)
    buffers[0].set_held(0, 40)
    buffers[1].set_held(2, 41)
    buffers[2].set_held(None, 12)
    _allreduce(buffers)
    assert all(b.slot_steps() == {0: 40} and b.held_steps() == {0: 40, 2: 41} for b in buffers)
    assert all(b.contributors() == 1 for b in buffers)
    buffers[0].save()
    buffers[0].restore()
    buffers[0].set_held(1, 40)
    assert buffers[0].held_steps() == {1: 40}
    with pytest.raises(ValueError, match="data rank"):
        buffers[0].set_held(MAX_SLOTS, 1)


@pytest.mark.parametrize("step", [-1, MAX_EXACT_STEP + 1, 1.0])
def test_a_step_that_cannot_travel_exactly_is_rejected(step: object) -> None:
    model, _ = _replica(1)
    buf = StepBuffer(model.parameters(), max_slots=MAX_SLOTS)
    with pytest.raises(ValueError, match="step must be an int"):
        buf.pack(0, step)  # type: ignore[arg-type]
