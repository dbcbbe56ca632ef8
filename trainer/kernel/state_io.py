"""How a kind of replica copies its state: whole (one rank) or this rank's shards (FSDP).

The kernel snapshots, restores and hashes the replica's state only through a ``StateIO``;
an algorithm picks one (``WHOLE_STATE`` in ``ft.py``, ``SHARD_STATE`` in ``hsdp.py``).
"""
from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable, Mapping

import torch


@dataclass(frozen=True)
class StateIO:
    """How a kind of replica copies its state: whole (one rank) or this rank's shards (FSDP)."""

    # (model, optimizer, extra meta) -> (msgpack-able meta, CPU tensors)
    capture: Callable[[torch.nn.Module, torch.optim.Optimizer, dict[str, object]],
                      tuple[dict[str, object], dict[str, torch.Tensor]]]
    # (model, optimizer, a capture's meta as it arrives off the wire, its tensors)
    restore: Callable[[torch.nn.Module, torch.optim.Optimizer, Mapping[str, object], dict[str, torch.Tensor]], None]
    digest: Callable[[torch.nn.Module, torch.optim.Optimizer], str]
    receive_into: Callable[[torch.nn.Module, torch.optim.Optimizer], dict[str, torch.Tensor]] | None = None
    # The state may be copied on a transport thread while the loop is outside a step. Not for
    # FSDP shards: a forward pass (an evaluation between steps) swaps the module's parameters.
    copy_between_steps: bool = True


__all__ = ["StateIO"]
