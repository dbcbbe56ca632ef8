"""Per-step metrics of one replica, pushed by its training loop once per step.

The control and data planes are pulled at scrape time (``p2pft.ops.metrics``); what only the loop
knows (the step's outcome, its time, a catch-up's start and end) is pushed here, from the
``StepResult`` of each ``commit()``. It lives beside the trainer because it reads the trainer's
results and state; it registers into the runtime's registry.
"""
from __future__ import annotations

import statistics
import time
from collections import deque
from typing import Protocol

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ..ops.metrics import ROLES, DataCollector
from ..runtime import Runtime
from .kernel.attempt import StepResult
from .kernel.ports import DataServerPort

STEP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
STALL_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
CATCHUP_BUCKETS = (0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
HEALTHY_KEEP = 32              # recent healthy step times: the baseline a stall is measured against


class Trainer(Protocol):
    """What the step metrics read of ``FaultTolerant`` / ``HSDP`` (both are ``StepEngine``s)."""

    @property
    def model(self) -> torch.nn.Module: ...

    @property
    def opt(self) -> torch.optim.Optimizer: ...

    @property
    def synced(self) -> bool: ...

    @property
    def ds(self) -> DataServerPort | None:
        """Its data server (HSDP: one per rank, not the runtime's)."""


class StepMetrics:
    """Per-step values of one replica, fed by its training loop: ``observe_step(result)`` after
    every ``commit()`` (a ``StepResult``). Built disabled when the process serves no metrics, so
    the loop calls it unconditionally; disabled, a call is one attribute test."""

    def __init__(self, registry: CollectorRegistry | None = None, trainer: Trainer | None = None) -> None:
        self.enabled = registry is not None
        self.trainer = trainer
        self._last: float | None = None
        self._healthy: deque[float] = deque(maxlen=HEALTHY_KEEP)
        self._prev_contributors = 0
        self._catchup_t0: float | None = None
        if registry is None:
            return
        r = registry
        self.step = Gauge("p2pft_committed_step", "Committed step count of this replica.", registry=r)
        self.step_seconds = Histogram("p2pft_step_seconds", "Wall seconds per training step (commit to commit).",
                                      buckets=STEP_BUCKETS, registry=r)
        self.steps = Counter("p2pft_steps", "Step outcomes: committed (an optimizer update applied) or not.",
                             ["outcome"], registry=r)
        self.retries = Counter("p2pft_step_retries", "Failed allreduce attempts retried in a later view.",
                               registry=r)
        self.fast_forwards = Counter("p2pft_fast_forwarded_steps", "Steps applied from a peer's log "
                                     "(commits this replica missed).", registry=r)
        self.contributors = Gauge("p2pft_step_contributors", "Replicas whose gradients were in the last "
                                  "committed mean.", registry=r)
        self.role = Gauge("p2pft_replica_role", "1 for this replica's role at its last step.", ["role"], registry=r)
        self.stall = Histogram("p2pft_failure_stall_seconds", "Survivor stall per failure: extra seconds of a step "
                               "that lost a contributor or retried, over the recent healthy median.",
                               buckets=STALL_BUCKETS, registry=r)
        self.catchups = Counter("p2pft_catchups", "Catch-ups this replica completed (snapshot pulled, log "
                                "replayed).", registry=r)
        self.catchup_seconds = Histogram("p2pft_catchup_seconds", "Seconds from losing sync to being caught up.",
                                         buckets=CATCHUP_BUCKETS, registry=r)
        self.catchup_bytes = Counter("p2pft_catchup_bytes", "Bytes of model and optimizer state restored by "
                                     "catch-ups.", registry=r)
        self.catching_up = Gauge("p2pft_catchup_in_progress", "1 while this replica catches up.", registry=r)
        for role in ROLES[:2]:
            self.role.labels(role).set(0)
        self.steps.labels("committed")
        self.steps.labels("not_committed")
        if trainer is not None:
            self.catching_up.set_function(lambda: 0 if trainer.synced else 1)

    @classmethod
    def attach(cls, rt: Runtime | None, trainer: Trainer | None = None) -> "StepMetrics":
        """Step metrics in `rt`'s registry (disabled when `rt` serves none: rt is None on the
        non-zero ranks of an HSDP replica). A trainer with a data server of its own (HSDP)
        gets its data-plane collector registered too."""
        endpoint = rt.metrics if rt is not None else None
        if rt is None or endpoint is None:
            return cls(None)
        ds = trainer.ds if trainer is not None else None
        if ds is not None and ds is not rt.data:
            endpoint.registry.register(DataCollector(ds))
        return cls(endpoint.registry, trainer)

    def observe_step(self, result: StepResult, seconds: float | None = None) -> None:
        """One step's outcome; `seconds` defaults to the time since the previous call."""
        if not self.enabled:
            return
        now = time.monotonic()
        if seconds is None and self._last is not None:
            seconds = now - self._last
        self._last = now
        self.step.set(result.step)
        self.steps.labels("committed" if result.committed else "not_committed").inc()
        if result.retries:
            self.retries.inc(result.retries)
        if result.fast_forwarded:
            self.fast_forwards.inc(result.fast_forwarded)
        for role in ROLES[:2]:
            self.role.labels(role).set(1 if result.role == role else 0)
        if result.committed:
            self.contributors.set(result.contributors)
        if seconds is not None:
            self.step_seconds.observe(seconds)
            self._observe_stall(result, seconds)
        self._observe_catchup(now)

    def _observe_stall(self, result: StepResult, seconds: float) -> None:
        if result.role != "participant" or not result.committed:
            return
        lost = 0 < result.contributors < self._prev_contributors
        self._prev_contributors = result.contributors
        if result.retries or lost:
            base = statistics.median(self._healthy) if self._healthy else 0.0
            self.stall.observe(max(0.0, seconds - base))
        else:
            self._healthy.append(seconds)

    def _observe_catchup(self, now: float) -> None:
        if self.trainer is None:
            return
        synced = self.trainer.synced
        if not synced and self._catchup_t0 is None:
            self._catchup_t0 = now
        elif synced and self._catchup_t0 is not None:
            self.catchups.inc()
            self.catchup_seconds.observe(now - self._catchup_t0)
            self.catchup_bytes.inc(state_bytes(self.trainer))
            self._catchup_t0 = None


def state_bytes(trainer: Trainer) -> int:
    """Bytes of this process's model parameters, buffers and optimizer tensors: what a catch-up
    snapshot carries (the local shards, for a sharded model)."""
    tensors: list[torch.Tensor] = list(trainer.model.parameters()) + list(trainer.model.buffers())
    for st in trainer.opt.state.values():
        tensors += [v for v in st.values() if isinstance(v, torch.Tensor)]
    total = 0
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t   # DTensor shards
        total += local.numel() * local.element_size()
    return total


__all__ = ["StepMetrics", "state_bytes"]
