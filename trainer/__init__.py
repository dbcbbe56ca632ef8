"""PyTorch integration: wrap a model and optimizer, train through failures.

``FaultTolerant`` runs the step protocol around an ordinary loop; the building blocks
(data cursor, learning-rate policy, snapshots, checkpoints, the example model and data) are
importable on their own.
"""
from __future__ import annotations

from .cursor import DataCursor
from .diloco import DiLoCo, DiLoCoResult
from .errors import InitialStateMismatch, JobConfigError, JobError, JobFinished, MissingStateError, StepTimeout, Stopped
from .ft import FaultTolerant, StepResult
from .hsdp import HSDP
from .loader import StepLoader
from .lr import LRPolicy, lr_scale
from .state import capture, restore, state_digest

__all__ = ["DiLoCo", "DiLoCoResult", "FaultTolerant", "HSDP", "StepResult", "StepTimeout", "Stopped", "JobError",
           "JobFinished",
           "MissingStateError",
           "JobConfigError", "InitialStateMismatch", "StepLoader", "DataCursor", "LRPolicy", "lr_scale",
           "capture", "restore", "state_digest"]
