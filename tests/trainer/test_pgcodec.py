"""Pseudo-gradient compression: the int8 digits sum without carries; the error is bounded."""
from __future__ import annotations

import pytest
import torch

from p2pft.trainer.algorithms.pgcodec import (INT8_BLOCK, Compression, block_absmax, decode_digits, dequantize_blocks,
                                   digit_range, encode_digits, quantize_blocks, shared_scales)


def _ring_sum_int8(xs: list[torch.Tensor], world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What the two ring phases compute: sums of absmax**8, then int32 sums of packed digits."""
    stats = sum(block_absmax(x).pow(8) for x in xs)
    scales = shared_scales(stats, world)
    words = sum(encode_digits(x, scales, world).to(torch.int64) for x in xs)
    # the ring adds int32 with wrap-around; reproduce that from the exact int64 sum
    wrapped = ((words + (1 << 31)) % (1 << 32) - (1 << 31)).to(torch.int32)
    return decode_digits(wrapped, xs[0].numel(), len(xs), scales, world), scales


@pytest.mark.parametrize("world", [2, 3, 8])
def test_int8_digits_sum_exactly_to_the_quantized_sum(world: int) -> None:
    g = torch.Generator().manual_seed(world)
    n = 3 * INT8_BLOCK + 17
    xs = [torch.randn(n, generator=g) * (10.0 ** (-i)) for i in range(world)]
    xs[0][5] = 0.0
    got, scales = _ring_sum_int8(xs, world)
    per = scales.repeat_interleave(INT8_BLOCK)[:n]
    # each replica rounds to the nearest step of the shared scale: at most half a step each
    err = (got - sum(xs)).abs()
    assert bool((err <= per * world * 0.5 + 1e-6).all())
    # and the digits did not saturate: the shared scale covers every replica's absmax
    q = digit_range(world)
    assert bool((torch.stack([block_absmax(x) for x in xs]).amax(0) <= scales * q * (1 + 1e-9)).all())


def test_digit_range_never_carries() -> None:
    for world in (1, 2, 3, 5, 127):
        assert 2 * digit_range(world) * world <= 255
    with pytest.raises(ValueError):
        digit_range(128)


def test_block_quantization_error_is_half_a_step() -> None:
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    q, s = quantize_blocks(x)
    assert q.dtype == torch.int8 and s.numel() == 4
    back = dequantize_blocks(q, s)
    per = s.repeat_interleave(INT8_BLOCK)[:1000]
    assert bool(((back - x).abs() <= per * 0.5 + 1e-7).all())
    zeros = torch.zeros(10)
    q0, s0 = quantize_blocks(zeros)
    assert torch.equal(dequantize_blocks(q0, s0), zeros)


def test_compression_parse() -> None:
    assert Compression.parse("BF16") is Compression.BF16
    assert Compression.parse(None) is Compression.NONE
    with pytest.raises(ValueError, match="compression must be one of"):
        Compression.parse("fp4")
