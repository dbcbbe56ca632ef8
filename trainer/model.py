"""Small models for tests, examples and benchmarks.

`TinyLM` is a real decoder-only transformer, small enough that a few replicas train on CPU cores
at tens of steps per second, so fault-tolerance tests exercise real training. The MLP builder
makes a model of a chosen parameter count for state-transfer benchmarks, where the shape of the
model does not matter but its size does.
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class ModelConfig:
    """Hyperparameters of a `TinyLM`."""

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    seq_len: int
    dropout: float = 0.0

    def build(self) -> TinyLM:
        """A freshly initialised model (seed torch's RNG first for identical replicas)."""
        return TinyLM(**asdict(self))


_SIZES: dict[str, ModelConfig] = {
    # ~120K params: > 20 steps/s on one CPU core at batch 8 x seq 64.
    "tiny": ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, seq_len=64),
    # ~3.3M params.
    "small": ModelConfig(vocab_size=256, d_model=256, n_layers=4, n_heads=8, seq_len=128),
}


def model_config_for(size: str) -> ModelConfig:
    """The configuration of a named model size ("tiny" or "small")."""
    try:
        return _SIZES[size]
    except KeyError:
        raise ValueError(f"unknown model size {size!r}; expected one of {sorted(_SIZES)}") from None


class CausalSelfAttention(nn.Module):
    """Multi-head attention where each position sees only itself and earlier positions."""

    def __init__(self, d_model: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    """Pre-norm transformer block: attention then a 4x MLP, each with a residual."""

    def __init__(self, d_model: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads, dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


def _check_positive_int(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


class TinyLM(nn.Module):
    """Decoder-only transformer language model with tied input/output embeddings."""

    def __init__(
        self, vocab_size: int, d_model: int, n_layers: int, n_heads: int, seq_len: int, dropout: float = 0.0
    ) -> None:
        super().__init__()
        for name, value in [("vocab_size", vocab_size), ("d_model", d_model), ("n_layers", n_layers),
                            ("n_heads", n_heads), ("seq_len", seq_len)]:
            _check_positive_int(name, value)
        if d_model % n_heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by n_heads ({n_heads})")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
        self.config = ModelConfig(vocab_size, d_model, n_layers, n_heads, seq_len, dropout)
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(seq_len, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, dropout) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self._init_weights(n_layers)

    @classmethod
    def from_config(cls, config: ModelConfig) -> TinyLM:
        return cls(**asdict(config))

    def _init_weights(self, n_layers: int) -> None:
        """GPT-2 style init; all draws come from torch's global RNG, so a seed fixes the model."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)
                nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, std=0.02)
        # Residual projections shrink with depth so the residual stream keeps its scale.
        # (A ModuleList and a Sequential hand out plain Modules; these hold Blocks and a Linear.)
        for block in cast("Iterable[Block]", self.blocks):
            nn.init.normal_(block.attn.proj.weight, std=0.02 / math.sqrt(2 * n_layers))
            nn.init.normal_(cast(nn.Linear, block.mlp[2]).weight, std=0.02 / math.sqrt(2 * n_layers))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits [B, T, vocab] for tokens [B, T] (T <= seq_len)."""
        if tokens.dim() != 2:
            raise ValueError(f"tokens must have shape [batch, time], got {tuple(tokens.shape)}")
        if tokens.shape[1] > self.config.seq_len:
            raise ValueError(f"sequence length {tokens.shape[1]} exceeds the model's seq_len {self.config.seq_len}")
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.drop(self.tok_emb(tokens) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x) @ self.tok_emb.weight.t()

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross entropy of a [B, T+1] batch (inputs tokens[:, :-1], targets tokens[:, 1:])."""
        if tokens.dim() != 2 or tokens.shape[1] < 2:
            raise ValueError(f"tokens must have shape [batch, time >= 2], got {tuple(tokens.shape)}")
        logits = self(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def count_params(model: nn.Module) -> int:
    """Number of scalar parameters (tied weights counted once)."""
    return sum(p.numel() for p in model.parameters())


def build_mlp_for_params(n_params: int, n_layers: int = 4) -> nn.Sequential:
    """A plain MLP of `n_layers` square Linear layers with about `n_params` parameters in total.

    The width w is the integer nearest to solving n_layers * (w*w + w) = n_params, so the count
    is within about n_layers * w of the target (under 0.01% at 50M parameters).
    """
    _check_positive_int("n_layers", n_layers)
    _check_positive_int("n_params", n_params)
    if n_params < 2 * n_layers:
        raise ValueError(f"n_params = {n_params} is too small for {n_layers} layers (need at least {2 * n_layers})")
    root = int((-n_layers + math.sqrt(n_layers * n_layers + 4 * n_layers * n_params)) / (2 * n_layers))
    # Of the widths around the real root, take the one whose count is nearest the target.
    width = min((w for w in (root - 1, root, root + 1, root + 2) if w >= 1),
                key=lambda w: abs(n_layers * w * (w + 1) - n_params))
    layers: list[nn.Module] = []
    for i in range(n_layers):
        layers.append(nn.Linear(width, width))
        if i < n_layers - 1:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)
