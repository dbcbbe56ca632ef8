"""PyTorch integration: wrap a model and optimizer, train through failures.

``FaultTolerant`` runs the step protocol around an ordinary loop; the building blocks
(data cursor, learning-rate policy, snapshots, checkpoints, the example model and data) are
importable on their own. The modules are grouped by concept: ``kernel`` (the step engine and
what crosses its parts), ``recovery`` (catch-up, donor, fast-forward), ``job`` (start, end,
pauses), ``state`` (snapshots, digests, checkpoints), ``algorithms`` (the adapters), ``data``.
"""
from __future__ import annotations

import sys

from .kernel.cursor import DataCursor
from .algorithms.diloco import DiLoCo, DiLoCoResult
from .kernel.errors import (InitialStateMismatch, JobConfigError, JobError, JobFinished, MissingStateError, StepTimeout,
                            Stopped)
from .algorithms.front import Front
from .algorithms.ft import FaultTolerant, StepResult
from .kernel.optimizers import Optimizers, Schedulers
from .kernel.options import Options
from .algorithms.hsdp import HSDP
from .data.loader import StepLoader
from .kernel.lr import LRPolicy, lr_scale
from .state.whole import capture, restore, state_digest
from .algorithms import hsdp as _hsdp, outer as _outer
from .data import loader as _loader, tokens as _tokens

# Module paths the documentation showed before the modules moved into their packages
# (``p2pft.trainer.hsdp.HSDP``, ``from p2pft.trainer.loader import StepLoader``, ...) still import.
for _old, _module in (("hsdp", _hsdp), ("outer", _outer), ("loader", _loader), ("tokens", _tokens)):
    sys.modules.setdefault(f"{__name__}.{_old}", _module)
    globals()[_old] = _module

__all__ = ["DiLoCo", "DiLoCoResult", "FaultTolerant", "Front", "HSDP", "Optimizers", "Options", "Schedulers",
           "StepResult", "StepTimeout", "Stopped", "JobError", "JobFinished", "MissingStateError", "JobConfigError",
           "InitialStateMismatch", "StepLoader", "DataCursor", "LRPolicy", "lr_scale", "capture", "restore",
           "state_digest"]
