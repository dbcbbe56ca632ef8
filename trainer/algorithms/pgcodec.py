"""How a pseudo-gradient travels: float32, bfloat16, or int8 block quantization.

The ring can only *sum*, so a compressed pseudo-gradient must be something whose sum is the
compressed sum. Two ways:

- ``bf16``: the payload is reduced as bfloat16 (2 bytes a value; the ring adds in bf16, the
  same bytes reach every replica, so every replica applies the same mean). The header (mask,
  contributor count, steps) is reduced separately in float32, where it is exact.
- ``int8``: one byte a value. Phase 1 reduces, in float64, the header and per block of
  ``INT8_BLOCK`` values the sum over replicas of ``absmax**8``; its 8th root is within
  ``world**(1/8)`` of the largest absmax of any replica (a max from a sum), so every replica
  derives the *same* scale per block. Phase 2: each replica rounds its values to integers in
  ``[-Q, Q]`` with that scale, stores ``q + Q`` as one unsigned byte, and the bytes, four to an
  int32, are summed by the ring. With ``Q = 255 // (2 * world)`` no byte sum passes 255, so
  no carry crosses into the next value: the int32 sum holds the byte sums exactly. The mean is
  ``(byte sum - contributors * Q) * scale / contributors``.

No error feedback: DiLoCo restarts the local weights from the global ones every round, so a
residual would be one more per-replica state that a restarted replica lacks and that snapshots
would have to carry, and Streaming DiLoCo reports no loss from 4-bit outer gradients without it.
"""
from __future__ import annotations

import enum
import math

import torch

from ...transport.base import Communicator

INT8_BLOCK = 256
_NORM_P = 8


class Compression(enum.Enum):
    NONE = "none"
    BF16 = "bf16"
    INT8 = "int8"

    @classmethod
    def parse(cls, value: "Compression | str | None") -> "Compression":
        if value is None:
            return cls.NONE
        if isinstance(value, Compression):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            raise ValueError(f"compression must be one of {[c.value for c in cls]}, got {value!r}") from None


def digit_range(world: int) -> int:
    """Q: the largest |integer| a replica may send so that `world` byte digits never carry."""
    q = 255 // (2 * world)
    if q < 1:
        raise ValueError(f"int8 compression supports at most 127 ranks in a ring, got {world}")
    return q


def _blocks(n: int, block: int) -> int:
    return (n + block - 1) // block


def block_absmax(x: torch.Tensor, block: int = INT8_BLOCK) -> torch.Tensor:
    """Largest |value| of each block of `x` (the last block padded with zeros), float64."""
    n = x.numel()
    nb = _blocks(n, block)
    padded = torch.zeros(nb * block, dtype=torch.float64, device=x.device)
    padded[:n] = x.reshape(-1)
    return padded.view(nb, block).abs().amax(dim=1)


def shared_scales(norm_sums: torch.Tensor, world: int) -> torch.Tensor:
    """Per-block scale from the reduced sum of absmax**8: every replica derives the same one."""
    bound = norm_sums.clamp_min(0.0).pow(1.0 / _NORM_P)
    scale = bound / digit_range(world)
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def encode_digits(x: torch.Tensor, scales: torch.Tensor, world: int, block: int = INT8_BLOCK) -> torch.Tensor:
    """`x` as one unsigned byte per value (q + Q), packed four to an int32 (padded with Q)."""
    q_max = digit_range(world)
    n = x.numel()
    per = scales.repeat_interleave(block)[:n].to(torch.float64)
    q = torch.round(x.reshape(-1).to(torch.float64) / per).clamp_(-q_max, q_max)
    words = (n + 3) // 4
    digits = torch.full((words * 4,), q_max, dtype=torch.uint8, device=x.device)
    digits[:n] = (q + q_max).to(torch.uint8)
    return digits.view(torch.int32)


def decode_digits(summed: torch.Tensor, n: int, contributors: int, scales: torch.Tensor, world: int,
                  block: int = INT8_BLOCK) -> torch.Tensor:
    """The *sum* over contributors of the values `encode_digits` packed, as float32."""
    q_max = digit_range(world)
    digits = summed.view(torch.uint8)[:n].to(torch.float64) - contributors * q_max
    return (digits * scales.repeat_interleave(block)[:n]).to(torch.float32)


def quantize_blocks(x: torch.Tensor, block: int = INT8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Local int8 block quantization (the reference the shared-scale path is checked against):
    int8 values in [-127, 127] and one float32 scale per block."""
    amax = block_absmax(x, block)
    scales = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    per = scales.repeat_interleave(block)[:x.numel()]
    q = torch.round(x.reshape(-1).to(torch.float64) / per).clamp_(-127, 127).to(torch.int8)
    return q, scales.to(torch.float32)


def dequantize_blocks(q: torch.Tensor, scales: torch.Tensor, block: int = INT8_BLOCK) -> torch.Tensor:
    per = scales.to(torch.float64).repeat_interleave(block)[:q.numel()]
    return (q.to(torch.float64) * per).to(torch.float32)


class PseudoGradCodec:
    """Reduces a step buffer ``[payload (n values)][header]`` over a communicator, compressed."""

    def __init__(self, kind: Compression | str, n: int, device: torch.device) -> None:
        self.kind = Compression.parse(kind)
        self.n = n
        self.device = device
        self.payload_bytes = 0   # payload bytes this replica handed to the ring (all syncs so far)
        self._bf: torch.Tensor | None = None

    def wire_bytes(self, world: int) -> int:
        """Bytes one reduction puts on the wire of the slowest ring link (payload only)."""
        per_value = {Compression.NONE: 4.0, Compression.BF16: 2.0, Compression.INT8: 1.0}[self.kind]
        return int(math.ceil(self.n * per_value))

    def reduce(self, comm: Communicator, flat: torch.Tensor, *, contribute: bool, timeout: float, world: int,
               header: bool | None = None) -> None:
        """Sum `flat` over the ring in place; the header part always exactly. `contribute`: this
        rank's payload counts; `header` (default: the same): its header goes into the sum (a
        member holding the state that contributes nothing still says its step there)."""
        n = self.n
        send_header = contribute if header is None else (header or contribute)
        if self.kind is Compression.NONE:
            comm.allreduce(flat, contribute=send_header, timeout=timeout)   # a non-contributor's payload is zeros
            self.payload_bytes += 4 * n
            return
        head = flat[n:]
        if self.kind is Compression.BF16:
            if self._bf is None:
                self._bf = torch.empty(n, dtype=torch.bfloat16, device=flat.device)
            self._bf.copy_(flat[:n])
            comm.allreduce(self._bf, contribute=contribute, timeout=timeout)
            comm.allreduce(head, contribute=send_header, timeout=timeout)
            flat[:n].copy_(self._bf)
            self.payload_bytes += 2 * n
            return
        nb = _blocks(n, INT8_BLOCK)
        stats = torch.zeros(head.numel() + nb, dtype=torch.float64, device=flat.device)
        stats[:head.numel()] = head
        stats[head.numel():] = block_absmax(flat[:n]).pow(_NORM_P)
        comm.allreduce(stats, contribute=send_header, timeout=timeout)   # a non-contributor's norms are 0
        scales = shared_scales(stats[head.numel():], world)
        words = encode_digits(flat[:n], scales, world)
        count = comm.allreduce(words, contribute=contribute, timeout=timeout)
        head.copy_(stats[:head.numel()])
        flat[:n].copy_(decode_digits(words, n, count, scales, world))
        self.payload_bytes += words.numel() * 4


__all__ = ["Compression", "INT8_BLOCK", "PseudoGradCodec", "block_absmax", "decode_digits", "dequantize_blocks",
           "digit_range", "encode_digits", "quantize_blocks", "shared_scales"]
