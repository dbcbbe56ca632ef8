"""p2pft: fault-tolerant data-parallel training with no central coordinator.

Importing ``p2pft`` stays light (no torch): a witness peer starts in well under a second.
``p2pft.Runtime`` is the public entry point; ``p2pft.trainer`` holds the PyTorch wrappers.
"""
from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["Runtime", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "Runtime":
        from .runtime import Runtime
        return Runtime
    raise AttributeError(f"module 'p2pft' has no attribute {name!r}")
