"""Packed sequences from a memory-mapped token file: a dataset whose position is resumable.

A token file is a flat array of token ids (``uint16`` or ``uint32``) on disk. Sample ``i`` is
the window of ``seq_len + 1`` tokens starting at ``i * seq_len`` (inputs and shifted targets), so
the whole file is covered once per epoch with no padding. The dataset itself holds no position:
which samples a replica trains on, and how far training has got, is the replicated data cursor,
which travels in snapshots and checkpoints. That is what makes a streaming corpus resumable and
exactly-once here: a restarted or joining replica continues from the cursor, not from a file
offset of its own. Reading is a slice of the memory map, so workers share the page cache.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


def write_tokens(path: str | os.PathLike[str], tokens: np.ndarray | list[int], dtype: str = "uint16") -> Path:
    """Write token ids as a flat file of `dtype` (atomically: a reader never sees half a file)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    arr = np.asarray(tokens)
    if arr.size and (arr.min() < 0 or arr.max() > np.iinfo(dtype).max):
        raise ValueError(f"token ids do not fit in {dtype}")
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    arr.astype(DTYPES[dtype]).tofile(tmp)
    os.replace(tmp, path)
    return path


class TokenFile:
    """Map-style dataset over a token file: ``ds[i]`` is a LongTensor of ``seq_len + 1`` tokens."""

    def __init__(self, path: str | os.PathLike[str], seq_len: int, dtype: str = "uint16") -> None:
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"no token file at {self.path}")
        self.tokens = np.memmap(self.path, dtype=DTYPES[dtype], mode="r")
        self.seq_len = seq_len
        if len(self.tokens) < seq_len + 1:
            raise ValueError(f"{self.path} holds {len(self.tokens)} tokens, fewer than one sample "
                             f"of {seq_len + 1}")

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, i: int) -> torch.Tensor:
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} is out of range [0, {len(self)})")
        start = i * self.seq_len
        return torch.from_numpy(self.tokens[start:start + self.seq_len + 1].astype(np.int64))


__all__ = ["TokenFile", "write_tokens"]
