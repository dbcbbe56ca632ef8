"""Learning-rate scaling when the number of contributing replicas differs from the plan.

With fewer contributors the averaged gradient comes from a smaller global batch, so its noise
grows; scaling the learning rate down (linearly or by the square root, which the FT-HSDP paper
found best) keeps the update size matched to the batch actually trained.
"""
from __future__ import annotations

import enum
import math



class LRPolicy(str, enum.Enum):
    """How the learning rate follows the ratio of contributors to the planned replica count."""

    NONE = "none"
    LINEAR = "linear"
    SQRT = "sqrt"

    @classmethod
    def parse(cls, value: LRPolicy | str) -> LRPolicy:
        """Accept an enum member or its name ("none", "linear", "sqrt"), case-insensitive."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                return cls(value.strip().lower())
            except ValueError:
                pass
        choices = ", ".join(repr(m.value) for m in cls)
        raise ValueError(f"unknown learning-rate policy {value!r}; expected one of {choices}")


def _positive_int(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def lr_scale(policy: LRPolicy | str, contributors: int, nominal: int) -> float:
    """Factor for the base learning rate when `contributors` of `nominal` planned replicas contribute."""
    policy = LRPolicy.parse(policy)
    _positive_int("contributors", contributors)
    _positive_int("nominal", nominal)
    ratio = contributors / nominal
    if policy is LRPolicy.LINEAR:
        return ratio
    if policy is LRPolicy.SQRT:
        return math.sqrt(ratio)
    return 1.0
