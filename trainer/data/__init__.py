"""What each step trains on: ``StepLoader`` over the kernel's replicated data cursor, token files,
and the generated training text of tests and examples.

``p2pft.trainer.data`` itself is the generated text's public path (``TextDataset``,
``ByteTokenizer``, ``generate_corpus``), re-exported here from ``text.py``.
"""
from __future__ import annotations

from .text import CORPUS_VERSION, DEFAULT_SAMPLES, ByteTokenizer, TextDataset, generate_corpus

__all__ = ["CORPUS_VERSION", "DEFAULT_SAMPLES", "ByteTokenizer", "TextDataset", "generate_corpus"]
